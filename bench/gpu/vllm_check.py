"""The GPU check: the launcher's ``vllm serve`` engines behind ``fleetpilot router``, one machine.

For a machine with one NVIDIA GPU, after ``make setup vllm`` (fleetpilot in ``.venv``, the
pinned vLLM in ``.venv-vllm``), with no network::

    .venv/bin/python bench/gpu/vllm_check.py --out /tmp/gpu-check

1. writes a tiny random-weight Llama checkpoint (the reference engine's writer, seeded; head
   size 64, which GPU attention kernels take) with the reference engine's tokenizer beside it;
2. realizes a service of a unified tier and a prefill/decode tier (NixlConnector), one engine
   per role, with :class:`~fleetpilot.runtime.local.LocalFleet`: each engine is the launcher's
   exact ``vllm serve`` line for its role, with that checkpoint, a fifth of the GPU and
   loopback ports (:class:`~fleetpilot.runtime.engines.VllmBackend`), and the router in front.
   Without NIXL in vLLM's environment the P/D tier is left out and its check says so;
3. records in ``OUT/results.json``, each with a status (pass, fail, skip) and a reason:
   ``flags`` (every engine's argv; /health and /v1/models answer), ``prefix`` (per request,
   the router's ``prefix-match`` against the engine's ``cached_tokens``; the engines' prefix
   cache counters), ``pd`` (the prefill hop ran and the decode engine answered), ``bench``
   (``fleetpilot bench`` for ``--duration`` seconds, its summary) and ``metrics`` (after that
   load, every vLLM metric the autoscaler reads exists on every engine, and which carry data).

``--backend reference`` runs the same checks with CPU reference engines of the same
architecture (the tests do). The run is bounded (``--budget``: the load is cut short to fit);
it exits 1 when a check failed, and stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.api import parse_service
from fleetpilot.autoscaler.prometheus import MetricNames, escaped_name
from fleetpilot.engine.reference.checkpoint import save_checkpoint
from fleetpilot.engine.reference.model import LlamaModel, ModelConfig
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.loadgen import cli as loadgen
from fleetpilot.loadgen.runner import ROUTE_HEADER, route_fields
from fleetpilot.loadgen.workloads import words
from fleetpilot.routing.features import TIER_HEADER
from fleetpilot.runtime.engines import EngineBackend, ReferenceBackend, VllmBackend
from fleetpilot.runtime.local import LocalFleet, Replica
from fleetpilot.runtime.processes import ChildFailedError

ROOT = Path(__file__).resolve().parents[2]
SEED = 0
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
SERVICE = "gpu-check"
UNIFIED = "unified"
PD = "pd"
# vLLM reports usage.prompt_tokens_details.cached_tokens only with this flag; the reference
# engine always reports them (and is not given the tier's extra vLLM arguments).
EXTRA_ARGS = ("--enable-prompt-tokens-details",)
# Head size 64: FlashAttention takes it and so does FlashInfer (64, 128 or 256 only), where the
# "tiny" preset's 16 would leave vLLM without a GPU attention kernel; the vocabulary is the
# reference tokenizer's (ModelConfig's default), as the tiny preset's is.
CHECK_MODEL = ModelConfig(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=MAX_MODEL_LEN,
    init_seed=SEED,
)
PASS, FAIL, SKIP = "pass", "fail", "skip"
NO_NIXL = "nixl is not installed in the vLLM environment"
# How vLLM's NIXL connector imports it (vllm/distributed/kv_transfer/.../nixl_connector.py).
NIXL_IMPORT = "from nixl._api import nixl_agent"
REQUEST_TIMEOUT_S = 60.0
# A random model may end an answer at once: every answer here decodes its max_tokens.
ANSWER = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
# The prefix requests: a cold one, two repeating its prefix, one repeating half of it, each
# with a tail of its own, so a prediction must say how much of a prompt is cached, not only
# whether (the byte tokenizer makes characters tokens).
PREFIX_CHARS = 1000
TAIL_CHARS = 200
PREFIX_SHARES = (1.0, 1.0, 1.0, 0.5)
# The engines publish KV events once a request's blocks are stored; the router reads them.
EVENTS_SETTLE_S = 1.0


# ---- results --------------------------------------------------------------------------------


@dataclass
class Check:
    """One check's outcome: pass, fail or skip, why, and what it saw."""

    status: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, **self.details}


