"""``fleetpilot simulate calibrate``: measure the reference engine on this machine, as the local
fleet (``fleetpilot up``) runs it, and write the
:class:`~fleetpilot.simulate.profile.MeasuredProfile` the simulator times engines with.

Every engine is started with the local fleet's own command line
(:func:`~fleetpilot.engine.reference_launch.reference_argv`: the tiny model, 16 sequences, 2048
tokens of context, the engine's default token budget (512) and block size (16), prefix caching
and KV events on) and measured over HTTP with the load generator ``fleetpilot bench`` uses,
because that is what the profile must predict: an engine serving HTTP spends a large share of a
step on its event loop (an SSE write per token per stream, on the same GIL as the step); on a
2-core machine a 16-sequence decode step took ~6 ms driven in-process and ~10 ms serving.

* Step costs: a *step recorder* (this module run as ``python -m``) serves exactly as
  ``fleetpilot engine --backend reference`` does with the same flags, but wraps the engine's
  ``step`` and its scheduler's ``schedule`` from outside to note, per step, what ran (decoding
  sequences, their KV tokens, prompt tokens computed) and when it started. A step's cost is the
  time to the next step's start while the engine stays busy: the step plus the runner's work
  around it (metrics, KV events, handing outputs to the event loop), which is what separates
  two tokens of a stream. Closed-loop loads of 1..16 concurrent chats with short to long
  prompts and varied answer lengths give decode-only, prefill-only and mixed steps, and loads
  of short and longer questions after a shared (so cached) prefix give prompts that attend to
  a cached prefix; :func:`fit_step_costs` fits the six step coefficients to them
  (non-negative least squares on relative error, gross outliers dropped). Without the two
  attention terms a 40-token question after a 1,200-token cached prefix was priced as a
  40-token prompt alone: 4 ms, where the engine took 7.4.
* ``prefill_base_s``: what the client's TTFT (first non-empty content, as ``fleetpilot bench``
  measures it) of a lone request has beyond the engine's own (its
  ``vllm:time_to_first_token_seconds``, read before and after each request): the chat template
  and tokenizer before the engine's clock starts, the SSE write and the client's read after
  it; the median, floored at 0. With a byte tokenizer and a random model the first token is
  sometimes a held-back partial UTF-8 character, so this also carries the mean delay that
  causes. (It was once the TTFT minus the *modeled* prefill, which let the step fit's error
  on lone prompts stand in for the served path: 1.1 ms, where the engines' own clock says
  4-5 ms.)
* ``first_token_per_stream_s``: that gap grows with the streams the engine serves beside the
  request (their token writes share the engine's event loop, and the client's): each
  closed-loop load's mean client TTFT minus the engine's mean over the same requests, beyond
  ``prefill_base_s``, fitted per other stream (concurrency - 1) through the origin.
* ``transfer_per_token_s``: the router's P/D hand-off (the prefill hop, then the decode hop,
  which pulls the pinned KV over HTTP); the recorder runs with a P/D role's flags
  (``kv_both``), so it serves both hops. The decode hop's TTFT minus what it costs without a
  pull (a one-token step and ``prefill_base_s``), fitted per prompt token through the origin,
  so a pull's fixed cost is spread over typical prompt lengths.
* ``router_s`` (the profile's, not an engine cost): the local fleet's smallest service (one
  reference engine, ``fleetpilot router`` before it, started as ``fleetpilot up`` starts
  them) answers lone requests through the router and straight to the engine, alternately;
  the median difference of their TTFTs. The simulated routers decide for free; this is their
  hop on the client's clock.
* Lone requests and hand-offs run between the loads, not after them: a shared CPU's speed
  drifts by tens of percent within a minute, and both coefficients are differences against the
  step fit, so they must see the same machine.
* ``cold_start_s``: launch of the real command to ``/health`` answering 200, polled as the local
  fleet polls it; the median of three starts (``quick``: the step recorder's own launch).
* Shape: the KV pool (blocks x block size), batch limits and block size the recorder's engine
  was built with, checked against what the real command's engine reports in ``/metrics``;
  ``chars_per_token`` and ``message_tokens`` are fitted to how the engine's ``/tokenize`` counts
  the ``fleetpilot bench`` workloads' chats: bytes of content per token, and the tokens its chat
  template adds a message (the simulator's tokenizer counts a chat that way).

Nothing here imports torch: engines run in child processes (the runtime's supervisor, so none
outlives the calibration).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

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
from fleetpilot.loadgen.runner import RequestRecord, RunConfig, Runner
from fleetpilot.loadgen.workloads import WORKLOADS, RequestSpec, make_workload, words
from fleetpilot.routing.policies.pd import decode_request, kv_params_of, prefill_request
from fleetpilot.runtime.local import LocalFleet
from fleetpilot.runtime.processes import Child, ChildFailedError, Supervisor, free_ports
from fleetpilot.simulate.profile import EngineCosts, EngineShape, MeasuredProfile

if TYPE_CHECKING:
    from fleetpilot.engine.reference.engine import LLMEngine
    from fleetpilot.engine.reference.request import RequestOutput
    from fleetpilot.engine.reference.scheduler import SchedulerOutput

HOST = "127.0.0.1"
SERVED_NAME = f"reference-{CPU_MODEL_CONFIG}"
RECORDER_MODULE = "fleetpilot.simulate.calibrate"
# What reference_argv puts before the engine's own flags.
_ENGINE_COMMAND = ["-m", "fleetpilot", "engine", "--backend", "reference"]
_START_TIMEOUT_S = 120.0

Progress = Callable[[str], None]


class CalibrationError(RuntimeError):
    """A measurement that could not be made; the message says which and why."""


# ---- the step fit (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One engine step: what ran in it and how long it kept the engine busy."""

    running: int  # sequences that decoded a token
    kv_tokens: int  # their KV tokens (prompt + output so far)
    prefill_tokens: int  # prompt tokens computed
    seconds: float
    # The prefilling sequences' tokens already in the KV cache (a cached prefix, earlier
    # chunks), which their new tokens attend to, and the (new token, attended token) pairs:
    # new x (prior + new / 2) per sequence.
    prefill_context: int = 0
    prefill_pairs: float = 0.0

    @property
    def kind(self) -> str:
        if self.prefill_tokens == 0:
            return "decode"
        return "prefill" if self.running == 0 else "mixed"


