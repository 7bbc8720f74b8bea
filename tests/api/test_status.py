"""set_condition: the one rule for conditions both status writers follow."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleetpilot.api.status import Condition, ConditionStatus, set_condition

T0 = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def cond(
    kind: str, status: bool, when: datetime, reason: str = "Why", message: str = ""
) -> Condition:
    return Condition(
        type=kind,
        status=ConditionStatus.TRUE if status else ConditionStatus.FALSE,
        reason=reason,
        message=message,
        last_transition_time=when,
    )


def test_a_condition_that_holds_keeps_its_transition_time() -> None:
    """Same status, new reason and message: those are taken, lastTransitionTime is not, so it
    keeps saying since when the condition holds."""
    (merged,) = set_condition([cond("Ready", True, T0)], cond("Ready", True, T1, "Other", "m"))
    assert merged == cond("Ready", True, T0, "Other", "m")


def test_a_flipped_condition_takes_the_new_transition_time() -> None:
    """The status changed: the time of the change is the new one."""
    (merged,) = set_condition([cond("Ready", True, T0)], cond("Ready", False, T1))
    assert merged == cond("Ready", False, T1)


def test_only_the_condition_of_its_type_is_replaced() -> None:
    """The other writers' conditions stay as they are and where they are; a condition of a
    type not there yet is appended."""
    ready, degraded = cond("Ready", True, T0), cond("Degraded", False, T0)
    scaling = cond("ScalingActive", True, T1)
    assert set_condition([ready, degraded], scaling) == [ready, degraded, scaling]
    progressing = cond("Progressing", True, T1)
    merged = set_condition([ready, progressing, degraded], cond("Progressing", False, T1))
    assert merged == [ready, cond("Progressing", False, T1), degraded]


def test_the_input_is_left_alone() -> None:
    """Purely computational: the list passed in is not changed."""
    before = [cond("Ready", True, T0)]
    set_condition(before, cond("Ready", False, T1))
    assert before == [cond("Ready", True, T0)]
