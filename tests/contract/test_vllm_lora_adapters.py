"""The LoRA adapters fleetpilot writes, read by the pinned vLLM's own loader.

A local fleet's engines serve seeded stand-ins for a tier's adapters: started with the local
fleet's LoRA flags (``reference_argv.lora_argv``: vLLM's ``--enable-lora`` sizes and
``--lora-modules``, plus ``--seed-missing-lora-modules``), the reference engine writes
``write_seeded_adapter``'s PEFT folder where a path is empty, then reads every adapter with its
own loader (``fleetpilot/engine/reference/lora.py``). Here such an engine starts on the tiny
checkpoint, beside adapters written beforehand with the functions the seeding is made of
(``random_adapter``, ``save_adapter``) for other ranks and target sets; the pinned vLLM then
loads the same folders with the same flags, and both must have read the same thing: rank,
alpha and scaling, the modules adapted with their A and B shapes, and the delta each
projection receives. An adapter whose rank exceeds ``--max-lora-rank`` is refused by both.

How deep vLLM runs (``vllm_judge.py``, op ``lora_adapters``): on the CPU, all of the worker's
load path. The model is built from the checkpoint (no weights read), vLLM's
``LRUCacheWorkerLoRAManager`` wraps it as the model runner does, and each adapter goes
through ``_load_adapter`` (``PEFTHelper.from_local_dir``, ``validate_legal`` against the
engine's ``LoRAConfig``, ``LoRAModel.from_local_checkpoint`` with the model's expected
modules, ``parse_fine_tuned_lora_name`` on every tensor) and ``add_adapter`` (q/k/v and
gate/up packed, scaling folded into B, the adapter copied into a slot of the LoRA layers).
Not run: the punica kernels of a forward pass, and the hop from the API server to the engine
core (the judge gives ``--lora-modules`` ids 1, 2, ... in order, as ``OpenAIServingModels``
does at start). vLLM is asked for float32 (``--dtype float32``: the checkpoint's dtype, which
the reference engine keeps), so deltas agree to float32 rounding.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from fleetpilot.engine.reference.lora import (
    CONFIG_FILE,
    parse_adapter_config,
    peft_tensor_name,
    random_adapter,
    read_adapter,
    save_adapter,
)
from fleetpilot.engine.reference.lora_serving import RUNTIME_UPDATING_ENV
from fleetpilot.engine.reference.model import LoRAWeights, ModelConfig, lora_targets
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.engine.reference_launch import adapter_stand_in, lora_argv
from fleetpilot.engine.vllm_args import LoraLaunch, lora_args
from fleetpilot.testing.engine_server import BackgroundServer
from tests.contract.conftest import VllmJudge

MAX_MODEL_LEN = "512"
TINY = MODEL_PRESETS["tiny"]  # the tiny checkpoint's architecture
SEED_FLAG = "--seed-missing-lora-modules"  # the reference engine's own: vLLM has no such flag


@dataclass(frozen=True)
class Written:
    """An adapter the test writes before the engine starts (``random_adapter``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int


# name -> Written, or None for a stand-in the engine seeds (write_seeded_adapter: rank
# min(8, --max-lora-rank), alpha twice the rank, all seven projections).
Adapters = Mapping[str, Written | None]
SCENARIOS: dict[str, tuple[LoraLaunch, Adapters]] = {
    # max_cpu_loras holds all three, so the reference engine keeps each one's weights.
    "rank-16-engine": (
        LoraLaunch(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        {
            "sql": None,
            # rank == --max-lora-rank, attention only: k/o have no delta
            "attn-qv": Written(16, 32.0, ("q_proj", "v_proj"), seed=1),
            # rank 1, a packed projection half adapted (gate without up)
            "mlp-half": Written(1, 4.0, ("o_proj", "gate_proj", "down_proj"), seed=2),
        },
    ),
    # the seeding's clamp: a stand-in of rank 1 for an engine that takes no more
    "rank-1-engine": (LoraLaunch(max_loras=1, max_lora_rank=1), {"legal": None}),
}


@dataclass(frozen=True)
class Loaded:
    """One scenario's adapters as the reference engine and as vLLM read them."""

    max_lora_rank: int
    folders: dict[str, Path]
    ours: dict[str, LoRAWeights]
    theirs: dict[str, dict[str, Any]]


def start_flags(launch: LoraLaunch, adapters: Adapters, root: Path) -> list[str]:
    """The local fleet's LoRA flags for these adapters (stand-ins under ``root``)."""
    modules = tuple((name, f"/adapters/{name}") for name in adapters)  # pod paths: replaced
    return lora_argv(replace(launch, modules=modules), root)


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def loaded(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_checkpoint: Path,
    vllm_judge: VllmJudge,
) -> Loaded:
    launch, adapters = SCENARIOS[request.param]
    root = tmp_path_factory.mktemp("adapters")
    folders = {name: adapter_stand_in(root, name) for name in adapters}
    for name, written in adapters.items():
        if written is not None:
            adapter, tensors = random_adapter(
                TINY, written.rank, written.alpha, written.targets, written.seed
            )
            save_adapter(folders[name], adapter, tensors)
    flags = start_flags(launch, adapters, root)
    assert SEED_FLAG in flags
    server = BackgroundServer.from_argv(
        ["--host", "127.0.0.1", "--port", "0", "--model", str(tiny_checkpoint),
         "--max-model-len", MAX_MODEL_LEN, "--num-gpu-blocks-override", "64", *flags]
    ).start()  # fmt: skip
    try:
        engine = server.server.engine
        assert engine is not None
        assert engine.loras is not None
        ours = {}
        for name in adapters:
            lora = server.server.loras.get(name)
            assert lora is not None, f"the reference engine did not load {name}"
            ours[name] = engine.loras.loaded[lora.lora_int_id]
    finally:
        server.stop()
    assert all((folder / CONFIG_FILE).is_file() for folder in folders.values())
    vllm_flags = [flag for flag in flags if flag != SEED_FLAG]  # the same vLLM flags
    argv = [str(tiny_checkpoint), "--dtype", "float32", "--max-model-len", MAX_MODEL_LEN,
            *vllm_flags]  # fmt: skip
    answer = vllm_judge.ask({"op": "lora_adapters", "argv": argv})
    assert answer["ok"], answer["error"]
    return Loaded(launch.max_lora_rank, folders, ours, answer["adapters"])


def module_name(layer: int, module: str) -> str:
    """vLLM's name of a module (``parse_fine_tuned_lora_name`` of its PEFT tensor name)."""
    return (
        peft_tensor_name(layer, module, "A")
        .removeprefix("base_model.model.")
        .removesuffix(".lora_A.weight")
    )


def our_modules(weights: LoRAWeights, config: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """The reference engine's loaded adapter per module: (A [rank, in], B [out, rank] with the
    scaling folded in), unstacked from its fused projections."""
    by_place = {(t.projection, t.column): name for name, t in lora_targets(config).items()}
    modules = {}
    for layer, projections in enumerate(weights.layers):
        for projection, delta in projections.items():
            for start, end, column, b in delta.parts:
                name = module_name(layer, by_place[(projection, column)])
                modules[name] = (delta.a[start:end], b)
    return modules


def tensor(data: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(data["float32"]))
    return torch.frombuffer(raw, dtype=torch.float32).reshape(data["shape"])


def test_vllm_reads_the_adapter_config_as_the_reference_engine(loaded: Loaded) -> None:
    """vLLM's ``PEFTHelper`` reads each adapter_config.json fleetpilot wrote to the rank,
    alpha, target modules and scaling the reference engine's parser reads."""
    for name, folder in loaded.folders.items():
        theirs = loaded.theirs[name]
        assert theirs["ok"], f"vLLM refused {name}: {theirs['error']}"
        data = json.loads((folder / CONFIG_FILE).read_text())
        ours = parse_adapter_config(data, max_lora_rank=loaded.max_lora_rank)
        peft = theirs["peft"]
        assert peft["r"] == ours.r
        assert peft["lora_alpha"] == ours.lora_alpha
        assert peft["use_rslora"] == ours.use_rslora
        assert peft["target_modules"] == list(ours.target_modules)
        assert peft["scaling"] == pytest.approx(ours.rank_and_scaling("")[1])


def test_vllm_loads_the_same_modules_with_the_same_shapes(loaded: Loaded) -> None:
    """``LoRAModel.from_local_checkpoint`` finds the modules the reference engine loaded, no
    other, each with the rank, scaling and A/B shapes the reference engine uses."""
    for name, folder in loaded.folders.items():
        theirs = loaded.theirs[name]["modules"]
        ours = our_modules(loaded.ours[name], TINY)
        config = json.loads((folder / CONFIG_FILE).read_text())
        adapter = parse_adapter_config(config, max_lora_rank=loaded.max_lora_rank)
        assert sorted(theirs) == sorted(ours), name
        for module, (a, b) in ours.items():
            rank, scaling = adapter.rank_and_scaling(module)
            assert theirs[module] == {
                "rank": rank,
                "scaling": pytest.approx(scaling),
                "lora_a": list(a.shape),
                "lora_b": list(b.shape),
            }, (name, module)
            assert a.shape[0] == rank


def test_vllm_gives_each_projection_the_reference_engines_delta(loaded: Loaded) -> None:
    """After vLLM packed the adapter into its LoRA layers' slot (q/k/v and gate/up fused, the
    scaling folded into B, slots padded to --max-lora-rank), every projection's delta B @ A
    is the one the reference engine adds: the same module, the same scaling, and nothing
    where the adapter has no delta."""
    for name in loaded.folders:
        slots = loaded.theirs[name]["slots"]
        ours = our_modules(loaded.ours[name], TINY)
        assert set(ours) <= set(slots)
        assert len(slots) == 7 * TINY.num_hidden_layers  # every projection has a LoRA slot
        for module, slot in slots.items():
            a, b = tensor(slot["a"]), tensor(slot["b"])
            assert a.shape[0] == b.shape[1] == loaded.max_lora_rank
            theirs = b.double() @ a.double()
            if module in ours:
                our_a, our_b = ours[module]
                expected = our_b.double() @ our_a.double()
            else:
                expected = torch.zeros_like(theirs)
            torch.testing.assert_close(theirs, expected, rtol=1e-5, atol=1e-6, msg=module)


TOO_BIG = "LoRA rank 32 is greater than max_lora_rank 16."


def test_an_adapter_above_max_lora_rank_is_refused_by_vllm_and_the_reference_engine(
    tmp_path: Path,
    tiny_checkpoint: Path,
    vllm_judge: VllmJudge,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rank-32 adapter on an engine started with --max-lora-rank 16: vLLM's
    ``validate_legal`` refuses it (its server then refuses to start), and so does the
    reference engine, at start and when loaded at run time (400 with vLLM's message, where
    vLLM answers 500). The planner cannot check it: it never sees the adapter's files."""
    launch = LoraLaunch(max_loras=1, max_lora_rank=16)
    folder = tmp_path / "too-big"
    adapter, tensors = random_adapter(TINY, 32, 32.0, ("q_proj", "v_proj"))
    save_adapter(folder, adapter, tensors)
    flags = lora_args(replace(launch, modules=(("too-big", str(folder)),)))
    argv = [str(tiny_checkpoint), "--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, *flags]
    answer = vllm_judge.ask({"op": "lora_adapters", "argv": argv})
    assert answer["ok"], answer["error"]
    refusal = answer["adapters"]["too-big"]
    assert not refusal["ok"]
    assert refusal["error"] == f"ValueError: {TOO_BIG}"

    # The reference engine's loader, given the limit the same flags set.
    with pytest.raises(ValueError, match=TOO_BIG):
        read_adapter(folder, TINY, max_lora_rank=launch.max_lora_rank)
    engine_argv = ["--host", "127.0.0.1", "--port", "0", "--model", str(tiny_checkpoint),
                   "--max-model-len", MAX_MODEL_LEN, "--num-gpu-blocks-override", "64"]  # fmt: skip
    # At start, as --lora-modules: the engine fails, naming the adapter and vLLM's reason.
    failing = BackgroundServer.from_argv([*engine_argv, *flags])
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="did not start"):
            failing.start()
    finally:
        failing.stop()
    assert f"cannot load adapter 'too-big': {TOO_BIG}" in caplog.text
    # Loaded at run time through the server (the load endpoint vLLM has).
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "1")
    server = BackgroundServer.from_argv([*engine_argv, *lora_args(launch)]).start()
    try:
        response = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "too-big", "lora_path": str(folder)},
            timeout=30,
        )
    finally:
        server.stop()
    assert response.status_code == 400
    assert TOO_BIG in response.text
