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
  pipeline GPUs of one data-parallel rank. With expert parallelism (a MoE model's
  ``parallelism.expert``) the routed experts are spread over every GPU of the replica instead
  (data x tensor x pipeline), and only the rest is split by tensor x pipeline; without the
  experts' share of the parameters (``expertParameters``) such a role is not sized.
- LoRA slots (a tier that serves adapters): vLLM 0.33 gives every LoRA-capable layer of the
  model, targeted by an adapter or not, zeroed A and B buffers for ``maxLoras`` adapters of
  ``maxLoraRank``, in the model's dtype, when it loads the model (:func:`lora_bytes_per_gpu`):
  its profiler counts them with the weights (``load_lora_model`` inside ``load_model``), and the
  profile run's dummy adapters are CPU tensors copied into these same slots.
- KV capacity per GPU = GPU memory x ``gpuMemoryUtilization`` - its share of the weights - its
  LoRA slots - a reserve for activations, CUDA graphs and the CUDA context
  (:data:`RESERVE_BYTES_PER_GPU`, a heuristic: vLLM measures it when it starts). A replica's
  capacity in tokens is the sum over its GPUs over KV bytes per token, times its data-parallel
  ranks (each rank its own cache); in sequences, that over ``maxModelLen``.
- The host tier (``engine.kvOffload``, vLLM's native CPU offloading): ``size`` bytes per
  engine - per data-parallel rank, each an engine core with its own ``cpu_bytes_to_use`` -
  cut into chunks of one KV block of every GPU of the rank (``vllm/v1/kv_offload/cpu/
  spec.py``: ``worker_kv_bytes_per_block x world_size``, tensor x pipeline, rounded up to a
  page): tokens = whole blocks of KV bytes per token x block size in ``size``, the same KV
  bytes per token as the GPUs' (vLLM keeps every GPU's share, replicated heads included),
  times the data-parallel ranks. One exception: MLA's latent, identical on every tensor GPU,
  is kept once (vLLM's "replicated layout", ``build_offloading_config``: tensor parallelism
  alone, on one node), so such a host tier holds ``tensor`` times the tokens.

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
from fleetpilot.api.spec import (
    EngineBackend,
    EngineSettings,
    KvCacheDtype,
    LoraSettings,
    ModelArchitecture,
    ModelDtype,
    Parallelism,
    Quantization,
)
from fleetpilot.api.units import quantity_decimal

GIB = 1024**3
MIB = 1024**2
KIB = 1024
# Activations of the largest batch, CUDA graphs and the CUDA context, per GPU: vLLM profiles
# them at start-up; ~1-3 GiB for dense models at the default batched-token budget.
RESERVE_BYTES_PER_GPU = 2 * GIB
# vLLM's host tier (engine.kvOffload) is an mmap'd region whose chunks are page aligned.
PAGE_BYTES = 4096
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


@dataclass(frozen=True)
class LayerWidths:
    """The widths of a model's linear layers that size vLLM's LoRA buffers (the attention
    shape - layers, KV heads, head dim - is the :class:`ModelArchitecture`'s)."""

    hidden: int  # hidden_size
    intermediate: int  # intermediate_size; of one expert for a MoE model
    heads: int  # num_attention_heads (query heads)
    vocab: int  # vocab_size
    # The model's vLLM class lists embed_tokens and lm_head in ``embedding_modules``: then
    # vLLM 0.33 gives them LoRA buffers too (Llama, Qwen3, Mixtral do; Qwen2 and Mistral not).
    lora_embeddings: bool
    experts: int = 0  # routed experts of each MoE layer (0: a dense MLP)


