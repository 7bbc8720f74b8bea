"""How fast a simulated engine runs: per-replica cost coefficients, from a GPU's published
figures (a roofline over the role's capacity) or measured on the reference engine (``calibrate``).

The engine model (:mod:`fleetpilot.simulate.engine`) runs continuous batching in steps. One step
costs

    decode_base_s + decode_per_seq_s x running sequences + decode_per_kv_token_s x their KV tokens
    + prefill_per_token_s x prompt tokens computed in the step
    + prefill_per_context_token_s x the prefilling prompts' tokens already in the KV cache
    + prefill_per_pair_s x their attention pairs (new tokens x (prior + new / 2) a prompt)

(the last two: a prompt's new tokens attend to its cached prefix and earlier chunks; on the
reference engine a 40-token question after a 1,200-token cached prefix took 7.4 ms to its
first token against 4.2 ms without one)

and a prompt's first token reaches the client ``prefill_base_s`` after its last prompt token
was computed (the sampling, the response's first write, the chat template and tokenizer ahead of
the engine's clock), plus ``first_token_per_stream_s`` for each other stream the replica serves
then (their token writes share its event loop). A disaggregated tier pays
``transfer_per_token_s`` per uncached prompt token to move KV from prefill to decode, and a new
replica serves ``cold_start_s`` after it was asked for. Purely computational.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from fleetpilot import files
from fleetpilot.api import ResolvedRole
from fleetpilot.api.capacity import architecture_of, kv_offload_bytes, role_capacity
from fleetpilot.api.spec import EngineBackend

# Tokens per character of English text with Llama/Qwen-style BPE vocabularies (the router's
# features assume the same: fleetpilot.routing.features.CHARS_PER_TOKEN).
GPU_CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class EngineCosts:
    """The timing model of one replica of one role. Seconds, per the module docstring."""

    prefill_base_s: float
    prefill_per_token_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_kv_token_s: float
    transfer_per_token_s: float = 0.0
    cold_start_s: float = 60.0
    # Measured on the reference engine (its HTTP server shares one GIL with the step); a
    # GPU profile leaves it at 0: no published figure for vLLM's API server per stream.
    first_token_per_stream_s: float = 0.0
    prefill_per_context_token_s: float = 0.0
    prefill_per_pair_s: float = 0.0
    # Copying one token's KV from the host tier (``engine.kvOffload``) into the device pool.
    host_load_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, not {value}")
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError("a decode step must take some time (decode_base_s > 0)")

    def served_s(self, other_streams: int) -> float:
        """From a token computed to the client reading it, for a first token: the base, and
        the share of the event loop the other streams' token writes take."""
        return self.prefill_base_s + self.first_token_per_stream_s * other_streams

    def decode_hop_s(self, prompt_tokens: int) -> float:
        """A P/D decode hop's one step once the KV is pulled: the prompt's last token,
        attending to the rest of it."""
        prior = max(0, prompt_tokens - 1)
        return self.step_s(0, 0, 1, prior, prior + 0.5)

    def step_s(
        self,
        running: int,
        kv_tokens: float,
        prefill_tokens: float = 0,
        prefill_context: float = 0.0,
        prefill_pairs: float = 0.0,
    ) -> float:
        """One engine step: every running sequence decodes a token, ``prefill_tokens`` prompt
        tokens are computed alongside, attending to ``prefill_context`` earlier ones of their
        prompts in ``prefill_pairs`` pairs."""
        return (
            self.decode_base_s
            + self.decode_per_seq_s * running
            + self.decode_per_kv_token_s * kv_tokens
            + self.prefill_per_token_s * prefill_tokens
            + self.prefill_per_context_token_s * prefill_context
            + self.prefill_per_pair_s * prefill_pairs
        )


@dataclass(frozen=True)
class EngineShape:
    """What a replica holds and batches: its KV cache and step limits."""

    kv_tokens: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chars_per_token: float = GPU_CHARS_PER_TOKEN
    # Tokens the chat template adds a message (Llama 3's header and end-of-turn: five).
    message_tokens: int = 5
    # The host tier's KV tokens (``engine.kvOffload``): 0 without one.
    host_kv_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kv_tokens < self.block_size or self.block_size < 1:
            raise ValueError("an engine needs at least one KV block")
        if self.host_kv_tokens < 0:
            raise ValueError("host_kv_tokens must not be negative")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.chars_per_token <= 0 or self.message_tokens < 0:
            raise ValueError("chars_per_token must be positive, message_tokens not negative")


