"""Capacity: the KV-cache formula against published figures and the reference engine's own
pool, weights and the room they leave, and where the planner uses them (a refused tier, the
summary's lines and warnings, the router's prefix-index size)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from fleetpilot.api import parse_service
from fleetpilot.api.capacity import (
    GIB,
    GPU_MEMORY,
    KIB,
    LayerWidths,
    architecture_from_config,
    known_architecture,
    kv_bytes_per_token,
    kv_element_bytes,
    lora_bytes_per_gpu,
    role_capacity,
    weight_bytes,
)
from fleetpilot.api.spec import (
    KvCacheDtype,
    LoraSettings,
    ModelArchitecture,
    ModelDtype,
    Quantization,
)
from fleetpilot.engine.reference.blocks import KVPool
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.operator.plan_types import PlanError
from fleetpilot.operator.planner import capacity_warnings, plan
from fleetpilot.operator.router_objects import router_config
from fleetpilot.operator.status import Observed, compute_status
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


H200 = {"resources": {"gpuProduct": "NVIDIA-H200"}}


def test_expert_parallelism_spreads_the_routed_experts_over_every_gpu() -> None:
    """DeepSeek-V3 in fp8 on 16 data-parallel ranks: with expert parallelism each GPU holds the
    dense part whole (tensor 1) and a 16th of the routed experts, 54 GiB; split the dense way
    it would be the whole 671 GB on each GPU, refused."""
    model = {"name": "deepseek-ai/DeepSeek-V3", "quantization": "fp8"}
    parallelism = {"data": 16, "expert": True}
    tier = make_tier("main", parallelism=parallelism, **H200)
    tier["model"] = model
    (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
    sized = role_capacity(role)
    assert sized is not None
    experts = 58 * 256 * 3 * 7168 * 2048
    assert sized.weights_per_gpu_bytes == pytest.approx((671e9 - experts) + experts / 16, rel=1e-6)
    assert f"{sized.weights_per_gpu_bytes / GIB:.1f}" == "54.0"
    assert sized.fits
    dense = make_tier("main", parallelism={"data": 16}, **H200)
    dense["model"] = model
    with pytest.raises(PlanError, match="leave no room for a KV cache"):
        plan(parse_service(make_manifest(tiers=[dense])))


def test_expert_parallelism_over_unknown_experts_is_not_sized() -> None:
    """A MoE model whose experts' share the planner does not know is not sized with expert
    parallelism (CapacitySufficient Unknown), rather than sized by the dense split."""
    tier = make_tier("main", parallelism={"data": 2, "expert": True}, **H100)
    tier["model"] = {
        "name": "acme/moe",
        "architecture": {"layers": 32, "kvHeads": 8, "headDim": 128, "parameters": 47_000_000_000},
    }
    (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
    assert role_capacity(role) is None


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
    assert (
        "capacity: not sized: spec.tiers[0].model.name 'acme/secret-13b': model architecture "
        "unknown; set spec.tiers[0].model.architecture; GPU memory unknown; set "
        "spec.tiers[0].resources.gpuMemory (e.g. 80Gi), or spec.tiers[0].resources.gpuProduct "
        "to one of: "
    ) in text


def test_an_unknown_gpu_product_names_the_field_and_what_to_do() -> None:
    """Issue 47: `gpuProduct: NVIDIA-L40` (a product the table lacks) said "not sized:
    unknown the GPU's memory". The summary and CapacitySufficient now name the field and
    its value, and say what to set instead: gpuMemory, or one of the known products."""
    svc = service(model="meta-llama/Llama-3.1-8B-Instruct", resources={"gpuProduct": "NVIDIA-L40"})
    text = summarize(svc, plan(svc))
    known = ", ".join(sorted(GPU_MEMORY))
    expected = (
        "capacity: not sized: spec.tiers[0].resources.gpuProduct 'NVIDIA-L40': GPU memory "
        "unknown for this product; set spec.tiers[0].resources.gpuMemory (e.g. 48Gi) or use "
        f"one of: {known}"
    )
    assert expected in text
    assert "NVIDIA-L40S" in known  # the nearest known product is offered
    capacity = next(
        c
        for c in compute_status(
            svc, Observed({}, []), None, datetime(2026, 1, 1, tzinfo=UTC)
        ).conditions
        if c.type == "CapacitySufficient"
    )
    assert (capacity.status, capacity.reason) == ("Unknown", "NotSized")
    assert capacity.message == f"not sized: tier small / unified: {expected.split(': ', 2)[2]}"


def test_the_routers_prefix_index_is_sized_like_the_largest_cache() -> None:
    """The guessed index remembers as many 64-character blocks per replica as its engine's
    KV cache holds tokens (~4 characters each); unsized services keep the default."""
    svc = service(model="meta-llama/Llama-3.1-8B-Instruct", **H100)
    sized = role_capacity(svc.spec.tiers[0].roles()[0])
    assert sized is not None
    assert router_config(svc).prefix_index_blocks == sized.kv_tokens * 4 // 64
    assert router_config(service(model="acme/secret-13b")).prefix_index_blocks == 32768


def test_the_routers_kv_index_holds_every_host_tier_within_half_its_memory() -> None:
    """With host tiers the router's KV index must hold every engine's host blocks (a
    superset of its device's): 8 replicas of an 8B model with 128 GiB each hold 65,536 blocks
    apiece, 524,288 together - the default bound exactly, so it stays; 16 replicas need
    twice that, which half of a 1 GiB router holds at ~400 bytes an entry (1,342,177), so the
    bound is theirs; a 256 MiB router caps it at what half of it holds, never below the
    default. Without host tiers the default stands."""
    offload = {"engine": {"kvOffload": {"size": "128Gi"}}, **H100}

    def bound(replicas: int, memory: str = "1Gi") -> int | None:
        manifest = make_tier(model=LLAMA_8B, **offload)
        manifest["serving"] = {"replicas": {"min": 1, "max": replicas}}
        svc = parse_service(make_manifest(tiers=[manifest], routing={"memory": memory}))
        return router_config(svc).kv_index.max_blocks

    assert bound(8) is None
    assert bound(16) == 16 * 65_536
    assert bound(64, memory="256Mi") == 524_288  # half of 256 MiB / 400 B is below the default
    assert bound(64, memory="2Gi") == 2**30 // 400  # half of 2 GiB, 400 bytes an entry
    assert router_config(service(model=LLAMA_8B, **H100)).kv_index.max_blocks is None


# LoRA slots. vLLM 0.33 (vllm/lora/model_manager.py, LoRAModelManager._create_lora_modules)
# wraps every LoRA-capable layer when the engine loads the model, whatever the adapters target,
# and each wrapper's create_lora_weights (vllm/lora/layers/) allocates zeroed A [max_loras, 1,
# rank, in] and B [max_loras, 1, out, rank] per slice in the LoRA dtype (the model's: bf16).
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
SLOTS = {"maxLoras": 2, "maxLoraRank": 32}
SLOT_BYTES = 2 * 32 * 2  # max_loras x rank x bf16: every buffer is this times a width


def test_lora_slots_of_llama_3_8b_are_vllms_buffers() -> None:
    """Llama-3.1-8B (32 layers, hidden 4096, intermediate 14336, 32 heads / 8 KV heads of 128,
    vocab 128256) at maxLoras 2, rank 32, bf16. Widths of A (in) plus B (out) per layer, from
    vllm/lora/layers/column_parallel_linear.py and row_parallel_linear.py (t: tensor size):

    - qkv_proj, MergedQKVParallelLinearWithLoRA: A 3 slices x 4096; B 4096/t + 2 x 1024/t
    - o_proj, RowParallelLinearWithLoRA: A 4096/t (input_size_per_partition); B 4096
    - gate_up_proj, MergedColumnParallelLinearWithLoRA: A 2 x 4096; B 2 x 14336/t
    - down_proj, RowParallelLinearWithLoRA: A 14336/t; B 4096

    TP 1: 16384 + 8192 + 36864 + 18432 = 81920 a layer; TP 2: (12288 + 3072) + (2048 + 4096)
    + (8192 + 14336) + (7168 + 4096) = 55296. LlamaForCausalLM lists embed_tokens and lm_head
    in embedding_modules, so VocabParallelEmbeddingWithLoRA (A [2, 128256, 32], B [2, 1, 4096,
    32]) and LogitsProcessorWithLoRA (A [2, 1, 32, 4096], B [2, 1, 128256, 32]) add
    2 x (128256 + 4096) = 264704, unsharded. Times 2 x 32 x 2 bytes: TP 1 (32 x 81920 +
    264704) x 128 = 369,426,432 bytes (352 MiB); TP 2 (32 x 55296 + 264704) x 128 =
    260,374,528 (248 MiB) on each GPU. The same formula on a tiny Llama and a tiny Qwen2 gave
    vLLM's own allocation exactly (CPU; Llama at TP 1, 2 and 4 over gloo ranks)."""
    tp1 = role_capacity(service(LLAMA_8B, lora=SLOTS, **H100).spec.tiers[0].roles()[0])
    tp2 = role_capacity(service(LLAMA_8B, tensor=2, lora=SLOTS, **H100).spec.tiers[0].roles()[0])
    assert tp1 is not None
    assert tp2 is not None
    assert tp1.lora_bytes_per_gpu == (32 * 81920 + 264704) * SLOT_BYTES == 369_426_432
    assert tp2.lora_bytes_per_gpu == (32 * 55296 + 264704) * SLOT_BYTES == 260_374_528


@pytest.mark.parametrize(
    ("model", "dtype", "tier", "per_gpu"),
    [
        # Qwen2ForCausalLM lists no embedding_modules: no embed_tokens or lm_head buffers.
        # 28 layers: qkv 3 x 3584 + 3584 + 2 x 512, o 3584 + 3584, gate_up 2 x 3584 +
        # 2 x 18944, down 18944 + 3584 = 90112 a layer; rank 16: 2 x 16 x 2 bytes.
        ("Qwen/Qwen2.5-7B-Instruct", "auto", {"lora": {"maxLoras": 2, "maxLoraRank": 16}},
         28 * 90112 * 64),
        # Tensor 4: qkv 10752 + (896 + 2 x 128), o 896 + 3584, gate_up 7168 + 2 x 4736,
        # down 4736 + 3584 = 41344 a layer.
        ("Qwen/Qwen2.5-7B-Instruct", "auto",
         {"tensor": 4, "lora": {"maxLoras": 2, "maxLoraRank": 16}}, 28 * 41344 * 64),
        # float32: the LoRA dtype is the model's; four bytes an element.
        (LLAMA_8B, "float32", {"lora": SLOTS}, 2 * 369_426_432),
        # Pipeline 2: the busiest stage holds 16 layers and one of embed_tokens / lm_head.
        (LLAMA_8B, "auto", {"lora": SLOTS, "parallelism": {"pipeline": 2}},
         (16 * 81920 + 132352) * SLOT_BYTES),
        # Mixtral (FusedMoEWithLoRA, vllm/lora/layers/fused_moe.py): per expert w13 A 2 x 4096,
        # B 2 x 14336, w2 A 14336, B 4096 = 55296; 8 experts, plus the router's
        # ReplicatedLinearWithLoRA (A 4096, B 8) and attention 26624: 473096 a layer; vocab
        # 32000 with embedding_modules: 2 x (32000 + 4096). Nearly 2 GB at 2 x rank 32.
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "auto", {"lora": SLOTS},
         (32 * 473096 + 72192) * SLOT_BYTES),
    ],
)  # fmt: skip
def test_lora_slots_by_model_and_parallelism(
    model: str, dtype: str, tier: dict[str, Any], per_gpu: int
) -> None:
    """A model without embedding LoRA, tensor parallelism, the model's dtype, a pipeline
    stage, and MoE experts each with their own slots."""
    manifest = make_tier(model=model, **H100, **tier)
    manifest["model"]["dtype"] = dtype
    role = parse_service(make_manifest(tiers=[manifest])).spec.tiers[0].roles()[0]
    sized = role_capacity(role)
    assert sized is not None
    assert sized.lora_bytes_per_gpu == per_gpu