def skipped(reason: str) -> Check:
    return Check(SKIP, reason, {"skipped": reason})


def format_table(checks: Mapping[str, Mapping[str, Any]]) -> str:
    """The table printed at the end: one line per check of ``results.json``."""
    rows = [("CHECK", "STATUS", "REASON")]
    rows += [(name, check["status"], check["reason"]) for name, check in checks.items()]
    return "\n".join(f"{a:<9}{b:<8}{c}" for a, b, c in rows)


# ---- the checkpoint -------------------------------------------------------------------------


def write_checkpoint(directory: Path, config: ModelConfig = CHECK_MODEL) -> Path:
    """A random-weight Llama checkpoint of ``config`` (seeded by its ``init_seed``) with the
    reference engine's tokenizer files beside it: a folder ``vllm serve`` loads as it is."""
    save_checkpoint(LlamaModel(config), directory)
    for file in REFERENCE_TOKENIZER.glob("*.json"):
        shutil.copy(file, directory / file.name)
    return directory


# ---- /metrics -------------------------------------------------------------------------------


def autoscaler_metric_names() -> list[str]:
    """Every vLLM metric name the autoscaler reads (its MetricNames defaults)."""
    names = MetricNames()
    return [v for f in fields(names) if isinstance(v := getattr(names, f.name), str)]


def metric_samples(text: str) -> dict[str, list[float]]:
    """The values of every sample of a ``/metrics`` page, by sample name."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.value)
    return samples


def series_values(samples: Mapping[str, list[float]], name: str) -> list[float] | None:
    """The values of what the autoscaler reads as ``name``: its samples, or for a histogram
    (whose family name has no sample of its own) its ``_count``, under either spelling of a
    name (``escaped_name``); None when the page has neither."""
    for spelled in (name, escaped_name(name)):
        for series in (spelled, f"{spelled}_count"):
            if series in samples:
                return samples[series]
    return None


def metrics_check(pages: Mapping[str, str], names: Sequence[str]) -> Check:
    """Every name in ``names`` on every engine's ``/metrics`` page (by engine name) with at
    least one sample; which carry non-zero data is recorded, not judged (gauges read zero
    once the load is over)."""
    engines: dict[str, dict[str, list[str]]] = {}
    missing: list[str] = []
    for engine, text in pages.items():
        samples = metric_samples(text)
        seen: dict[str, list[str]] = {"missing": [], "zero": [], "nonzero": []}
        for name in names:
            values = series_values(samples, name)
            if not values:
                seen["missing"].append(name)
                missing.append(f"{engine}: {name}")
            else:
                seen["nonzero" if any(v != 0 for v in values) else "zero"].append(name)
        engines[engine] = seen
    details: dict[str, Any] = {"names": list(names), "engines": engines}
    if not pages:
        return Check(FAIL, "no engine was scraped", details)
    if missing:
        return Check(FAIL, "missing: " + ", ".join(missing), details)
    return Check(PASS, f"{len(names)} metrics on each of {len(pages)} engines", details)


def counter_total(text: str, name: str) -> float:
    """The sum over every labelled series of counter ``name`` on a page (0 when absent)."""
    return sum(series_values(metric_samples(text), name) or [])


# ---- prefix hits: the router's prediction against the engine's count ------------------------


@dataclass(frozen=True)
class PrefixObservation:
    """One request's route header and usage, as the client saw them."""

    route: str | None
    prompt_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None: not reported


def observe(route: str | None, response: Mapping[str, Any]) -> PrefixObservation:
    """What a completion answer says of its prompt and its prefix-cache hit."""
    usage = response.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return PrefixObservation(route, int(usage.get("prompt_tokens", 0)), cached)


