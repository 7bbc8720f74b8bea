"""The server as a process: ``python -m fleetpilot.engine.reference.server``, SIGTERM drain, and
the command-line entry points the ``fleetpilot engine --backend reference`` CLI calls."""

from __future__ import annotations

import argparse
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleetpilot.engine.reference import server
from fleetpilot.engine.reference.checkpoint import save_checkpoint
from fleetpilot.engine.reference.model import LlamaModel
from fleetpilot.engine.reference.server import build_server, run
from fleetpilot.engine.reference.settings import MODEL_PRESETS, add_arguments
from fleetpilot.testing.polling import eventually
from tests.engine.reference.process_support import ServerProcess, wait_ok


@pytest.fixture
def process() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
        "--max-model-len", "512", "--served-model-name", "drain-model",
        "--step-delay-seconds", "0.01", "--drain-grace-seconds", "20", "--log-level", "debug",
    )  # fmt: skip
    yield proc
    proc.close()


def test_sigterm_drains_running_requests_then_exits_zero(process: ServerProcess) -> None:
    """SIGTERM: /health and new requests turn 503 while a running stream finishes, then the
    process exits 0; its logs are JSON lines (the shared default) and never carry a client's
    bearer token."""
    url = process.wait_listening()
    wait_ok(url + "/health")
    body = {"prompt": "a long one", "max_tokens": 120, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None

        process.proc.send_signal(signal.SIGTERM)
        # New work is refused while the running request goes on (>= 1 s: 120 steps x 10 ms).
        eventually(
            "/health answering 503",
            lambda: httpx.get(url + "/health").status_code,
            5,
            until=lambda status: status == 503,
            interval=0.02,
        )
        refused = httpx.post(
            url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Authorization": "Bearer secret-token"},
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert process.proc.poll() is None

        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert process.proc.wait(20) == 0
    messages = process.messages()
    assert "shutdown requested: draining" in messages
    assert any(m.startswith("stopped (exit code 0)") for m in messages)
    assert "secret-token" not in "".join(process.log)


def test_cli_entry_points_refuse_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad flag value or combination is exit status 2 and a message naming the flag, before
    anything listens."""
    # run() sets up the process's logging, which in here would replace pytest's handlers for
    # the rest of the session.
    monkeypatch.setattr(server, "configure_logging", lambda level, fmt: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cases = {
        "method 'ngram' is not supported": ["--speculative-config", '{"method": "ngram"}'],
        "num_speculative_tokens is required": ["--speculative-config", "{}"],
        "kv_role must be one of": ["--kv-transfer-config", '{"kv_role": "sideways"}'],
        "invalid JSON": ["--kv-transfer-config", "{nope"],
        "exceeds the model's max_position_embeddings": ["--max-model-len", "999999"],
        "is not a directory": ["--model", str(tmp_path / "missing")],
        "not a JSON object or a file": ["--model-config", "huge"],
    }
    for message, argv in cases.items():
        assert run(parser.parse_args(argv)) == 2
        assert message in capsys.readouterr().err


def test_settings_from_flags(tmp_path: Path) -> None:
    """Flags become the server's settings and engine: defaults, a checkpoint, served names,
    vLLM's --kv-transfer-config (kv_both: both sides of the hand-off), cache and speculation."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = build_server(parser.parse_args([]))
    assert defaults.settings.model_name == "reference-small"
    assert defaults.settings.kv.role == "unified"
    assert defaults.settings.max_model_len == 2048

    save_checkpoint(LlamaModel(MODEL_PRESETS["tiny"]), tmp_path / "ckpt")
    args = parser.parse_args(
        [
            "--model", str(tmp_path / "ckpt"),
            "--served-model-name", "a", "b",
            "--kv-transfer-config",
            '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "e1", '
            '"kv_ip": "10.0.0.5"}',
            "--no-enable-prefix-caching", "--kv-cache-dtype", "int8", "--block-size", "8",
            "--speculative-config", '{"method": "draft_layers", "num_speculative_tokens": 3}',
        ]
    )  # fmt: skip
    srv = build_server(args)
    s = srv.settings
    assert s.served_model_names == ("a", "b")
    assert s.kv.role == "both"
    assert s.kv.engine_id == "e1"
    assert s.kv.advertise_host == "10.0.0.5"
    engine = srv.engine_factory()  # loads the checkpoint
    assert engine.config.block_size == 8
    assert engine.config.kv_cache_dtype == "int8"
    assert not engine.config.enable_prefix_caching
    assert engine.config.speculative is not None
    assert engine.config.speculative.num_speculative_tokens == 3
    explicit = build_server(parser.parse_args(["--role", "decode"]))
    assert explicit.settings.kv.consumes
    assert not explicit.settings.kv.produces
