"""The CPU reference engine: paged KV blocks, prefix caching, continuous batching, chunked
prefill, preemption, speculative decoding and P/D KV hand-off, in torch.

The HTTP server (later) uses only what is exported here: build an ``LLMEngine`` (optionally
from ``load_checkpoint``), ``add_request`` / ``abort_request``, call ``step()`` in a loop and
stream the ``RequestOutput``s; ``stats()`` feeds ``/metrics``; ``pinned_kv`` / ``export_kv`` /
``release_kv`` and ``add_request(kv_import=...)`` implement the P/D hand-off.
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
