"""Routers as a cluster runs them, and the multi-tenant trace that tells their policies apart.

Every router replica is its own process (``python -m fleetpilot router``, the command a pod
runs), each with its own port, KV-event subscribers, scrape loop and tokenizer; the client
spreads requests over them as a Kubernetes Service does: alternating (``--spread alternate``)
or at random (``--spread random``). A router inside the load generator's process shares its
event loop and its CPU with the client, which a cluster never does (issue 44).

Arms the router's config cannot express (a bench-only policy such as pure longest-prefix
match) run through ``serve`` below: the same listener and app as ``fleetpilot router``, with
the arm's plugins swapped in before it serves.

``cluster_trace``: issue 44's held-out shape - 12 tenants whose system prompts run 150-600
words, Zipf tenant popularity, 30 users a tenant (each user's first message carries their
profile), chats of 1-9 turns that resend the whole history after a think time, conversations
arriving as a Poisson process.

Run one router alone: ``python bench/router_fleet.py serve --arm longest-prefix --config C
--endpoints-file E --port P``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from router_prefix_workloads import Conversation, use_arm, zipf_weights
from router_support import ROOT, free_ports, stop_all

from fleetpilot.api.router_config import RouterConfig

# Arms that are the router's own defaults (its config says which prefix source): run as a pod
# runs them. Every other arm goes through ``serve``.
DEFAULT_ARMS = ("events", "guessed", "events+peers", "guessed+peers")

TENANTS = 12
USERS_PER_TENANT = 30
ZIPF_S = 1.1
SYSTEM_WORDS = (150, 600)
MAX_TURNS = 9
THINK_MEAN_S = 2.0
# Short words: the reference engine's tokenizer is byte-level, so 600 words of these and nine
# turns of history stay under its 4,096-token context.
_WORDS = ("the", "and", "for", "our", "you", "with", "plan", "bill", "ship", "item", "fee",
          "cart", "card", "tax", "date", "send", "help", "rule", "user", "note", "sale", "code",
          "app", "web", "data", "fix", "use", "own", "pay", "due")  # fmt: skip
_TOPICS = ("refund", "invoice", "delivery", "password", "upgrade", "discount", "contract")


def tenant_prompt(tenant: int, seed: int) -> str:
    """A tenant's system prompt: 150-600 words, its own for each (tenant, seed)."""
    rng = random.Random(f"prompt-{seed}-{tenant}")
    words = rng.randint(*SYSTEM_WORDS)
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Tenant {tenant:02d} assistant. {body}."


def user_profile(tenant: int, user: int, seed: int) -> str:
    rng = random.Random(f"user-{seed}-{tenant}-{user}")
    likes = ", ".join(rng.sample(_TOPICS, 3))
    account = rng.randrange(10**6)
    return f"I am user {user} of tenant {tenant}, account {account:06d}; I ask about {likes}."


def turns(rng: random.Random) -> int:
    """1-9 turns, most chats short and some long (mean about 3.7)."""
    return min(MAX_TURNS, 1 + int(rng.expovariate(1 / 2.7)))


def _mean_turns(samples: int = 20_000) -> float:
    rng = random.Random(0)
    return sum(turns(rng) for _ in range(samples)) / samples


MEAN_TURNS = _mean_turns()


def cluster_trace(rate_rps: float, requests: int, seed: int) -> list[Conversation]:
    """Conversations whose turns total at least ``requests``, arriving so that requests come
    at about ``rate_rps`` a second."""
    rng = random.Random(seed)
    weights = zipf_weights(TENANTS, ZIPF_S)
    order = list(range(TENANTS))
    rng.shuffle(order)  # which tenant is hot is part of the seed
    prompts = [tenant_prompt(t, seed) for t in range(TENANTS)]
    trace: list[Conversation] = []
    t, total = 0.0, 0
    while total < requests:
        t += rng.expovariate(rate_rps / MEAN_TURNS)
        tenant = order[rng.choices(range(TENANTS), weights)[0]]
        user = rng.randrange(USERS_PER_TENANT)
        n = turns(rng)
        questions = tuple(
            (f"{user_profile(tenant, user, seed)} " if turn == 0 else "")
            + f"Question {turn}: what about my {rng.choice(_TOPICS)} number {rng.randrange(1000)}?"
            for turn in range(n)
        )
        think = tuple(rng.expovariate(1.0 / THINK_MEAN_S) for _ in range(n))
        trace.append(Conversation(t, tenant, prompts[tenant], questions, think))
        total += n
    return trace


# -- router processes ------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterProcess:
    url: str  # its chat-completions URL
    metrics_url: str
    pid: int


