"""The adapter client against a real engine (the reference engine serves vLLM's load/unload
endpoints and ``/v1/models`` as vLLM 0.33 does)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleetpilot.engine.adapter_client import AdapterClient
from fleetpilot.engine.reference.lora import random_adapter, save_adapter
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.testing.engine_server import BackgroundServer

MODEL = "tiny-model"
ARGS = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len",
        "256", "--served-model-name", MODEL, "--enable-lora", "--max-loras", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for seed, name in enumerate(("a", "b", "b2", "c"), start=1):
        adapter, tensors = random_adapter(MODEL_PRESETS["tiny"], 8, 16, seed=seed)
        paths[name] = str(save_adapter(root / name, adapter, tensors))
    return paths


@pytest.fixture
def engine() -> Iterator[BackgroundServer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        server = BackgroundServer.from_argv(ARGS).start()
    yield server
    server.stop()


@pytest.fixture
def client() -> Iterator[AdapterClient]:
    adapter_client = AdapterClient()
    yield adapter_client
    adapter_client.close()


def served(url: str, model: str) -> int:
    body = {"model": model, "prompt": "hello there", "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def test_a_sync_loads_the_list_and_a_changed_list_swaps_and_reloads(
    engine: BackgroundServer, client: AdapterClient, adapters: dict[str, str]
) -> None:
    first = client.sync(engine.url, {"a": adapters["a"], "b": adapters["b"]})
    assert first.errors == []
    assert sorted(first.done) == ["load a", "load b"]
    assert client.listed(engine.url) == {"a": adapters["a"], "b": adapters["b"]}
    assert served(engine.url, "a") == 200

    again = client.sync(engine.url, {"a": adapters["a"], "b": adapters["b"]})
    assert again.done == []
    assert again.errors == []
    assert again.plan.empty

    changed = client.sync(engine.url, {"b": adapters["b2"], "c": adapters["c"]})
    assert changed.errors == []
    assert changed.done == ["unload a", "load c", "reload b"]
    assert client.listed(engine.url) == {"b": adapters["b2"], "c": adapters["c"]}
    assert served(engine.url, "a") == 404
    assert served(engine.url, "c") == 200


def test_a_bad_adapter_is_reported_and_does_not_keep_the_others_out(
    engine: BackgroundServer, client: AdapterClient, adapters: dict[str, str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "nowhere")
    outcome = client.sync(engine.url, {"a": adapters["a"], "ghost": missing})
    assert outcome.done == ["load a"]
    (error,) = outcome.errors
    assert error.startswith(f"load ghost from {missing}: ")
    assert client.listed(engine.url) == {"a": adapters["a"]}


def test_an_unreachable_engine_is_an_error_not_an_exception(client: AdapterClient) -> None:
    outcome = client.sync("http://127.0.0.1:9", {"a": "/x"})
    assert outcome.done == []
    (error,) = outcome.errors
    assert error.startswith("list adapters: ")
