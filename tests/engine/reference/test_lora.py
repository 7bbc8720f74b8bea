"""LoRA in the reference engine: PEFT adapters read and checked, deltas applied per sequence in
mixed batches, the loaded/active LRUs, and the prefix cache keyed by adapter."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fleetpilot.engine.reference import EngineConfig, LLMEngine
from fleetpilot.engine.reference.blocks import KVPool
from fleetpilot.engine.reference.lora import (
    ALL_TARGETS,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    LoRAConfig,
    LoRAError,
    LoRANotFoundError,
    LoRARequest,
    peft_tensor_name,
    random_adapter,
    read_adapter,
    save_adapter,
    write_seeded_adapter,
)
from fleetpilot.engine.reference.lora_manager import LoRAManager
from fleetpilot.engine.reference.model import (
    LlamaModel,
    LoRABatch,
    LoRAWeights,
    ModelConfig,
    SeqSlice,
    build_attention_metadata,
    lora_targets,
    make_kv_pool,
)
from fleetpilot.engine.reference.request import RequestOutput
from fleetpilot.engine.reference.sampling import SamplingParams
from fleetpilot.kv_events import BlockStored
from fleetpilot.routing.policies.kv_index import KVIndex
from tests.engine.reference.conftest import TINY

F64 = replace(TINY, torch_dtype="float64")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "A prompt of several blocks, so the prefix cache has something to share."


@pytest.fixture(scope="module")
def model64() -> LlamaModel:
    return LlamaModel(F64)


def write_adapter(
    folder: Path,
    config: ModelConfig = TINY,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    targets: tuple[str, ...] = ALL_TARGETS,
) -> Path:
    adapter, tensors = random_adapter(config, rank, alpha, targets, seed)
    return save_adapter(folder, adapter, tensors)


def merged_weights(
    model: LlamaModel, tensors: Mapping[str, torch.Tensor], scaling: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """The base weights with ``W + scaling * B @ A`` merged in, computed from PEFT's tensor
    names independently of the engine's stacking."""
    weights = {k: v.clone() for k, v in model.weights.items()}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        key = module + ".weight"
        s = scaling[module.rsplit(".", 1)[1]]
        weights[key] = weights[key] + s * (b.double() @ a.double()).to(weights[key].dtype)
    return weights


def hand_made(
    config: ModelConfig, ranks: Mapping[str, int], seed: int, *, zero_b: bool = False
) -> dict[str, torch.Tensor]:
    """PEFT tensors of the given rank per module, on every layer."""
    gen = torch.Generator().manual_seed(seed)
    shapes = lora_targets(config)
    out: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module, r in ranks.items():
            t = shapes[module]
            out[peft_tensor_name(layer, module, "A")] = torch.randn(r, t.in_features, generator=gen)
            b = torch.randn(t.out_features, r, generator=gen) * 0.05
            out[peft_tensor_name(layer, module, "B")] = b * 0 if zero_b else b
    return out


# ---- the forward pass --------------------------------------------------------------------


@pytest.mark.parametrize("use_rslora", [False, True])
def test_known_adapter_changes_logits_exactly_as_merged_weights(
    model64: LlamaModel, tmp_path: Path, use_rslora: bool
) -> None:
    """An adapter read from PEFT files gives the logits of the base model with every targeted
    weight replaced by W + scaling * B @ A, with scaling alpha/r (alpha/sqrt(r) under rsLoRA)
    and per-module rank and alpha from rank_pattern/alpha_pattern: the formula and the
    q/k/v and gate/up column offsets in the stacked projections, all at once."""
    ranks = {"q_proj": 8, "k_proj": 4, "v_proj": 8, "o_proj": 8, "gate_proj": 2, "up_proj": 8,
             "down_proj": 8}  # fmt: skip
    tensors = hand_made(F64, ranks, seed=1)
    config = AdapterConfig(
        r=8,
        lora_alpha=16,
        use_rslora=use_rslora,
        rank_pattern={"k_proj": 4, "gate_proj": 2},
        alpha_pattern={"up_proj": 4.0},
    )
    save_adapter(tmp_path, config, tensors)
    weights = read_adapter(tmp_path, F64, max_lora_rank=16)

    def scale(r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if use_rslora else alpha / r

    scaling = {m: scale(r, 4.0 if m == "up_proj" else 16.0) for m, r in ranks.items()}
    merged = LlamaModel(F64, merged_weights(model64, tensors, scaling))
    ids = torch.tensor([256, *b"LoRA changes what the model says."])
    ours = model64.forward_dense(ids, lora=weights)
    expected = merged.forward_dense(ids)
    base = model64.forward_dense(ids)
    assert (ours - base).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-9)