# What vLLM 0.33 allocated for 2 slots of rank 8 in bf16 on a tiny model (3 layers, hidden
# 256, intermediate 704, 8 heads / 2 KV heads of 32, vocab 1000): the model built on the CPU
# as the judge builds it (tests/contract/vllm_judge.py, op lora_adapters), its
# LRUCacheWorkerLoRAManager created, the storages of every *_stacked tensor of the manager's
# modules summed, on each of `tensor` gloo ranks.
TINY_WIDTHS = LayerWidths(hidden=256, intermediate=704, heads=8, vocab=1000, lora_embeddings=True)
VLLM_TINY_LORA_BYTES = [
    ("LlamaForCausalLM", 1, 516_608),
    ("LlamaForCausalLM", 2, 384_512),
    ("LlamaForCausalLM", 4, 321_536),  # 2 KV heads over 4 GPUs: vLLM replicates, one each
    ("Qwen2ForCausalLM", 1, 436_224),  # no embedding_modules: no embed_tokens/lm_head slots
]


@pytest.mark.parametrize(("vllm_class", "tensor", "allocated"), VLLM_TINY_LORA_BYTES)
def test_the_formula_is_what_vllm_allocated(vllm_class: str, tensor: int, allocated: int) -> None:
    """The formula over a tiny model gives the bytes vLLM itself allocated for it, per GPU."""
    arch = ModelArchitecture(layers=3, kv_heads=2, head_dim=32)
    widths = replace(TINY_WIDTHS, lora_embeddings=vllm_class == "LlamaForCausalLM")
    lora = LoraSettings(max_loras=2, max_lora_rank=8)
    assert lora_bytes_per_gpu(arch, widths, lora, 2, tensor) == allocated


