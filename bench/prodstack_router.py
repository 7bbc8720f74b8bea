"""The vLLM production-stack's own router (github.com/vllm-project/production-stack,
``src/vllm_router``, Python: FastAPI + aiohttp) as a baseline the routing benchmarks measure
fleetpilot's router against, over the same engines.

Two of its routing logics are compared:
- ``prefixaware``: a trie of xxhash'd 128-character chunks of the request's text (the chat
  messages' contents joined by newlines, roles left out), per router process, never evicted;
  the engines that hold the deepest matching chunk are the candidates and one is picked at
  random (with no match, that is every engine: a uniform random pick). It reads neither the
  engines' stats nor its own request stats (those matter only with
  ``--prefix-min-match-length`` above 0, left at its default 0);
- ``roundrobin``: the engines in sorted URL order, in turn.

Each runs as a user would deploy it with static service discovery: its defaults, but for the
engine-stats scrape interval its Helm chart sets (15 s; neither logic reads the scrape) and log
level ``warning`` (at ``info`` it logs a line per request). Its static backend health checks
stay off: they send dummy requests to the engines, which would show in their metrics.

It is not installed by the project (it needs Python 3.12, and its distribution name,
``vllm-router``, is the Rust router's too): install production-stack's router
(vllm-project/production-stack, src/vllm_router) into ``.venv-prodstack`` from its source
tree, or point ``FLEETPILOT_PRODSTACK_ROUTER`` at its ``vllm-router`` console script. A
benchmark arm that needs it is skipped, naming ``.venv-prodstack``, when it is missing
(``available()``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from router_support import ROOT, free_ports, stop_all

from fleetpilot.runtime.processes import http_ok

PRODSTACK_ROUTER = Path(
    os.environ.get("FLEETPILOT_PRODSTACK_ROUTER")
    or ROOT / ".venv-prodstack" / "bin" / "vllm-router"
)
POLICIES = {"prodstack-prefix": "prefixaware", "prodstack-rr": "roundrobin"}
# Its Helm chart's routerSpec.engineScrapeInterval (the CLI's own default is 30 s).
ENGINE_STATS_INTERVAL_S = 15
MISSING = (
    f"production-stack's router is not installed: {PRODSTACK_ROUTER} is missing; install its "
    "router (vllm-project/production-stack, src/vllm_router) into .venv-prodstack from its "
    "source tree, or set FLEETPILOT_PRODSTACK_ROUTER"
)


def available() -> bool:
    """Whether production-stack's router is installed (``.venv-prodstack`` or the override)."""
    return PRODSTACK_ROUTER.is_file() and os.access(PRODSTACK_ROUTER, os.X_OK)


def argv(policy: str, port: int, addresses: Sequence[str], model: str) -> list[str]:
    """One router's command line: routing logic ``policy`` over the engines at ``addresses``,
    each serving ``model`` (static discovery takes one model per backend)."""
    backends = ",".join(f"http://{a}" for a in addresses)
    models = ",".join(model for _ in addresses)
    return [str(PRODSTACK_ROUTER), "--host", "127.0.0.1", "--port", str(port),
            "--service-discovery", "static", "--static-backends", backends,
            "--static-models", models, "--routing-logic", policy,
            "--engine-stats-interval", str(ENGINE_STATS_INTERVAL_S),
            "--log-level", "warning"]  # fmt: skip


def _env() -> dict[str, str]:
    """The router's environment: no PYTHONPATH (this directory's ``vllm_router.py`` must not
    shadow its package) and no proxy for loopback (its engine-stats scraper uses requests,
    which honours HTTP_PROXY)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _serving(port: int) -> bool:
    """Whether the router on ``port`` answers its ``/health`` (its service discovery and
    engine-stats scraper are up; static discovery does not probe the engines)."""
    return http_ok(f"http://127.0.0.1:{port}/health", timeout_s=2)


@contextlib.contextmanager
def routers(
    arm_policy: str, count: int, addresses: Sequence[str], model: str, logdir: Path
) -> Iterator[list[str]]:
    """``count`` production-stack router processes with the routing logic ``arm_policy``
    names, serving; their chat-completions URLs. Each has its own port and its own log file in
    ``logdir``, quoted if one dies; each keeps its own prefix trie (they share nothing)."""
    if not available():
        raise SystemExit(f"{arm_policy}: {MISSING}")
    policy = POLICIES[arm_policy]
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    ports = free_ports(count)
    try:
        for i, port in enumerate(ports):
            log = logdir / f"{arm_policy}-{i}.log"
            line = argv(policy, port, addresses, model)
            with log.open("wb") as out:
                procs.append(
                    (
                        subprocess.Popen(
                            line, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=_env()
                        ),
                        log,
                    )
                )
        deadline = time.monotonic() + 60
        for port, (proc, log) in zip(ports, procs, strict=True):
            while not _serving(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"production-stack router {policy} did not start:\n{tail}")
                time.sleep(0.1)
        yield [f"http://127.0.0.1:{port}/v1/chat/completions" for port in ports]
    finally:
        stop_all([proc for proc, _ in procs])