@dataclass(frozen=True)
class Gpu:
    """Published peak figures of one GPU, and the fractions of them vLLM achieves."""

    name: str
    dense_bf16_flops: float
    memory_bandwidth: float  # bytes/s
    # Achieved fractions. Prefill is compute-bound: ~40% of peak (model FLOPs utilisation) for
    # large matmuls with attention and sampling around them. Decode is bandwidth-bound: each
    # step reads every weight and the batch's KV once, at ~70% of the HBM peak.
    prefill_mfu: float = 0.4
    bandwidth_efficiency: float = 0.7
    # The CPU's share of a step (scheduling, sampling, detokenizing): vLLM's own profile of
    # Llama 3 8B on one H100 found the CPU side the bottleneck before v0.6 (blog, 2024-09-05).
    step_overhead_s: float = 0.0015
    # KV moved between a prefill and a decode pod: one 400 Gb/s RDMA NIC, ~80% achieved.
    transfer_bandwidth: float = 40e9
    # Pod start to ready: image pull (cached on the node), CUDA init, graph capture; the
    # weights' load time is added at ``weights_load_bandwidth``.
    start_overhead_s: float = 60.0
    weights_load_bandwidth: float = 2e9  # bytes/s from a PVC or node-local cache
    # The host KV tier's copy back (engine.kvOffload), each GPU over its own PCIe link:
    # Gen5 x16 (H100, H200) carries 64 GB/s a direction, Gen4 x16 (A100, L40S, L4) 32; pinned
    # DMA reaches ~80% of that, and the copies share the link with the running batch's
    # traffic, so ~60% is taken.
    host_bandwidth: float = 40e9


# Dense BF16 peak and memory bandwidth from NVIDIA's datasheets (sparsity figures halved away).
# The H100 SXM5: 989 TFLOPS, 3.35 TB/s. With these, Llama 3 8B (bf16, one GPU) decodes a step in
# ~8.4 ms at batch 1 and ~10-11k tokens/s at batch 256 with 300-500 tokens of context each, and
# prefills ~25k tokens/s (tests/simulate/test_profile.py), against vLLM's published ~6-8 ms TPOT
# at low load (vLLM blog "vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction",
# 2024-09-05, Llama 3 8B on one H100) and ~12.5k output tokens/s for Llama 3.1 8B on one H100
# (third-party benchmarks collected at morphllm.com/vllm-benchmarks, 2026).
_GEN4 = 20e9  # PCIe Gen4 x16 at ~60%, as host_bandwidth's comment
H100 = Gpu("h100", dense_bf16_flops=989e12, memory_bandwidth=3.35e12)
H200 = Gpu("h200", dense_bf16_flops=989e12, memory_bandwidth=4.8e12)
A100 = Gpu("a100", dense_bf16_flops=312e12, memory_bandwidth=2.039e12, host_bandwidth=_GEN4)
A100_PCIE = Gpu(
    "a100-pcie", dense_bf16_flops=312e12, memory_bandwidth=1.935e12, host_bandwidth=_GEN4
)
L40S = Gpu("l40s", dense_bf16_flops=362e12, memory_bandwidth=0.864e12, host_bandwidth=_GEN4)
L4 = Gpu("l4", dense_bf16_flops=121e12, memory_bandwidth=0.3e12, host_bandwidth=_GEN4)
GPUS: dict[str, Gpu] = {g.name: g for g in (H100, H200, A100, A100_PCIE, L40S, L4)}
# By the nvidia.com/gpu.product label, as api.capacity.GPU_MEMORY.
GPU_BY_PRODUCT: dict[str, Gpu] = {
    "NVIDIA-H100-80GB-HBM3": H100,
    "NVIDIA-H200": H200,
    "NVIDIA-A100-SXM4-80GB": A100,
    "NVIDIA-A100-SXM4-40GB": A100,
    "NVIDIA-A100-80GB-PCIe": A100_PCIE,
    "NVIDIA-L40S": L40S,
    "NVIDIA-L4": L4,
}