def test_the_kv_cache_shrinks_by_exactly_the_lora_slots() -> None:
    """The same tier with and without LoRA slots: the cache is computed from what the weights
    and the slots leave on each GPU (over both GPUs of a tensor-parallel pair); a tier without
    adapters keeps the KV cache it had (nothing subtracted, no LoRA line in the summary)."""
    budget = GPU_MEMORY["NVIDIA-H100-80GB-HBM3"] * 0.9 - 2 * GIB
    per_token = 128 * KIB
    for tensor, lora_bytes in ((1, 369_426_432), (2, 260_374_528)):
        weights = 16_060_000_000 // tensor
        plain_svc = service(LLAMA_8B, tensor=tensor, **H100)
        plain = role_capacity(plain_svc.spec.tiers[0].roles()[0])
        role = service(LLAMA_8B, tensor=tensor, lora=SLOTS, **H100).spec.tiers[0].roles()[0]
        with_lora = role_capacity(role)
        assert plain is not None
        assert with_lora is not None
        assert plain.lora is None
        assert plain.lora_bytes_per_gpu == 0
        assert plain.kv_tokens == (budget - weights) * tensor // per_token
        assert with_lora.kv_tokens == (budget - weights - lora_bytes) * tensor // per_token
        assert "LoRA slots" not in summarize(plain_svc, plan(plain_svc))


