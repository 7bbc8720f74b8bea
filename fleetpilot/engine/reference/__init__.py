"""The CPU reference engine: paged KV blocks, prefix caching, continuous batching, chunked
prefill, preemption, speculative decoding and P/D KV hand-off, in torch, behind vLLM's
OpenAI-compatible HTTP API and metrics (``fleetpilot engine --backend reference``).

The engine core is exported here: build an ``LLMEngine`` (optionally from ``load_checkpoint``),
``add_request`` / ``abort_request``, call ``step()`` in a loop and read the ``RequestOutput``s;
``stats()`` feeds ``/metrics``; ``pinned_kv`` / ``export_kv`` / ``release_kv`` and
``add_request(kv_import=...)`` are the engine's side of the P/D hand-off;
``add_request(lora=...)`` / ``add_lora`` serve LoRA adapters; ``EngineConfig.kv_offload`` adds
a host tier of KV blocks (vLLM's ``--kv-offloading-size``). Core modules: model, blocks,
scheduler, sampling, speculative, request, engine, checkpoint, tokenizer, lora (PEFT adapters:
reading, checking, writing), lora_manager (the loaded and active adapters) and offload (the
host tier: its bookkeeping, pacing and tensor).

The server around it is not re-exported here (the core needs no HTTP stack); import its
modules directly:
``server`` (the HTTP handlers and the process's entry point), ``settings`` (flags and model
presets), ``runner`` (the engine's own thread), ``protocol`` (request and response models),
``sse`` (streaming), ``pd`` and ``peers`` (the hand-off between engines and whom it trusts),
``kv_wire`` (its payload), ``metrics`` (vLLM's metric names) and ``lora_serving`` (adapter
names and vLLM's load/unload rules).
"""

from fleetpilot.engine.reference.blocks import BlockManager, KVCacheSpec, KVPool
from fleetpilot.engine.reference.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from fleetpilot.engine.reference.engine import (
    EngineConfig,
    EngineStats,
    LLMEngine,
    PinnedKV,
    RequestRejectedError,
)
from fleetpilot.engine.reference.model import LlamaModel, ModelConfig
from fleetpilot.engine.reference.request import KVBlocks, RequestMetrics, RequestOutput
from fleetpilot.engine.reference.sampling import SamplingParams
from fleetpilot.engine.reference.speculative import SpeculativeConfig
from fleetpilot.engine.reference.tokenizer import ByteTokenizer

__all__ = [
    "BlockManager",
    "ByteTokenizer",
    "CheckpointError",
    "EngineConfig",
    "EngineStats",
    "KVBlocks",
    "KVCacheSpec",
    "KVPool",
    "LLMEngine",
    "LlamaModel",
    "ModelConfig",
    "PinnedKV",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejectedError",
    "SamplingParams",
    "SpeculativeConfig",
    "load_checkpoint",
    "save_checkpoint",
]