def test_zero_adapter_changes_nothing(model64: LlamaModel, tmp_path: Path) -> None:
    """An adapter with B = 0 (PEFT's initial state) leaves every logit bit for bit."""
    tensors = hand_made(F64, dict.fromkeys(ALL_TARGETS, 8), seed=2, zero_b=True)
    save_adapter(tmp_path, AdapterConfig(r=8, lora_alpha=32), tensors)
    weights = read_adapter(tmp_path, F64, max_lora_rank=8)
    ids = torch.tensor([256, *b"nothing changes"])
    assert torch.equal(model64.forward_dense(ids, lora=weights), model64.forward_dense(ids))


def test_mixed_adapter_batch_equals_each_sequence_alone(model64: LlamaModel) -> None:
    """One paged pass over three sequences (adapter A, adapter B, none) gives each the logits
    of a dense pass of that sequence alone under its own adapter: rows never leak deltas."""
    from fleetpilot.engine.reference.lora import adapter_weights

    a = adapter_weights(*random_adapter(F64, 8, 16, seed=3), F64)
    b = adapter_weights(*random_adapter(F64, 8, 8, ("q_proj", "down_proj"), seed=4), F64)
    prompts = [[256, *b"first sequence"], [256, *b"the second one, longer"], [256, *b"third"]]
    adapters: list[LoRAWeights | None] = [a, b, None]
    pool: KVPool = make_kv_pool(F64, block_size=4, num_blocks=64)
    seqs, start, next_block = [], 0, 0
    for p in prompts:
        n = -(-len(p) // 4)
        seqs.append(SeqSlice(start, len(p), 0, list(range(next_block, next_block + n))))
        start, next_block = start + len(p), next_block + n
    rows = [torch.arange(s.query_start, s.query_start + s.query_len) for s in seqs]
    batch = LoRABatch(((a, rows[0]), (b, rows[1])))
    ids = torch.tensor([t for p in prompts for t in p])
    logits = model64.forward(ids, build_attention_metadata(seqs, 4), pool, lora=batch)
    for p, adapter, r in zip(prompts, adapters, rows, strict=True):
        alone = model64.forward_dense(torch.tensor(p), lora=adapter)
        torch.testing.assert_close(logits[r], alone, rtol=0, atol=1e-9)
    assert (logits[rows[0]] - model64.forward_dense(torch.tensor(prompts[0]))).abs().max() > 0.1


# ---- reading and checking adapters -------------------------------------------------------


def _valid(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    adapter, tensors = random_adapter(TINY, 8, 16, ("q_proj", "v_proj"), seed=5)
    return adapter.to_json_dict(), tensors


def _write_raw(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / WEIGHTS_FILE)


Mutation = Callable[[dict[str, Any], dict[str, torch.Tensor]], object]
A0 = peft_tensor_name(0, "q_proj", "A")
B0 = peft_tensor_name(0, "q_proj", "B")

BAD_ADAPTERS: list[tuple[str, Mutation, str]] = [
    ("dora", lambda c, t: c.update(use_dora=True), "does not yet support DoRA"),
    ("bias", lambda c, t: c.update(bias="all"), "Adapter bias is not supported"),
    ("lora bias", lambda c, t: c.update(lora_bias=True), "LoRA bias (lora_bias)"),
    ("pissa init", lambda c, t: c.update(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
    ("modules_to_save", lambda c, t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    ("rank over max", lambda c, t: c.update(r=32), "LoRA rank 32 is greater than max_lora_rank 16"),
    ("rank pattern over max", lambda c, t: c.update(rank_pattern={"q_proj": 64}),
     "LoRA rank 64 is greater than max_lora_rank 16"),
    ("rank zero", lambda c, t: c.update(r=0), "must be a positive integer"),
    ("no alpha", lambda c, t: c.pop("lora_alpha"), "lacks required fields ['lora_alpha']"),
    ("module the model lacks", lambda c, t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(258, 8)}), "lm_head"),
    ("layer the model lacks", lambda c, t: t.update({
        peft_tensor_name(7, "q_proj", "A"): torch.zeros(8, 64),
        peft_tensor_name(7, "q_proj", "B"): torch.zeros(64, 8)}), "the model has 3 layers"),
    ("A of the wrong width", lambda c, t: t.update({A0: torch.zeros(8, 32)}),
     f"tensor {A0} has shape (8, 32)"),
    ("B of the wrong rank", lambda c, t: t.update({B0: torch.zeros(64, 4)}),
     f"tensor {B0} has shape (64, 4)"),
    ("A without B", lambda c, t: t.pop(B0), "has lora_A but no lora_B"),
    ("not finite", lambda c, t: t[A0].fill_(math.nan), "not finite"),
    ("not a LoRA weight", lambda c, t: t.update({"base_model.model.x.weight": torch.zeros(1)}),
     "is unsupported LoRA weight"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "mutate", "message"), BAD_ADAPTERS, ids=[c[0] for c in BAD_ADAPTERS]
)
def test_bad_adapters_are_refused_with_the_problem_named(
    tmp_path: Path, case: str, mutate: Mutation, message: str
) -> None:
    """A valid adapter with one thing wrong is refused, and the message says what."""
    config, tensors = _valid(tmp_path)
    _write_raw(tmp_path / "ok", config, tensors)
    read_adapter(tmp_path / "ok", TINY, max_lora_rank=16)  # the base case is fine
    mutate(config, tensors)
    _write_raw(tmp_path / "bad", config, tensors)
    with pytest.raises(LoRAError) as info:
        read_adapter(tmp_path / "bad", TINY, max_lora_rank=16)
    assert message in str(info.value)
    assert not isinstance(info.value, LoRANotFoundError)


def test_missing_files_are_named(tmp_path: Path) -> None:
    """No folder or no config: not found (vLLM's 404); no safetensors (only a pickle): refused."""
    with pytest.raises(LoRANotFoundError, match="is not a folder"):
        read_adapter(tmp_path / "nowhere", TINY, max_lora_rank=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRANotFoundError, match=f"has no {CONFIG_FILE}"):
        read_adapter(tmp_path / "empty", TINY, max_lora_rank=16)
    folder = write_adapter(tmp_path / "pickled")
    (folder / WEIGHTS_FILE).rename(folder / "adapter_model.bin")
    with pytest.raises(LoRAError, match=r"adapter_model\.bin is not read"):
        read_adapter(folder, TINY, max_lora_rank=16)
    (folder / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(LoRAError, match="not a valid safetensors file"):
        read_adapter(folder, TINY, max_lora_rank=16)


def test_saved_adapter_is_peft_format(tmp_path: Path) -> None:
    """What save_adapter writes reads back as PEFT lays it out: the config's fields and
    tensors named base_model.model.<module>.lora_{A,B}.weight, A [r, in] and B [out, r]."""
    folder = write_adapter(tmp_path, rank=8, alpha=16, targets=("q_proj", "down_proj"))
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == (
        "LORA", 8, 16.0, "none")  # fmt: skip
    assert config["target_modules"] == ["q_proj", "down_proj"]
    from safetensors.torch import load_file

    tensors = load_file(folder / WEIGHTS_FILE)
    assert tensors[peft_tensor_name(0, "q_proj", "A")].shape == (8, 64)
    assert tensors["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"].shape == (64, 8)
    assert len(tensors) == 2 * 2 * TINY.num_hidden_layers


def test_lora_config_follows_vllms_rules() -> None:
    assert LoRAConfig(max_loras=3).cpu_capacity == 3
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LoRAConfig(max_lora_rank=4)
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        LoRAConfig(max_loras=0)


# ---- the loaded and active sets ----------------------------------------------------------


def _requests(n: int) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, n + 1)]


def test_lru_evicts_the_least_recently_used_idle_adapter() -> None:
    """Two slots, three loaded: a third adapter takes the slot of the one used least recently,
    a fourth evicts the least recent loaded one, and an evicted adapter is read again."""
    weights = adapter_of(seed=0)
    reads: list[str] = []

    def loader(r: LoRARequest) -> LoRAWeights:
        reads.append(r.name)
        return weights

    manager = LoRAManager(LoRAConfig(max_loras=2, max_cpu_loras=3), loader)
    a1, a2, a3, a4 = _requests(4)
    manager.activate([a1])
    manager.activate([a2])
    manager.activate([a1])  # a1 is now more recent than a2
    manager.activate([a3])
    assert list(manager.active) == [1, 3]
    assert list(manager.loaded) == [2, 1, 3]
    manager.activate([a4])
    assert list(manager.loaded) == [1, 3, 4]  # a2, least recently used, left
    manager.activate([a2])
    assert reads == ["a1", "a2", "a3", "a4", "a2"]
    assert (manager.stats.loads, manager.stats.activations) == (5, 5)
    assert manager.stats.cpu_evictions == 2


def test_an_adapter_in_use_is_never_evicted() -> None:
    """The least recently used adapter stays when a running sequence uses it; an idle more
    recent one goes instead, from both levels."""
    manager = LoRAManager(LoRAConfig(max_loras=2, max_cpu_loras=2), lambda r: adapter_of(seed=0))
    a1, a2, a3 = _requests(3)
    manager.activate([a1])
    manager.activate([a2])
    manager.activate([a3], in_use={1})
    assert list(manager.active) == [1, 3]
    assert list(manager.loaded) == [1, 3]
    assert not manager.remove(1, in_use={1})
    assert manager.remove(3, in_use={1})
    # Adding with no idle adapter to evict validates it but keeps nothing over capacity.
    manager.activate([a2], in_use={1})
    manager.add(a3, in_use={1, 2})
    assert list(manager.loaded) == [1, 2]


def adapter_of(seed: int, config: ModelConfig = TINY, **kwargs: Any) -> LoRAWeights:
    from fleetpilot.engine.reference.lora import adapter_weights

    return adapter_weights(*random_adapter(config, 8, 16, seed=seed, **kwargs), config)


# ---- the engine --------------------------------------------------------------------------


def lora_engine(model: LlamaModel, tmp_path: Path, **overrides: Any) -> LLMEngine:
    lora = overrides.pop("lora", LoRAConfig(max_loras=2, max_cpu_loras=4))
    config = EngineConfig(num_kv_blocks=256, max_model_len=256, lora=lora, **overrides)
    return LLMEngine(config, model)


def adapters(tmp_path: Path, n: int = 2) -> list[LoRARequest]:
    out = []
    for i in range(1, n + 1):
        folder = write_adapter(tmp_path / f"adapter-{i}", seed=10 + i, alpha=8 * i)
        out.append(LoRARequest(f"adapter-{i}", i, str(folder)))
    return out


def run(engine: LLMEngine, jobs: list[tuple[str, LoRARequest | None]]) -> list[RequestOutput]:
    """Add every (prompt, adapter) at once and step until all finish; outputs in order."""
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=lora)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(jobs))]


