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


def test_an_ejection_hangs_when_a_failure_that_ejected_it_was_a_timeout() -> None:
    """Issue 41: panic mode keeps only replicas that fail fast, so the tracker tells a frozen
    replica (timeouts) from a killed one (refused connections); a timeout while ejected marks
    it too, and readmission forgets it."""
    t = HealthTracker(3, 10.0)
    for now in (0.0, 1.0, 2.0):
        t.record_failure("killed", now)
    t.record_failure("frozen", 0.0)
    t.record_failure("frozen", 1.0, hung=True)
    t.record_failure("frozen", 2.0)
    assert (t.is_ejected("killed"), t.hangs("killed")) == (True, False)
    assert (t.is_ejected("frozen"), t.hangs("frozen")) == (True, True)
    t.record_failure("killed", 3.0, hung=True)
    assert t.hangs("killed")
    t.readmit("frozen")
    assert not t.hangs("frozen")
    t.retain({"frozen"})
    assert not t.hangs("killed")
