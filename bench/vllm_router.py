"""The vLLM project's router (github.com/vllm-project/router, PyPI ``vllm-router``, Rust) as a
baseline the routing benchmarks measure fleetpilot's router against, over the same engines.

Two of its policies are the established answers to what fleetpilot's prefix routing does:
- ``cache_aware`` (its default; SGLang's router policy): an approximate radix tree per
  worker of the request *text* it sent there, the longest match above ``cache_threshold``
  wins, shortest queue when the workers' loads are imbalanced;
- ``kv_aware``: an index of the engines' own vLLM KV events (ZMQ, with replay), the prompt's
  token ids from each worker's ``/v1/chat/completions/render`` or ``/tokenize``, and the
  worker with the least new prefill work plus load.

Both run with their defaults, as a user would deploy them. Installed by ``make baselines``
into ``.venv-baselines`` (the pyproject's ``baselines`` extra); a benchmark arm that needs it
says how to install it when it is missing.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from router_support import ROOT, free_ports, stop_all

from fleetpilot.runtime.processes import http_ok

VLLM_ROUTER = ROOT / ".venv-baselines" / "bin" / "vllm-router"
POLICIES = {"vllm-router-cache": "cache_aware", "vllm-router-kv": "kv_aware"}


def argv(
    policy: str,
    port: int,
    metrics_port: int,
    addresses: Sequence[str],
    kv_ports: Sequence[tuple[int, int]],
    model: str,
) -> list[str]:
    """One router's command line: ``policy`` over the engines at ``addresses``; for
    ``kv_aware``, each engine's KV event publisher and replay ports."""
    workers = [f"http://{a}" for a in addresses]
    line = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--policy", policy, "--log-level", "warning", "--worker-urls", *workers]  # fmt: skip
    if policy == "kv_aware":
        for worker, (pub, replay) in zip(workers, kv_ports, strict=True):
            line += ["--kv-event-source", f"{worker}=tcp://127.0.0.1:{pub}"]
            line += ["--kv-event-replay-source", f"{worker}=tcp://127.0.0.1:{replay}"]
        line += ["--kv-event-model", model]
    return line


def _serving(port: int) -> bool:
    """Whether the router on ``port`` answers its ``/health`` (it listens only once every
    worker has answered its own health check)."""
    return http_ok(f"http://127.0.0.1:{port}/health", timeout_s=2)


@contextlib.contextmanager
def routers(
    arm_policy: str,
    count: int,
    addresses: Sequence[str],
    kv_ports: Sequence[tuple[int, int]],
    model: str,
    logdir: Path,
) -> Iterator[list[str]]:
    """``count`` vllm-router processes with the policy ``arm_policy`` names, serving; their
    chat-completions URLs. Each has its own log file in ``logdir``, quoted if one dies."""
    if not VLLM_ROUTER.exists():
        raise SystemExit(f"{arm_policy}: {VLLM_ROUTER} is missing; run `make baselines`")
    policy = POLICIES[arm_policy]
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    ports = free_ports(2 * count)
    try:
        for i in range(count):
            log = logdir / f"vllm-router-{i}.log"
            line = argv(policy, ports[2 * i], ports[2 * i + 1], addresses, kv_ports, model)
            with log.open("wb") as out:
                procs.append(
                    (subprocess.Popen(line, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT), log)
                )
        deadline = time.monotonic() + 60
        for i, (proc, log) in enumerate(procs):
            while not _serving(ports[2 * i]):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"vllm-router {policy} did not start:\n{tail}")
                time.sleep(0.1)
        # Its KV subscribers connect as it starts; a ZMQ subscription takes a moment to
        # propagate, and the engines are fresh (nothing to replay), so let it settle.
        time.sleep(1.0)
        yield [f"http://127.0.0.1:{ports[2 * i]}/v1/chat/completions" for i in range(count)]
    finally:
        stop_all([proc for proc, _ in procs])