def test_engine_mixed_batch_equals_one_at_a_time(model: LlamaModel, tmp_path: Path) -> None:
    """Three requests in one continuous batch (adapter 1, adapter 2, none) generate exactly
    what each generates alone, and the adapters really change the output."""
    a, b = adapters(tmp_path)
    jobs = [(PROMPT, a), (PROMPT + " B", b), (PROMPT + " base", None)]
    together = run(lora_engine(model, tmp_path), jobs)
    alone = [run(lora_engine(model, tmp_path), [job])[0] for job in jobs]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    base = run(lora_engine(model, tmp_path), [(PROMPT, None), (PROMPT + " B", None)])
    assert together[0].token_ids != base[0].token_ids
    assert together[1].token_ids != base[1].token_ids


def test_engine_runs_at_most_max_loras_adapters_at_once(model: LlamaModel, tmp_path: Path) -> None:
    """With max_loras=1, requests under two adapters never run in the same step: the second
    adapter's request waits (a base-model request behind it goes ahead), and every output is
    what it is alone."""
    a, b = adapters(tmp_path)
    engine = lora_engine(model, tmp_path, lora=LoRAConfig(max_loras=1))
    jobs = [(PROMPT, a), (PROMPT, b), ("base model request", None)]
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=lora)
    final: dict[str, RequestOutput] = {}
    overlapped_base = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        running = {r.lora.name if r.lora else None for r in engine.scheduler.running}
        assert len(running - {None}) <= 1
        overlapped_base |= None in running and "adapter-1" in running
    assert overlapped_base
    for i, job in enumerate(jobs):
        alone = run(lora_engine(model, tmp_path), [job])[0]
        assert final[f"r{i}"].token_ids == alone.token_ids
    assert engine.stats().lora_loads_total == 2


