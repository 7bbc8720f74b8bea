"""``--model ORG/NAME``: the reference engine reads a repo id from a Hub cache offline, as vLLM
does in an engine pod of a cached tier (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``).

The cache is the one ``fleetpilot model fetch hub`` writes (the download Job's code, run against
the Hub on 127.0.0.1 of tests/delivery/hub_server.py, then stopped) holding a checkpoint the
engine's own ``save_checkpoint`` wrote; the engine must load exactly those weights through the
loader every checkpoint takes, by branch and by commit, choose the cache as vLLM does
(``--download-dir``, else ``HF_HUB_CACHE``), serve them with no Hub to ask, and refuse a repo or
revision the cache lacks at start, naming both.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import torch
from huggingface_hub import close_session, constants

from fleetpilot.delivery.hub import fetch_hub
from fleetpilot.engine.reference import server
from fleetpilot.engine.reference.checkpoint import load_checkpoint, save_checkpoint
from fleetpilot.engine.reference.model import LlamaModel
from fleetpilot.engine.reference.settings import (
    ConfigError,
    ServerSettings,
    add_arguments,
    settings_from_args,
)
from fleetpilot.testing.engine_server import BackgroundServer
from tests.delivery.hub_server import FakeHub
from tests.engine.reference.conftest import TINY
from tests.engine.reference.process_support import ServerProcess, wait_ok

REPO = "acme/tiny-llm"
BRANCH = "v1"
# Not the preset's seed: a model built from the preset instead of the checkpoint differs.
CHECKPOINT_SEED = 7
GREEDY = {"prompt": "Hello, cache", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@dataclass(frozen=True)
class Cached:
    cache: Path  # the Hub cache folder, as the Job leaves it
    commit: str  # what BRANCH resolves to
    checkpoint: Path  # the same checkpoint as a plain folder


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Cached:
    """A Hub cache holding REPO at BRANCH, filled by the download Job's code; the Hub is gone."""
    root = tmp_path_factory.mktemp("hub-cache")
    checkpoint = root / "checkpoint"
    save_checkpoint(LlamaModel(replace(TINY, init_seed=CHECKPOINT_SEED)), checkpoint)
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    hub = FakeHub(REPO, files, revision=BRANCH)
    with pytest.MonkeyPatch.context() as mp:
        # No token or endpoint of this machine's reaches the fake Hub.
        for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
            mp.delenv(name, raising=False)
        mp.setattr(constants, "HF_TOKEN_PATH", str(root / "hf-home" / "token"))
        mp.setattr(constants, "HF_STORED_TOKENS_PATH", str(root / "hf-home" / "stored"))
        try:
            result = fetch_hub(REPO, root / "cache", revision=BRANCH, endpoint=hub.endpoint)
        finally:
            # The library's pooled connections keep the Hub's request threads waiting for a
            # next request (a later test joining HTTP server threads would wait on them).
            close_session()
            hub.close()
    assert sorted(p.name for p in result.snapshot.iterdir()) == sorted(files)
    return Cached(root / "cache", result.commit, checkpoint)


def settings_for(argv: list[str], environ: dict[str, str]) -> tuple[ServerSettings, LlamaModel]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings, factory = settings_from_args(parser.parse_args(argv), environ)
    return settings, factory().model


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def same_weights(a: LlamaModel, b: LlamaModel) -> bool:
    wa, wb = dict(a.named_weights()), dict(b.named_weights())
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_repo_id_loads_the_cached_checkpoint_by_branch_or_commit(cached: Cached) -> None:
    """``--model ORG/NAME --revision BRANCH`` (through ``refs/``) and ``--revision COMMIT``
    load the very weights of the checkpoint, not a seeded random model; the served name is the
    repo id, as vLLM's default."""
    expected = load_checkpoint(cached.checkpoint)
    assert not same_weights(expected, LlamaModel(TINY))  # the test can tell them apart
    for revision in (BRANCH, cached.commit):
        argv = ["--model", REPO, "--revision", revision, "--max-model-len", "256"]
        settings, model = settings_for(argv, offline(cached.cache))
        assert same_weights(model, expected), revision
        assert settings.served_model_names == (REPO,)
        assert settings.model_root == REPO


def test_download_dir_is_the_cache_before_hf_hub_cache(cached: Cached, tmp_path: Path) -> None:
    """vLLM's ``--download-dir`` names the cache; without it, ``HF_HUB_CACHE`` does."""
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    argv = ["--model", REPO, "--revision", BRANCH, "--max-model-len", "256"]
    _, model = settings_for([*argv, "--download-dir", str(cached.cache)], offline(empty))
    assert same_weights(model, load_checkpoint(cached.checkpoint))
    with pytest.raises(ConfigError, match="empty-cache"):
        settings_for([*argv, "--download-dir", str(empty)], offline(cached.cache))


