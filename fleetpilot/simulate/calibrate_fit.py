"""The calibration's fits (pure: numbers in, coefficients out; no I/O): the six step
coefficients from recorded steps, and the costs around the steps from the samples
:mod:`fleetpilot.simulate.calibrate_measure` takes (the served path of a first token, its growth
with other streams, a P/D pull, the router's hop, the tokenizer's counts).

What each coefficient means and how it is measured: :mod:`fleetpilot.simulate.calibrate`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from fleetpilot.simulate.profile import EngineCosts


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


def fit_tokenization(samples: Sequence[tuple[int, int, int]]) -> tuple[float, int]:
    """``(chars_per_token, message_tokens)`` from ``(messages, content bytes, prompt tokens)``
    per prompt: tokens = message_tokens x (messages + 1, the answer's header) + bytes /
    chars_per_token, least squares - how ``simulate.tokens.SimTokenizer`` counts a chat."""
    a = np.array([[m + 1, b] for m, b, _ in samples], dtype=float)
    y = np.array([t for _, _, t in samples], dtype=float)
    (per_message, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_byte <= 0:
        raise ValueError("the tokenizer's length does not grow with the text")
    return float(1.0 / per_byte), max(0, round(float(per_message)))


def step_records(raw: Sequence[Sequence[float]], since_wall: float) -> list[StepRecord]:
    """The step recorder's rows (:mod:`fleetpilot.simulate.calibrate_record`) from
    ``since_wall`` on as steps that ran work, each costing the time to the next step's start;
    steps after which the engine went idle have no next start and are left out."""
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
