"""Kubernetes-style durations and quantities."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity as kubernetes_quantity

from fleetpilot.api.units import (
    POSITIVE_QUANTITY_PATTERN,
    format_duration,
    parse_duration,
    parse_positive_quantity,
    parse_quantity,
    quantity_decimal,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("800ms", 0.8),
        ("0s", 0.0),
        ("15s", 15.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250us", 0.00025),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    """Every unit Kubernetes and CEL accept, alone, combined and fractional, has its value in
    seconds."""
    assert parse_duration(text).total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["300", "5 m", "-1s", "1d", "", "ms", 300, None, "1h-5m", "5m\n"])
def test_parse_duration_refuses_ambiguous_or_malformed(bad: object) -> None:
    """A bare number is refused: an SLO off by 1000x must not be silently accepted."""
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.8, "800ms"), (0, "0s"), (90, "90s"), (300, "5m"), (7200, "2h"), (0.00025, "250us")],
)
def test_format_duration_is_canonical(seconds: float, text: str) -> None:
    """Durations are written in their shortest unit, so the CRD defaults and status read as a person
    would write them."""
    assert format_duration(timedelta(seconds=seconds)) == text


@given(st.integers(min_value=0, max_value=10**12))
def test_duration_round_trips_through_text(micros: int) -> None:
    """Any duration written and read back is unchanged (a lossy format would drift objects on each
    re-plan)."""
    value = timedelta(microseconds=micros)
    assert parse_duration(format_duration(value)) == value


@pytest.mark.parametrize(("value", "text"), [(8, "8"), ("500m", "500m"), ("64Gi", "64Gi")])
def test_quantity_accepts_ints_and_suffixes(value: object, text: str) -> None:
    """Integers and suffixed strings are kept as the exact text Kubernetes will see."""
    assert parse_quantity(value) == text


@pytest.mark.parametrize("bad", ["64GB", "lots", True, 1.5, "8 Gi", "8Gi\n"])
def test_quantity_refuses_what_kubernetes_refuses(bad: object) -> None:
    """ "64GB", floats, booleans and spaced units are refused here, not at `kubectl apply` or in the
    cluster."""
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity(bad)


@given(
    st.from_regex(
        r"\A[+-]?([0-9]{1,6}(\.[0-9]{0,3})?|\.[0-9]{1,3})([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,2})?\Z"
    )
)
def test_quantity_values_are_kubernetes_own(text: str) -> None:
    """The planner's quantity value (it may not import the Kubernetes client) equals the
    client's parse_quantity on every string of the API server's grammar."""
    assert quantity_decimal(text) == kubernetes_quantity(text)


def test_a_string_outside_the_grammar_has_no_value() -> None:
    """What the API server would refuse is refused here too, not read as Decimal reads it."""
    for text in ("1K", "Gi", "1_000", " 1", "NaN", "1Gi\n"):
        with pytest.raises(ValueError, match="invalid quantity"):
            quantity_decimal(text)


@given(
    st.from_regex(
        r"\A[+-]?([0-9]{1,6}(\.[0-9]{0,3})?|\.[0-9]{1,3})([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,2})?\Z"
    )
)
def test_a_positive_quantity_is_one_kubernetes_reads_above_zero(text: str) -> None:
    """The CRD's pattern for a size above zero (engine.kvOffload.size) accepts exactly the
    quantities of the API server's grammar that the Kubernetes client reads above zero -
    "0.5Gi" and "1e3", not "0", "0.000Gi", "0e5" or "-1Gi" - and the model refuses the rest."""
    positive = kubernetes_quantity(text) > 0
    assert bool(re.fullmatch(POSITIVE_QUANTITY_PATTERN, text)) is positive
    if positive:
        assert parse_positive_quantity(text) == text
    else:
        with pytest.raises(ValueError, match="must be more than 0"):
            parse_positive_quantity(text)


def test_a_positive_quantity_may_be_an_integer_above_zero() -> None:
    assert parse_positive_quantity(1) == "1"
    for value in (0, -5):
        with pytest.raises(ValueError, match="must be more than 0"):
            parse_positive_quantity(value)