# Mixture-of-experts models compute with their active parameters only (their model cards).
_ACTIVE_PARAMETERS: tuple[tuple[re.Pattern[str], float], ...] = (
    (re.compile(r"mixtral-8x7b"), 12.9e9),
    (re.compile(r"deepseek-(v3|r1)"), 37e9),
)


def active_parameters(model_name: str, parameters: int) -> float:
    """Parameters a forward pass computes with: all of a dense model's, a MoE's active ones."""
    name = model_name.lower()
    return next((p for pattern, p in _ACTIVE_PARAMETERS if pattern.search(name)), parameters)


class ProfileError(ValueError):
    """A role this profile cannot time, with the reason."""


@dataclass(frozen=True)
class RoleModel:
    """One role's replicas as the simulator runs them."""

    costs: EngineCosts
    shape: EngineShape
    gpus: int  # per replica, for GPU-hours


def roofline(gpu: Gpu, role: ResolvedRole) -> RoleModel:
    """Costs of ``role`` on ``gpu`` from its capacity (``api.capacity``): a decode step reads
    the weights once (base) and each sequence's KV (per KV token) and computes 2 x active
    parameters FLOPs per token (per sequence and per prefill token), over the replica's tensor
    x pipeline GPUs; data-parallel ranks multiply what it holds and batches."""
    capacity = role_capacity(role)
    found = architecture_of(role)
    if capacity is None or found is None or found[0].parameters is None:
        raise ProfileError(
            f"tier {role.tier.name!r} ({role.name}): the planner cannot size it; set "
            "model.architecture (with parameters) and resources.gpuProduct or gpuMemory"
        )
    if not capacity.fits:
        raise ProfileError(f"tier {role.tier.name!r} ({role.name}): the weights do not fit")
    p = role.parallelism
    per_rank = p.tensor * p.pipeline
    flops = 2 * active_parameters(role.tier.model.name, found[0].parameters)
    compute = gpu.dense_bf16_flops * gpu.prefill_mfu * per_rank
    bandwidth = gpu.memory_bandwidth * gpu.bandwidth_efficiency * per_rank
    # Data-parallel ranks step side by side: per-sequence and per-token costs divide by them.
    ranks = p.data
    costs = EngineCosts(
        prefill_base_s=gpu.step_overhead_s,
        prefill_per_token_s=flops / compute / ranks,
        decode_base_s=gpu.step_overhead_s + capacity.weights_bytes / bandwidth,
        decode_per_seq_s=flops / compute / ranks,
        decode_per_kv_token_s=capacity.kv_bytes_per_token / bandwidth / ranks,
        # A prompt's cached prefix is read as a decode reads its context. Its attention FLOPs
        # (per pair) stay 0: the architecture table has no query heads, and below ~32k tokens
        # of context they are a small share of the 2 x parameters a token.
        prefill_per_context_token_s=capacity.kv_bytes_per_token / bandwidth / ranks,
        transfer_per_token_s=capacity.kv_bytes_per_token / gpu.transfer_bandwidth,
        host_load_per_token_s=capacity.kv_bytes_per_token / (gpu.host_bandwidth * per_rank) / ranks,
        cold_start_s=gpu.start_overhead_s
        + capacity.weights_per_gpu_bytes / gpu.weights_load_bandwidth,
    )
    engine = role.tier.engine
    shape = EngineShape(
        kv_tokens=capacity.kv_tokens,
        block_size=engine.kv_cache.block_size,
        max_num_seqs=engine.max_num_seqs * ranks,
        max_num_batched_tokens=(engine.max_num_batched_tokens or 8192) * ranks,
        host_kv_tokens=capacity.host_kv_tokens,
    )
    return RoleModel(costs, shape, per_rank * ranks)


