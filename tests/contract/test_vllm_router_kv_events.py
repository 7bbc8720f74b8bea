"""The reference engine's KV events and ``/tokenize`` as another consumer of vLLM's contract
reads them: the vLLM project's own router (``vllm-router``, ``make baselines``), whose
``kv_aware`` policy subscribes to vLLM engines' ZMQ event publishers, replays what it missed
from their replay sockets, tokenizes each request through the engine's ``/tokenize`` and
credits the prefix the events say an engine holds. If the engine's events strayed from vLLM's
wire format (msgpack batches, sequence frames, replay markers, ``BlockStored`` fields) or its
tokenizer endpoint from vLLM's, this router would find no prefix: its placement lookups count
``miss`` or fail, never ``hit``."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fleetpilot.kv_events import kv_events_config
from fleetpilot.runtime.processes import free_ports
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
VLLM_ROUTER = ROOT / ".venv-baselines" / "bin" / "vllm-router"
MODEL = "m"
DEADLINE_S = 60.0
# Long enough for several 16-token blocks; the second user message differs, so the shared
# part is the system prompt's blocks.
SYSTEM = "You answer questions about the fleet's routers, engines and caches. " * 6


@dataclass
class Fleet:
    engine: BackgroundServer
    events_port: int
    replay_port: int

    def chat(self, url: str, question: str) -> None:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
            "max_tokens": 2,
            "ignore_eos": True,
        }
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).raise_for_status()


@dataclass
class VllmRouter:
    process: subprocess.Popen[bytes]
    url: str
    metrics_url: str
    log: Path

    def lookups(self) -> dict[str, float]:
        """``vllm_router_kv_placement_lookups_total`` by result (hit, miss, ...)."""
        text = httpx.get(self.metrics_url, timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm_router_kv_placement_lookups_total{"):
                labels, value = line.rsplit(" ", 1)
                result = labels.split('result="', 1)[1].split('"', 1)[0]
                out[result] = out.get(result, 0.0) + float(value)
        return out


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    if not VLLM_ROUTER.exists():
        pytest.skip(f"{VLLM_ROUTER} is absent: `make baselines` installs the vLLM project's router")
    events, replay = free_ports(2)
    config = kv_events_config(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
    engine = BackgroundServer.from_argv(
        ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len",
         "1024", "--served-model-name", MODEL, "--kv-events-config", json.dumps(config)]
    ).start()  # fmt: skip
    try:
        yield Fleet(engine, events, replay)
    finally:
        engine.stop()


@pytest.fixture
def start_router(fleet: Fleet, tmp_path: Path) -> Iterator[Callable[[], VllmRouter]]:
    started: list[VllmRouter] = []

    def start() -> VllmRouter:
        port, metrics = free_ports(2)
        worker = fleet.engine.url
        log = tmp_path / f"vllm-router-{len(started)}.log"
        argv = [
            str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--policy", "kv_aware", "--worker-urls", worker,
            "--kv-event-source", f"{worker}=tcp://127.0.0.1:{fleet.events_port}",
            "--kv-event-replay-source", f"{worker}=tcp://127.0.0.1:{fleet.replay_port}",
            "--kv-event-model", MODEL, "--log-level", "info",
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        router = VllmRouter(
            process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics", log
        )
        started.append(router)

        def health() -> int:
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            return httpx.get(f"{router.url}/health", timeout=2).status_code

        eventually(
            "vllm-router healthy",
            health,
            DEADLINE_S,
            until=lambda status: status == 200,
            interval=0.1,
            ignoring=(httpx.HTTPError,),
            context=lambda: log.read_text(errors="replace")[-3000:],
        )
        return router

    yield start
    for router in started:
        router.process.terminate()
        try:
            router.process.wait(10)
        except subprocess.TimeoutExpired:
            router.process.kill()
            router.process.wait(10)


def wait_for_hit(fleet: Fleet, router: VllmRouter, question: str) -> dict[str, float]:
    """Send ``question`` through the router until one of its placements counts a hit (the
    events of an earlier request may still be on their way); its lookup counts."""

    def lookups_after_one_more() -> dict[str, float]:
        fleet.chat(router.url, question)
        return router.lookups()

    return eventually(
        "vllm-router finding the cached prefix",
        lookups_after_one_more,
        DEADLINE_S,
        until=lambda counts: counts.get("hit", 0) > 0,
        interval=0.2,
        context=lambda: router.log.read_text(errors="replace")[-3000:],
    )


def test_vllm_router_credits_the_prefix_the_reference_engine_reports(
    fleet: Fleet, start_router: Callable[[], VllmRouter]
) -> None:
    """A first request is a miss (nothing cached); once the engine has published its blocks,
    the same system prompt is found in vllm-router's index: a hit."""
    router = start_router()
    time.sleep(1.0)  # its ZMQ subscription propagates before the first event is published
    fleet.chat(router.url, "What is a replica?")
    counts = wait_for_hit(fleet, router, "And what is a tier?")
    assert counts.get("miss", 0) >= 1
    assert set(counts) <= {"hit", "miss"}, counts  # no lookup failed on our tokens or events


def test_vllm_router_replays_what_the_engine_cached_before_it_started(
    fleet: Fleet, start_router: Callable[[], VllmRouter]
) -> None:
    """The engine caches a chat before any router listens. A router started afterwards hears
    the engine's next batch (another prompt: a raw completion sharing no block with the chat),
    sees that it missed the earlier sequence numbers and asks the engine's replay socket for
    them (vllm-router replays on a gap, not on joining). Its lookups of the chat then hit:
    nothing published after it started names the chat's blocks (they are cached, so serving
    the chat again stores nothing), so only the replay can have told it."""
    fleet.chat(fleet.engine.url, "What is a replica?")
    router = start_router()
    time.sleep(1.0)  # its ZMQ subscription propagates before the next batch
    body = {"model": MODEL, "prompt": "Zebras graze. " * 20, "max_tokens": 1}
    httpx.post(f"{fleet.engine.url}/v1/completions", json=body, timeout=30).raise_for_status()
    wait_for_hit(fleet, router, "What is a replica?")
