"""The liveness verdict of ``fleetpilot up``'s children: probe results over time -> live,
failing, or unresponsive (report once and restart), as a kubelet's liveness probe decides."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fleetpilot.runtime.liveness import Liveness, LivenessProbe, Verdict, due, judge

PROBE = LivenessProbe(period_s=5.0, timeout_s=3.0, failure_threshold=3)
L, F, S, U = Verdict.LIVE, Verdict.FAILING, Verdict.STARTING, Verdict.UNRESPONSIVE


def verdicts(answers: Sequence[bool], probe: LivenessProbe = PROBE) -> list[Verdict]:
    """One process probed every period with these answers, from its start."""
    state = Liveness()
    seen = []
    for i, answered in enumerate(answers):
        state, verdict = judge(state, answered, i * probe.period_s, probe)
        seen.append(verdict)
    return seen


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        # Every probe answered.
        ([True, True, True], [L, L, L]),
        # A frozen child: reported once, at the threshold; the restarted process is not
        # judged until it answers, so a freeze is never reported twice.
        ([True, False, False, False, False, False], [L, F, F, U, S, S]),
        # One or two slow answers in a row are forgiven; the count starts over.
        ([True, False, False, True, False, False, True], [L, F, F, L, F, F, L]),
        # Never answered since its start (an engine loading, a --cold-start): not judged.
        ([False] * 6, [S] * 6),
        # The restarted process answers, then freezes too: reported again, once.
        ([True, False, False, False, True, False, False, False], [L, F, F, U, L, F, F, U]),
    ],
    ids=["live", "frozen", "flaky", "starting", "frozen-twice"],
)
def test_a_verdict_follows_the_probe_results(answers: list[bool], expected: list[Verdict]) -> None:
    """A frozen child is reported and restarted after exactly ``failure_threshold`` failed
    probes in a row, once per freeze; slow answers below the threshold and a process that has
    not answered since it started never restart anything."""
    assert verdicts(answers) == expected


def test_a_threshold_of_one_restarts_at_the_first_failure() -> None:
    """``--liveness-failures 1``: the first failed probe after an answer is the verdict."""
    probe = LivenessProbe(period_s=1.0, timeout_s=1.0, failure_threshold=1)
    assert verdicts([True, False, False], probe) == [L, U, S]


def test_a_child_is_probed_once_a_period() -> None:
    """The first probe is due at once; the next one a period after the last."""
    state = Liveness()
    assert due(state, 100.0, PROBE)
    state, _ = judge(state, True, 100.0, PROBE)
    assert not due(state, 104.9, PROBE)
    assert due(state, 105.0, PROBE)


def test_the_defaults_restart_a_frozen_child_within_its_detection_time() -> None:
    """The longest freeze that goes unnoticed: a probe passed just before it, then the
    threshold's probes a period apart each waited out the timeout (8 s with the defaults,
    well within the 25 s freeze of issue 41's probe)."""
    assert LivenessProbe().detection_s == 8.0
    assert PROBE.describe() == "3 probes in a row, 5 s apart, 3 s timeout"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period_s": 0.0}, "period_s must be a finite number of seconds above 0"),
        ({"timeout_s": float("nan")}, "timeout_s must be a finite number of seconds above 0"),
        ({"failure_threshold": 0}, "failure_threshold must be at least 1"),
    ],
)
def test_a_probe_without_a_period_timeout_or_threshold_is_refused(
    kwargs: dict[str, float], message: str
) -> None:
    """A zero period would probe in a busy loop; a zero threshold restart every child."""
    with pytest.raises(ValueError, match=message):
        LivenessProbe(**kwargs)  # type: ignore[arg-type]