@dataclass(frozen=True)
class KindResidual:
    """How well the fit describes one kind of step."""

    kind: str  # decode, prefill, mixed; "  x4-7": decode steps of 4 to 7 sequences
    steps: int
    measured_s: float  # mean
    model_s: float  # mean
    median_rel_error: float  # median of |model - measured| / measured


@dataclass(frozen=True)
class StepFit:
    """The six step coefficients (EngineCosts' meaning) and how well they fit."""

    decode_base_s: float
    decode_per_seq_s: float
    decode_per_kv_token_s: float
    prefill_per_token_s: float
    r2: float  # of the kept steps, in seconds
    steps: int  # kept
    dropped: int  # gross outliers
    residuals: tuple[KindResidual, ...]
    prefill_per_context_token_s: float = 0.0
    prefill_per_pair_s: float = 0.0

    @property
    def coefficients(self) -> np.ndarray:
        return np.array(
            [
                self.decode_base_s,
                self.decode_per_seq_s,
                self.decode_per_kv_token_s,
                self.prefill_per_token_s,
                self.prefill_per_context_token_s,
                self.prefill_per_pair_s,
            ]
        )

    @property
    def costs(self) -> EngineCosts:
        """The fitted step coefficients as the simulator's costs (nothing beyond the steps)."""
        return EngineCosts(
            prefill_base_s=0.0,
            prefill_per_token_s=self.prefill_per_token_s,
            decode_base_s=self.decode_base_s,
            decode_per_seq_s=self.decode_per_seq_s,
            decode_per_kv_token_s=self.decode_per_kv_token_s,
            prefill_per_context_token_s=self.prefill_per_context_token_s,
            prefill_per_pair_s=self.prefill_per_pair_s,
        )


