"""The hold for a tier at zero replicas (routing.hold), computed without a router."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fleetpilot.routing.hold import ColdStartHold, hold_for, retry_after_s
from tests.routing.support import make_config, tier

S = timedelta(seconds=1)


@pytest.mark.parametrize(
    ("observed", "maximum", "expected"),
    [
        (60 * S, 600 * S, 100 * S),  # 60 x 1.5 + 10
        (None, 600 * S, 600 * S),  # nothing observed yet: up to the bound, as before
        (400 * S, 600 * S, 600 * S),  # 610 s is past the bound
        (0 * S, 600 * S, 10 * S),  # an instant start still waits out the margin
        (60 * S, 0 * S, 0 * S),  # no hold at all
    ],
)
def test_the_hold_is_the_observed_cold_start_times_the_factor_plus_the_margin_within_a_bound(
    observed: timedelta | None, maximum: timedelta, expected: timedelta
) -> None:
    assert hold_for(observed, maximum, 1.5, 10 * S) == expected


@pytest.mark.parametrize(
    ("observed", "waited_s", "expected"),
    [
        (300 * S, 60.0, 240),  # a hold bounded below the start: the rest of it
        (300 * S, 59.5, 241),  # rounded up: a client back early finds it still starting
        (60 * S, 100.0, 1),  # waited past the observed start: it is due any moment
        (None, 600.0, 1),  # nothing observed: no estimate, the least delay
        (2 * S, 0.0, 2),
    ],
)
def test_retry_after_is_the_rest_of_the_observed_cold_start_at_least_one_second(
    observed: timedelta | None, waited_s: float, expected: int
) -> None:
    assert retry_after_s(observed, waited_s) == expected


def test_the_hold_of_a_tier_comes_from_its_own_observation_and_the_config() -> None:
    """Each tier's own cold start sets its hold; the config's factor, margin and bound apply;
    the 503 that ends it names the tier, the observed start and carries Retry-After."""
    slow = tier("slow", 0.5, []).model_copy(update={"cold_start_observed": 120 * S})
    fresh = tier("fresh", 1.0, [])
    config = make_config(
        [slow, fresh], coldStartWait="10m", coldStartFactor=2.0, coldStartMargin="30s"
    )
    hold = ColdStartHold.of(config, "slow", ("unified",))
    assert (hold.seconds, hold.observed) == (270.0, 120 * S)  # 120 x 2 + 30
    assert ColdStartHold.of(config, "fresh", ("unified",)).seconds == 600.0
    refusal = hold.refusal(waited_s=30.0)
    assert refusal.status == 503
    assert refusal.headers["Retry-After"] == "90"
    assert "tier slow" in refusal.message
    assert "observed cold start 120s" in refusal.message
    assert (refusal.tier, refusal.roles) == ("slow", ("unified",))
