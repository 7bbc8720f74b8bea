"""What one replica of a role holds: its weights, its KV cache in tokens and in sequences.

Purely computational. The formula (the one vLLM's memory profiler leaves room for):

- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per KV element
  (2 for an ``auto`` cache of a 16-bit model, 1 for an fp8 cache). With tensor parallelism over
  more GPUs than the model has KV heads, vLLM replicates heads so each GPU holds one: the
  replica then stores ``tensor`` heads' worth. Multi-head latent attention (DeepSeek-V2/V3's
  MLA) caches one compressed latent per token and layer instead of per-head K and V:
  ``kv_lora_rank + qk_rope_head_dim`` elements (576 for DeepSeek-V3), no factor 2, no heads -
  about a 57th of what the same model would cache with 128 full heads.
- Weights = parameters x bytes per weight: 2 for 16-bit, 1 for fp8, ~0.53 for 4-bit AWQ/GPTQ
  (4 bits plus a 16-bit scale and zero point per group of 128); split evenly over the tensor x
  pipeline GPUs of one data-parallel rank.
- KV capacity per GPU = GPU memory x ``gpuMemoryUtilization`` - its share of the weights - a
  reserve for activations, CUDA graphs and the CUDA context (:data:`RESERVE_BYTES_PER_GPU`, a
  heuristic: vLLM measures it when it starts). A replica's capacity in tokens is the sum over
  its GPUs over KV bytes per token, times its data-parallel ranks (each rank its own cache);
  in sequences, that over ``maxModelLen``.

The architecture comes from the spec (``model.architecture``: what the user says wins), else
from a ``config.json`` the caller could read (:func:`architecture_from_config`: a local
checkpoint, the reference engine's presets), else from a built-in table of common models
matched by name (:data:`KNOWN_MODELS`); GPU memory from ``resources.gpuMemory``, else a table of
GPU products by their ``nvidia.com/gpu.product`` label (:data:`GPU_MEMORY`). Without both, a
role is not sized (the planner says so instead of guessing).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetpilot.api import ResolvedRole
from fleetpilot.api.spec import KvCacheDtype, ModelArchitecture, ModelDtype, Quantization
from fleetpilot.api.units import quantity_decimal

GIB = 1024**3
MIB = 1024**2
KIB = 1024
# Activations of the largest batch, CUDA graphs and the CUDA context, per GPU: vLLM profiles
# them at start-up; ~1-3 GiB for dense models at the default batched-token budget.
RESERVE_BYTES_PER_GPU = 2 * GIB
# The planner warns when maxNumSeqs asks for more than this many times the sequences of full
# context length the cache holds. Sequences average far less than maxModelLen (a chat's few
# thousand tokens of a 32k context), so overcommit is normal; at 32x the batch limit is reached
# only by sequences averaging under a 32nd of the context, and longer ones are preempted.
OVERCOMMIT_WARNING_FACTOR = 32

# Bytes per weight by quantization; None: the checkpoint's own dtype decides (16-bit).
_WEIGHT_BYTES: dict[Quantization | None, float | None] = {
    None: 2.0,
    Quantization.FP8: 1.0,
    Quantization.MODELOPT: 1.0,  # NVIDIA ModelOpt checkpoints are fp8 (or fp4: then smaller)
    Quantization.AWQ: 0.53,
    Quantization.AWQ_MARLIN: 0.53,
    Quantization.GPTQ: 0.53,
    Quantization.GPTQ_MARLIN: 0.53,
    Quantization.BITSANDBYTES: 0.53,
    # Their bit width is in the checkpoint, not the method name: not sized.
    Quantization.COMPRESSED_TENSORS: None,
    Quantization.GGUF: None,
}


def _arch(layers: int, kv_heads: int, head_dim: int, billions: float) -> ModelArchitecture:
    return ModelArchitecture(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, parameters=round(billions * 1e9)
    )


# Common models by a pattern of their Hub id (lowercase), from their config.json files
# (num_hidden_layers, num_key_value_heads, head_dim or hidden_size / num_attention_heads) and
# their model cards' parameter counts.
KNOWN_MODELS: tuple[tuple[re.Pattern[str], ModelArchitecture], ...] = tuple(
    (re.compile(pattern), arch)
    for pattern, arch in (
        (r"llama-3(\.[0-9])?-8b", _arch(32, 8, 128, 8.03)),
        (r"llama-3(\.[0-9])?-70b", _arch(80, 8, 128, 70.6)),
        (r"llama-3(\.[0-9])?-405b", _arch(126, 8, 128, 405.9)),
        (r"qwen2\.5-7b", _arch(28, 4, 128, 7.62)),
        (r"qwen2\.5-14b", _arch(48, 8, 128, 14.7)),
        (r"qwen2\.5-32b", _arch(64, 8, 128, 32.8)),
        (r"qwen2\.5-72b", _arch(80, 8, 128, 72.7)),
        (r"qwen3-8b", _arch(36, 8, 128, 8.19)),
        (r"qwen3-14b", _arch(40, 8, 128, 14.8)),
        (r"qwen3-32b", _arch(64, 8, 128, 32.8)),
        (r"mixtral-8x7b", _arch(32, 8, 128, 46.7)),
        (r"mistral-7b", _arch(32, 8, 128, 7.24)),
        (
            r"deepseek-(v3|r1)",
            ModelArchitecture(
                layers=61,
                kv_heads=128,
                head_dim=128,
                parameters=671_000_000_000,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
            ),
        ),
    )
)

# Memory of one GPU as the driver reports it, by the GPU feature discovery label
# nvidia.com/gpu.product (spaces become dashes). The H200's was read on a lent machine; the
# others are what nvidia-smi reports for the part.
GPU_MEMORY: dict[str, int] = {
    "NVIDIA-H200": 143_771 * MIB,
    "NVIDIA-H100-80GB-HBM3": 81_559 * MIB,
    "NVIDIA-A100-SXM4-80GB": 81_920 * MIB,
    "NVIDIA-A100-80GB-PCIe": 81_920 * MIB,
    "NVIDIA-A100-SXM4-40GB": 40_960 * MIB,
    "NVIDIA-L40S": 46_068 * MIB,
    "NVIDIA-L4": 23_034 * MIB,
    "NVIDIA-A10G": 23_028 * MIB,
}


def known_architecture(model_name: str) -> ModelArchitecture | None:
    """The built-in architecture of a Hub model id, or None."""
    name = model_name.lower()
    return next((arch for pattern, arch in KNOWN_MODELS if pattern.search(name)), None)


def architecture_from_config(
    config: Mapping[str, Any], parameters: int | None = None
) -> ModelArchitecture:
    """The architecture in a Hugging Face ``config.json`` (``parameters`` as counted from the
    weights, which the config does not say). Raises ValueError for a config without them."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config.json lacks the attention shape: {e}") from None
    latent = config.get("kv_lora_rank")
    return ModelArchitecture(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        parameters=parameters,
        kv_lora_rank=int(latent) if latent else None,
        qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0) if latent else None,
    )