def test_engine_rereads_an_evicted_adapter(model: LlamaModel, tmp_path: Path) -> None:
    """One slot and one loaded adapter: alternating adapters reads each again from its folder,
    and the outputs stay those of a fresh engine."""
    a, b = adapters(tmp_path)
    engine = lora_engine(model, tmp_path, lora=LoRAConfig(max_loras=1, max_cpu_loras=1))
    outs = [run(engine, [(PROMPT, lora)])[0] for lora in (a, b, a)]
    assert outs[0].token_ids == outs[2].token_ids != outs[1].token_ids
    stats = engine.stats()
    assert (stats.lora_loads_total, stats.lora_activations_total) == (3, 3)


def test_engine_refuses_adapters_when_lora_is_off(model: LlamaModel, tmp_path: Path) -> None:
    from fleetpilot.engine.reference.engine import RequestRejectedError

    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256), model)
    with pytest.raises(RequestRejectedError, match="--enable-lora"):
        engine.add_request("r", PROMPT, GREEDY, lora=adapters(tmp_path, 1)[0])


def test_unreadable_adapter_aborts_its_requests_only(model: LlamaModel, tmp_path: Path) -> None:
    """An adapter whose folder vanished after loading: its request finishes "abort" when
    scheduled, the others in the same batch are unaffected."""
    (a,) = adapters(tmp_path, 1)
    engine = lora_engine(model, tmp_path, lora=LoRAConfig(max_loras=1, max_cpu_loras=1))
    gone = LoRARequest("gone", 9, str(tmp_path / "gone"))
    outs = run(engine, [(PROMPT, gone), (PROMPT, None), (PROMPT, a)])
    assert outs[0].finish_reason == "abort"
    assert outs[0].token_ids == ()
    assert [o.finish_reason for o in outs[1:]] == ["length", "length"]
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prefix_cache_is_keyed_by_adapter(model: LlamaModel, tmp_path: Path) -> None:
    """The same prompt under adapter A then B misses (B's KV differs), A then A hits, and the
    base model shares nothing with either."""
    a, b = adapters(tmp_path)
    engine = lora_engine(model, tmp_path)
    first = run(engine, [(PROMPT, a)])[0]
    assert first.num_cached_tokens == 0
    assert run(engine, [(PROMPT, b)])[0].num_cached_tokens == 0
    assert run(engine, [(PROMPT, None)])[0].num_cached_tokens == 0
    again = run(engine, [(PROMPT, a)])[0]
    block = engine.config.block_size
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // block * block > 0
    assert again.token_ids == first.token_ids


