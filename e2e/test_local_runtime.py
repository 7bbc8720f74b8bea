"""The local runtime: a two-tier service as processes, served through the router.

Uses the official ``openai`` client against the fleet, kills an engine and checks it is
replaced, refuses a taken port before starting anything, and runs ``fleetpilot up`` itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.support import free_port_range, route_fields
from fleetpilot.api import load_services
from fleetpilot.runtime.local import LocalFleet
from fleetpilot.runtime.processes import PortInUseError, port_in_use
from fleetpilot.testing.polling import eventually

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "local-two-tier.yaml"


def route_tier(header: str | None) -> str:
    return route_fields(header)["tier"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    (service,) = load_services(EXAMPLE)
    local = LocalFleet(service, tmp_path_factory.mktemp("fleet"), 0)
    local.start()
    try:
        yield local
    finally:
        local.stop()
        assert local.leftovers() == []


@pytest.fixture
def client(fleet: LocalFleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fleet.endpoint, api_key="unused", max_retries=0) as api:
        yield api


HARD = (
    "Prove step by step that the loop below terminates and derive its complexity; explain why "
    "the invariant holds, then analyze the integral of x^2 dx from 0 to n and compare.\n"
    "```python\ndef f(n):\n    while n > 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
    "    return n\n```\n" * 3
)


def chat(client: openai.OpenAI, text: str, model: str = "local") -> str:
    """One chat completion through the router; returns the tier that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=4
    )
    completion = raw.parse()
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage is not None
    assert completion.usage.completion_tokens > 0
    return route_tier(raw.headers.get("x-fleetpilot-route"))


def test_fleet_runs_every_tier_and_writes_its_endpoints(fleet: LocalFleet) -> None:
    """Every tier of the two-tier example runs one healthy engine, and the router's endpoints
    file lists exactly their loopback addresses, each with KV-event ports of its own."""
    rows = fleet.status_rows()
    assert {(r.tier, r.role) for r in rows} == {("small", "unified"), ("large", "unified")}
    assert all(r.replicas == r.alive == r.healthy == 1 for r in rows)
    listed = yaml.safe_load(fleet.endpoints_path.read_text())["endpoints"]
    addresses = {e["tier"]: [e["address"]] for e in listed}
    assert addresses == {r.tier: [f"127.0.0.1:{p}" for p in r.ports] for r in rows}
    kv_ports = [p for e in listed for p in (e["kvEventsPort"], e["kvReplayPort"])]
    assert len(set(kv_ports)) == 2 * len(listed)
    assert fleet.config_path.is_file()
    assert fleet.endpoint == f"http://127.0.0.1:{fleet.router_port}/v1"


def test_complexity_and_model_names_choose_the_tier(client: openai.OpenAI) -> None:
    """The router picks the tier by complexity (an easy chat to small, a hard one to large),
    unless the model name asks for a tier."""
    assert chat(client, "hi") == "small"
    assert chat(client, HARD) == "large"
    assert chat(client, "hi", model="large-model") == "large"


def test_openai_chat_and_stream_through_the_router(client: openai.OpenAI) -> None:
    """The official OpenAI client works through the router (chat, streamed chat,
    completions), each request served by the tier its prompt belongs to."""
    # Every prompt here is easy (complexity far below the small tier's 0.4): small serves it.
    assert chat(client, "hi") == "small"
    with client.chat.completions.with_streaming_response.create(
        model="local",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        stream=True,
    ) as response:
        assert route_tier(response.headers.get("x-fleetpilot-route")) == "small"
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    raw = client.completions.with_raw_response.create(
        model="local", prompt="Once upon", max_tokens=4
    )
    assert raw.parse().choices[0].text
    assert route_tier(raw.headers.get("x-fleetpilot-route")) == "small"


