"""LoRA through the reference engine's HTTP server: vLLM's load/unload endpoints, adapters
named in ``model``, ``/v1/models`` and ``vllm:lora_requests_info``, and vLLM's flags."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference import EngineConfig, LlamaModel, LLMEngine
from fleetpilot.engine.reference.lora import LoRAConfig, LoRARequest, random_adapter, save_adapter
from fleetpilot.engine.reference.lora_serving import parse_lora_module
from fleetpilot.engine.reference.metrics import ServerMetrics
from fleetpilot.engine.reference.sampling import SamplingParams
from fleetpilot.engine.reference.settings import (
    MODEL_PRESETS,
    ConfigError,
    add_arguments,
    settings_from_args,
)
from fleetpilot.testing.engine_server import BackgroundServer

MODEL = "tiny-model"
TINY = MODEL_PRESETS["tiny"]
PROMPT = "The quick brown fox jumps over the lazy dog, again and again and again."
BASE_ARGS = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
             "--max-model-len", "256", "--served-model-name", MODEL]  # fmt: skip


def write(folder: Path, seed: int, rank: int = 8) -> Path:
    adapter, tensors = random_adapter(TINY, rank, 16, seed=seed)
    return save_adapter(folder, adapter, tensors)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    write(root / "static", seed=1)
    write(root / "dyn", seed=2)
    write(root / "other", seed=3)
    write(root / "rank32", seed=4, rank=32)
    return root


def start(argv: list[str], *, runtime_updating: str | None = "true") -> BackgroundServer:
    with pytest.MonkeyPatch.context() as mp:
        if runtime_updating is None:
            mp.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        else:
            mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", runtime_updating)
        return BackgroundServer.from_argv(argv).start()


@pytest.fixture(scope="module")
def server(adapter_dir: Path) -> Iterator[BackgroundServer]:
    srv = start([*BASE_ARGS, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3",
                 "--lora-modules", f"static={adapter_dir / 'static'}"])  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def complete(http: httpx.Client, model: str, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def expected_tokens(path: Path, prompt: str = PROMPT) -> list[int]:
    """What an engine built here, with the same seeded model and the adapter, generates."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=64, max_model_len=256, lora=LoRAConfig()), LlamaModel(TINY)
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("r", prompt, params, lora=LoRARequest("x", 1, str(path)))
    while True:
        for out in engine.step():
            if out.finished:
                return list(out.token_ids)