def kv_element_bytes(kv_dtype: KvCacheDtype, model_dtype: ModelDtype) -> int:
    """Bytes of one cached K or V element: fp8 caches take one, ``auto`` the model's dtype."""
    if kv_dtype is not KvCacheDtype.AUTO:
        return 1
    return 4 if model_dtype is ModelDtype.FLOAT32 else 2


def kv_bytes_per_token(arch: ModelArchitecture, element_bytes: int, tensor: int = 1) -> int:
    """The KV cache one token takes in one data-parallel rank (all its GPUs together)."""
    if arch.kv_lora_rank is not None:
        # MLA: one latent per layer, replicated on every tensor-parallel GPU by vLLM.
        latent = arch.kv_lora_rank + (arch.qk_rope_head_dim or 0)
        return arch.layers * latent * element_bytes * tensor
    heads = max(arch.kv_heads, tensor)  # fewer heads than GPUs: each GPU holds one
    return 2 * arch.layers * heads * arch.head_dim * element_bytes


def weight_bytes(arch: ModelArchitecture, quantization: Quantization | None) -> int | None:
    """The checkpoint's weights in bytes, or None when its size is unknown."""
    per_weight = _WEIGHT_BYTES.get(quantization)
    if arch.parameters is None or per_weight is None:
        return None
    return math.ceil(arch.parameters * per_weight)