def compare_prefix(observation: PrefixObservation, block_size: int) -> dict[str, Any]:
    """The router's predicted hit and the engine's, in blocks, for one request.

    The router's ``prefix-match`` is the fraction of the prompt's full blocks it expects the
    chosen replica to cache; the engine's ``cached_tokens`` counts the tokens it did not
    compute. They agree within one block: vLLM always computes a prompt's last token (a fully
    cached prompt gives one block back), and the header rounds to two decimals.
    """
    fields_ = route_fields(observation.route)
    full_blocks = observation.prompt_tokens // block_size
    row: dict[str, Any] = {
        "prompt_tokens": observation.prompt_tokens,
        "cached_tokens": observation.cached_tokens,
        "prefix_match": fields_.get("prefix-match"),
        "prefix_source": fields_.get("prefix-source"),
        "engine_blocks": (observation.cached_tokens or 0) / block_size,
    }
    try:
        match = float(fields_["prefix-match"])
    except (KeyError, ValueError):
        return row | {"router_blocks": None, "agree": False}
    router_blocks = match * full_blocks
    # The header's rounding (0.005 of the prompt) on top of the one block.
    tolerance = 1 + 0.005 * full_blocks
    agree = abs(router_blocks - row["engine_blocks"]) <= tolerance
    return row | {"router_blocks": round(router_blocks, 2), "agree": agree}


def prefix_check(
    observations: Sequence[PrefixObservation],
    block_size: int,
    counters: Mapping[str, float],
) -> Check:
    """Requests sharing a long prefix, the first one cold: the router's prediction matches the
    engine's reported hit on each, the warm ones hit, and the engines' counters moved.

    ``counters``: the deltas of the engines' ``prefix_cache_hits``/``queries`` over the
    requests (keys ``hits`` and ``queries``).
    """
    rows = [compare_prefix(o, block_size) for o in observations]
    details: dict[str, Any] = {"block_size": block_size, "requests": rows, "counters": counters}
    if not rows:
        return Check(FAIL, "no request was sent", details)
    if any(row["prefix_match"] is None for row in rows):
        return Check(FAIL, f"no prefix-match in the router's {ROUTE_HEADER} header", details)
    warm = rows[1:]
    if not any(row["cached_tokens"] for row in warm):
        return Check(
            FAIL,
            "the engine reported no cached_tokens for requests repeating a prefix "
            f"(is {EXTRA_ARGS[0]} applied?)",
            details,
        )
    wrong = [i for i, row in enumerate(rows) if not row["agree"]]
    if wrong:
        return Check(
            FAIL,
            f"router and engine disagree on requests {wrong} (router_blocks against engine_blocks)",
            details,
        )
    if counters.get("hits", 0) <= 0:
        return Check(FAIL, "the engines' prefix_cache_hits counter did not move", details)
    hits = sum(row["cached_tokens"] or 0 for row in rows)
    return Check(
        PASS,
        f"router and engine agree on {len(rows)} requests ({hits} cached tokens; counter "
        f"+{counters['hits']:g} hits of +{counters.get('queries', 0):g} queried)",
        details,
    )


# ---- the P/D hop ----------------------------------------------------------------------------


def pd_check(status: int, route: str | None, response: Mapping[str, Any] | None) -> Check:
    """A request to the P/D tier: answered (200, tokens), the router's header says the prefill
    hop ran, and the decode engine reported the prompt as cached (the KV came from prefill)
    when it reports cached tokens at all."""
    fields_ = route_fields(route)
    body = response or {}
    choices = body.get("choices") or [{}]
    text = choices[0].get("text") or ""
    observation = observe(route, body)
    usage = body.get("usage") or {}
    details: dict[str, Any] = {
        "http_status": status,
        "route": route,
        "prefill": fields_.get("prefill"),
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_tokens": observation.prompt_tokens,
        "decode_cached_tokens": observation.cached_tokens,
        "text": text[:80],
    }
    if status != 200:
        return Check(FAIL, f"HTTP {status}", details)
    prefill = fields_.get("prefill")
    if prefill in (None, "none"):
        return Check(FAIL, f"the prefill hop did not run (route: {route!r})", details)
    if not text or not usage.get("completion_tokens"):
        return Check(FAIL, "the answer has no content", details)
    cached = observation.cached_tokens
    if cached == 0:
        return Check(FAIL, "the decode engine computed the whole prompt again", details)
    kv = (
        "decode reported no cached_tokens: recompute not observable"
        if cached is None
        else f"decode took {cached} of {observation.prompt_tokens} prompt tokens as cached"
    )
    return Check(PASS, f"prefilled on {prefill}; {kv}", details)


# ---- the load -------------------------------------------------------------------------------