def test_the_summary_shows_the_lora_slots() -> None:
    """`fleetpilot plan -o summary` prints what the slots take on each GPU, before the KV
    cache they shrink (examples/lora.yaml's tier: 2 x rank 32 on one H100)."""
    svc = service(LLAMA_8B, 16384, lora=SLOTS, **H100)
    text = summarize(svc, plan(svc))
    assert "    LoRA slots: 2 x rank 32: 352 MiB per GPU\n    KV cache per replica: 445,494" in text


@pytest.mark.parametrize(
    ("gpu_memory", "without_lora", "with_lora"),
    [
        # 15.1 GiB for 15.0 GiB of weights: room for a cache, but not once 352 MiB of slots
        # are taken; at tensor 2 (7.5 GiB + 248 MiB) both fit.
        ("19Gi", None, "tensor 2 fits"),
        # 7.54 GiB: the weights need tensor 2 (7.48 GiB each), which the 248 MiB of slots at
        # tensor 2 overflow; tensor 4 (3.7 GiB + 196 MiB) fits.
        ("10.6Gi", "tensor 2 fits", "tensor 4 fits"),
    ],
)
def test_lora_slots_can_refuse_a_tier_and_raise_the_tensor_size_it_needs(
    gpu_memory: str, without_lora: str | None, with_lora: str
) -> None:
    """The refusal and the smallest tensor size that fits count the slots at each size."""
    plain = service(LLAMA_8B, resources={"gpuMemory": gpu_memory})
    if without_lora is None:
        plan(plain)
    else:
        with pytest.raises(PlanError, match=without_lora):
            plan(plain)
    with pytest.raises(PlanError, match=with_lora) as refused:
        plan(service(LLAMA_8B, lora=SLOTS, resources={"gpuMemory": gpu_memory}))
    # The refusal names what took the room: the weights and the slots.
    assert " of LoRA slots per GPU (tensor " in refused.value.message