def nnls(a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active set method).

    Ours rather than scipy's: the project does not depend on scipy for one small solver.
    """
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n + 10):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(passive, -np.inf, gradient)
        if passive.all() or candidates.max() <= tol:
            break
        passive[int(np.argmax(candidates))] = True
        while True:
            s = np.zeros(n)
            if not passive.any():
                break
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            # Step from x towards s until the first passive variable reaches zero; it leaves
            # (explicitly, so rounding cannot keep it and loop forever), with any others at 0.
            falling = passive & (s <= 0)
            ratios = np.full(n, np.inf)
            ratios[falling] = x[falling] / np.maximum(x[falling] - s[falling], 1e-300)
            leaving = int(np.argmin(ratios))
            x = x + ratios[leaving] * (s - x)
            passive &= x > tol
            passive[leaving] = False
            x[~passive] = 0.0
        x = s
    return x


def _design(records: Sequence[StepRecord]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array(
        [
            [1.0, r.running, r.kv_tokens, r.prefill_tokens, r.prefill_context, r.prefill_pairs]
            for r in records
        ]
    )
    return a, np.array([r.seconds for r in records])


def _weighted_nnls(a: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """NNLS of rows scaled by ``weights``; columns scaled to unit norm for conditioning."""
    aw = a * weights[:, None]
    norms = np.linalg.norm(aw, axis=0)
    norms[norms == 0] = 1.0
    x: np.ndarray = nnls(aw / norms, y * weights) / norms
    return x


def fit_step_costs(records: Sequence[StepRecord], *, outlier_sigmas: float = 5.0) -> StepFit:
    """Fit ``decode_base + per_seq x running + per_kv x kv_tokens + per_prefill x prefill +
    per_context x prefill_context + per_pair x prefill_pairs`` to measured steps, every
    coefficient >= 0.

    On relative error (rows weighted by 1/step), since steps span 3 ms decodes to 50 ms
    prefills and the simulator needs both right in proportion, not the big ones in
    milliseconds. Steps more than ``outlier_sigmas`` robust deviations slower or faster than
    the first fit (a scheduler hiccup or GC pause of the machine, not of the engine) are dropped
    before the final fit, which weights by the first fit's prediction so noisy short steps do
    not pull it down.
    """
    if len(records) < 8:
        raise ValueError(f"a step fit needs at least 8 steps, got {len(records)}")
    if any(not (r.seconds > 0 and math.isfinite(r.seconds)) for r in records):
        raise ValueError("step durations must be positive and finite")
    a, y = _design(records)
    first = _weighted_nnls(a, y, 1 / y)
    predicted = np.maximum(a @ first, y.min())
    rel = (y - predicted) / predicted
    centre = float(np.median(rel))
    spread = 1.4826 * float(np.median(np.abs(rel - centre)))
    keep = np.abs(rel - centre) <= outlier_sigmas * spread if spread > 0 else np.ones_like(y, bool)
    coef = _weighted_nnls(a[keep], y[keep], 1 / predicted[keep])
    kept = [r for r, k in zip(records, keep, strict=True) if k]
    model = a[keep] @ coef
    total = float(np.sum((y[keep] - y[keep].mean()) ** 2))
    r2 = 1.0 - float(np.sum((y[keep] - model) ** 2)) / total if total > 0 else 1.0
    return StepFit(
        decode_base_s=float(coef[0]),
        decode_per_seq_s=float(coef[1]),
        decode_per_kv_token_s=float(coef[2]),
        prefill_per_token_s=float(coef[3]),
        r2=r2,
        steps=len(kept),
        dropped=len(records) - len(kept),
        residuals=_residuals(kept, model),
        prefill_per_context_token_s=float(coef[4]),
        prefill_per_pair_s=float(coef[5]),
    )


# Decode-only steps by batch size too: a linear per-sequence cost is the model's assumption, and
# these rows show where the engine departs from it.
_DECODE_BATCHES = ((1, 1), (2, 3), (4, 7), (8, 11), (12, 10**9))


def _groups(records: Sequence[StepRecord]) -> Iterator[tuple[str, list[int]]]:
    for kind in ("decode", "prefill", "mixed"):
        yield kind, [i for i, r in enumerate(records) if r.kind == kind]
        if kind != "decode":
            continue
        for low, high in _DECODE_BATCHES:
            label = f"{low}" if low == high else f"{low}+" if high > 16 else f"{low}-{high}"
            picked = [
                i for i, r in enumerate(records) if r.kind == kind and low <= r.running <= high
            ]
            yield f"  x{label}", picked


def _residuals(records: Sequence[StepRecord], model: np.ndarray) -> tuple[KindResidual, ...]:
    out = []
    for kind, idx in _groups(records):
        if not idx:
            continue
        measured = np.array([records[i].seconds for i in idx])
        predicted = model[idx]
        out.append(
            KindResidual(
                kind=kind,
                steps=len(idx),
                measured_s=float(measured.mean()),
                model_s=float(predicted.mean()),
                median_rel_error=float(np.median(np.abs(predicted - measured) / measured)),
            )
        )
    return tuple(out)


# ---- the other coefficients (pure) -------------------------------------------------------------


@dataclass(frozen=True)
class TtftSample:
    """A lone request's time to first content, as the client saw it, and its first token's
    time as the engine counted it (arrival to first token)."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    engine_ttft_s: float


@dataclass(frozen=True)
class LoadGap:
    """A closed-loop load's mean TTFT as its clients saw it and as the engine counted it."""

    concurrency: int
    client_mean_s: float
    engine_mean_s: float


@dataclass(frozen=True)
class PullSample:
    """A P/D decode hop's time to first content; its prompt's KV was pulled first."""

    prompt_tokens: int
    ttft_s: float


def prefill_s(fit: StepFit, tokens: int, max_num_batched_tokens: int, cached: int = 0) -> float:
    """Modeled time to compute ``tokens`` prompt tokens after ``cached`` ones alone on an idle
    engine: one step per chunk of the token budget, each attending to what came before it,
    nothing decoding beside it."""
    costs = fit.costs
    total, prior = 0.0, cached
    left = max(1, tokens)
    while left > 0:
        take = min(left, max_num_batched_tokens)
        total += costs.step_s(0, 0, take, prior, take * (prior + take / 2))
        prior += take
        left -= take
    return total


def fit_prefill_base(samples: Sequence[TtftSample]) -> float:
    """Median of the client's TTFT minus the engine's own, floored at 0: the first token's
    cost outside the engine's clock (template, tokenizer, SSE, HTTP, held-back bytes)."""
    if not samples:
        raise ValueError("no TTFT samples")
    return max(0.0, statistics.median(s.ttft_s - s.engine_ttft_s for s in samples))


