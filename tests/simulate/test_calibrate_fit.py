"""The calibration's fits (``simulate.calibrate_fit``, pure): on synthetic records and samples
whose coefficients are known, so every number asserted is one the fit must give back."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

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
    fit_tokenization,
    fit_transfer,
    nnls,
    prefill_s,
    step_records,
)

# decode_base_s, decode_per_seq_s, decode_per_kv_token_s, prefill_per_token_s,
# prefill_per_context_token_s, prefill_per_pair_s
TRUE = (3e-3, 4e-4, 5e-7, 6e-5, 1.5e-6, 3e-8)


def synthetic(
    seed: int, n: int = 2000, noise: float = 0.05, outliers: float = 0.03
) -> tuple[list[StepRecord], int]:
    """Steps of every kind priced by TRUE, with multiplicative noise and some 10x outliers
    (the machine stalling); also how many outliers there are."""
    rng = random.Random(seed)
    records, injected = [], 0
    for _ in range(n):
        kind = rng.choice(["decode", "prefill", "mixed"])
        running = 0 if kind == "prefill" else rng.randint(1, 16)
        kv = sum(rng.randint(20, 1900) for _ in range(running))
        prefill = 0 if kind == "decode" else rng.randint(1, 512)
        # Half the prompts after a cached prefix or an earlier chunk.
        prior = 0 if kind == "decode" or rng.random() < 0.5 else rng.randint(16, 1500)
        pairs = prefill * (prior + prefill / 2)
        seconds = float(np.array(TRUE) @ [1, running, kv, prefill, prior, pairs])
        seconds *= math.exp(rng.gauss(0, noise))
        if rng.random() < outliers:
            seconds *= 10
            injected += 1
        records.append(StepRecord(running, kv, prefill, seconds, prior, pairs))
    return records, injected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_known_coefficients_from_noisy_steps(seed: int) -> None:
    records, injected = synthetic(seed)
    fit = fit_step_costs(records)
    assert fit.coefficients == pytest.approx(TRUE, rel=0.1)
    # The stalls, and (nearly) only them, are dropped: they would pull every coefficient up.
    assert injected <= fit.dropped <= injected + len(records) // 100
    assert fit.steps == len(records) - fit.dropped
    assert fit.r2 > 0.9
    kinds = {r.kind: r.steps for r in fit.residuals}
    assert {"decode", "prefill", "mixed", "  x1", "  x2-3", "  x4-7", "  x8-11", "  x12+"} == set(
        kinds
    )
    assert kinds["decode"] + kinds["prefill"] + kinds["mixed"] == fit.steps
    assert sum(n for kind, n in kinds.items() if kind.startswith("  x")) == kinds["decode"]
    for r in fit.residuals:
        assert r.median_rel_error < 0.1  # the noise is 5%
        assert r.model_s == pytest.approx(r.measured_s, rel=0.05)


def test_fit_never_returns_negative_coefficients() -> None:
    """Steps that get *cheaper* with more sequences: least squares would price a sequence
    negatively; the fit prices it at zero and still explains the rest."""
    rng = random.Random(7)
    records = []
    for _ in range(300):
        running, prefill = rng.randint(0, 16), rng.randint(0, 512)
        seconds = 5e-3 - 2e-4 * running + 6e-5 * prefill
        records.append(StepRecord(running, 0, prefill, seconds * math.exp(rng.gauss(0, 0.02))))
    a = np.array([[1.0, r.running, r.kv_tokens, r.prefill_tokens] for r in records])
    y = np.array([r.seconds for r in records])
    unconstrained = np.linalg.lstsq(a, y, rcond=None)[0]
    assert unconstrained[1] < 0  # what the constraint is there for

    fit = fit_step_costs(records)
    assert min(fit.coefficients) >= 0
    assert fit.decode_per_seq_s == 0
    assert fit.decode_base_s > 0
    assert fit.prefill_per_token_s == pytest.approx(6e-5, rel=0.2)


@pytest.mark.parametrize("seed", range(100))
def test_nnls_finds_the_constrained_optimum(seed: int) -> None:
    """Against brute force: the best non-negative least-squares solution of any subset of the
    columns (the optimum is one of them). Positive, strongly correlated columns, as step
    records make: there a variable that entered must sometimes leave again."""
    rng = np.random.default_rng(seed)
    shared = np.abs(rng.normal(size=(30, 1)))
    a = 0.3 * np.abs(rng.normal(size=(30, 4))) + shared
    b = a @ rng.normal(size=4) + 0.05 * rng.normal(size=30)
    x = nnls(a, b)
    assert (x >= 0).all()
    best = float(np.linalg.norm(b))
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (sub >= 0).all():
                best = min(best, float(np.linalg.norm(a[:, cols] @ sub - b)))
    assert np.linalg.norm(a @ x - b) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_fit_refuses_too_few_or_bad_steps() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        fit_step_costs([StepRecord(1, 10, 0, 0.003)] * 7)
    with pytest.raises(ValueError, match="positive"):
        fit_step_costs([StepRecord(1, 10, 0, 0.003)] * 8 + [StepRecord(1, 10, 0, 0.0)])


def exact_fit(
    base: float = 3e-3, per_token: float = 5e-5, per_context: float = 0.0, per_pair: float = 0.0
) -> StepFit:
    return StepFit(
        decode_base_s=base,
        decode_per_seq_s=4e-4,
        decode_per_kv_token_s=5e-7,
        prefill_per_token_s=per_token,
        r2=1.0,
        steps=0,
        dropped=0,
        residuals=(),
        prefill_per_context_token_s=per_context,
        prefill_per_pair_s=per_pair,
    )


def test_modeled_prefill_is_one_step_per_chunk_of_the_token_budget() -> None:
    fit = exact_fit()
    assert prefill_s(fit, 1, 512) == pytest.approx(3e-3 + 5e-5)
    assert prefill_s(fit, 512, 512) == pytest.approx(3e-3 + 512 * 5e-5)
    assert prefill_s(fit, 1300, 512) == pytest.approx(3 * 3e-3 + 1300 * 5e-5)


def test_a_modeled_prefill_attends_to_its_cached_prefix_and_earlier_chunks() -> None:
    fit = exact_fit(per_context=2e-6, per_pair=4e-8)
    # 100 tokens after 1,000 cached: one step reading 1,000 prior tokens in 100 x 1,050 pairs.
    one = 3e-3 + 100 * 5e-5 + 1000 * 2e-6 + 100 * 1050 * 4e-8
    assert prefill_s(fit, 100, 512, cached=1000) == pytest.approx(one)
    # 600 uncached tokens: a chunk of 512 attending to itself, then 88 after those 512.
    first = 3e-3 + 512 * 5e-5 + 512 * 256 * 4e-8
    second = 3e-3 + 88 * 5e-5 + 512 * 2e-6 + 88 * (512 + 44) * 4e-8
    assert prefill_s(fit, 600, 512) == pytest.approx(first + second)


def test_prefill_base_is_the_median_client_ttft_beyond_the_engines_own() -> None:
    rng = random.Random(3)
    samples = []
    for prompt, cached in [(40, 0), (500, 0), (1300, 0), (1100, 1024), (1900, 0)] * 5:
        engine = 0.002 + prompt * 4e-5
        ttft = engine + 0.005 + rng.gauss(0, 0.0005)
        samples.append(TtftSample(prompt, cached, ttft, engine))
    samples.append(TtftSample(40, 0, 5.0, 0.003))  # one stall does not move a median
    assert fit_prefill_base(samples) == pytest.approx(0.005, rel=0.1)
    # A client that saw the token before the engine's clock stopped: no negative overhead.
    fast = [TtftSample(1000, 0, 0.001, 0.002)] * 3
    assert fit_prefill_base(fast) == 0.0
    with pytest.raises(ValueError, match="no TTFT"):
        fit_prefill_base([])


def test_per_stream_is_the_loads_gap_beyond_the_base_per_other_stream() -> None:
    base, per_stream = 0.005, 0.0007
    rng = random.Random(4)
    gaps = [
        LoadGap(c, engine + base + per_stream * (c - 1) + rng.gauss(0, 0.0002), engine)
        for c in (1, 2, 4, 8, 12, 16)
        for engine in (0.01, 0.05)
    ]
    assert fit_per_stream(gaps, base) == pytest.approx(per_stream, rel=0.1)
    # Gaps that shrink with load: no negative share.
    shrinking = [LoadGap(c, 0.02 - 0.001 * c, 0.01) for c in (2, 4, 8)]
    assert fit_per_stream(shrinking, base) == 0.0
    with pytest.raises(ValueError, match="more than one stream"):
        fit_per_stream([LoadGap(1, 0.02, 0.01)], base)


def test_router_hop_is_the_median_of_routed_minus_direct() -> None:
    samples = [RouterSample(0.008 + d, 0.008) for d in (0.001, 0.002, 0.003, 0.5)]
    samples.append(RouterSample(0.009, 0.010))  # one drifted the other way
    assert fit_router(samples) == pytest.approx(0.002)
    assert fit_router([RouterSample(0.005, 0.006)]) == 0.0
    with pytest.raises(ValueError, match="no router"):
        fit_router([])


def test_transfer_is_the_decode_hops_extra_time_per_prompt_token() -> None:
    fit = exact_fit()
    base, per_token = 0.007, 2e-5
    rng = random.Random(5)
    samples = [
        PullSample(p, fit.costs.step_s(0, 0, 1) + base + per_token * p + rng.gauss(0, 0.0003))
        for p in [240, 960, 1900] * 4
    ]
    assert fit_transfer(samples, fit, base) == pytest.approx(per_token, rel=0.1)
    assert fit_transfer([PullSample(500, 0.001)], fit, base) == 0.0


def test_a_steps_cost_is_the_time_to_the_next_steps_start() -> None:
    """What separates two tokens: the step and the runner's work after it. Steps before the
    warm-up ended, steps that ran nothing and steps after which the engine idled are out."""
    raw = [
        # wall, start, end, running, kv, prefill, prefill context, pairs, busy after
        [100.0, 1.000, 1.003, 0, 0, 512, 0, 131072, 1],  # warm-up
        [200.0, 1.010, 1.013, 1, 41, 128, 600, 84992, 1],
        [200.1, 1.030, 1.033, 2, 643, 0, 0, 0, 0],  # then idle: the next start is not its cost
        [200.5, 1.500, 1.500, 0, 0, 0, 0, 0, 1],  # nothing scheduled
        [200.6, 1.510, 1.514, 1, 602, 0, 0, 0, 1],
        [200.7, 1.516, 1.519, 1, 603, 0, 0, 0, 1],  # the last: no next start
    ]
    records = step_records(raw, 150.0)
    assert [
        (r.running, r.kv_tokens, r.prefill_tokens, r.prefill_context, r.prefill_pairs)
        for r in records
    ] == [(1, 41, 128, 600, 84992), (1, 602, 0, 0, 0)]
    assert [r.seconds for r in records] == pytest.approx([0.020, 0.006])


def test_tokenization_fit_recovers_a_templates_tokens_and_the_bytes_per_token() -> None:
    """Chats counted as the simulator counts them - 12 tokens a message (and the answer's
    header), 1.3 bytes a token - give those two numbers back."""
    rng = random.Random(3)
    samples = []
    for _ in range(200):
        messages = rng.randint(1, 9)
        content = rng.randint(10, 5000)
        samples.append((messages, content, 12 * (messages + 1) + round(content / 1.3)))
    chars, per_message = fit_tokenization(samples)
    assert per_message == 12
    assert chars == pytest.approx(1.3, rel=1e-3)