@pytest.mark.parametrize("model", ["acme/secret-13b", LLAMA_8B])
def test_lora_slots_of_a_model_of_unknown_widths_are_a_warning(model: str) -> None:
    """model.architecture has no hidden or intermediate size: the slots are not counted, and
    plan, the summary and CapacitySufficient say so instead of showing a cache too large. A
    name the table knows does not lend its widths to an architecture the spec gives: that
    says the checkpoint is not the table's."""
    tier = service(model, resources={"gpuMemory": "48Gi"}, lora=SLOTS).spec.tiers[0]
    manifest = tier.model_dump(by_alias=True, exclude_none=True)
    arch = {"layers": 40, "kvHeads": 8, "headDim": 128, "parameters": 13_000_000_000}
    manifest["model"]["architecture"] = arch
    svc = parse_service(make_manifest(tiers=[manifest]))
    sized = role_capacity(svc.spec.tiers[0].roles()[0])
    assert sized is not None
    assert sized.lora_bytes_per_gpu is None
    (warning,) = capacity_warnings(svc)
    assert "2 LoRA slots of rank 32 is not counted" in warning
    assert "LoRA slots: 2 x rank 32: not counted" in summarize(svc, plan(svc))


# The host KV tier (engine.kvOffload): vLLM's CPUOffloadingSpec divides cpu_bytes_to_use into
# page-aligned chunks of one block of every GPU of an engine (tests/contract judges this with
# vLLM's own spec; these pin the arithmetic and where the planner shows it).
def offload_service(model: str, size: str, max_model_len: int = 8192, **tier: Any) -> Any:
    engine = {"kvOffload": {"size": size}, **tier.pop("engine", {})}
    return service(model, max_model_len, engine=engine, **H100, **tier)


def test_the_host_tier_holds_its_bytes_over_the_gpus_kv_bytes_per_token() -> None:
    """Llama 3 8B, 128 KiB a token: 64 GiB hold 524,288 tokens (64 sequences of 8k), on top
    of the ~448k of the GPU; with tensor 2 the same bytes a token over both GPUs, so the
    same; with two data-parallel ranks each engine has its own 64 GiB, twice the tokens."""
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    (role,) = offload_service(llama, "64Gi").spec.tiers[0].roles()
    sized = role_capacity(role)
    assert sized is not None
    assert sized.kv_offload_bytes == 64 * GIB
    assert sized.host_kv_tokens == 64 * GIB // (128 * KIB) == 524_288
    assert sized.host_sequences_at_max_len == 64
    assert sized.kv_tokens < sized.host_kv_tokens
    for parallelism, factor in (({"tensor": 2}, 1), ({"data": 2}, 2)):
        (other,) = offload_service(llama, "64Gi", parallelism=parallelism).spec.tiers[0].roles()
        wider = role_capacity(other)
        assert wider is not None
        assert wider.host_kv_tokens == factor * 524_288
    (plain,) = service(llama, 8192, **H100).spec.tiers[0].roles()
    none = role_capacity(plain)
    assert none is not None
    assert (none.kv_offload_bytes, none.host_kv_tokens, none.host_sequences_at_max_len) == (
        None,
        0,
        None,
    )