def test_kv_events_carry_the_adapter_so_the_router_keys_match(
    model: LlamaModel, tmp_path: Path
) -> None:
    """BlockStored events of a request under an adapter carry its id and name; the router's
    index, fed those events, matches the prompt under that adapter's name, and under no name
    only through the base-model request that shares the prompt, never under another adapter."""
    a, _ = adapters(tmp_path)
    engine = lora_engine(model, tmp_path, enable_kv_cache_events=True)
    out = run(engine, [(PROMPT, a), (PROMPT + " base", None)])
    batch = engine.take_kv_events()
    assert batch is not None
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert {(e.lora_id, e.lora_name) for e in stored} == {(1, "adapter-1"), (None, None)}
    index = KVIndex()
    index.apply("engine-0", batch.events)
    ids = list(out[0].prompt_token_ids)
    full = len(ids) // engine.config.block_size
    assert index.match(ids, engine.config.block_size, "adapter-1") == {"engine-0": full}
    assert index.match(ids, engine.config.block_size, "adapter-2") == {}
    assert index.match(ids, engine.config.block_size, None) == {"engine-0": full}


def test_speculative_decoding_under_an_adapter_is_exact(model: LlamaModel, tmp_path: Path) -> None:
    """The early-exit draft runs under the request's adapter; greedy outputs with speculation
    equal those without."""
    from fleetpilot.engine.reference.speculative import SpeculativeConfig

    a, b = adapters(tmp_path)
    jobs = [(PROMPT, a), (PROMPT, b), (PROMPT, None)]
    plain = run(lora_engine(model, tmp_path), jobs)
    spec = SpeculativeConfig(num_speculative_tokens=3, draft_num_layers=1)
    engine = lora_engine(model, tmp_path, speculative=spec)
    assert [o.token_ids for o in run(engine, jobs)] == [o.token_ids for o in plain]
    assert engine.stats().spec_decode_num_accepted_tokens_total > 0