def fit_per_stream(gaps: Sequence[LoadGap], prefill_base_s: float) -> float:
    """Seconds the client's first token comes later per other stream the engine serves: each
    load's mean gap beyond ``prefill_base_s`` against its concurrency - 1, least squares
    through the origin, floored at 0. Loads of one stream carry no slope."""
    x = np.array([g.concurrency - 1 for g in gaps], dtype=float)
    if not (x > 0).any():
        raise ValueError("no closed-loop load with more than one stream")
    y = np.array([g.client_mean_s - g.engine_mean_s - prefill_base_s for g in gaps])
    return max(0.0, float(x @ y / (x @ x)))


@dataclass(frozen=True)
class RouterSample:
    """A lone request's TTFT through the router, and a like one's straight to its engine."""

    routed_s: float
    direct_s: float


def fit_router(samples: Sequence[RouterSample]) -> float:
    """The router's hop: the median of routed minus direct, floored at 0."""
    if not samples:
        raise ValueError("no router samples")
    return max(0.0, statistics.median(s.routed_s - s.direct_s for s in samples))


def fit_transfer(samples: Sequence[PullSample], fit: StepFit, prefill_base_s: float) -> float:
    """Seconds per prompt token of a KV pull: what a decode hop's TTFT has beyond its one step
    and ``prefill_base_s``, least squares through the origin, floored at 0."""
    if not samples:
        raise ValueError("no P/D samples")
    costs = fit.costs
    x = np.array([s.prompt_tokens for s in samples], dtype=float)
    extra = np.array(
        [s.ttft_s - costs.decode_hop_s(s.prompt_tokens) - prefill_base_s for s in samples]
    )
    return max(0.0, float(x @ extra / (x @ x)))


# ---- what is measured --------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One closed-loop load on the step recorder."""

    concurrency: int
    prompt_chars: int
    max_tokens: int  # the middle of each request's answer length (0.5x..1.5x)
    requests: int
    # A prefix of this many characters every prompt of the load starts with (cached after the
    # first few): steps whose prompts attend to a cached prefix.
    shared_chars: int = 0


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    loads: tuple[Load, ...]
    # One lone request / P/D hand-off each, spread over the gaps between loads.
    ttft_chars: tuple[int, ...]
    pull_chars: tuple[int, ...]
    # Lone requests through a router and straight to its engine, one of each a size.
    router_chars: tuple[int, ...]
    tokenize_per_workload: int
    # Launches of the real command; with none, the step recorder's own launch stands in (the
    # same engine, plus this module's imports: ~0.5 s more), to keep quick runs quick.
    cold_starts: int


# Longest prompt: 1800 characters + framing stays under 2048 tokens with 1.5 x 64 answer tokens.
FULL = Plan(
    loads=tuple(
        Load(c, chars, max_tokens, requests=2 * c)
        for c in (1, 2, 4, 8, 12, 16)
        for chars, max_tokens in ((40, 128), (500, 96), (1800, 64))
    )
    # Questions after a cached prefix (a system prompt, a chat's history): the bench
    # workloads' shape. At most 1,300 + 400 characters and 1.5 x 64 answer tokens: under 2048.
    + tuple(
        Load(c, chars, 64, requests=3 * c, shared_chars=shared)
        for c in (1, 4, 12)
        for chars, shared in ((40, 600), (400, 600), (40, 1300), (400, 1300))
    ),
    # Mostly short and medium prompts, as the bench workloads' uncached parts are: the median
    # gap is what the simulator adds to every first token.
    ttft_chars=(40, 120, 240, 500, 960, 1500) * 4,
    pull_chars=(120, 500, 1000, 1500) * 3,
    router_chars=(40, 240, 500, 960) * 4,
    tokenize_per_workload=200,
    cold_starts=3,
)
QUICK = Plan(
    loads=(
        Load(1, 40, 24, 2),
        Load(4, 500, 16, 4),
        Load(16, 40, 16, 16),
        Load(4, 1200, 8, 4),
        Load(2, 40, 8, 4, shared_chars=800),
    ),
    ttft_chars=(40, 500, 1200),
    pull_chars=(500, 1200),
    router_chars=(40, 500),
    tokenize_per_workload=5,
    cold_starts=0,
)
# Before recording counts: torch's first calls and the allocator's growth are not a step cost.
WARM_UP = Load(2, 500, 8, 2)