def error(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["error"]
    assert body["code"] == response.status_code
    return body


def test_load_use_unload_an_adapter(http: httpx.Client, adapter_dir: Path) -> None:
    """Loaded at runtime, an adapter serves chat and completions under its name with exactly
    the engine's adapted output; unloaded, its name is a 404 again, as in vLLM."""
    path = adapter_dir / "dyn"
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "dyn", "lora_path": str(path)})
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'dyn' added successfully."
    data = complete(http, "dyn")
    assert data["model"] == "dyn"
    assert data["choices"][0]["token_ids"] == expected_tokens(path)
    assert data["choices"][0]["token_ids"] != complete(http, MODEL)["choices"][0]["token_ids"]
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "dyn", "messages": messages, "max_tokens": 4}
    chat = http.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200
    assert chat.json()["model"] == "dyn"

    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'dyn' removed successfully."
    gone = http.post("/v1/completions", json={"model": "dyn", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404
    assert error(gone) == {"message": "The model `dyn` does not exist.", "type": "NotFoundError",
                           "param": "model", "code": 404}  # fmt: skip
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
    assert again.status_code == 404
    assert error(again)["message"] == "The lora adapter 'dyn' cannot be found."


def test_static_adapter_from_lora_modules_serves(http: httpx.Client, adapter_dir: Path) -> None:
    """--lora-modules name=path is loaded at start and generates the adapter's output."""
    assert complete(http, "static")["choices"][0]["token_ids"] == expected_tokens(
        adapter_dir / "static"
    )


BAD_LOADS = [
    ("nothing at the path", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404,
     "NotFoundError", "Loading lora x failed: No adapter found for /nonexistent/adapter"),
    ("rank over max", {"lora_name": "x", "lora_path": "{dir}/rank32"}, 400, "BadRequestError",
     "LoRA rank 32 is greater than max_lora_rank 16."),
    ("base model's name", {"lora_name": MODEL, "lora_path": "{dir}/other"}, 400,
     "InvalidUserInput", f"The lora adapter '{MODEL}' conflicts with a served base model."),
    ("loaded already", {"lora_name": "static", "lora_path": "{dir}/other"}, 400,
     "InvalidUserInput", "The lora adapter 'static' has already been loaded."),
    ("empty path", {"lora_name": "x", "lora_path": ""}, 400, "InvalidUserInput",
     "Both 'lora_name' and 'lora_path' must be provided."),
    ("no path", {"lora_name": "x"}, 400, "BadRequestError", "lora_path"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "body", "status", "type_", "message"), BAD_LOADS, ids=[c[0] for c in BAD_LOADS]
)
def test_bad_loads_are_refused(
    http: httpx.Client,
    adapter_dir: Path,
    case: str,
    body: dict[str, str],
    status: int,
    type_: str,
    message: str,
) -> None:
    """Each refused load answers vLLM's status and error type, with the problem named, and
    leaves nothing behind."""
    body = {k: v.format(dir=adapter_dir) for k, v in body.items()}

    def models() -> list[tuple[str, str]]:
        return [(m["id"], m["root"]) for m in http.get("/v1/models").json()["data"]]

    before = models()
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status, response.text
    err = error(response)
    assert err["type"] == type_
    assert message in err["message"]
    assert models() == before


def test_load_in_place_keeps_the_name_and_changes_the_weights(
    http: httpx.Client, adapter_dir: Path
) -> None:
    """load_inplace replaces an adapter's weights under its name (vLLM's flag)."""
    path1, path2 = adapter_dir / "dyn", adapter_dir / "other"
    http.post("/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": str(path1)})
    try:
        assert complete(http, "swap")["choices"][0]["token_ids"] == expected_tokens(path1)
        body = {"lora_name": "swap", "lora_path": str(path2), "load_inplace": True}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert complete(http, "swap")["choices"][0]["token_ids"] == expected_tokens(path2)
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})


def test_models_lists_adapters_with_their_parent(http: httpx.Client, adapter_dir: Path) -> None:
    """/v1/models: the base model, then each adapter with root = its path and parent = the base
    model, as vLLM lists them."""
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards[MODEL]["parent"] is None
    assert cards[MODEL]["max_model_len"] == 256
    static = cards["static"]
    assert (static["object"], static["root"], static["parent"]) == (
        "model", str(adapter_dir / "static"), MODEL)  # fmt: skip


def test_prefix_cache_does_not_cross_adapters_over_http(http: httpx.Client) -> None:
    """A prompt computed under one adapter is not a cache hit for the base model, and is for
    the same adapter (usage.prompt_tokens_details.cached_tokens)."""
    prompt = "A prompt of its own, for this test only: " + PROMPT

    def cached(model: str) -> int:
        usage = complete(http, model, prompt)["usage"]
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    assert cached("static") == 0
    assert cached(MODEL) == 0
    assert cached("static") >= 16


def test_lora_gauge_is_exported_with_vllms_labels(http: httpx.Client) -> None:
    """/metrics has vllm:lora_requests_info with max_lora and the (here empty) adapter lists,
    valued at the time of the engine state it shows."""
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "2", "waiting_lora_adapters": "",
                             "running_lora_adapters": ""}  # fmt: skip
    assert abs(sample.value - time.time()) < 300
    assert "fleetpilot_lora_adapter_loads" in families