def test_a_seeded_stand_in_is_written_once_by_its_name_and_reads_back(tmp_path: Path) -> None:
    """The local fleet's stand-in for an adapter: a valid PEFT folder (it reads back under the
    engine's rank limit), the same tensors wherever it is written for the same name, others
    for another name, and never written over what is already there."""
    first = write_seeded_adapter(TINY, "sql", tmp_path / "a", max_rank=16)
    assert first == tmp_path / "a"
    read_adapter(first, TINY, max_lora_rank=8)  # the stand-in's rank is 8 at most
    written = (first / "adapter_model.safetensors").read_bytes()
    assert write_seeded_adapter(TINY, "legal", first, max_rank=16) is None
    assert (first / "adapter_model.safetensors").read_bytes() == written
    again = write_seeded_adapter(TINY, "sql", tmp_path / "b", max_rank=16)
    other = write_seeded_adapter(TINY, "legal", tmp_path / "c", max_rank=16)
    assert again is not None
    assert other is not None
    assert (again / "adapter_model.safetensors").read_bytes() == written
    assert (other / "adapter_model.safetensors").read_bytes() != written
    low = write_seeded_adapter(TINY, "sql", tmp_path / "d", max_rank=1)
    assert low is not None
    read_adapter(low, TINY, max_lora_rank=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "d"]  # no staging left
