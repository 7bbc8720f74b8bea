"""The calibration's driver: start the step recorder and the local fleet's engines and router
as child processes (the runtime's supervisor, so none outlives the calibration), run the plan
against them (:mod:`fleetpilot.simulate.calibrate_http`), check what they report, and fit the
profile (:mod:`fleetpilot.simulate.calibrate_fit`). What is measured and why:
:mod:`fleetpilot.simulate.calibrate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

import fleetpilot
from fleetpilot.api import API_VERSION, KIND, parse_service
from fleetpilot.api.spec import KvConnector, RoleName
from fleetpilot.engine.reference_launch import (
    CPU_MAX_MODEL_LEN,
    CPU_MAX_NUM_SEQS,
    CPU_MODEL_CONFIG,
    reference_argv,
)
from fleetpilot.engine.vllm_args import EngineLaunch
from fleetpilot.runtime.local import LocalFleet
from fleetpilot.runtime.processes import Child, ChildFailedError, Supervisor, free_ports
from fleetpilot.simulate.calibrate_fit import (
    LoadGap,
    PullSample,
    RouterSample,
    StepFit,
    StepRecord,
    TtftSample,
    fit_per_stream,
    fit_prefill_base,
    fit_router,
    fit_step_costs,
    fit_transfer,
    step_records,
)
from fleetpilot.simulate.calibrate_http import (
    HOST,
    ROUTED_SERVICE,
    SERVED_NAME,
    CalibrationError,
    Progress,
    kv_pool,
    router_pairs,
    session,
)
from fleetpilot.simulate.calibrate_plan import FULL, QUICK, Plan
from fleetpilot.simulate.profile import EngineShape, MeasuredProfile

RECORDER_MODULE = "fleetpilot.simulate.calibrate_record"
# What reference_argv puts before the engine's own flags.
_ENGINE_COMMAND = ["-m", "fleetpilot", "engine", "--backend", "reference"]
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Calibration:
    """A profile and the measurements behind it."""

    profile: MeasuredProfile
    fit: StepFit
    ttft: tuple[TtftSample, ...]
    gaps: tuple[LoadGap, ...]
    pulls: tuple[PullSample, ...]
    router: tuple[RouterSample, ...]
    cold_starts_s: tuple[float, ...]
    elapsed_s: float


@dataclass(frozen=True)
class _EngineInfo:
    """What the step recorder's engine was built with."""

    num_blocks: int
    block_size: int
    kv_bytes_per_block: int
    host_bandwidth_bytes_per_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    torch_threads: int


@dataclass(frozen=True)
class _Session:
    """What one session with the step recorder measured."""

    engine: _EngineInfo
    steps: list[StepRecord]
    ttft: tuple[TtftSample, ...]
    gaps: tuple[LoadGap, ...]
    pulls: tuple[PullSample, ...]
    tokenization: tuple[float, int]  # (chars_per_token, message_tokens)
    launch_s: float  # from its launch to /health answering 200
    pool: tuple[int, int]  # (KV blocks, block size) its /metrics reported


def calibrate(
    *, seed: int = 0, quick: bool = False, progress: Progress | None = None
) -> MeasuredProfile:
    """Measure the reference engine as the local fleet runs it; ``quick``: a few samples of
    each kind (seconds, for tests), not a profile to trust."""
    return measure(seed=seed, quick=quick, progress=progress).profile


