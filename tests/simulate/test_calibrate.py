"""``fleetpilot simulate calibrate``: the step recorder's accounting on a real engine, one
quick calibration of the real engine over HTTP, and the command line. The fits are
``test_calibrate_fit``'s.

No assertion is about how fast anything ran: the machine is noisy. The real calibration is
checked for what must hold on any machine (positive costs, the engine's own pool and limits,
every planned sample taken, a profile made of those samples, a JSON round trip).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fleetpilot.simulate import calibrate as cal
from fleetpilot.simulate.calibrate_fit import (
    fit_per_stream,
    fit_prefill_base,
    fit_router,
    fit_transfer,
)
from fleetpilot.simulate.calibrate_http import CalibrationError
from fleetpilot.simulate.calibrate_measure import Calibration, launch_argv, measure
from fleetpilot.simulate.calibrate_plan import QUICK
from fleetpilot.simulate.calibrate_record import StepRecorder
from fleetpilot.simulate.profile import MeasuredProfile, load_profile

if TYPE_CHECKING:
    from fleetpilot.engine.reference.engine import LLMEngine


def fleet_engine() -> LLMEngine:
    """The local fleet's unified engine, built in this process by the engine's own settings
    code from the flags the fleet starts it with (torch is imported only here)."""
    from fleetpilot.engine.reference import settings

    argv = launch_argv(8000, 5557, 5558, pd=False)
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
    recorder = StepRecorder()
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
        # The tiny preset: K and V x 3 layers x 2 KV heads x 16 dims x 4 bytes, 16 a block.
        "kv_bytes_per_block": 16 * 768,
        # No host tier: the default link a reference engine's would copy back over.
        "host_bandwidth_bytes_per_s": 25e9,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": True,
        "torch_threads": 1,
    }


@pytest.fixture(scope="module")
def progress() -> list[str]:
    """What the quick calibration said it was doing."""
    return []


@pytest.fixture(scope="module")
def quick(progress: list[str]) -> Calibration:
    return measure(seed=0, quick=True, progress=progress.append)


def test_quick_calibration_of_the_real_engine(quick: Calibration, progress: list[str]) -> None:
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
    assert len(quick.ttft) == len(QUICK.ttft_chars)
    assert len(quick.pulls) == len(QUICK.pull_chars)
    assert all(s.cached_tokens == 0 for s in quick.ttft)
    # Each lone request's own engine TTFT, read around it: inside the client's.
    assert all(0 < s.engine_ttft_s < s.ttft_s for s in quick.ttft)
    assert [g.concurrency for g in quick.gaps] == [load.concurrency for load in QUICK.loads]
    assert all(0 < g.engine_mean_s < g.client_mean_s for g in quick.gaps)
    # The router's hop, paired with direct requests: some milliseconds, not seconds.
    assert len(quick.router) == len(QUICK.router_chars)
    assert all(0 < s.direct_s < 5 and 0 < s.routed_s < 5 for s in quick.router)
    assert profile.router_s < 1
    assert {r.kind for r in quick.fit.residuals} >= {"decode", "prefill", "mixed"}
    # The profile is made of these samples, each fit fed its own (the fits are floored at 0,
    # so a sign check could not tell a mixed-up sample from a right one).
    base = fit_prefill_base(quick.ttft)
    assert costs.prefill_base_s == base
    assert costs.first_token_per_stream_s == fit_per_stream(quick.gaps, base)
    assert costs.transfer_per_token_s == fit_transfer(quick.pulls, quick.fit, base)
    assert profile.router_s == fit_router(quick.router)
    assert costs.cold_start_s == statistics.median(quick.cold_starts_s)
    step = quick.fit.costs
    assert (
        costs.decode_base_s,
        costs.decode_per_seq_s,
        costs.decode_per_kv_token_s,
        costs.prefill_per_token_s,
        costs.prefill_per_context_token_s,
        costs.prefill_per_pair_s,
    ) == (
        step.decode_base_s,
        step.decode_per_seq_s,
        step.decode_per_kv_token_s,
        step.prefill_per_token_s,
        step.prefill_per_context_token_s,
        step.prefill_per_pair_s,
    )
    assert "torch threads 1" in profile.source
    assert "--quick" in profile.source
    assert any("step recorder" in m for m in progress)  # it said what it was doing


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
    assert cal.run(parse("--out", str(out), "--quick", "--seed", "3")) == 0
    assert (asked["seed"], asked["quick"]) == (3, True)
    assert load_profile(str(out)) == quick.profile
    assert out.read_text().startswith('{\n  "name": ')
    # The printed coefficients are the written profile's, each on its own labelled line (the
    # labels alone are in the format string, so finding them would prove nothing).
    lines = capsys.readouterr().out.splitlines()
    printed = {
        line.split()[0]: line.split()[1] for line in lines if line.strip() and " " in line.strip()
    }
    costs = quick.profile.costs
    for name in (
        "decode_base_s",
        "decode_per_seq_s",
        "decode_per_kv_token_s",
        "prefill_per_token_s",
        "prefill_per_context_token_s",
        "prefill_per_pair_s",
        "prefill_base_s",
        "first_token_per_stream_s",
        "transfer_per_token_s",
    ):
        assert printed[name] == f"{getattr(costs, name):.6g}", name
    assert printed["router_s"] == f"{quick.profile.router_s:.6g}"
    assert printed["cold_start_s"] == f"{costs.cold_start_s:.3f}"
    fit = quick.fit
    assert f"step costs: {fit.steps} steps ({fit.dropped} outliers dropped), R^2 {fit.r2:.3f}" in (
        lines
    )
    # One row per kind of step, with its count.
    rows = [line.split()[:4] for line in lines]
    for r in fit.residuals:
        row = [r.kind.strip(), str(r.steps), f"{r.measured_s * 1e3:.2f}", f"{r.model_s * 1e3:.2f}"]
        assert rows.count(row) == 1, r.kind
    assert lines[-1] == f"wrote {out}"


def test_cli_reports_a_failed_measurement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def measure(**_: object) -> Calibration:
        raise CalibrationError("the step recorder left no steps")

    monkeypatch.setattr(cal, "measure", measure)
    out = tmp_path / "profile.json"
    assert cal.run(parse("--out", str(out))) == 1
    assert not out.exists()
    assert "error: the step recorder left no steps" in capsys.readouterr().err


def test_cli_takes_out_for_the_profile_file_and_leaves_o_to_formats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``-o``/``--output`` is an output format across the CLI family (``plan -o yaml``), so the
    profile's file is ``--out FILE``, as ``fleetpilot bench``'s document is; ``-o`` is refused
    rather than taken as a path."""
    assert parse("--out", "p.json").out == Path("p.json")
    for flag in ("-o", "--output"):
        with pytest.raises(SystemExit):
            parse(flag, "p.json")
        assert "--out" in capsys.readouterr().err