_TABLE: tuple[tuple[str, ModelArchitecture, LayerWidths | None], ...] = (
    (r"llama-3(\.[0-9])?-8b", _arch(32, 8, 128, 8.03), LayerWidths(4096, 14336, 32, 128256, True)),
    (
        r"llama-3(\.[0-9])?-70b",
        _arch(80, 8, 128, 70.6),
        LayerWidths(8192, 28672, 64, 128256, True),
    ),
    (
        r"llama-3(\.[0-9])?-405b",
        _arch(126, 8, 128, 405.9),
        LayerWidths(16384, 53248, 128, 128256, True),
    ),
    (r"qwen2\.5-7b", _arch(28, 4, 128, 7.62), LayerWidths(3584, 18944, 28, 152064, False)),
    (r"qwen2\.5-14b", _arch(48, 8, 128, 14.7), LayerWidths(5120, 13824, 40, 152064, False)),
    (r"qwen2\.5-32b", _arch(64, 8, 128, 32.8), LayerWidths(5120, 27648, 40, 152064, False)),
    (r"qwen2\.5-72b", _arch(80, 8, 128, 72.7), LayerWidths(8192, 29568, 64, 152064, False)),
    (r"qwen3-8b", _arch(36, 8, 128, 8.19), LayerWidths(4096, 12288, 32, 151936, True)),
    (r"qwen3-14b", _arch(40, 8, 128, 14.8), LayerWidths(5120, 17408, 40, 151936, True)),
    (r"qwen3-32b", _arch(64, 8, 128, 32.8), LayerWidths(5120, 25600, 64, 151936, True)),
    (
        r"mixtral-8x7b",
        _arch(32, 8, 128, 46.7),
        LayerWidths(4096, 14336, 32, 32000, True, experts=8),
    ),
    # Mistral's vocab is 32000 (v0.1/v0.2) or 32768 (v0.3): no matter, no embedding LoRA.
    (r"mistral-7b", _arch(32, 8, 128, 7.24), LayerWidths(4096, 14336, 32, 32768, False)),
    (
        r"deepseek-(v3|r1)",
        ModelArchitecture(
            layers=61,
            kv_heads=128,
            head_dim=128,
            parameters=671_000_000_000,
            # 58 MoE layers x 256 routed experts x (gate, up, down) of 7168 x 2048.
            expert_parameters=58 * 256 * 3 * 7168 * 2048,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        ),
        None,  # MLA projections, dense and MoE layers, shared experts: not modelled
    ),
)