def measure(*, seed: int = 0, quick: bool = False, progress: Progress | None = None) -> Calibration:
    """:func:`calibrate`, with the fit and samples behind the profile."""
    say = progress or (lambda _message: None)
    plan = QUICK if quick else FULL
    started = time.monotonic()
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="fleetpilot-calibrate-") as tmp:
        supervisor = Supervisor(Path(tmp))
        try:
            session = _record(supervisor, Path(tmp), plan, rng, seed, say)
            starts = _cold_starts(supervisor, plan.cold_starts, say)
            router = _router_samples(Path(tmp), plan.router_chars, rng, say)
        except (ChildFailedError, httpx.HTTPError) as e:  # an engine died or never started
            raise CalibrationError(f"{type(e).__name__}: {e}") from e
        finally:
            supervisor.stop_all(grace_s=5.0)
    engine = session.engine
    for blocks, block_size in [session.pool, *(pool for _, pool in starts)]:
        if (blocks, block_size) != (engine.num_blocks, engine.block_size):
            raise CalibrationError(
                f"an engine serves {blocks} KV blocks of {block_size} tokens but the step "
                f"recorder's was built with {engine.num_blocks} of {engine.block_size}"
            )
    cold_starts = tuple(s for s, _ in starts) or (session.launch_s,)
    say(f"fitting {len(session.steps)} steps")
    try:
        fit, profile = _profile(session, router, cold_starts, quick)
    except ValueError as e:  # too few samples, or costs EngineCosts refuses
        raise CalibrationError(f"the measurements make no profile: {e}") from e
    elapsed = time.monotonic() - started
    return Calibration(
        profile, fit, session.ttft, session.gaps, session.pulls, router, cold_starts, elapsed
    )


def _profile(
    session: _Session,
    router: Sequence[RouterSample],
    cold_starts: Sequence[float],
    quick: bool,
) -> tuple[StepFit, MeasuredProfile]:
    """The fits, in order: the base and transfer costs are what remains beyond the step fit."""
    engine = session.engine
    fit = fit_step_costs(session.steps)
    prefill_base = fit_prefill_base(session.ttft)
    kv_bytes_per_token = engine.kv_bytes_per_block // engine.block_size
    costs = dataclasses.replace(
        fit.costs,
        # A reference engine with a host tier paces its copies back at its link's bandwidth
        # (--kv-offload-gb-per-second); the copy itself is a memcpy, small beside that.
        host_load_per_token_s=kv_bytes_per_token / engine.host_bandwidth_bytes_per_s,
        prefill_base_s=prefill_base,
        first_token_per_stream_s=fit_per_stream(session.gaps, prefill_base),
        transfer_per_token_s=fit_transfer(session.pulls, fit, prefill_base),
        cold_start_s=statistics.median(cold_starts),
    )
    shape = EngineShape(
        kv_tokens=engine.num_blocks * engine.block_size,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        chars_per_token=session.tokenization[0],
        message_tokens=session.tokenization[1],
    )
    profile = MeasuredProfile(
        SERVED_NAME,
        _source(engine, quick),
        costs,
        shape,
        router_s=fit_router(router),
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return fit, profile


def _source(engine: _EngineInfo, quick: bool) -> str:
    """What was measured, where and when: the engine's settings and the host's CPU."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    caching = "on" if engine.enable_prefix_caching else "off"
    return (
        f"fleetpilot {fleetpilot.__version__} simulate calibrate{' --quick' if quick else ''}: "
        f"reference engine, model preset {CPU_MODEL_CONFIG}, max-num-seqs "
        f"{engine.max_num_seqs}, max-model-len {CPU_MAX_MODEL_LEN}, max-num-batched-tokens "
        f"{engine.max_num_batched_tokens}, {engine.num_blocks} KV blocks of "
        f"{engine.block_size}, prefix caching {caching}, served over HTTP; on {_cpu_model()} "
        f"({os.cpu_count()} CPUs), torch threads {engine.torch_threads}; {when}"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return "an unknown CPU"


# ---- measuring: the step recorder --------------------------------------------------------------


def launch_argv(port: int, events: int, replay: int, *, pd: bool) -> list[str]:
    """The local fleet's command line for one engine on these ports; ``pd``: as a P/D role."""
    launch = EngineLaunch(
        model=SERVED_NAME,
        served_name=SERVED_NAME,
        role=RoleName.PREFILL if pd else RoleName.UNIFIED,
        port=port,
        max_num_seqs=CPU_MAX_NUM_SEQS,
        kv_connector=KvConnector.NIXL.value if pd else None,
        kv_events_port=events,
        kv_replay_port=replay,
    )
    argv = reference_argv(launch, HOST, python=sys.executable)
    if argv[1 : 1 + len(_ENGINE_COMMAND)] != _ENGINE_COMMAND:
        raise CalibrationError(f"reference_argv no longer starts with {_ENGINE_COMMAND}: {argv}")
    return argv


def _record(
    supervisor: Supervisor, tmp: Path, plan: Plan, rng: random.Random, seed: int, say: Progress
) -> _Session:
    """Run the plan against the step recorder; its steps, TTFTs, P/D pulls and token counts."""
    port, events, replay = free_ports(3, HOST)
    out = tmp / "steps.json"
    # A P/D role's flags (kv_both), so one engine also serves both hops of a hand-off; requests
    # without kv_transfer_params run exactly as on a unified engine.
    flags = launch_argv(port, events, replay, pd=True)[len(_ENGINE_COMMAND) + 1 :]
    say("starting the step recorder (the local fleet's engine, its steps timed)")
    argv = [sys.executable, "-m", RECORDER_MODULE, str(out), *flags]
    child, launch_s = _start(supervisor, "step-recorder", argv, port)
    since, ttft, gaps, pulls, tokenization = asyncio.run(
        session(f"http://{HOST}:{port}", plan, rng, seed, say)
    )
    pool = kv_pool(port)
    supervisor.stop(child, grace_s=10.0)
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"the step recorder left no steps ({e}):\n{child.tail()}") from e
    steps = step_records(data["steps"], since)
    engine = _EngineInfo(**data["engine"])
    return _Session(engine, steps, ttft, gaps, pulls, tokenization, launch_s, pool)


