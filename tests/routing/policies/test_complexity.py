"""Complexity scoring, tier thresholds, overrides and spill-over decisions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.routing.errors import InvalidRequestError, UnknownModelError
from fleetpilot.routing.features import RequestFeatures
from fleetpilot.routing.policies.complexity import (
    Target,
    TierSpec,
    TierState,
    choose_tier,
    complexity_score,
    resolve_target,
    tier_for_score,
)

TIERS = [TierSpec("small", "small-m", 0.4), TierSpec("large", "large-m", 1.0)]
BASE = RequestFeatures(
    kind="completions",
    model=None,
    prompt_text="hi",
    approx_tokens=1,
    max_tokens=None,
    turns=1,
    system_chars=0,
    has_code=False,
    has_math=False,
    has_reasoning=False,
    stream=False,
)


def with_(f: RequestFeatures, **changes: Any) -> RequestFeatures:
    return replace(f, **changes)


features = st.builds(
    RequestFeatures,
    kind=st.just("completions"),
    model=st.none(),
    prompt_text=st.just(""),
    approx_tokens=st.integers(0, 1_000_000),
    max_tokens=st.none() | st.integers(0, 1_000_000),
    turns=st.integers(0, 1000),
    system_chars=st.integers(0, 10_000_000),
    has_code=st.booleans(),
    has_math=st.booleans(),
    has_reasoning=st.booleans(),
    stream=st.booleans(),
)


@given(features)
def test_score_is_in_unit_interval(f: RequestFeatures) -> None:
    """Every request scores within [0, 1]."""
    assert 0.0 <= complexity_score(f) <= 1.0


@given(features, st.sampled_from(["approx_tokens", "max_tokens", "turns", "system_chars"]))
def test_score_is_monotone_in_each_size_feature(f: RequestFeatures, name: str) -> None:
    """More of a feature never lowers the score."""
    value = getattr(f, name) or 0
    assert complexity_score(with_(f, **{name: value * 2 + 10})) >= complexity_score(f)


@given(features, st.sampled_from(["has_code", "has_math", "has_reasoning"]))
def test_score_is_monotone_in_each_marker(f: RequestFeatures, name: str) -> None:
    """A marker present never scores lower than absent."""
    assert complexity_score(with_(f, **{name: True})) >= complexity_score(with_(f, **{name: False}))


@pytest.mark.parametrize(
    ("changes", "tier"),
    [
        ({}, "small"),
        ({"approx_tokens": 200, "max_tokens": 100}, "small"),
        ({"has_code": True, "approx_tokens": 300}, "small"),
        ({"has_math": True, "has_reasoning": True, "approx_tokens": 800, "max_tokens": 1500},
         "large"),
        ({"approx_tokens": 8000, "max_tokens": 4000}, "large"),
        ({"turns": 12, "approx_tokens": 3000, "has_code": True}, "large"),
    ],
)  # fmt: skip
def test_typical_requests_land_on_the_expected_tier(changes: dict[str, Any], tier: str) -> None:
    """Short chit-chat stays small; long, maths-heavy or deep-conversation work goes large."""
    target = resolve_target(with_(BASE, **changes), TIERS, "chat")
    assert TIERS[target.index].name == tier
    assert target.reason == "complexity"


@pytest.mark.parametrize(("score", "index"), [(0.0, 0), (0.4, 0), (0.41, 1), (1.0, 1)])
def test_tier_thresholds_are_inclusive(score: float, index: int) -> None:
    """A tier takes scores up to and including its up_to."""
    assert tier_for_score(score, TIERS) == index


def test_last_tier_takes_scores_above_every_threshold() -> None:
    """Tiers whose up_to stops short of 1: the last one takes the rest."""
    assert tier_for_score(0.9, [TierSpec("a", "a", 0.2), TierSpec("b", "b", 0.5)]) == 1


def test_header_and_model_pin_a_tier() -> None:
    """x-fleetpilot-tier names a tier; requesting a tier's model alias pins it; the service
    name, 'auto' or no model leaves the choice to the score."""
    assert resolve_target(replace(BASE, tier_header="large"), TIERS, "chat") == Target(1, "header")
    assert resolve_target(replace(BASE, model="large-m"), TIERS, "chat") == Target(1, "model")
    for model in ("chat", "auto", None):
        assert resolve_target(replace(BASE, model=model), TIERS, "chat").reason == "complexity"


def test_unknown_tier_header_is_400_and_unknown_model_404() -> None:
    """An unknown tier header is a 400, an unknown model a 404 (as an engine answers)."""
    with pytest.raises(InvalidRequestError):
        resolve_target(replace(BASE, tier_header="huge"), TIERS, "chat")
    with pytest.raises(UnknownModelError) as info:
        resolve_target(replace(BASE, model="gpt-4"), TIERS, "chat")
    assert info.value.status == 404


OK = TierState(has_replicas=True, available=True, saturated=False)
SAT = TierState(has_replicas=True, available=True, saturated=True)
FULL = TierState(has_replicas=True, available=False, saturated=True)
NONE = TierState(has_replicas=False, available=False, saturated=True)

SPILL_CASES = [
    # states of (small, large), base, pinned, spill enabled -> chosen, reason
    ((OK, OK), 0, False, True, 0, "complexity"),
    ((SAT, OK), 0, False, True, 1, "spillover"),
    ((SAT, OK), 0, False, False, 0, "complexity"),
    ((SAT, SAT), 0, False, True, 0, "complexity"),  # everything busy: stay home
    ((FULL, SAT), 0, False, True, 1, "spillover"),
    ((FULL, FULL), 0, False, True, None, "saturated"),
    ((NONE, OK), 0, False, True, 1, "spillover"),
    ((NONE, NONE), 0, False, True, None, "no-endpoints"),
    ((SAT, OK), 0, True, True, 0, "header"),  # pinned: never leaves
    ((FULL, OK), 0, True, True, None, "saturated"),
    ((OK, SAT), 1, False, True, 1, "complexity"),  # no tier above: no spill
    ((OK, FULL), 1, False, True, None, "saturated"),  # and never down
]


@pytest.mark.parametrize(("states", "base", "pinned", "spill", "chosen", "reason"), SPILL_CASES)
def test_spillover(
    states: tuple[TierState, TierState],
    base: int,
    pinned: bool,
    spill: bool,
    chosen: int | None,
    reason: str,
) -> None:
    """Spill-over goes up a tier only when the base is saturated and the next is not; a
    pinned tier is used or refused."""
    target = Target(base, "header" if pinned else "complexity")
    choice = choose_tier(target, 2, lambda i: states[i], spill)
    assert (choice.index, choice.reason) == (chosen, reason)
    if reason == "spillover":
        assert choice.spilled_from == base


def test_tier_state_is_read_lazily() -> None:
    """The common case (base tier has room) reads only the base tier's state."""
    seen: list[int] = []

    def state(i: int) -> TierState:
        seen.append(i)
        return OK

    choose_tier(Target(0, "complexity"), 3, state, True)
    assert seen == [0]


def test_an_adapter_pins_the_tier_that_serves_it_and_unknown_names_list_them() -> None:
    """A LoRA adapter's name pins the tier whose engines serve it, as its base model's alias
    does (never spilled: another tier's engines do not have it); a 404 names the adapters
    among the models a client may ask for."""
    tiers = [TierSpec("small", "small-m", 0.4, frozenset({"sql"})),
             TierSpec("large", "large-m", 1.0, frozenset({"legal", "tax"}))]  # fmt: skip
    target = resolve_target(replace(BASE, model="legal"), tiers, "chat")
    assert target == Target(1, "adapter")
    assert target.pinned
    assert resolve_target(replace(BASE, model="sql"), tiers, "chat") == Target(0, "adapter")
    with pytest.raises(UnknownModelError) as info:
        resolve_target(replace(BASE, model="poetry"), tiers, "chat")
    assert str(info.value).endswith("Models: chat, small-m, large-m, sql, legal, tax")