# Common models by a pattern of their Hub id (lowercase), from their config.json files
# (num_hidden_layers, num_key_value_heads, head_dim or hidden_size / num_attention_heads,
# hidden_size, intermediate_size, num_attention_heads, vocab_size, num_local_experts) and
# their model cards' parameter counts.
KNOWN_MODELS: tuple[tuple[re.Pattern[str], ModelArchitecture], ...] = tuple(
    (re.compile(pattern), arch) for pattern, arch, _ in _TABLE
)
# Their layer widths, where vLLM's LoRA buffers for them are modelled (None: not).
KNOWN_LAYER_WIDTHS: tuple[tuple[re.Pattern[str], LayerWidths | None], ...] = tuple(
    (re.compile(pattern), widths) for pattern, _, widths in _TABLE
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


def known_layer_widths(model_name: str) -> LayerWidths | None:
    """The built-in layer widths of a Hub model id (of the entry its architecture comes from),
    or None."""
    name = model_name.lower()
    return next((widths for pattern, widths in KNOWN_LAYER_WIDTHS if pattern.search(name)), None)


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


def lora_bytes_per_gpu(
    arch: ModelArchitecture,
    widths: LayerWidths,
    lora: LoraSettings,
    element_bytes: int,
    tensor: int = 1,
    pipeline: int = 1,
) -> int:
    """The LoRA buffers vLLM 0.33 allocates on one GPU for ``lora.max_loras`` slots of
    ``lora.max_lora_rank`` (``element_bytes``: the LoRA dtype's, the model's by default).

    Every buffer is ``max_loras x rank x width`` (``vllm/lora/layers/``, ``create_lora_weights``;
    A is ``[max_loras, 1, rank, in]``, B ``[max_loras, 1, out, rank]``); per decoder layer, with
    h hidden, i intermediate, q = heads x head dim, kv = KV heads on this GPU x head dim, t the
    tensor size (fully sharded LoRAs off, vLLM's default):

    - qkv_proj (``MergedQKVParallelLinearWithLoRA``, one slice each for q, k, v): A 3 x h,
      B q/t + 2 kv (column parallel: B's rows split, A whole);
    - o_proj (``RowParallelLinearWithLoRA``): A q/t, B h (row parallel: A's columns split);
    - gate_up_proj (``MergedColumnParallelLinearWithLoRA``, two slices): A 2 x h, B 2 x i/t;
    - down_proj (``RowParallelLinearWithLoRA``): A i/t, B h;
    - a MoE layer instead of the last two (``FusedMoEWithLoRA``, E experts): w13 A 2 x E x h,
      B 2 x E x i/t; w2 A E x i/t, B E x h; and its router (``ReplicatedLinearWithLoRA``):
      A h, B E.

    Where the model's vLLM class lists ``embedding_modules``, embed_tokens
    (``VocabParallelEmbeddingWithLoRA``: A vocab, B h) and lm_head (``LogitsProcessorWithLoRA``:
    A h, B vocab) get buffers too, whole on every GPU. Under pipeline parallelism the busiest
    stage holds ceil(layers / stages) layers and one of the two (the first embed_tokens, the
    last lm_head). Left out: the punica wrapper's index buffers (``punica_base.py``,
    ``punica_gpu.py``: four int64 and two times two int32 arrays of ``maxNumBatchedTokens``,
    48 bytes a token, 384 KiB at 8192) and the LoRA kernels' activations and CUDA graphs (in
    the profiled peak the reserve, :data:`RESERVE_BYTES_PER_GPU`, stands for).
    """
    # Widths (A's in plus B's out) summed; each times max_loras x rank x element bytes.
    h, i = widths.hidden, widths.intermediate // tensor
    q = widths.heads * arch.head_dim // tensor
    kv = max(1, arch.kv_heads // tensor) * arch.head_dim  # fewer KV heads than GPUs: one each
    qkv_proj, o_proj = 3 * h + (q + 2 * kv), q + h
    gate_up_proj, down_proj = 2 * h + 2 * i, i + h
    if widths.experts:
        mlp = widths.experts * (gate_up_proj + down_proj) + (h + widths.experts)
    else:
        mlp = gate_up_proj + down_proj
    layers = math.ceil(arch.layers / pipeline) * (qkv_proj + o_proj + mlp)
    embeddings = 0
    if widths.lora_embeddings:
        embed_tokens = lm_head = widths.vocab + h
        embeddings = embed_tokens + lm_head if pipeline == 1 else max(embed_tokens, lm_head)
    return lora.max_loras * lora.max_lora_rank * element_bytes * (layers + embeddings)


def kv_offload_bytes(engine: EngineSettings) -> int | None:
    """Bytes of the host KV tier of one engine (``engine.kvOffload.size``, rounded up to a
    byte as Kubernetes rounds memory), or None without one."""
    if engine.kv_offload is None:
        return None
    return math.ceil(quantity_decimal(engine.kv_offload.size))


def host_kv_bytes_per_token(
    arch: ModelArchitecture, per_token: int, p: Parallelism, gpus_per_node: int
) -> int:
    """KV bytes a token takes in the host tier of one engine (``per_token``: on its GPUs):
    the same, but for MLA's latent under tensor parallelism alone on one node, which vLLM 0.33
    keeps once rather than once a GPU (``build_offloading_config``'s ``replicated_layout``:
    MLA, tensor > 1, no pipeline, every worker on one node)."""
    replicated = arch.kv_lora_rank is not None and p.tensor > 1 and p.pipeline == 1
    if replicated and p.tensor <= gpus_per_node:
        return per_token // p.tensor
    return per_token


def host_kv_tokens_per_engine(offload_bytes: int, per_token: int, block_size: int) -> int:
    """Tokens the host tier of one engine holds: whole KV blocks of every GPU of the engine
    (``per_token``: KV bytes a token in the tier), each chunk rounded up to a page."""
    chunk = -(-per_token * block_size // PAGE_BYTES) * PAGE_BYTES
    return offload_bytes // chunk * block_size


def weight_bytes(arch: ModelArchitecture, quantization: Quantization | None) -> int | None:
    """The checkpoint's weights in bytes, or None when its size is unknown."""
    per_weight = _WEIGHT_BYTES.get(quantization)
    if arch.parameters is None or per_weight is None:
        return None
    return math.ceil(arch.parameters * per_weight)


@dataclass(frozen=True)
class RoleCapacity:
    """One replica of a role, sized. ``kv_tokens`` is over all its data-parallel ranks."""

    architecture: ModelArchitecture
    architecture_source: str  # "spec", "built-in table" or "config.json"
    gpu_memory_bytes: int
    # GPU memory x gpuMemoryUtilization less the reserve: what weights and KV cache share.
    budget_per_gpu_bytes: float
    weights_bytes: int  # the whole checkpoint, over every GPU of a data-parallel rank
    weights_per_gpu_bytes: int
    # The tier's LoRA slots (None: it serves no adapters) and what they take on each GPU: 0
    # without them, None where the model's layer widths are unknown (then not counted).
    lora: LoraSettings | None
    lora_bytes_per_gpu: int | None
    kv_bytes_per_token: int
    kv_tokens: int  # <= 0: the weights (and LoRA slots) leave no room for a KV cache
    max_model_len: int | None
    max_num_seqs: int
    # The host tier (engine.kvOffload): its bytes per engine (a data-parallel rank; None: no
    # host tier) and the tokens it holds over all the replica's ranks.
    kv_offload_bytes: int | None = None
    host_kv_tokens: int = 0

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0

    @property
    def sequences_at_max_len(self) -> int | None:
        """Sequences of ``maxModelLen`` tokens the cache holds at once."""
        if self.max_model_len is None:
            return None
        return max(0, self.kv_tokens) // self.max_model_len

    @property
    def host_sequences_at_max_len(self) -> int | None:
        """Sequences of ``maxModelLen`` tokens the host tier holds; None without one."""
        if self.max_model_len is None or self.kv_offload_bytes is None:
            return None
        return self.host_kv_tokens // self.max_model_len

    def warnings(self) -> list[str]:
        """What a user should know before deploying: LoRA slots the planner cannot size, a
        context no sequence fits in, or a batch limit the cache can never fill with sequences
        of full length."""
        out = []
        if self.lora is not None and self.lora_bytes_per_gpu is None:
            out.append(
                f"the GPU memory of {self.lora.max_loras} LoRA slots of rank "
                f"{self.lora.max_lora_rank} is not counted (the layer widths of a model from the "
                f"{self.architecture_source} are unknown): the KV cache is smaller than shown"
            )
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
        if (
            self.kv_offload_bytes is not None
            and self.fits
            and self.host_kv_tokens <= self.kv_tokens
        ):
            # vLLM copies a prompt's blocks to the host tier as they are computed, so the host
            # tier holds what the GPUs hold: only what it holds beyond them is a second tier.
            out.append(
                f"engine.kvOffload.size {format_bytes(self.kv_offload_bytes)} holds "
                f"{self.host_kv_tokens:,} tokens per replica, no more than the "
                f"{self.kv_tokens:,} of the GPUs' KV cache, which it copies: it adds nothing; "
                "make it larger or remove it"
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


def model_element_bytes(dtype: ModelDtype) -> int:
    """Bytes of one element in the model's dtype (``auto``: a 16-bit checkpoint's)."""
    return 4 if dtype is ModelDtype.FLOAT32 else 2


def role_lora_bytes_per_gpu(
    role: ResolvedRole, arch: ModelArchitecture, source: str, tensor: int | None = None
) -> int | None:
    """The role's LoRA buffers on one GPU at ``tensor`` (default: the role's): 0 when its tier
    serves no adapters, None when the layer widths are unknown (known for the built-in
    table's models only: ``model.architecture`` and config.json carry no hidden sizes)."""
    lora = role.tier.lora_settings
    if lora is None:
        return 0
    widths = known_layer_widths(role.tier.model.name) if source == "built-in table" else None
    if widths is None:
        return None
    p = role.parallelism
    element = model_element_bytes(role.tier.model.dtype)
    return lora_bytes_per_gpu(arch, widths, lora, element, tensor or p.tensor, p.pipeline)


def _weights_per_gpu(arch: ModelArchitecture, weights: int, p: Parallelism) -> int | None:
    """One GPU's share of the weights; None for expert parallelism over unknown experts."""
    if not p.expert:
        return math.ceil(weights / (p.tensor * p.pipeline))
    if arch.expert_parameters is None or arch.parameters is None:
        return None
    experts = weights * arch.expert_parameters / arch.parameters
    return math.ceil((weights - experts) / (p.tensor * p.pipeline) + experts / p.gpus)


def role_capacity(
    role: ResolvedRole, config: ModelArchitecture | None = None
) -> RoleCapacity | None:
    """One replica of ``role`` sized, or None when its architecture, its weights' size or its
    GPU memory is unknown (``config`` as for :func:`architecture_of`), or it runs on no GPU
    (the CPU reference engine's seeded model, whatever model name the tier gives)."""
    if role.engine.backend is EngineBackend.REFERENCE:
        return None
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
    weights_per_gpu = _weights_per_gpu(arch, weights, p)
    if weights_per_gpu is None:
        return None
    budget = memory * tier.engine.gpu_memory_utilization - RESERVE_BYTES_PER_GPU
    lora_per_gpu = role_lora_bytes_per_gpu(role, arch, source)
    usable = budget - weights_per_gpu - (lora_per_gpu or 0)
    element = kv_element_bytes(tier.engine.kv_cache.dtype, tier.model.dtype)
    per_token = kv_bytes_per_token(arch, element, p.tensor)
    tokens_per_rank = math.floor(usable * gpus_per_rank / per_token)
    offload = kv_offload_bytes(tier.engine)
    host_per_token = host_kv_bytes_per_token(arch, per_token, p, tier.resources.gpus_per_node)
    host_per_rank = (
        host_kv_tokens_per_engine(offload, host_per_token, tier.engine.kv_cache.block_size)
        if offload is not None
        else 0
    )
    return RoleCapacity(
        architecture=arch,
        architecture_source=source,
        gpu_memory_bytes=memory,
        budget_per_gpu_bytes=budget,
        weights_bytes=weights,
        weights_per_gpu_bytes=weights_per_gpu,
        lora=tier.lora_settings,
        lora_bytes_per_gpu=lora_per_gpu,
        kv_bytes_per_token=per_token,
        kv_tokens=tokens_per_rank * p.data if tokens_per_rank > 0 else tokens_per_rank,
        max_model_len=tier.model.max_model_len,
        max_num_seqs=tier.engine.max_num_seqs,
        kv_offload_bytes=offload,
        host_kv_tokens=host_per_rank * p.data,
    )


def smallest_fitting_tensor(role: ResolvedRole, capacity: RoleCapacity) -> int | None:
    """The smallest tensor-parallel size (a power of two, within the node) at which the
    weights and the LoRA slots leave room for a KV cache, or None when none does."""
    arch, source = capacity.architecture, capacity.architecture_source
    pipeline = role.parallelism.pipeline
    tensor = 1
    while tensor * pipeline <= role.tier.resources.gpus_per_node:
        lora = role_lora_bytes_per_gpu(role, arch, source, tensor)
        used = capacity.weights_bytes / (tensor * pipeline) + (lora or 0)
        if used < capacity.budget_per_gpu_bytes:
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
