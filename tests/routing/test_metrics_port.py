"""The router's /metrics kept from clients (issue 41, probe 5): its exposition names replicas
(their addresses), tenants and per-tenant counts. With API keys on, the public port must not
serve it to anyone; with ``metricsPort`` it is served on that port only."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import yaml

from fleetpilot.api.router_config import AuthConfig, RouterConfig, TenantKeys
from fleetpilot.routing.app import metrics_on_public_port
from fleetpilot.routing.peers import PEER_COUNTS_PATH
from tests.routing.support import (
    assert_openai_error,
    make_config,
    router_process,
    running_router,
    tier,
)

KEY = "sk-team-a-0123456789abcdef"
TENANT = "team-secret-name"
WAIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _keyed_config(tmp_path: Path, **overrides: Any) -> RouterConfig:
    keys = tmp_path / "a.keys"
    keys.write_text(f"{KEY}\n")
    auth = AuthConfig(tenants=[TenantKeys(name=TENANT, key_files=[str(keys)])])
    return make_config([tier("small", 1.0)], auth=auth, **overrides)


def _write(tmp_path: Path, config: RouterConfig) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config.to_wire()))
    return path


def _assert_refused(response: httpx.Response) -> None:
    """A 404 in the OpenAI shape, as for any route the port does not serve, that gives
    nothing of the exposition away."""
    assert_openai_error(response.status_code, response.json(), 404)
    assert TENANT not in response.text
    assert "fleetpilot_router" not in response.text


@pytest.mark.parametrize(
    ("auth_on", "metrics_listener", "public"),
    [(False, False, True), (True, False, False), (False, True, False), (True, True, False)],
)
def test_the_public_port_serves_metrics_only_without_keys_or_a_metrics_port(
    auth_on: bool, metrics_listener: bool, public: bool
) -> None:
    assert metrics_on_public_port(auth_on=auth_on, metrics_listener=metrics_listener) is public


def test_a_router_with_keys_serves_metrics_only_on_its_metrics_port(tmp_path: Path) -> None:
    """Regression (issue 41): a router process with API keys answered GET /metrics on its
    public port to anyone, with tenant names and replica addresses. Now the public port
    answers 404 (with a key too: a tenant must not read the others' names and counts); the
    metrics port serves the exposition and /health; the public /health stays for probes."""
    metrics_port = _free_port()
    path = _write(tmp_path, _keyed_config(tmp_path, metricsPort=metrics_port))
    with router_process(path, wait_s=WAIT_S) as (_, port):
        public = f"http://127.0.0.1:{port}"
        _assert_refused(httpx.get(f"{public}/metrics", timeout=WAIT_S))
        keyed = {"Authorization": f"Bearer {KEY}"}
        _assert_refused(httpx.get(f"{public}/metrics", headers=keyed, timeout=WAIT_S))
        # The counts it shares with its peers name replicas too (issue 44).
        _assert_refused(httpx.get(f"{public}{PEER_COUNTS_PATH}", headers=keyed, timeout=WAIT_S))
        assert httpx.get(f"{public}/health", timeout=WAIT_S).status_code == 200
        counts = httpx.get(f"http://127.0.0.1:{metrics_port}{PEER_COUNTS_PATH}", timeout=WAIT_S)
        assert counts.status_code == 200
        assert counts.json()["replicas"] == {}

        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S)
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain")
        assert f'fleetpilot_router_auth_keys{{tenant="{TENANT}"}} 1.0' in scrape.text
        health = httpx.get(f"http://127.0.0.1:{metrics_port}/health", timeout=WAIT_S)
        assert health.json()["status"] == "ok"
        # Only those two: the OpenAI API is not reachable through the metrics port.
        proxied = httpx.post(
            f"http://127.0.0.1:{metrics_port}/v1/completions",
            json={"model": "chat", "prompt": "hi"},
            headers=keyed,
            timeout=WAIT_S,
        )
        assert_openai_error(proxied.status_code, proxied.json(), 404)


def test_a_router_with_keys_and_no_metrics_port_serves_metrics_on_no_port(
    tmp_path: Path,
) -> None:
    """Regression (issue 41): without a metricsPort, a keyed router still served /metrics
    publicly. Now it serves it nowhere, and says so in its log at start."""
    path = _write(tmp_path, _keyed_config(tmp_path))
    with router_process(path, wait_s=WAIT_S) as (proc, port):
        _assert_refused(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S))
        proc.terminate()
        assert proc.wait(WAIT_S) == 0
        assert proc.stderr is not None
        assert "no metricsPort is set" in proc.stderr.read()


def test_a_router_without_keys_serves_metrics_on_its_public_port(tmp_path: Path) -> None:
    """A fleet without API keys and without a metricsPort keeps its scrape where it was."""
    path = _write(tmp_path, make_config([tier("small", 1.0)]))
    with router_process(path, wait_s=WAIT_S) as (_, port):
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S)
    assert scrape.status_code == 200
    assert "fleetpilot_router_" in scrape.text


@pytest.mark.asyncio
async def test_keys_added_by_a_reload_close_the_public_metrics(tmp_path: Path) -> None:
    """A config reload that turns API keys on closes the public /metrics at once: the
    decision is made per request, not when the routes were built."""
    async with (
        running_router(make_config([tier("small", 1.0)])) as router,
        httpx.AsyncClient(base_url=router.url) as client,
    ):
        assert (await client.get("/metrics")).status_code == 200
        router.state.apply_config(_keyed_config(tmp_path))
        _assert_refused(await client.get("/metrics"))


def test_a_taken_metrics_port_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    """The metrics port held by another process: the router exits non-zero with one
    ``error:`` line naming the metrics address (not the public one), no traceback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = int(holder.getsockname()[1])
        path = _write(tmp_path, _keyed_config(tmp_path, metricsPort=taken))
        done = subprocess.run(
            [sys.executable, "-m", "fleetpilot", "router", "--config", str(path),
             "--host", "127.0.0.1", "--port", str(_free_port()), "--discovery", "static"],
            capture_output=True, text=True, timeout=WAIT_S,
        )  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert f"cannot listen on 127.0.0.1:{taken}" in line


def test_the_metrics_port_must_differ_from_the_public_one() -> None:
    with pytest.raises(pydantic.ValidationError, match="metricsPort 8000 is the public port"):
        make_config([tier("small", 1.0)], port=8000, metricsPort=8000)