def test_lora_gauge_names_running_and_waiting_adapters(tmp_path: Path) -> None:
    """The gauge's labels list the adapters of running and waiting requests: with max_loras=1
    a second adapter's request waits while the first runs."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=64, max_model_len=256, lora=LoRAConfig(max_loras=1)),
        LlamaModel(TINY),
    )
    params = SamplingParams(temperature=0, max_tokens=8)
    for i, name in enumerate(["a", "a", "b"]):
        lora = LoRARequest(name, 1 if name == "a" else 2, str(write(tmp_path / name, seed=i)))
        engine.add_request(f"r{i}", PROMPT, params, lora=lora)
    engine.add_request("base", PROMPT, params)
    engine.step()
    metrics = ServerMetrics(MODEL, max_model_len=256, max_lora=1)
    metrics.set_stats(engine.stats())
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "1", "running_lora_adapters": "a",
                             "waiting_lora_adapters": "b"}  # fmt: skip
    assert engine.stats().running_lora_adapters == {"a": 2}


def test_no_lora_means_no_gauge_and_no_endpoints(adapter_dir: Path) -> None:
    """Without --enable-lora there is no vllm:lora_requests_info (as vLLM), and without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING the load endpoint does not exist."""
    srv = start([*BASE_ARGS, "--enable-lora"], runtime_updating=None)
    plain = start(BASE_ARGS, runtime_updating="true")
    try:
        body = {"lora_name": "x", "lora_path": str(adapter_dir / "dyn")}
        assert httpx.post(srv.url + "/v1/load_lora_adapter", json=body).status_code == 404
        metrics = httpx.get(plain.url + "/metrics").text
        assert "vllm:lora_requests_info" not in metrics
        refused = httpx.post(plain.url + "/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400
        assert "--enable-lora" in error(refused)["message"]
    finally:
        srv.stop()
        plain.stop()


# ---- flags -------------------------------------------------------------------------------


def parse(*argv: str, env: dict[str, str] | None = None) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args([*BASE_ARGS, *argv]), env or {})


def test_lora_flags_use_vllms_spelling_and_rules(tmp_path: Path) -> None:
    settings, _ = parse("--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
                        "--lora-modules", "a=/x/a",
                        json.dumps({"name": "b", "path": "/x/b", "base_model_name": MODEL}),
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # fmt: skip
    assert settings.lora == LoRAConfig(max_loras=3, max_lora_rank=64)
    assert settings.lora.cpu_capacity == 3
    assert [(m.name, m.path, m.base_model_name) for m in settings.lora_modules] == [
        ("a", "/x/a", None), ("b", "/x/b", MODEL)]  # fmt: skip
    assert settings.allow_runtime_lora_updating
    assert not parse("--enable-lora")[0].allow_runtime_lora_updating
    assert parse()[0].lora is None
    for argv, message in [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "must be >= max_loras"),
        (["--enable-lora", "--lora-modules", f"{MODEL}=/x"], "conflict with a served base model"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names given twice"),
        (["--enable-lora", "--lora-modules", "{not json"], "Invalid JSON format"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse(*argv)
    with pytest.raises(SystemExit):
        parse("--enable-lora", "--max-lora-rank", "4")  # not one of vLLM's ranks


def test_lora_modules_entries_parse_as_vllms() -> None:
    """name=path splits at the first '='; anything with a comma is JSON."""
    assert parse_lora_module("sql=/a=b") == parse_lora_module('{"name": "sql", "path": "/a=b"}')
    with pytest.raises(ValueError, match="Invalid fields"):
        parse_lora_module('{"name": "sql"}')


def test_absolute_adapter_paths_are_read_under_the_path_root(tmp_path: Path) -> None:
    """A test playing a pod names the pod's paths (/adapter-volumes/...): the engine reads them
    under --adapter-path-root and reports the path as named, as vLLM in the pod would."""
    write(tmp_path / "adapter-volumes" / "loras" / "tax", seed=5)
    srv = start([*BASE_ARGS, "--enable-lora", "--adapter-path-root", str(tmp_path)])
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"lora_name": "tax", "lora_path": "/adapter-volumes/loras/tax"}
            assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
            cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
            assert cards["tax"]["root"] == "/adapter-volumes/loras/tax"
            data = complete(http, "tax")
            path = tmp_path / "adapter-volumes" / "loras" / "tax"
            assert data["choices"][0]["token_ids"] == expected_tokens(path)
            missing = {"lora_name": "nope", "lora_path": str(path)}  # not under the root
            assert http.post("/v1/load_lora_adapter", json=missing).status_code == 404
    finally:
        srv.stop()