class _Prompts:
    """Chat requests of about ``chars`` characters that share no KV block with any other: a
    random hex tag comes first, inside the first block (steps must compute every prompt
    token; the prefix cache is the simulator's to model); with ``shared_chars``, after a
    prefix of that many characters they all share."""

    name = "calibration"

    def __init__(
        self, rng: random.Random, chars: int, max_tokens: int, shared_chars: int = 0
    ) -> None:
        self._rng = rng
        self._chars = chars
        self._max_tokens = max_tokens
        self._shared = ""
        if shared_chars:
            tag = f"{rng.getrandbits(48):012x} "
            self._shared = tag + words(rng, max(0, shared_chars - len(tag))) + " "

    def next(self) -> RequestSpec:
        tag = f"{self._rng.getrandbits(48):012x} "
        text = self._shared + tag + words(self._rng, max(0, self._chars - len(tag)))
        low, high = max(1, self._max_tokens // 2), max(1, self._max_tokens * 3 // 2)
        return RequestSpec(
            [{"role": "user", "content": text}], self._rng.randint(low, high), kind="calibration"
        )

    def take(self, n: int) -> list[RequestSpec]:
        return [self.next() for _ in range(n)]


class _Listed:
    """A workload of given requests, in order."""

    name = "calibration"

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self._specs: Iterator[RequestSpec] = iter(specs)

    def next(self) -> RequestSpec:
        return next(self._specs)


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
    costs = dataclasses.replace(
        fit.costs,
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
        SERVED_NAME, _source(engine, quick), costs, shape, router_s=fit_router(router)
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


def _launch(port: int, events: int, replay: int, *, pd: bool) -> list[str]:
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
    flags = _launch(port, events, replay, pd=True)[len(_ENGINE_COMMAND) + 1 :]
    say("starting the step recorder (the local fleet's engine, its steps timed)")
    argv = [sys.executable, "-m", RECORDER_MODULE, str(out), *flags]
    child, launch_s = _start(supervisor, "step-recorder", argv, port)
    since, ttft, gaps, pulls, tokenization = asyncio.run(
        _session(f"http://{HOST}:{port}", plan, rng, seed, say)
    )
    pool = _kv_pool(port)
    supervisor.stop(child, grace_s=10.0)
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"the step recorder left no steps ({e}):\n{child.tail()}") from e
    steps = _step_records(data["steps"], since)
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


async def _session(
    url: str, plan: Plan, rng: random.Random, seed: int, say: Progress
) -> tuple[
    float, tuple[TtftSample, ...], tuple[LoadGap, ...], tuple[PullSample, ...], tuple[float, int]
]:
    """The warm-up, then each load followed by its share of lone requests and P/D hand-offs:
    interleaved, because this machine's speed drifts by tens of percent within a minute and
    ``prefill_base_s`` and ``transfer_per_token_s`` are differences against the step fit."""
    await _run_load(url, WARM_UP, rng)
    since = time.time()
    ttft: list[TtftSample] = []
    gaps: list[LoadGap] = []
    pulls: list[PullSample] = []
    n = len(plan.loads)
    # Loopback only, and never through a proxy from the environment.
    async with httpx.AsyncClient(base_url=url, timeout=60.0, trust_env=False) as client:
        for i, load in enumerate(plan.loads):
            say(
                f"load {i + 1}/{n}: {load.concurrency} concurrent, ~{load.prompt_chars} prompt "
                f"chars, ~{load.max_tokens} tokens each"
            )
            before = await _engine_ttft(client)
            records = await _run_load(url, load, rng)
            gaps.append(_load_gap(load, records, before, await _engine_ttft(client)))
            ttft += await _ttft_samples(client, url, plan.ttft_chars[i::n], rng)
            pulls += await _pull_samples(client, plan.pull_chars[i::n], rng)
        say(f"tokenizing {plan.tokenize_per_workload} requests of each bench workload")
        tokenization = await _tokenization(client, plan.tokenize_per_workload, seed)
        _check_pulls((await client.get("/metrics")).text, len(pulls))
    return since, tuple(ttft), tuple(gaps), tuple(pulls), tokenization


async def _run_load(url: str, load: Load, rng: random.Random) -> list[RequestRecord]:
    prompts = _Prompts(
        random.Random(rng.getrandbits(64)), load.prompt_chars, load.max_tokens, load.shared_chars
    )
    return await _run(url, prompts.take(load.requests), load.concurrency)


async def _run(
    url: str, specs: Sequence[RequestSpec], concurrency: int, model: str = SERVED_NAME
) -> list[RequestRecord]:
    """``specs`` through the load generator (closed loop); every one must succeed."""
    config = RunConfig(
        url + "/v1",
        model,
        concurrency=concurrency,
        max_requests=len(specs),
        timeout_s=120.0,
        ignore_eos=True,
    )
    result = await Runner(config, _Listed(specs)).run()
    failed = [r for r in result.records if not r.ok]
    if failed:
        raise CalibrationError(
            f"{len(failed)} of {len(specs)} calibration requests failed, e.g. "
            f"{failed[0].error}: {failed[0].detail}"
        )
    return sorted(result.records, key=lambda r: r.index)


def _step_records(raw: Sequence[Sequence[float]], since_wall: float) -> list[StepRecord]:
    """Steps that ran work, each costing the time to the next step's start; steps after which
    the engine went idle have no next start and are left out."""
    records = []
    for this, after in itertools.pairwise(raw):
        wall, start, _end, running, kv, prefill, context, pairs, busy = this
        if wall < since_wall or not busy or running + prefill == 0:
            continue
        seconds = after[1] - start
        records.append(
            StepRecord(int(running), int(kv), int(prefill), seconds, int(context), pairs)
        )
    return records


# The local fleet's smallest service: one tier, one reference engine, the router before it.
_ROUTED_SERVICE = "calibrate"


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
        "metadata": {"name": _ROUTED_SERVICE, "namespace": "default"},
        "spec": {"tiers": [tier]},
    }
    fleet = LocalFleet(parse_service(manifest, "calibrate's router"), tmp / "routed", 0)
    say("starting a router in front of a reference engine, as the local fleet runs them")
    fleet.start()
    try:
        routed = f"http://{HOST}:{fleet.router_port}"
        direct = f"http://{HOST}:{fleet.replicas[0].port}"
        return asyncio.run(_router_pairs(routed, direct, chars, rng))
    finally:
        fleet.stop()