def _start(supervisor: Supervisor, name: str, argv: list[str], port: int) -> tuple[Child, float]:
    """Launch ``argv`` and wait for its ``/health`` to answer 200, polled as the local fleet
    polls its engines; the child and the seconds that took."""
    started = time.monotonic()
    child = supervisor.start(
        name, argv, health_url=f"http://{HOST}:{port}/health", env={"PYTHONUNBUFFERED": "1"}
    )
    supervisor.wait_healthy(child, timeout_s=_START_TIMEOUT_S)
    return child, time.monotonic() - started


def _router_samples(
    tmp: Path, chars: Sequence[int], rng: random.Random, say: Progress
) -> tuple[RouterSample, ...]:
    """The router's hop as ``fleetpilot up`` runs it: lone requests through the router and
    straight to its engine, in alternating order (a shared CPU's speed drifts)."""
    tier = {
        "name": "main",
        "model": {"name": SERVED_NAME, "servedName": SERVED_NAME, "maxModelLen": 2048},
        "engine": {"maxNumSeqs": CPU_MAX_NUM_SEQS},
        "serving": {"replicas": {"min": 1, "max": 1}},
    }
    manifest = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": ROUTED_SERVICE, "namespace": "default"},
        "spec": {"tiers": [tier]},
    }
    fleet = LocalFleet(parse_service(manifest, "calibrate's router"), tmp / "routed", 0)
    say("starting a router in front of a reference engine, as the local fleet runs them")
    fleet.start()
    try:
        routed = f"http://{HOST}:{fleet.router_port}"
        direct = f"http://{HOST}:{fleet.replicas[0].port}"
        return asyncio.run(router_pairs(routed, direct, chars, rng))
    finally:
        fleet.stop()


def _cold_starts(
    supervisor: Supervisor, starts: int, say: Progress
) -> list[tuple[float, tuple[int, int]]]:
    """Launches of the local fleet's real (unified) engine command: per start, the seconds to
    ready and the KV pool it reports."""
    out = []
    for i in range(starts):
        port, events, replay = free_ports(3, HOST)
        say(f"cold start {i + 1}/{starts} of the engine")
        argv = launch_argv(port, events, replay, pd=False)
        child, seconds = _start(supervisor, f"engine-{i}", argv, port)
        out.append((seconds, kv_pool(port)))
        supervisor.stop(child, grace_s=10.0)
    return out