def metric_values(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` on a /metrics page, by their sorted labels."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _ready(metrics_url: str, replicas: int, events: bool) -> bool:
    """Whether a router knows every engine and, with ``events``, hears each one's KV events
    and has loaded its tokenizer (so it routes on the events from its first request)."""
    try:
        active = sum(
            v
            for labels, v in metric_values(metrics_url, "fleetpilot_router_endpoints").items()
            if ("state", "active") in labels
        )
        if active < replicas:
            return False
        if not events:
            return True
        live = metric_values(metrics_url, "fleetpilot_router_kv_events_live")
        loaded = metric_values(metrics_url, "fleetpilot_router_tokenizer_loaded")
    except OSError:
        return False
    return sum(live.values()) >= replicas and bool(loaded) and all(loaded.values())


def engine_successes(address: str) -> int:
    """Requests the engine at ``address`` finished (its ``vllm:request_success_total``)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
    )


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime, stime in clock ticks (USER_HZ)


@contextlib.contextmanager
def fleetpilot_routers(
    arm: str,
    count: int,
    cfg: RouterConfig,
    endpoints: Path,
    workdir: Path,
    *,
    replicas: int,
    events: bool,
    peers: bool = False,
    epp_ports: Sequence[int] | None = None,
) -> Iterator[list[RouterProcess]]:
    """``count`` router processes of ``arm`` over the engines ``endpoints`` lists, each ready
    (see ``_ready``) before this yields; each logs to its own file in ``workdir``, quoted when
    one dies or never gets ready. With ``peers``, they share their in-flight counts
    (``routing.peers``: every router listed, each skipping itself). With API keys on
    (``cfg.auth``), each serves /metrics and its peer counts on a metrics port of its own.
    With ``epp_ports``, each also serves the endpoint picker on its own (``eppPort``)."""
    ports = free_ports(count)
    keyed = cfg.auth is not None
    metrics_ports = free_ports(count) if keyed else ports
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for i, port in enumerate(ports):
            wire = cfg.to_wire()
            if keyed:
                wire["metricsPort"] = metrics_ports[i]
            if peers:
                wire["peers"] = {"addresses": [f"127.0.0.1:{p}" for p in metrics_ports]}
            if epp_ports is not None:
                wire["eppPort"] = epp_ports[i]
            config_path = workdir / f"router-{i}.yaml"
            config_path.write_text(yaml.safe_dump(wire))
            head = (
                ["-m", "fleetpilot", "router"]  # the arm is in its config
                if arm in DEFAULT_ARMS
                else [str(Path(__file__)), "serve", "--arm", arm]
            )
            line = [sys.executable, *head, "--config", str(config_path), "--endpoints-file",
                    str(endpoints), "--discovery", "static", "--host", "127.0.0.1", "--port",
                    str(port), "--seed", str(i), "--log-level", "warning"]  # fmt: skip
            log = workdir / f"router-{i}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    line, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT / "bench"
                )
            procs.append((proc, log))
        deadline = time.monotonic() + 90
        for (proc, log), port in zip(procs, metrics_ports, strict=True):
            while not _ready(f"http://127.0.0.1:{port}/metrics", replicas, events):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"router {arm} on port {port} never got ready:\n{tail}")
                time.sleep(0.1)
        yield [
            RouterProcess(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                f"http://127.0.0.1:{metrics_port}/metrics",
                proc.pid,
            )
            for (proc, _), port, metrics_port in zip(procs, ports, metrics_ports, strict=True)
        ]
    finally:
        stop_all([proc for proc, _ in procs], 15.0)


# -- one router with a bench-only arm --------------------------------------------------------


def serve(argv: Sequence[str]) -> int:
    """``fleetpilot router`` with the arm's plugins swapped in before it serves."""
    from fleetpilot.httpserver import ServerLimits, run_app
    from fleetpilot.logs import configure_logging
    from fleetpilot.routing.app import ROUTER_APP, build_app
    from fleetpilot.routing.config import load_config
    from fleetpilot.routing.discovery import build_source

    parser = argparse.ArgumentParser(prog="router_fleet.py serve")
    parser.add_argument("--arm", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--endpoints-file", required=True)
    parser.add_argument("--discovery", default="static")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, "text")
    cfg = load_config(Path(args.config))
    source = build_source(cfg, endpoints_file=Path(args.endpoints_file), kube_client=None)
    app = build_app(cfg, source, seed=args.seed, metrics_host=args.host)
    use_arm(args.arm, app[ROUTER_APP].router, cfg)
    limits = ServerLimits(upstream_connections=cfg.backpressure.max_in_flight)
    run_app(app, args.host, args.port, limits, handler_cancellation=True, access_log=None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        raise SystemExit(serve(sys.argv[2:]))
    raise SystemExit("usage: router_fleet.py serve --arm ARM --config C --endpoints-file E ...")