@dataclass(frozen=True)
class MeasuredProfile:
    """Costs measured on one engine (``fleetpilot simulate calibrate``): every role of every
    tier runs as that engine did, with its KV cache and limits (``shape``), since the
    measurement times one model, not the tier's."""

    name: str
    source: str  # what was measured, where and when
    costs: EngineCosts
    shape: EngineShape
    # The router's hop: a lone request's TTFT through ``fleetpilot router`` minus the same
    # engine's directly (its parse, features, pick and relay). A GPU profile has none: the
    # router runs on CPUs whatever the engines run on, and a simulated router decides free.
    router_s: float = 0.0
    # The measured engine's KV bytes a token (what a host tier of engine.kvOffload.size holds);
    # 0 in a profile from before host tiers, which then cannot time a tier with one.
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.router_s) and self.router_s >= 0):
            raise ValueError(f"router_s must be a finite number >= 0, not {self.router_s}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, not {self.kv_bytes_per_token}")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "costs": asdict(self.costs),
            "shape": asdict(self.shape),
            "router_s": self.router_s,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }

    @classmethod
    def from_json(cls, data: Any) -> MeasuredProfile:
        try:
            return cls(
                name=str(data["name"]),
                source=str(data.get("source", "")),
                costs=EngineCosts(**data["costs"]),
                shape=EngineShape(**data["shape"]),
                router_s=float(data.get("router_s", 0.0)),
                kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"not a measured profile: {e}") from None

    def role_model(self, role: ResolvedRole) -> RoleModel:
        engine = role.tier.engine
        shape = EngineShape(
            host_kv_tokens=self._host_kv_tokens(role),
            kv_tokens=self.shape.kv_tokens,
            block_size=self.shape.block_size,
            max_num_seqs=min(engine.max_num_seqs, self.shape.max_num_seqs),
            max_num_batched_tokens=self.shape.max_num_batched_tokens,
            chars_per_token=self.shape.chars_per_token,
            message_tokens=self.shape.message_tokens,
        )
        return RoleModel(self.costs, shape, role.parallelism.gpus)

    def _host_kv_tokens(self, role: ResolvedRole) -> int:
        """The tokens ``engine.kvOffload.size`` holds on the measured engine: whole blocks."""
        offload = kv_offload_bytes(role.tier.engine)
        if offload is None:
            return 0
        if self.kv_bytes_per_token <= 0:
            raise ProfileError(
                f"tier {role.tier.name!r} has engine.kvOffload, but profile {self.name!r} does "
                "not record its engine's KV bytes a token (it predates host tiers): run "
                "fleetpilot simulate calibrate again"
            )
        block = self.shape.block_size
        return offload // (self.kv_bytes_per_token * block) * block


# None: each tier's own GPU, by its resources.gpuProduct.
Profile = Gpu | MeasuredProfile | None

AUTO = "auto"


def load_profile(text: str) -> Profile:
    """``auto`` (each tier's GPU by its product label), a GPU's name (``h100``) or the path of
    a measured profile's JSON file."""
    if text == AUTO:
        return None
    if text in GPUS:
        return GPUS[text]
    path = Path(text)
    if not path.is_file():
        known = ", ".join(sorted(GPUS))
        raise ProfileError(f"profile {text!r}: not auto, a GPU ({known}) or a profile file")
    try:
        data = files.load_json(path, what="simulator profile")
    except files.FileError as e:
        raise ProfileError(f"profile {text!r}: {e.reason}") from None
    return MeasuredProfile.from_json(data)


def _no_gpu_profile(role: ResolvedRole, product: str | None) -> str:
    """Why ``auto`` cannot time ``role``, in what the tier says (never "gpuProduct None")."""
    tier = role.tier
    gpus = ", ".join(sorted(GPUS))
    if tier.engine.backend is EngineBackend.REFERENCE:
        return (
            f"tier {tier.name!r} runs the reference engine (preset "
            f"{tier.engine.reference_model}) on CPUs, which no GPU profile times: pass --profile "
            "with a profile from 'fleetpilot simulate calibrate --out FILE'"
        )
    if not product:
        return (
            f"tier {tier.name!r} names no GPU product (resources.gpuProduct), so auto has none "
            f"to time: set it, or pass --profile with a GPU ({gpus}) or a measured profile"
        )
    known = ", ".join(sorted(GPU_BY_PRODUCT))
    return (
        f"tier {tier.name!r}: no timing profile for resources.gpuProduct {product!r} "
        f"(known: {known}); pass --profile with a GPU ({gpus}) or a measured profile"
    )


def role_model(profile: Profile, role: ResolvedRole) -> RoleModel:
    """How ``role``'s replicas run under ``profile``; ``ProfileError`` if it cannot say."""
    if isinstance(profile, MeasuredProfile):
        return profile.role_model(role)
    if profile is None:
        product = role.tier.resources.gpu_product
        found = GPU_BY_PRODUCT.get(product or "")
        if found is None:
            raise ProfileError(_no_gpu_profile(role, product))
        profile = found
    return roofline(profile, role)
