"""``fleetpilot simulate calibrate``: the step fit (pure), the step recorder's accounting on a
real engine, and one quick calibration of the real engine over HTTP.

No assertion is about how fast anything ran: the machine is noisy. The fits are checked on
synthetic records whose coefficients are known; the real calibration only for what must hold
on any machine (positive costs, the engine's own pool and limits, a JSON round trip).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from fleetpilot.simulate import calibrate as cal
from fleetpilot.simulate.calibrate import (
    Calibration,
    CalibrationError,
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
)
from fleetpilot.simulate.profile import MeasuredProfile, load_profile

if TYPE_CHECKING:
    from fleetpilot.engine.reference.engine import LLMEngine

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
    records = cal._step_records(raw, 150.0)
    assert [
        (r.running, r.kv_tokens, r.prefill_tokens, r.prefill_context, r.prefill_pairs)
        for r in records
    ] == [(1, 41, 128, 600, 84992), (1, 602, 0, 0, 0)]
    assert [r.seconds for r in records] == pytest.approx([0.020, 0.006])


# ---- on the real engine ---------------------------------------------------------------------


def fleet_engine() -> LLMEngine:
    """The local fleet's unified engine, built in this process by the engine's own settings
    code from the flags the fleet starts it with (torch is imported only here)."""
    from fleetpilot.engine.reference import settings

    argv = cal._launch(8000, 5557, 5558, pd=False)
    assert argv[1:6] == ["-m", "fleetpilot", "engine", "--backend", "reference"]

    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    _, factory = settings.settings_from_args(parser.parse_args(argv[6:]))
    return factory()


def test_the_recorder_counts_what_each_step_ran() -> None:
    """Two prompts (40 and 600 tokens, 3 answer tokens each) through the fleet's engine (token
    budget 512): the recorder must see the chunked prefill, the mixed step and the decodes
    with their KV tokens, exactly as the scheduler ran them."""
    from fleetpilot.engine.reference.sampling import SamplingParams

    engine = fleet_engine()
    recorder = cal._StepRecorder()
    assert recorder.attach(engine) is engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", [1 + i % 200 for i in range(40)], params)
    engine.add_request("b", [2 + i % 200 for i in range(600)], params)
    while engine.has_unfinished_requests():
        engine.step()
    ran = [(*(int(v) for v in s[3:6]), s[6], s[7], bool(s[8])) for s in recorder.steps]
    assert ran == [
        # a's 40 tokens, b's first 472: each attending to itself
        (0, 0, 512, 0, 40 * 20 + 472 * 236, True),
        # a decodes (40 + 1 tokens of KV) beside b's last 128, after its first 472
        (1, 41, 128, 472, 128 * (472 + 64), True),
        (2, 42 + 601, 0, 0, 0, True),
        (1, 602, 0, 0, 0, False),  # a is done
    ]
    assert all(s[1] <= s[2] for s in recorder.steps)
    assert recorder.engine == {
        "num_blocks": engine.kv.num_blocks,
        "block_size": 16,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": True,
        "torch_threads": 1,
    }


@pytest.fixture(scope="module")
def quick() -> Iterator[Calibration]:
    messages: list[str] = []
    yield cal.measure(seed=0, quick=True, progress=messages.append)
    assert messages  # it said what it was doing


def test_quick_calibration_of_the_real_engine(quick: Calibration) -> None:
    profile = quick.profile
    assert MeasuredProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    costs, shape = profile.costs, profile.shape
    assert costs.decode_base_s > 0
    assert costs.prefill_per_token_s > 0
    assert costs.cold_start_s > 0
    engine = fleet_engine()
    assert shape.kv_tokens == engine.kv.num_blocks * engine.config.block_size
    assert (shape.block_size, shape.max_num_seqs, shape.max_num_batched_tokens) == (16, 16, 512)
    # The byte tokenizer: a token per character of ASCII text, plus BOS per prompt.
    assert 0.95 < shape.chars_per_token < 1.1
    assert 5 <= shape.message_tokens <= 20
    # Every planned sample was taken, and the fit saw every kind of step.
    assert len(quick.ttft) == len(cal.QUICK.ttft_chars)
    assert len(quick.pulls) == len(cal.QUICK.pull_chars)
    assert all(s.cached_tokens == 0 for s in quick.ttft)
    # Each lone request's own engine TTFT, read around it: inside the client's.
    assert all(0 < s.engine_ttft_s < s.ttft_s for s in quick.ttft)
    assert [g.concurrency for g in quick.gaps] == [load.concurrency for load in cal.QUICK.loads]
    assert all(0 < g.engine_mean_s < g.client_mean_s for g in quick.gaps)
    assert costs.first_token_per_stream_s >= 0
    # The router's hop, paired with direct requests: some milliseconds, not seconds.
    assert len(quick.router) == len(cal.QUICK.router_chars)
    assert all(0 < s.direct_s < 5 and 0 < s.routed_s < 5 for s in quick.router)
    assert 0 <= profile.router_s < 1
    assert {r.kind for r in quick.fit.residuals} >= {"decode", "prefill", "mixed"}
    assert "torch threads 1" in profile.source
    assert "--quick" in profile.source


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cal.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_writes_a_profile_the_simulator_loads(
    quick: Calibration,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    asked: dict[str, object] = {}

    def measure(**kwargs: object) -> Calibration:
        asked.update(kwargs)
        return quick

    monkeypatch.setattr(cal, "measure", measure)
    out = tmp_path / "profile.json"
    assert cal.run(parse("-o", str(out), "--quick", "--seed", "3")) == 0
    assert (asked["seed"], asked["quick"]) == (3, True)
    assert load_profile(str(out)) == quick.profile
    assert out.read_text().startswith('{\n  "name": ')
    printed = capsys.readouterr().out
    for name in ("decode_base_s", "prefill_base_s", "first_token_per_stream_s", "R^2", "mixed"):
        assert name in printed


def test_cli_reports_a_failed_measurement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def measure(**_: object) -> Calibration:
        raise CalibrationError("the step recorder left no steps")

    monkeypatch.setattr(cal, "measure", measure)
    out = tmp_path / "profile.json"
    assert cal.run(parse("-o", str(out))) == 1
    assert not out.exists()
    assert "error: the step recorder left no steps" in capsys.readouterr().err


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
