"""Outlier ejection: consecutive failures within a window, readmission, forgetting."""

from __future__ import annotations

from fleetpilot.routing.policies.ejection import HealthTracker


def test_ejected_after_n_consecutive_failures() -> None:
    """Three failures in a row eject; only the third reports the ejection."""
    t = HealthTracker(3, 10.0)
    assert [t.record_failure("a", now) for now in (0.0, 1.0, 2.0)] == [False, False, True]
    assert t.is_ejected("a")
    assert t.ejected() == ["a"]


def test_a_success_resets_the_count() -> None:
    """A busy replica with rare errors is never ejected."""
    t = HealthTracker(3, 10.0)
    for now in range(10):
        t.record_failure("a", float(now))
        t.record_failure("a", now + 0.5)
        t.record_success("a")
    assert not t.is_ejected("a")


def test_failures_outside_the_window_do_not_count() -> None:
    """Failures spread wider than the window never add up."""
    t = HealthTracker(3, 10.0)
    assert not any(t.record_failure("a", float(now)) for now in (0, 6, 12, 18, 24))


def test_readmit_and_retain() -> None:
    """A passing probe readmits; a replica gone from discovery is forgotten."""
    t = HealthTracker(1, 10.0)
    t.record_failure("a", 0.0)
    t.record_failure("b", 0.0)
    assert t.readmit("a")
    assert not t.readmit("a")
    assert not t.is_ejected("a")
    t.retain(set())
    assert t.ejected() == []
