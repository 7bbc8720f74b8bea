"""Capacity: the KV-cache formula against published figures and the reference engine's own
pool, weights and the room they leave, and where the planner uses them (a refused tier, the
summary's lines and warnings, the router's prefix-index size)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.api import parse_service
from fleetpilot.api.capacity import (
    GIB,
    GPU_MEMORY,
    KIB,
    architecture_from_config,
    known_architecture,
    kv_bytes_per_token,
    kv_element_bytes,
    role_capacity,
    weight_bytes,
)
from fleetpilot.api.spec import KvCacheDtype, ModelArchitecture, ModelDtype, Quantization
from fleetpilot.engine.reference.blocks import KVPool
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.operator.plan_types import PlanError
from fleetpilot.operator.planner import capacity_warnings, plan
from fleetpilot.operator.router_objects import router_config
from fleetpilot.operator.summary import summarize
from tests.factories import make_manifest, make_tier

# Published KV-cache sizes per token (16-bit cache): Llama 3 70B's 320 KiB and 8B's 128 KiB
# are the figures NVIDIA's and vLLM's sizing guides quote; the others follow from the models'
# config.json files; DeepSeek-V3's MLA latent is (512 + 64) x 61 layers x 2 bytes.
PUBLISHED_KV_PER_TOKEN = [
    ("meta-llama/Llama-3.1-70B-Instruct", 320 * KIB),
    ("meta-llama/Meta-Llama-3-8B-Instruct", 128 * KIB),
    ("meta-llama/Llama-3.1-405B-Instruct", 504 * KIB),
    ("Qwen/Qwen2.5-7B-Instruct", 56 * KIB),
    ("Qwen/Qwen2.5-72B-Instruct", 320 * KIB),
    ("Qwen/Qwen3-32B", 256 * KIB),
    ("mistralai/Mistral-7B-Instruct-v0.3", 128 * KIB),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", 128 * KIB),
    ("deepseek-ai/DeepSeek-V3", 61 * 576 * 2),
]


@pytest.mark.parametrize(("model", "per_token"), PUBLISHED_KV_PER_TOKEN)
def test_kv_bytes_per_token_match_published_figures(model: str, per_token: int) -> None:
    """The formula over the built-in architectures gives the published per-token sizes, and
    an fp8 cache half of them."""
    arch = known_architecture(model)
    assert arch is not None, model
    assert kv_bytes_per_token(arch, 2) == per_token
    assert kv_bytes_per_token(arch, 1) == per_token // 2


def test_mla_caches_a_latent_not_heads() -> None:
    """DeepSeek-V3 with its 128 heads of 128 would cache 3.8 MiB a token as plain attention;
    its latent is 57 times smaller, the same on every tensor-parallel GPU."""
    arch = known_architecture("deepseek-ai/DeepSeek-R1")
    assert arch is not None
    plain = arch.model_copy(update={"kv_lora_rank": None, "qk_rope_head_dim": None})
    assert kv_bytes_per_token(plain, 2) == 2 * 61 * 128 * 128 * 2
    assert kv_bytes_per_token(plain, 2) // kv_bytes_per_token(arch, 2) == 56
    assert kv_bytes_per_token(arch, 2, tensor=8) == 8 * kv_bytes_per_token(arch, 2)


def test_more_gpus_than_kv_heads_replicate_heads() -> None:
    """Qwen2.5-7B has 4 KV heads: over 8 GPUs vLLM keeps one head on each, twice the cache."""
    arch = known_architecture("Qwen/Qwen2.5-7B-Instruct")
    assert arch is not None
    assert kv_bytes_per_token(arch, 2, tensor=4) == 56 * KIB
    assert kv_bytes_per_token(arch, 2, tensor=8) == 112 * KIB


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_the_formula_is_the_reference_engines_pool(preset: str) -> None:
    """The reference engine's preallocated pool is exactly the formula times its slots, for
    an architecture read from the config.json its checkpoints carry."""
    config = MODEL_PRESETS[preset]
    arch = architecture_from_config(config.to_json_dict())
    spec = config.kv_spec(block_size=16)
    pool = KVPool(spec, num_blocks=3)
    element = pool.data.element_size()
    assert pool.nbytes == kv_bytes_per_token(arch, element) * 3 * spec.block_size


def test_weights_by_quantization() -> None:
    """16-bit weights are two bytes a parameter (Llama 3 70B: ~141 GB), fp8 one, 4-bit AWQ
    about a quarter with its scales; a method whose width the checkpoint decides is unknown."""
    arch = known_architecture("meta-llama/Llama-3.1-70B-Instruct")
    assert arch is not None
    assert weight_bytes(arch, None) == pytest.approx(141.2e9, rel=0.01)
    assert weight_bytes(arch, Quantization.FP8) == pytest.approx(70.6e9, rel=0.01)
    awq = weight_bytes(arch, Quantization.AWQ)
    assert awq is not None
    assert 0.25 < awq / 141.2e9 < 0.3
    assert weight_bytes(arch, Quantization.GGUF) is None
    assert kv_element_bytes(KvCacheDtype.AUTO, ModelDtype.BFLOAT16) == 2
    assert kv_element_bytes(KvCacheDtype.FP8_E4M3, ModelDtype.BFLOAT16) == 1


def service(model: str, max_model_len: int | None = None, **tier: Any) -> Any:
    """A one-tier service of ``model``, with the tier fields given."""
    manifest = make_tier(model=model, **tier)
    if max_model_len is not None:
        manifest["model"]["maxModelLen"] = max_model_len
    return parse_service(make_manifest(tiers=[manifest]))


H100 = {"resources": {"gpuProduct": "NVIDIA-H100-80GB-HBM3"}}


def test_a_replica_is_sized_from_its_gpus() -> None:
    """Llama 3 8B on one H100 at 0.9: 15 GiB of weights, the rest less a 2 GiB reserve for
    KV at 128 KiB a token, over 400k tokens; the same over two data-parallel ranks twice that."""
    (role,) = service(model="meta-llama/Llama-3.1-8B-Instruct", **H100).spec.tiers[0].roles()
    sized = role_capacity(role)
    assert sized is not None
    assert sized.architecture_source == "built-in table"
    assert sized.weights_per_gpu_bytes == pytest.approx(8.03e9 * 2, rel=1e-6)
    expected = (GPU_MEMORY["NVIDIA-H100-80GB-HBM3"] * 0.9 - 16.06e9 - 2 * GIB) / (128 * KIB)
    assert sized.kv_tokens == pytest.approx(expected, rel=1e-4)
    assert 400_000 < sized.kv_tokens < 450_000
    doubled = service(
        "meta-llama/Llama-3.1-8B-Instruct", parallelism={"data": 2}, **H100
    ).spec.tiers[0]
    twice = role_capacity(doubled.roles()[0])
    assert twice is not None
    assert twice.kv_tokens == 2 * sized.kv_tokens


def test_the_spec_names_what_the_table_does_not_know() -> None:
    """An unknown model on an unknown GPU is not sized; with model.architecture and
    resources.gpuMemory it is, from the spec."""
    (role,) = service(model="acme/secret-13b").spec.tiers[0].roles()
    assert role_capacity(role) is None
    arch = {"layers": 40, "kvHeads": 8, "headDim": 128, "parameters": 13_000_000_000}
    tier = service("acme/secret-13b", resources={"gpuMemory": "48Gi"}).spec.tiers[0]
    tier = tier.model_dump(by_alias=True, exclude_none=True)
    tier["model"]["architecture"] = arch
    sized = role_capacity(parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()[0])
    assert sized is not None
    assert sized.architecture_source == "spec"
    assert sized.gpu_memory_bytes == 48 * GIB
    assert sized.kv_bytes_per_token == 2 * 40 * 8 * 128 * 2
    assert ModelArchitecture.model_validate(arch).kv_heads == 8


def test_weights_that_do_not_fit_are_refused_naming_the_tensor_size_that_does() -> None:
    """Llama 3 70B in 16 bits on one H100: refused before any object is planned, with the
    numbers and the smallest tensor-parallel size that fits (two: 66 GiB each leaves room)."""
    svc = service(model="meta-llama/Llama-3.1-70B-Instruct", **H100)
    with pytest.raises(PlanError) as refused:
        plan(svc)
    assert refused.value.field == "spec.tiers[0].parallelism.tensor"
    message = refused.value.message
    assert "132 GiB of weights per GPU (tensor 1 x pipeline 1)" in message
    assert "in 69.7 GiB (79.6 GiB x gpuMemoryUtilization 0.9, less 2 GiB" in message
    assert "tensor 2 fits" in message
    plan(service(model="meta-llama/Llama-3.1-70B-Instruct", tensor=2, **H100))


def test_no_tensor_size_within_the_node_fits() -> None:
    """DeepSeek-V3 in 16 bits needs more than 8 H100s: the refusal says none within the node."""
    svc = service(model="deepseek-ai/DeepSeek-V3", tensor=8, **H100)
    with pytest.raises(PlanError, match=r"no tensor size within resources\.gpusPerNode 8 fits"):
        plan(svc)


def test_warnings_for_a_context_no_sequence_fits_and_an_unreachable_batch_limit() -> None:
    """A 70B on two H100s has ~8 GiB left for KV, ~26k tokens: a 128k context fits no
    sequence, and 256 sequences where 3 of 8k fit is far beyond; both warned, not refused."""
    llama = "meta-llama/Llama-3.1-70B-Instruct"
    (warning,) = capacity_warnings(service(llama, 131_072, tensor=2, **H100))
    assert "maxModelLen 131072 does not fit one sequence" in warning
    long = service(llama, 8192, tensor=2, **H100)
    (warning,) = capacity_warnings(long)
    assert "maxNumSeqs 256 is over 32x the 3 sequences of maxModelLen" in warning
    assert "warning: tier small / unified: maxNumSeqs 256" in summarize(long, plan(long))
    assert capacity_warnings(service(model="meta-llama/Llama-3.1-8B-Instruct", **H100)) == []


def test_the_summary_shows_capacity_or_what_it_lacks() -> None:
    """`fleetpilot plan -o summary` prints weights per GPU and the KV cache per replica, or
    what it would need to know."""
    sized = service(model="Qwen/Qwen2.5-7B-Instruct", **H100)
    text = summarize(sized, plan(sized))
    assert "(architecture from the built-in table)" in text
    assert "(56 KiB a token); maxNumSeqs 256" in text
    unsized = service(model="acme/secret-13b")
    text = summarize(unsized, plan(unsized))
    assert "capacity: not sized: unknown the model's architecture (set model.architecture)" in text
    assert "the GPU's memory (set resources.gpuProduct or resources.gpuMemory)" in text


def test_the_routers_prefix_index_is_sized_like_the_largest_cache() -> None:
    """The guessed index remembers as many 64-character blocks per replica as its engine's
    KV cache holds tokens (~4 characters each); unsized services keep the default."""
    svc = service(model="meta-llama/Llama-3.1-8B-Instruct", **H100)
    sized = role_capacity(svc.spec.tiers[0].roles()[0])
    assert sized is not None
    assert router_config(svc).prefix_index_blocks == sized.kv_tokens * 4 // 64
    assert router_config(service(model="acme/secret-13b")).prefix_index_blocks == 32768