def test_a_repo_or_revision_the_cache_lacks_fails_the_start_naming_both(
    cached: Cached,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Nothing is downloaded: an unknown revision or repo is exit status 2 before anything
    listens, with one message naming the repo, the revision, the cache and how to fill it."""
    monkeypatch.setattr(server, "configure_logging", lambda level, fmt: None)
    for name, value in offline(cached.cache).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cases = {
        (REPO, "v2"): ["--model", REPO, "--revision", "v2"],
        ("acme/other", "main"): ["--model", "acme/other"],
    }
    for (repo, revision), argv in cases.items():
        assert server.run(parser.parse_args(argv)) == 2
        err = capsys.readouterr().err
        assert f"{repo} at revision {revision} is not in the Hub cache {cached.cache}" in err
        assert f"fleetpilot model fetch hub --repo {repo} --revision {revision}" in err
    # A path that is no repo id either says what it is not.
    assert server.run(parser.parse_args(["--model", "/no/such/checkpoint"])) == 2
    assert "is not a directory, nor a Hub repo id" in capsys.readouterr().err


def test_an_engine_process_serves_the_cached_model_offline(cached: Cached) -> None:
    """The real process, given only ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` as a cached
    tier's pod is (the Hub stopped), answers a greedy completion exactly as an engine loading
    the same checkpoint from its plain folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= offline(cached.cache)
    proc = ServerProcess(
        "--host", "127.0.0.1", "--port", "0", "--model", REPO, "--revision", BRANCH,
        "--max-model-len", "256", env=env,
    )  # fmt: skip
    plain = BackgroundServer.from_argv(
        [
            "--host", "127.0.0.1", "--port", "0", "--model", str(cached.checkpoint),
            "--served-model-name", REPO, "--max-model-len", "256",
        ]
    ).start()  # fmt: skip
    try:
        url = proc.wait_listening()
        with httpx.Client(timeout=60) as client:
            from_cache = _greedy(client, url)
            from_folder = _greedy(client, plain.url)
    finally:
        plain.stop()
        proc.close()
    assert from_cache == from_folder
    assert len(from_cache) == GREEDY["max_tokens"]


def test_the_planned_job_fetches_from_the_mirror_and_the_planned_pod_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path of a reference tier with a cached Hub source, as planned: the fetch
    Job's own command and environment (the mirror reaches the fetcher only as HF_ENDPOINT,
    the spec's model.source.huggingface.endpoint) fill the cache volume from the Hub; the
    engine pod's own args and environment (HF_HUB_CACHE on that volume, offline) then load
    exactly the checkpoint's weights, under the spec's served name."""
    from fleetpilot.cli import main
    from fleetpilot.operator.planner import plan
    from tests.factories import make_service, make_tier

    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(LlamaModel(replace(TINY, init_seed=CHECKPOINT_SEED)), checkpoint)
    hub = FakeHub(REPO, {p.name: p.read_bytes() for p in checkpoint.iterdir()}, revision=BRANCH)
    tier = make_tier("small", model=REPO, engine={"backend": "reference"})
    source = {"huggingface": {"revision": BRANCH, "endpoint": hub.endpoint}}
    tier["model"] = {"name": REPO, "servedName": "tiny", "source": source}
    objects = plan(make_service(tiers=[tier], modelCache={"claimName": "models"}))
    (job,) = [o for o in objects if o["kind"] == "Job"]
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    engines = [o for o in objects if o["kind"] == "Deployment"]
    (deployment,) = [o for o in engines if o["metadata"]["name"] == "chat-small"]
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]

    volume = tmp_path / "volume"  # what the claim holds, at /model-cache in both pods

    def on_volume(value: str) -> str:
        return value.replace("/model-cache", str(volume), 1)

    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored"))
    job_env = {e["name"]: e["value"] for e in fetch["env"] if "value" in e}
    assert job_env["HF_ENDPOINT"] == hub.endpoint
    assert "--endpoint" not in fetch["command"]  # the environment is the only way there
    for name, value in job_env.items():
        if name.startswith("HF_"):
            monkeypatch.setenv(name, value)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert fetch["command"][:1] == ["fleetpilot"]
        assert main([on_volume(arg) for arg in fetch["command"][1:]]) == 0
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        close_session()
        hub.close()
    assert hub.requests(None)  # the mirror, not huggingface.co, answered

    pod_env = {e["name"]: on_volume(e["value"]) for e in engine["env"] if "value" in e}
    assert pod_env["HF_HUB_OFFLINE"] == "1"
    # `fleetpilot engine` picks the engine by --backend; the rest is the engine's own.
    assert engine["args"][:2] == ["--backend", "reference"]
    settings, model = settings_for(engine["args"][2:], pod_env)
    assert same_weights(model, load_checkpoint(checkpoint))
    assert settings.served_model_names == ("tiny",)


def _greedy(client: httpx.Client, url: str) -> list[int]:
    """The greedy completion's token ids, once the engine is ready."""
    wait_ok(url + "/health", get=client.get)
    body = {**GREEDY, "model": REPO, "return_token_ids": True}
    resp = client.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    ids = resp.json()["choices"][0]["token_ids"]
    assert isinstance(ids, list)
    return [int(i) for i in ids]