def test_a_killed_engine_is_restarted_and_the_fleet_keeps_serving(
    fleet: LocalFleet, client: openai.OpenAI
) -> None:
    """An engine killed with SIGKILL is reported with its exit code and log, restarted, and
    its tier serves again from the restarted engine."""
    replica = fleet.replicas[0]
    assert (replica.tier, replica.role) == ("small", "unified")  # the small tier's only engine
    victim = replica.child
    assert victim is not None
    assert victim.popen is not None
    old_pid = victim.pid
    os.killpg(old_pid, signal.SIGKILL)
    victim.popen.wait(timeout=10)
    assert fleet.supervisor.crashed() == [victim]
    reports = fleet.supervise_once()
    assert len(reports) == 1
    assert victim.name in reports[0]
    assert "code -9" in reports[0]
    assert victim.alive()
    assert victim.pid != old_pid
    assert victim.healthy()
    assert fleet.supervise_once() == []
    # Easy prompts: the small tier, served by the restarted engine alone.
    for i in range(6):
        assert chat(client, f"request {i} after the restart") == "small"
    assert all(r.healthy == 1 for r in fleet.status_rows())


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A taken port of the fleet is refused by name before any process starts."""
    (service,) = load_services(EXAMPLE)
    base = free_port_range(7)  # router, 2 engines, their KV-event ports
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 1))
        blocker.listen()
        local = LocalFleet(service, tmp_path, base)
        with pytest.raises(PortInUseError, match=rf"small/unified#0 port {base + 1}"):
            local.start()
    assert local.supervisor.children == []
    assert not (tmp_path / "router.yaml").exists()


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains ``text`` (the router names its workdir config)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


def up_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleetpilot.runtime.up", "-f", str(EXAMPLE), *args]


def test_up_serves_for_its_duration_then_stops_everything(tmp_path: Path) -> None:
    """``fleetpilot up --duration`` serves the example on its ports for the duration, then
    stops every process it started."""
    base = free_port_range(7)  # router, 2 engines, their KV-event ports
    started = time.monotonic()
    result = subprocess.run(
        up_argv("--duration", "8", "--port", str(base), "--workdir", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert f"http://127.0.0.1:{base}/v1" in result.stdout
    assert "small" in result.stdout
    assert "large" in result.stdout
    assert time.monotonic() - started >= 8
    assert not any(port_in_use(base + i) for i in range(7))
    assert processes_mentioning(str(tmp_path / "router.yaml")) == []
    assert (tmp_path / "router.yaml").is_file()


def test_up_stops_everything_on_sigterm(tmp_path: Path) -> None:
    """``fleetpilot up`` stopped with SIGTERM (a container stop) stops everything, exits 0."""
    base = free_port_range(7)  # router, 2 engines, their KV-event ports
    process = subprocess.Popen(
        up_argv("--port", str(base), "--workdir", str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "endpoint" in line:
                break
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "stopped" in out
    assert not any(port_in_use(base + i) for i in range(7))
    assert processes_mentioning(str(tmp_path / "router.yaml")) == []


def test_up_refuses_an_invalid_file_before_starting(tmp_path: Path) -> None:
    """An invalid file is refused with exit code 2, naming the field, before anything starts."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("upTo: 0.4", "upTo: 7"))
    result = subprocess.run(
        [sys.executable, "-m", "fleetpilot.runtime.up", "-f", str(bad), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "spec.tiers[0].complexity.upTo" in result.stderr
    assert not (tmp_path / "logs").exists()


def test_a_disaggregated_tier_serves_through_both_hops(tmp_path: Path) -> None:
    """A P/D tier runs a prefill and a decode engine, both with the planner's kv_both for
    NIXL, and a chat goes through both: prefill first, then the decode that pulls its KV. The
    same chat again is the decode engine's alone: it holds the prompt (its KV events say so)
    and computes the last few tokens itself."""
    (service,) = load_services(ROOT / "examples" / "disaggregated.yaml")
    local = LocalFleet(service, tmp_path, 0, max_replicas_per_role=1)
    local.start()
    try:
        assert [(r.role, r.replicas) for r in local.status_rows()] == [
            ("prefill", 1),
            ("decode", 1),
        ]
        prefill, decode = local.replicas
        for replica in (prefill, decode):
            config = replica.argv[replica.argv.index("--kv-transfer-config") + 1]
            assert json.loads(config)["kv_role"] == "kv_both"  # what the planner gives vLLM
        # Longer than a few blocks: a prompt the decode engine would compute in a moment goes
        # to it alone (router.PD_LOCAL_PREFILL_TOKENS).
        question = [{"role": "user", "content": "How do prefill and decode share KV? " * 6}]
        with openai.OpenAI(base_url=local.endpoint, api_key="unused", max_retries=0) as api:
            raw = api.chat.completions.with_raw_response.create(
                model="llama-70b", messages=question, max_tokens=4
            )
            assert raw.parse().choices[0].message.content
            route = raw.headers["x-fleetpilot-route"]
            assert f"replica={decode.address}" in route
            assert f"prefill={prefill.address}" in route
            again = api.chat.completions.with_raw_response.create(
                model="llama-70b", messages=question, max_tokens=4
            )
        assert again.parse().choices[0].message.content
        route = again.headers["x-fleetpilot-route"]
        assert f"replica={decode.address}" in route
        assert "prefill=local" in route
    finally:
        local.stop()
        assert local.leftovers() == []


def test_a_restarted_engine_of_a_dynamic_lora_tier_gets_its_adapters_back(
    tmp_path: Path,
) -> None:
    """`lora.dynamic`: the fleet loads the declared adapters into each engine before the
    router lists it, and again into an engine restarted after a crash (a new process holds
    none), so every adapter answers through the router before and after."""
    (service,) = load_services(ROOT / "examples" / "lora-dynamic.yaml")
    fleet = LocalFleet(service, tmp_path, 0, max_replicas_per_role=1)
    with (
        fleet,
        openai.OpenAI(base_url=fleet.endpoint, api_key="unused", max_retries=0) as api,
    ):
        adapters = [a.name for a in service.spec.tiers[0].adapters]

        def ask_each() -> None:
            for name in adapters:
                completion = api.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert completion.model == name

        ask_each()
        (replica,) = fleet.replicas
        assert replica.child is not None
        assert replica.child.popen is not None
        os.killpg(replica.child.pid, signal.SIGKILL)
        replica.child.popen.wait(timeout=10)
        assert len(fleet.supervise_once()) == 1  # the crash report, no failed load
        ask_each()
    assert fleet.leftovers() == []


def test_an_engine_with_a_cold_start_joins_the_router_only_once_ready(tmp_path: Path) -> None:
    """`fleetpilot up --cold-start`: an engine the autoscaler adds is told the cold start, answers
    503 while it lasts, and is written into the router's endpoints file only once its /health
    answers 200, no sooner than the cold start after it was launched (the exact bound, from the
    model's load, is tests/engine/reference/test_cold_start.py's)."""
    import httpx

    cold_start_s = 3.0
    (service,) = load_services(EXAMPLE)
    fleet = LocalFleet(service, tmp_path, 0, max_replicas_per_role=2, cold_start_s=cold_start_s)

    def listed() -> list[str]:
        endpoints = yaml.safe_load(fleet.endpoints_path.read_text())["endpoints"]
        return [e["address"] for e in endpoints]

    with fleet, httpx.Client(timeout=5.0, trust_env=False) as http:
        launched = time.monotonic()
        added = fleet.add_replica("small", "unified")
        assert added.child is not None
        seen: list[int | None] = []
        deadline = time.monotonic() + 120.0
        while not added.serving and time.monotonic() < deadline:
            fleet.refresh_serving()  # what `fleetpilot up` does every half second
            serving = added.serving
            assert (added.address in listed()) == serving
            try:
                status: int | None = http.get(f"http://{added.address}/health").status_code
            except httpx.TransportError:
                status = None  # not listening yet
            if serving:
                assert status == 200  # listed once ready, and ready for good
            seen.append(status)
            time.sleep(0.1)
        assert added.serving, f"never listed; /health answered {seen[-5:]}"
        assert time.monotonic() - launched >= cold_start_s
        assert 503 in seen  # it listened, starting, before it was ready
        assert "cold start: ready in 3.0 s" in added.child.log_path.read_text()
    assert fleet.leftovers() == []


def _peers_live(metrics_port: int) -> float | None:
    """The router's ``fleetpilot_router_peers{state="live"}``, or None (not answering yet)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fleetpilot_router_peers" and sample.labels["state"] == "live":
                return sample.value
    return None


def test_two_router_replicas_serve_peered_and_a_killed_one_rejoins(tmp_path: Path) -> None:
    """``routers=2``: two router processes, each on its own ports, each serving the service and
    hearing the other over the peer exchange, as a cluster's router pods do; one killed is
    restarted by supervision and is heard from again."""
    (service,) = load_services(EXAMPLE)
    local = LocalFleet(service, tmp_path, 0, max_replicas_per_role=1, routers=2)
    local.start()
    try:
        assert len(set(local.router_ports)) == 2
        for url in local.router_urls():
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as api:
                answer = api.chat.completions.create(
                    model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert answer.choices[0].message.content is not None
        for port in local.router_metrics_ports:
            eventually(f"router on {port} hears its peer", lambda p=port: _peers_live(p),
                       until=lambda live: live == 1)  # fmt: skip
        second = local.routers[1]
        os.killpg(second.pid, signal.SIGKILL)
        eventually("the killed router is restarted", lambda: local.supervise_once() or None)
        eventually("the first router hears its restarted peer",
                   lambda: _peers_live(local.router_metrics_ports[0]),
                   until=lambda live: live == 1)  # fmt: skip
    finally:
        local.stop()
        assert local.leftovers() == []