def bench_check(summary: Mapping[str, Any]) -> Check:
    """``fleetpilot bench``'s summary: every request answered, and prefix hits reported."""
    ttft = summary.get("ttft_s") or {}
    details = {
        "requests": summary.get("requests"),
        "succeeded": summary.get("succeeded"),
        "errors": summary.get("errors"),
        "ttft_p50_s": ttft.get("p50"),
        "ttft_p95_s": ttft.get("p95"),
        "prefix_hit_tokens": summary.get("cached_tokens"),
        "prompt_tokens": summary.get("prompt_tokens"),
        "throughput_rps": summary.get("throughput_rps"),
        "summary": dict(summary),
    }
    if not summary.get("succeeded"):
        return Check(FAIL, "no request succeeded", details)
    if summary.get("errors"):
        return Check(FAIL, f"errors: {summary['errors']}", details)
    if not summary.get("cached_tokens"):
        return Check(FAIL, "no prefix-cache hits reported under a shared-prefix load", details)

    def ms(value: Any) -> str:
        return f"{value * 1000:.0f}ms" if isinstance(value, float) else "-"

    return Check(
        PASS,
        f"{summary['succeeded']} requests, TTFT p50 {ms(ttft.get('p50'))} p95 "
        f"{ms(ttft.get('p95'))}, {summary['cached_tokens']} of {summary['prompt_tokens']} "
        "prompt tokens from the prefix cache",
        details,
    )


# ---- the run --------------------------------------------------------------------------------


def check_manifest(*, with_pd: bool) -> dict[str, Any]:
    """The service checked: a unified tier and, ``with_pd``, a prefill/decode tier over NIXL,
    one engine per role, a 2048-token context and 16-token KV blocks."""

    def tier(name: str, serving: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": name,
            "model": {
                "name": f"fleetpilot-check/{name}",
                "servedName": f"check-{name}",
                "maxModelLen": MAX_MODEL_LEN,
                "dtype": "bfloat16",
            },
            "engine": {
                "maxNumSeqs": 16,
                "kvCache": {"blockSize": BLOCK_SIZE},
                "extraArgs": list(EXTRA_ARGS),
            },
            "serving": serving,
        }

    one = {"min": 1, "max": 1}
    tiers = [tier(UNIFIED, {"replicas": one})]
    if with_pd:
        # Easy requests (the load's) stay on the unified tier; the P/D check pins its tier.
        tiers[0]["complexity"] = {"upTo": 0.5}
        pd = {
            "mode": "disaggregated",
            "prefill": {"replicas": one},
            "decode": {"replicas": one},
            "kvTransfer": {"connector": "NixlConnector"},
        }
        tiers.append(tier(PD, pd))
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": SERVICE, "namespace": "default"},
        "spec": {"tiers": tiers},
    }


def default_vllm() -> str:
    return shutil.which("vllm") or str(ROOT / ".venv-vllm" / "bin" / "vllm")


def vllm_python(executable: str) -> str:
    """The interpreter of the ``vllm`` command: its script's ``#!`` line, else the python
    beside it (pip writes a shell trampoline instead for long paths)."""
    path = Path(shutil.which(executable) or executable)
    try:
        with path.open("rb") as script:
            first = script.readline().decode(errors="replace").strip()
    except OSError:
        first = ""
    interpreter = Path(first[2:].strip()) if first.startswith("#!") else None
    if interpreter and interpreter.name.startswith("python") and interpreter.is_file():
        return str(interpreter)
    return str(path.parent / "python")


def nixl_problem(python: str) -> str | None:
    """None when NIXL imports in vLLM's environment as vLLM's connector imports it; else
    the error."""
    try:
        done = subprocess.run(
            [python, "-c", NIXL_IMPORT], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} -c {NIXL_IMPORT!r}: {e}"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def served_names(fleet: LocalFleet) -> dict[str, str]:
    return {t.name: t.model.alias for t in fleet.service.spec.tiers}