@dataclass(frozen=True)
class RoleCapacity:
    """One replica of a role, sized. ``kv_tokens`` is over all its data-parallel ranks."""

    architecture_source: str  # "spec", "built-in table" or "config.json"
    gpu_memory_bytes: int
    # GPU memory x gpuMemoryUtilization less the reserve: what weights and KV cache share.
    budget_per_gpu_bytes: float
    weights_bytes: int  # the whole checkpoint, over every GPU of a data-parallel rank
    weights_per_gpu_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int  # <= 0: the weights leave no room for a KV cache
    max_model_len: int | None
    max_num_seqs: int

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0

    @property
    def sequences_at_max_len(self) -> int | None:
        """Sequences of ``maxModelLen`` tokens the cache holds at once."""
        if self.max_model_len is None:
            return None
        return max(0, self.kv_tokens) // self.max_model_len

    def warnings(self) -> list[str]:
        """What a user should know before deploying: a context no sequence fits in, or a
        batch limit the cache can never fill with sequences of full length."""
        out = []
        seqs = self.sequences_at_max_len
        if seqs is not None and self.fits and seqs < 1:
            out.append(
                f"maxModelLen {self.max_model_len} does not fit one sequence: the KV cache holds "
                f"{self.kv_tokens} tokens per replica"
            )
        if seqs and self.max_num_seqs > OVERCOMMIT_WARNING_FACTOR * seqs:
            out.append(
                f"maxNumSeqs {self.max_num_seqs} is over {OVERCOMMIT_WARNING_FACTOR}x the "
                f"{seqs} sequences of maxModelLen the KV cache holds: the batch limit is reached "
                "only by short sequences, and long ones are preempted"
            )
        return out


def architecture_of(
    role: ResolvedRole, config: ModelArchitecture | None = None
) -> tuple[ModelArchitecture, str] | None:
    """The role's model architecture and where it came from, or None when unknown; ``config``:
    one the caller read from the checkpoint's config.json."""
    model = role.tier.model
    if model.architecture is not None:
        return model.architecture, "spec"
    if config is not None:
        return config, "config.json"
    known = known_architecture(model.name)
    return (known, "built-in table") if known is not None else None


def gpu_memory_of(role: ResolvedRole) -> int | None:
    """Bytes of one of the role's GPUs, or None when unknown."""
    resources = role.tier.resources
    if resources.gpu_memory is not None:
        return int(quantity_decimal(resources.gpu_memory))
    if resources.gpu_product is not None:
        return GPU_MEMORY.get(resources.gpu_product)
    return None


def role_capacity(
    role: ResolvedRole, config: ModelArchitecture | None = None
) -> RoleCapacity | None:
    """One replica of ``role`` sized, or None when its architecture, its weights' size or its
    GPU memory is unknown (``config`` as for :func:`architecture_of`)."""
    found = architecture_of(role, config)
    memory = gpu_memory_of(role)
    if found is None or memory is None:
        return None
    arch, source = found
    tier, p = role.tier, role.parallelism
    weights = weight_bytes(arch, tier.model.quantization)
    if weights is None:
        return None
    gpus_per_rank = p.tensor * p.pipeline
    weights_per_gpu = math.ceil(weights / gpus_per_rank)
    budget = memory * tier.engine.gpu_memory_utilization - RESERVE_BYTES_PER_GPU
    usable = budget - weights_per_gpu
    element = kv_element_bytes(tier.engine.kv_cache.dtype, tier.model.dtype)
    per_token = kv_bytes_per_token(arch, element, p.tensor)
    tokens_per_rank = math.floor(usable * gpus_per_rank / per_token)
    return RoleCapacity(
        architecture_source=source,
        gpu_memory_bytes=memory,
        budget_per_gpu_bytes=budget,
        weights_bytes=weights,
        weights_per_gpu_bytes=weights_per_gpu,
        kv_bytes_per_token=per_token,
        kv_tokens=tokens_per_rank * p.data if tokens_per_rank > 0 else tokens_per_rank,
        max_model_len=tier.model.max_model_len,
        max_num_seqs=tier.engine.max_num_seqs,
    )


def smallest_fitting_tensor(role: ResolvedRole, capacity: RoleCapacity) -> int | None:
    """The smallest tensor-parallel size (a power of two, within the node) at which the
    weights leave room for a KV cache, or None when none does."""
    pipeline = role.parallelism.pipeline
    tensor = 1
    while tensor * pipeline <= role.tier.resources.gpus_per_node:
        if capacity.weights_bytes / (tensor * pipeline) < capacity.budget_per_gpu_bytes:
            return tensor
        tensor *= 2
    return None


def format_bytes(n: float) -> str:
    """``74.2 GiB``, ``320 KiB``: binary units, as vLLM logs them."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            value = n / size
            exact = value == int(value) or value >= 100
            return f"{value:.0f} {unit}" if exact else f"{value:.1f} {unit}"
    return f"{n:.0f} B"