async def _router_pairs(
    routed: str, direct: str, chars: Sequence[int], rng: random.Random
) -> tuple[RouterSample, ...]:
    # Warm both paths first: the router's first request opens its connection to the engine.
    for url, model in ((routed, _ROUTED_SERVICE), (direct, SERVED_NAME)):
        await _run(url, _Prompts(rng, 200, 4).take(2), 1, model)
    samples = []
    for i, c in enumerate(chars):
        prompts = _Prompts(rng, c, 16).take(2)
        order = [(routed, _ROUTED_SERVICE), (direct, SERVED_NAME)]
        if i % 2:
            order.reverse()
        ttft: dict[str, float | None] = {}
        for (url, model), spec in zip(order, prompts, strict=True):
            (record,) = await _run(url, [spec], 1, model)
            ttft[url] = record.ttft_s
        routed_s, direct_s = ttft[routed], ttft[direct]
        if routed_s is not None and direct_s is not None:
            samples.append(RouterSample(routed_s, direct_s))
    return tuple(samples)


def _cold_starts(
    supervisor: Supervisor, starts: int, say: Progress
) -> list[tuple[float, tuple[int, int]]]:
    """Launches of the local fleet's real (unified) engine command: per start, the seconds to
    ready and the KV pool it reports."""
    out = []
    for i in range(starts):
        port, events, replay = free_ports(3, HOST)
        say(f"cold start {i + 1}/{starts} of the engine")
        argv = _launch(port, events, replay, pd=False)
        child, seconds = _start(supervisor, f"engine-{i}", argv, port)
        out.append((seconds, _kv_pool(port)))
        supervisor.stop(child, grace_s=10.0)
    return out


async def _ttft_samples(
    client: httpx.AsyncClient, url: str, chars: Sequence[int], rng: random.Random
) -> tuple[TtftSample, ...]:
    """One request at a time, the engine's TTFT histogram read around each: its own count."""
    samples = []
    for c in chars:
        before = await _engine_ttft(client)
        (record,) = await _run(url, [_Prompts(rng, c, 16).next()], 1)
        total, count = await _engine_ttft(client)
        if count != before[1] + 1:
            raise CalibrationError(f"the engine counted {count - before[1]:g} TTFTs for one")
        if record.ttft_s is not None and record.prompt_tokens:
            engine_s = total - before[0]
            samples.append(
                TtftSample(record.prompt_tokens, record.cached_tokens or 0, record.ttft_s, engine_s)
            )
    return tuple(samples)


async def _engine_ttft(client: httpx.AsyncClient) -> tuple[float, float]:
    return ttft_totals((await client.get("/metrics")).text)


def ttft_totals(metrics: str) -> tuple[float, float]:
    """Sum and count of the ``vllm:time_to_first_token_seconds`` histogram in an engine's
    ``/metrics`` text."""
    total = sum(v for _, v in _samples(metrics, "vllm:time_to_first_token_seconds_sum"))
    count = sum(v for _, v in _samples(metrics, "vllm:time_to_first_token_seconds_count"))
    return total, count


def _load_gap(
    load: Load,
    records: Sequence[RequestRecord],
    before: tuple[float, float],
    after: tuple[float, float],
) -> LoadGap:
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    count = after[1] - before[1]
    if not ttfts or count != len(records):
        raise CalibrationError(
            f"a load of {len(records)} requests: {len(ttfts)} client TTFTs, {count:g} counted "
            "by the engine"
        )
    return LoadGap(load.concurrency, statistics.fmean(ttfts), (after[0] - before[0]) / count)


async def _pull_samples(
    client: httpx.AsyncClient, chars: Sequence[int], rng: random.Random
) -> tuple[PullSample, ...]:
    """The router's two hops per request: prefill (pin the KV), then decode (pull it)."""
    samples = []
    for c in chars:
        body = _Prompts(rng, c, 16).next().body(SERVED_NAME, ignore_eos=True)
        hop = prefill_request(body, SERVED_NAME)
        answer = _json_of(await client.post("/v1/chat/completions", json=hop))
        params = kv_params_of(answer)
        if params is None:
            raise CalibrationError(f"the prefill hop pinned no KV: {answer}")
        ttft = await _stream_ttft(client, decode_request(body, SERVED_NAME, params))
        if ttft is not None:
            samples.append(PullSample(int(answer["usage"]["prompt_tokens"]), ttft))
    return tuple(samples)