def check_flags(fleet: LocalFleet, client: httpx.Client, backend: str) -> Check:
    """Every engine runs the backend's command for its launch and answers /health and
    /v1/models with its tier's served name."""
    names = served_names(fleet)
    engines = []
    problems = []
    for replica in fleet.replicas:
        health = client.get(f"http://{replica.address}/health").status_code
        models = client.get(f"http://{replica.address}/v1/models")
        listed = [m.get("id") for m in models.json().get("data", [])] if models.is_success else []
        engines.append(
            {
                "engine": replica.name,
                "argv": replica.argv,
                "env": replica.env,
                "health": health,
                "models": listed,
            }
        )
        if health != 200:
            problems.append(f"{replica.name}: /health {health}")
        if names[replica.tier] not in listed:
            problems.append(f"{replica.name}: /v1/models lists {listed}, not {names[replica.tier]}")
    details: dict[str, Any] = {"engines": engines}
    if backend == "reference":
        details["note"] = f"the reference engine is not passed the extra vLLM args {EXTRA_ARGS}"
    if problems:
        return Check(FAIL, "; ".join(problems), details)
    return Check(
        PASS,
        f"{len(engines)} engines up with the {backend} command of their launch; /health 200, "
        "/v1/models lists the served name",
        details,
    )


def complete(
    client: httpx.Client, fleet: LocalFleet, tier: str, prompt: str
) -> tuple[int, str | None, dict[str, Any] | None]:
    """A completion through the router, pinned to ``tier``: status, route header, body."""
    body = {"model": served_names(fleet)[tier], "prompt": prompt, **ANSWER}
    response = client.post(f"{fleet.endpoint}/completions", json=body, headers={TIER_HEADER: tier})
    answer = response.json() if response.is_success else None
    return response.status_code, response.headers.get(ROUTE_HEADER), answer


def scrape(client: httpx.Client, replicas: Sequence[Replica]) -> dict[str, str]:
    return {r.name: client.get(f"http://{r.address}/metrics").text for r in replicas}


def run_prefix(client: httpx.Client, fleet: LocalFleet) -> Check:
    """Requests sharing a long prefix (PREFIX_SHARES of it) to the unified tier, one at a
    time, the first cold."""
    rng = random.Random(SEED)
    prefix = "Shared context of the prefix check. " + words(rng, PREFIX_CHARS)
    engines = fleet.role_replicas(UNIFIED, "unified")
    names = MetricNames()
    before = scrape(client, engines)
    observations = []
    for i, share in enumerate(PREFIX_SHARES):
        head = prefix[: round(len(prefix) * share)]
        prompt = f"{head} Question {i}: {words(rng, TAIL_CHARS)}"
        status, route, answer = complete(client, fleet, UNIFIED, prompt)
        if answer is None:
            return Check(FAIL, f"request {i}: HTTP {status}", {"route": route})
        observations.append(observe(route, answer))
        time.sleep(EVENTS_SETTLE_S)
    after = scrape(client, engines)
    counters = {
        key: sum(counter_total(after[e], name) - counter_total(before[e], name) for e in after)
        for key, name in (("hits", names.prefix_hits), ("queries", names.prefix_queries))
    }
    return prefix_check(observations, BLOCK_SIZE, counters)


def run_pd(client: httpx.Client, fleet: LocalFleet) -> Check:
    """One request to the P/D tier, with a prompt no engine has seen."""
    prompt = "A prompt for the prefill/decode hand-off. " + words(random.Random(SEED + 1), 600)
    status, route, answer = complete(client, fleet, PD, prompt)
    return pd_check(status, route, answer)


def run_bench(fleet: LocalFleet, duration_s: float, out: Path) -> Check:
    """``fleetpilot bench`` (shared-prefix chats, closed loop) against the router."""
    path = out / "bench.json"
    argv = [
        "--url", fleet.endpoint, "--model", SERVICE, "--workload", "shared-prefix",
        "--concurrency", "4", "--duration", f"{duration_s:g}", "--max-tokens", "16",
        "--ignore-eos", "--timeout", "30", "--out", str(path),
    ]  # fmt: skip
    code = loadgen.main(argv)
    if not path.is_file():
        return Check(FAIL, f"fleetpilot bench exited with {code} and wrote no results")
    check = bench_check(json.loads(path.read_text())["summary"])
    check.details["command"] = ["fleetpilot", "bench", *argv]
    return check


def make_backend(args: argparse.Namespace, model_dir: Path) -> EngineBackend:
    if args.backend == "vllm":
        return VllmBackend(args.vllm, model_dir)
    config = json.dumps(CHECK_MODEL.to_json_dict(), separators=(",", ":"))
    return ReferenceBackend(sys.executable, config)


