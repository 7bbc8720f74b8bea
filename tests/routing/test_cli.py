"""The router's command-line entry points: flags, config errors, a real process serving and
shutting down on SIGTERM, structured logs."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from fleetpilot.routing.cli import EXIT_INVALID, add_arguments, run
from tests.routing.support import make_config, router_process, stop_and_read_log, tier


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


def test_router_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`python -m fleetpilot.routing.cli`: /health and /v1/models answer; SIGTERM exits 0;
    logs are JSON lines."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(make_config([tier("small", 1.0)]).to_wire()))
    with router_process(path, command=("-m", "fleetpilot.routing.cli"), wait_s=30) as (proc, port):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["chat", "small-model"]
        lines = stop_and_read_log(proc, 20)
        assert any(line["message"] == "router started" for line in lines)


def test_a_shutdown_delay_keeps_serving_after_sigterm(tmp_path: Path) -> None:
    """--shutdown-delay: after SIGTERM the router still answers (a deleted pod's clients learn
    of it a moment late), then closes its listener and exits 0."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(make_config([tier("small", 1.0)]).to_wire()))
    with router_process(path, extra=("--shutdown-delay", "3")) as (proc, port):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal handled, well inside the delay
        assert proc.poll() is None
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200
        assert proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert proc.stderr is not None
        lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.strip()]
    assert any(line["message"].startswith("stopping: still serving") for line in lines)


def test_shutdown_delay_refuses_what_is_not_seconds() -> None:
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse("--config", "x.yaml", "--shutdown-delay", bad)
    assert parse("--config", "x.yaml").shutdown_delay == 0.0