async def _stream_ttft(client: httpx.AsyncClient, body: dict[str, Any]) -> float | None:
    """Seconds to the first chunk with content, as ``fleetpilot bench`` counts it; the stream is
    read to its end so the engine finishes the request rather than aborting it."""
    start = time.monotonic()
    first: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code >= 400:
            detail = (await response.aread()).decode(errors="replace")
            raise CalibrationError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]" or first is not None:
                continue
            chunk = json.loads(data)
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                first = time.monotonic() - start
    return first


def fit_tokenization(samples: Sequence[tuple[int, int, int]]) -> tuple[float, int]:
    """``(chars_per_token, message_tokens)`` from ``(messages, content bytes, prompt tokens)``
    per prompt: tokens = message_tokens x (messages + 1, the answer's header) + bytes /
    chars_per_token, least squares - how ``simulate.tokens.SimTokenizer`` counts a chat."""
    a = np.array([[m + 1, b] for m, b, _ in samples], dtype=float)
    y = np.array([t for _, _, t in samples], dtype=float)
    (per_message, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_byte <= 0:
        raise CalibrationError("the tokenizer's length does not grow with the text")
    return float(1.0 / per_byte), max(0, round(float(per_message)))


async def _tokenization(
    client: httpx.AsyncClient, per_workload: int, seed: int
) -> tuple[float, int]:
    """How the engine's tokenizer and chat template count the bench workloads' prompts: bytes
    of content per token and tokens a message adds (:func:`fit_tokenization`)."""
    samples: list[tuple[int, int, int]] = []
    for name in sorted(WORKLOADS):
        workload = make_workload(name, seed)
        for _ in range(per_workload):
            messages = workload.next().messages
            ids = _json_of(
                await client.post("/tokenize", json={"model": SERVED_NAME, "messages": messages})
            )["tokens"]
            content = sum(len(m["content"].encode("utf-8")) for m in messages)
            samples.append((len(messages), content, len(ids)))
    return fit_tokenization(samples)


def _json_of(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise CalibrationError(
            f"{response.request.method} {response.request.url.path}: HTTP "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response.json()


def _samples(metrics: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == name
    ]


def _check_pulls(metrics: str, expected: int) -> None:
    """Every decode hop must have pulled: a fallback would time a local prefill instead."""
    pulls = sum(v for _, v in _samples(metrics, "fleetpilot:kv_transfer_pulls_total"))
    if pulls < expected:
        raise CalibrationError(f"only {pulls:g} of {expected} P/D decode hops pulled their KV")


def _kv_pool(port: int) -> tuple[int, int]:
    """(blocks, block size) the engine on ``port`` reports in ``vllm:cache_config_info``."""
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        metrics = client.get(f"http://{HOST}:{port}/metrics").text
    for labels, _ in _samples(metrics, "vllm:cache_config_info"):
        return int(labels["num_gpu_blocks"]), int(labels["block_size"])
    raise CalibrationError("the engine's /metrics has no vllm:cache_config_info")


# ---- the step recorder (runs as ``python -m``, in the engine's process) -----------------------


def _composition(plan: SchedulerOutput) -> tuple[int, int, int, int, float]:
    """(decoding sequences, their KV tokens, prompt tokens computed, the prefilling
    sequences' tokens already computed or cached, their attention pairs) of a step's plan."""
    running = kv = prefill = context = 0
    pairs = 0.0
    for s in plan.scheduled:
        r = s.request
        decoding = r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1
        if decoding and s.num_new_tokens == 1:
            running += 1
            kv += r.num_tokens
        else:
            new, prior = s.num_new_tokens, r.num_computed_tokens
            prefill += new
            context += prior
            pairs += new * (prior + new / 2)
    return running, kv, prefill, context, pairs


class _StepRecorder:
    """Wraps an engine's ``step`` and its scheduler's ``schedule`` from outside (the engine has
    no hook for it), noting per step its wall-clock and monotonic start, end, composition and
    whether work remained after it (the runner then steps again at once)."""

    def __init__(self) -> None:
        self.steps: list[list[float]] = []
        self.engine: dict[str, Any] = {}
        self._plan: tuple[int, int, int, int, float] = (0, 0, 0, 0, 0.0)

    def attach(self, engine: LLMEngine) -> LLMEngine:
        import torch  # the engine process has it loaded already

        schedule, step = engine.scheduler.schedule, engine.step

        def planned() -> SchedulerOutput:
            plan = schedule()
            self._plan = _composition(plan)
            return plan

        def timed() -> list[RequestOutput]:
            self._plan = (0, 0, 0, 0, 0.0)
            wall, start = time.time(), time.perf_counter()
            outputs = step()
            end = time.perf_counter()
            busy = engine.has_unfinished_requests()
            self.steps.append([wall, start, end, *self._plan, float(busy)])
            return outputs

        # Instance attributes shadow the methods: the runner and step() look them up there.
        engine.scheduler.schedule = planned  # type: ignore[method-assign]
        engine.step = timed  # type: ignore[method-assign]
        config = engine.config
        self.engine = {
            "num_blocks": engine.kv.num_blocks,
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_prefix_caching": config.enable_prefix_caching,
            "torch_threads": torch.get_num_threads(),
        }
        return engine


def _record_main(argv: Sequence[str]) -> int:
    """``python -m fleetpilot.simulate.calibrate OUT ENGINE_FLAGS...``: serve as
    ``fleetpilot engine --backend reference ENGINE_FLAGS...`` does, then write the engine's
    settings and its steps to OUT (JSON) on shutdown."""
    from fleetpilot.engine.reference import server as engine_server
    from fleetpilot.logs import configure_logging

    if not argv:
        print("usage: python -m fleetpilot.simulate.calibrate OUT ENGINE_FLAGS...", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="fleetpilot engine --backend reference (recording)")
    engine_server.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    configure_logging(args.log_level, args.log_format)
    server = engine_server.build_server(args)
    recorder = _StepRecorder()
    build = server.engine_factory
    server.engine_factory = lambda: recorder.attach(build())
    code = asyncio.run(engine_server.serve(server))
    Path(argv[0]).write_text(json.dumps({"engine": recorder.engine, "steps": recorder.steps}))
    return code


# ---- the command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output", required=True, type=Path, help="where to write the profile (JSON)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few samples of each kind (seconds): checks the machinery, not a profile to trust",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")


def run(args: argparse.Namespace) -> int:
    """Measure, write the profile, print the coefficients and how well they fit."""
    try:
        calibration = measure(
            seed=args.seed,
            quick=args.quick,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.output.write_text(json.dumps(calibration.profile.to_json(), indent=2) + "\n")
    print(report(calibration))
    print(f"wrote {args.output}")
    return 0


def report(c: Calibration) -> str:
    """The coefficients, and how well each part of the model fits what was measured."""
    costs, shape, fit = c.profile.costs, c.profile.shape, c.fit
    lines = [
        f"profile {c.profile.name}: {c.profile.source}",
        f"measured in {c.elapsed_s:.0f} s",
        "",
        f"step costs: {fit.steps} steps ({fit.dropped} outliers dropped), R^2 {fit.r2:.3f}",
        f"  decode_base_s          {costs.decode_base_s:.6g}",
        f"  decode_per_seq_s       {costs.decode_per_seq_s:.6g}",
        f"  decode_per_kv_token_s  {costs.decode_per_kv_token_s:.6g}",
        f"  prefill_per_token_s    {costs.prefill_per_token_s:.6g}",
        f"  prefill_per_context_token_s {costs.prefill_per_context_token_s:.6g}",
        f"  prefill_per_pair_s     {costs.prefill_per_pair_s:.6g}",
        "  step kind   steps  measured ms  model ms  median |error|",
    ]
    for r in fit.residuals:
        lines.append(
            f"  {r.kind:<9} {r.steps:>7}  {r.measured_s * 1e3:>11.2f}  {r.model_s * 1e3:>8.2f}"
            f"  {r.median_rel_error:>13.1%}"
        )
    max_batched = shape.max_num_batched_tokens
    ttft_errors = [
        abs(prefill_s(fit, s.prompt_tokens - s.cached_tokens, max_batched, s.cached_tokens)
            + costs.prefill_base_s - s.ttft_s) / s.ttft_s
        for s in c.ttft
    ]  # fmt: skip
    pull_errors = [
        abs(
            costs.decode_hop_s(s.prompt_tokens)
            + costs.prefill_base_s
            + costs.transfer_per_token_s * s.prompt_tokens
            - s.ttft_s
        )
        / s.ttft_s
        for s in c.pulls
    ]
    by_streams: dict[int, list[float]] = {}
    for g in c.gaps:
        by_streams.setdefault(g.concurrency, []).append(g.client_mean_s - g.engine_mean_s)
    lines += [
        "",
        f"prefill_base_s         {costs.prefill_base_s:.6g}  (client minus engine TTFT, median "
        f"over {len(c.ttft)} lone requests; TTFT median |error| "
        f"{statistics.median(ttft_errors):.1%})",
        f"first_token_per_stream_s {costs.first_token_per_stream_s:.6g}  (client minus engine "
        "mean TTFT per load, ms, by streams: "
        + ", ".join(f"{n}: {statistics.fmean(v) * 1e3:.1f}" for n, v in sorted(by_streams.items()))
        + ")",
        f"transfer_per_token_s   {costs.transfer_per_token_s:.6g}  ({len(c.pulls)} P/D "
        f"hand-offs; decode TTFT median |error| {statistics.median(pull_errors):.1%})",
        f"router_s               {c.profile.router_s:.6g}  (median of {len(c.router)} lone "
        "requests through the router minus one straight to its engine)",
        f"cold_start_s           {costs.cold_start_s:.3f}  (median of "
        + ", ".join(f"{s:.2f}" for s in c.cold_starts_s)
        + ")",
        "",
        f"shape: {shape.kv_tokens} KV tokens in blocks of {shape.block_size}, "
        f"max_num_seqs {shape.max_num_seqs}, max_num_batched_tokens {max_batched}, "
        f"{shape.chars_per_token:.4f} chars/token, {shape.message_tokens} tokens a message",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(_record_main(sys.argv[1:]))