class Results:
    """``results.json``, rewritten as each check ends: a run killed at its time limit still
    leaves what it found."""

    def __init__(self, path: Path, backend: str) -> None:
        self.path = path
        self.started = time.monotonic()
        self.checks: dict[str, Check] = {}
        self.doc: dict[str, Any] = {
            "backend": backend,
            "started_at": time.time(),
            "model": CHECK_MODEL.to_json_dict(),
        }

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def record(self, name: str, check: Check) -> None:
        self.checks[name] = check
        self.save()

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed_s, 1)
        self.doc["checks"] = {name: check.to_json() for name, check in self.checks.items()}
        self.doc["passed"] = not any(check.failed for check in self.checks.values())
        self.path.write_text(json.dumps(self.doc, indent=2) + "\n")


def say(text: str) -> None:
    print(f"== {text}", flush=True)


def run(args: argparse.Namespace) -> Results:
    """The whole check, recorded in ``OUT/results.json``."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = Results(out / "results.json", args.backend)
    model_dir = write_checkpoint(out / "model")
    results.doc["checkpoint"] = str(model_dir)
    pd_skip: str | None = None
    if args.backend == "vllm":
        python = vllm_python(args.vllm)
        results.doc["vllm"] = {"executable": args.vllm, "python": python}
        if not Path(shutil.which(args.vllm) or args.vllm).is_file():
            results.record("flags", Check(FAIL, f"no vllm executable at {args.vllm} (make vllm)"))
            return results
        problem = nixl_problem(python)
        if problem is not None:
            pd_skip = NO_NIXL
            results.doc["vllm"]["nixl_import_error"] = problem
    manifest = check_manifest(with_pd=pd_skip is None)
    results.doc["service"] = manifest
    fleet = LocalFleet(
        parse_service(manifest),
        out / "fleet",
        0,
        backend=make_backend(args, model_dir),
        health_timeout_s=args.engine_timeout,
    )
    try:
        say(f"starting {len(fleet.replicas)} {args.backend} engines and the router")
        try:
            fleet.start()
        except ChildFailedError as e:
            results.record("flags", Check(FAIL, f"the fleet did not start: {e}"))
            return results
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            steps: list[tuple[str, Callable[[], Check]]] = [
                ("flags", lambda: check_flags(fleet, client, args.backend)),
                ("prefix", lambda: run_prefix(client, fleet)),
                ("pd", lambda: skipped(pd_skip) if pd_skip else run_pd(client, fleet)),
            ]
            for name, step in steps:
                say(f"{name} check")
                results.record(name, attempt(step))
            # The load takes what the budget leaves, keeping time for the scrape and the stop.
            duration = min(args.duration, args.budget - results.elapsed_s - 30)
            say(f"fleetpilot bench for {duration:.0f} s")
            if duration <= 1:
                bench = Check(FAIL, f"no time left in the {args.budget:g} s budget")
            else:
                bench = attempt(lambda: run_bench(fleet, duration, out))
                bench.details["trimmed"] = duration < args.duration
            results.record("bench", bench)
            # After the load: counters and histograms have data.
            say("metrics check")
            results.record(
                "metrics",
                attempt(
                    lambda: metrics_check(scrape(client, fleet.replicas), autoscaler_metric_names())
                ),
            )
    finally:
        say("stopping the fleet")
        fleet.stop()
        results.doc["leftover_pids"] = fleet.leftovers()
        results.save()
    return results


def attempt(step: Callable[[], Check]) -> Check:
    """A check that raised (a timeout, a refused connection) failed, and the rest still run."""
    try:
        return step()
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Check(FAIL, f"{type(e).__name__}: {e}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    a = parser.add_argument
    a("--out", type=Path, required=True, help="folder for results.json, the model and the logs")
    a("--backend", choices=["vllm", "reference"], default="vllm", help="the engines to run")
    a("--vllm", default=default_vllm(), help="the vllm executable (default: %(default)s)")
    a("--duration", type=float, default=60.0, help="seconds of fleetpilot bench load")
    a(
        "--budget",
        type=float,
        default=450.0,
        help="seconds the whole run may take; the load is cut short to fit",
    )
    a(
        "--engine-timeout",
        type=float,
        default=120.0,
        help="seconds each engine may take to answer /health",
    )
    args = parser.parse_args(argv)
    results = run(args)
    print(format_table(results.doc["checks"]))
    print(f"results: {results.path} ({results.doc['elapsed_s']} s)")
    return 0 if results.doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