def test_the_host_tier_counts_whole_page_aligned_blocks() -> None:
    """A block of Qwen2.5-7B (56 KiB a token) at block size 8 is 448 KiB, page aligned: 1 GiB
    holds 2340 whole blocks, not 1 GiB / 56 KiB tokens. A block of DeepSeek-V3's fp8 MLA
    latent (35,136 bytes a token x 16 tokens = 137.25 pages) takes 138 pages."""
    (role,) = (
        offload_service("Qwen/Qwen2.5-7B-Instruct", "1Gi", engine={"kvCache": {"blockSize": 8}})
        .spec.tiers[0]
        .roles()
    )
    sized = role_capacity(role)
    assert sized is not None
    assert sized.host_kv_tokens == GIB // (448 * KIB) * 8 == 2340 * 8
    per_token = 61 * 576  # fp8 latent
    deepseek = ModelArchitecture(
        layers=61, kv_heads=128, head_dim=128, parameters=10**9, kv_lora_rank=512,
        qk_rope_head_dim=64,
    )  # fmt: skip
    chunk = 138 * 4096
    assert per_token * 16 < chunk < per_token * 16 + 4096
    tier = make_tier(
        model="deepseek-ai/DeepSeek-V3",
        engine={"kvOffload": {"size": "10Gi"}, "kvCache": {"dtype": "fp8"}},
        resources={"gpuMemory": "1000Gi"},
    )
    tier["model"]["architecture"] = deepseek.to_wire()
    (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
    sized = role_capacity(role)
    assert sized is not None
    assert sized.kv_bytes_per_token == per_token
    assert sized.host_kv_tokens == 10 * GIB // chunk * 16


def test_mlas_latent_is_kept_once_in_host_memory_under_tensor_parallelism_on_one_node() -> None:
    """On the GPUs every tensor-parallel rank holds MLA's whole latent (the device tier's KV
    bytes a token are tensor times the latent); vLLM's replicated host layout keeps it once,
    so the host tier holds tensor times more tokens - not with pipeline parallelism, nor
    across nodes, where vLLM keeps every rank's copy."""
    deepseek = "deepseek-ai/DeepSeek-V3"
    latent = 61 * 576 * 2  # bytes a token, bf16
    block = latent * 16
    for parallelism, copies in (
        ({"tensor": 8}, 1),
        ({"tensor": 4, "pipeline": 2}, 4),
        ({"tensor": 16}, 16),  # two nodes of 8
    ):
        tier = make_tier(
            model=deepseek,
            engine={"kvOffload": {"size": "100Gi"}},
            resources={"gpuMemory": "1000Gi"},
            parallelism=parallelism,
        )
        (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
        sized = role_capacity(role)
        assert sized is not None
        tensor = parallelism["tensor"]
        assert sized.kv_bytes_per_token == latent * tensor
        chunk = -(-block * copies // 4096) * 4096
        assert sized.host_kv_tokens == 100 * GIB // chunk * 16, parallelism


def test_a_host_tier_no_larger_than_the_gpus_cache_is_a_warning() -> None:
    """vLLM copies prompt blocks to the host tier as they are computed: a host tier that holds
    no more tokens than the GPUs' cache holds nothing the GPUs do not."""
    small = offload_service("meta-llama/Llama-3.1-8B-Instruct", "16Gi")
    (warning,) = capacity_warnings(small)
    assert "engine.kvOffload.size 16 GiB holds 131,072 tokens per replica, no more than" in warning
    assert capacity_warnings(offload_service("meta-llama/Llama-3.1-8B-Instruct", "64Gi")) == []


def test_the_summary_shows_both_tiers_and_the_pods_memory() -> None:
    """`fleetpilot plan -o summary`: the GPUs' KV cache, then the host tier's tokens and
    sequences with its size, and the pod's memory that pays for it."""
    svc = offload_service("meta-llama/Llama-3.1-8B-Instruct", "64Gi", max_model_len=32768)
    text = summarize(svc, plan(svc))
    assert "    KV cache per replica: 448,312 tokens, 13 sequences of 32768" in text
    assert (
        "    host KV cache per replica: 524,288 tokens, 16 sequences of 32768  "
        "(engine.kvOffload.size 64Gi, native)"
    ) in text
    assert (
        "    pod memory: 137626Mi  (resources.memory 64Gi + 64 GiB of host KV cache + 10%" in text
    )
    unsized = service("acme/secret-13b", engine={"kvOffload": {"size": "8Gi"}})
    text = summarize(unsized, plan(unsized))
    assert "    host KV cache per replica: engine.kvOffload.size 8Gi, native" in text
    plain = service("meta-llama/Llama-3.1-8B-Instruct", **H100)
    assert "host KV cache" not in summarize(plain, plan(plain))
