"""The router's command-line entry points: flags, config errors, a real process serving and
shutting down on SIGTERM, structured logs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from fleetpilot.routing.app import EXIT_INVALID, JsonFormatter, add_arguments, run
from tests.routing.support import make_config, tier


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_and_defaults() -> None:
    """--config is required; the port defaults to the config's; discovery defaults to auto."""
    args = parse("--config", "/etc/fleetpilot/router.yaml")
    assert (args.port, args.host, args.discovery, args.log_format) == (
        None,
        "0.0.0.0",
        "auto",
        "json",
    )


def test_invalid_config_exits_2(tmp_path: Path, capsys: object) -> None:
    """A config that does not parse: a message and exit status 2, no server."""
    path = tmp_path / "router.yaml"
    path.write_text("service: [")
    assert run(parse("--config", str(path), "--log-format", "plain")) == EXIT_INVALID
    logging.getLogger().handlers.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_router_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`python -m fleetpilot.routing.app`: /health and /v1/models answer; SIGTERM exits 0;
    logs are JSON lines."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(make_config([tier("small", 1.0)]).to_wire()))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetpilot.routing.app", "--config", str(path),
         "--host", "127.0.0.1", "--port", str(port), "--discovery", "static"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert health.status_code == 200
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["chat", "small-model"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert proc.stderr is not None
        lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.strip()]
        assert any(line["msg"] == "router started" for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_json_log_lines_carry_extras() -> None:
    """A log record becomes one JSON object with its structured fields."""
    record = logging.LogRecord("fleetpilot.routing", logging.WARNING, "x", 1, "replica ejected",
                               (), None)  # fmt: skip
    record.replica = "10.0.0.1:8000"
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["msg"], line["replica"]) == ("warning", "replica ejected",
                                                             "10.0.0.1:8000")  # fmt: skip
