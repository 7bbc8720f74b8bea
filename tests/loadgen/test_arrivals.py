"""Rate schedules and Poisson arrivals."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from fleetpilot.loadgen.runner import Schedule, Step, arrival_times, parse_schedule


def test_constant_rate_inter_arrival_mean_and_spread() -> None:
    """A constant rate gives Poisson arrivals: mean gap 1/rate and exponential spread, not a fixed
    clock that would never produce the bursts that make queues."""
    times = list(arrival_times(Schedule.constant(4.0), 5000.0, random.Random(42)))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) > 15000
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed clock would give 0).
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_arrivals_are_seeded_and_bounded_by_duration() -> None:
    """The same seed replays the same arrivals (benchmarks are comparable), another seed differs,
    and every arrival is ordered and inside the run."""
    sched = parse_schedule("0:5,10:~20")
    a = list(arrival_times(sched, 20.0, random.Random(1)))
    assert a == list(arrival_times(sched, 20.0, random.Random(1)))
    assert a != list(arrival_times(sched, 20.0, random.Random(2)))
    assert all(0 < t < 20.0 for t in a)
    assert a == sorted(a)


def test_steps_change_the_rate() -> None:
    """A step schedule changes the rate at each step, and a rate of 0 sends nothing (the idle phase
    of a scale-down run)."""
    sched = parse_schedule("0:2,100:20,200:0,300:2")
    times = list(arrival_times(sched, 400.0, random.Random(3)))

    def count(lo: float, hi: float) -> int:
        return sum(lo <= t < hi for t in times)

    assert count(0, 100) == pytest.approx(200, rel=0.25)
    assert count(100, 200) == pytest.approx(2000, rel=0.1)
    assert count(200, 300) == 0
    assert count(300, 400) == pytest.approx(200, rel=0.25)


def test_parse_steps_and_ramps() -> None:
    """Spaces are tolerated, '~' ramps linearly from the previous step, the last rate holds
    afterwards, and the peak is the highest step."""
    sched = parse_schedule(" 0:2, 30:8 ,60:~2")
    assert sched.steps == (Step(0, 2), Step(30, 8), Step(60, 2, ramp=True))
    assert sched.rate_at(10) == 2
    assert sched.rate_at(30) == 8
    assert sched.rate_at(45) == pytest.approx(5)
    assert sched.rate_at(1000) == 2
    assert sched.peak == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected 't_seconds:rate' steps"),
        ("0:2,,5:3", "expected 't_seconds:rate' steps"),
        ("0:2,30", "expected 't_seconds:rate'"),
        ("0:fast", "must be numbers"),
        ("0:-1", "finite and >= 0"),
        ("0:inf", "finite and >= 0"),
        ("0:nan", "finite and >= 0"),
        ("0:2,30:4,20:1", "times must increase"),
        ("0:2,0:3", "times must increase"),
        ("5:2", "first step must be '0:rate'"),
        ("0:~2", "first step must be '0:rate'"),
        ("0:0,10:0", "every rate is 0"),
    ],
)
def test_bad_schedules_are_refused_clearly(text: str, message: str) -> None:
    """Malformed, negative, non-finite, unordered or all-zero schedules are refused with a message
    naming the problem, before any load is sent."""
    with pytest.raises(ValueError, match=message):
        parse_schedule(text)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_constant_rate_is_refused(rate: float) -> None:
    """A zero, negative or non-finite --rate is refused instead of generating no arrivals or an
    endless burst."""
    with pytest.raises(ValueError, match="positive"):
        Schedule.constant(rate)
