"""Resource quantities by value, as the API server reads them (kube.quantity)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from fleetpilot.kube.quantity import quantity_value, same_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64Gi", 64 * 1024**3),
        ("0.5Gi", 512 * 1024**2),
        ("500m", Decimal("0.5")),
        ("1.5", Decimal("1.5")),
        ("+1Ki", 1024),
        ("1e3", 1000),
        ("250u", Decimal("0.00025")),
        # Valid for the API server, misread (None) by the regex drift.py once had: a trailing
        # dot ("2." is 2) and the exa suffix "E" (taken for an exponent without digits).
        ("2.", 2),
        ("5.Gi", 5 * 1024**3),
        ("1.e3", 1000),
        ("1E", 10**18),
    ],
)
def test_quantities_have_their_kubernetes_value(text: str, value: int | Decimal) -> None:
    """A suffix or spelling read wrong would make a planned quantity differ from the server's
    canonical form of it, and the operator would re-apply the object on every resync."""
    assert quantity_value(text) == value


@pytest.mark.parametrize(
    "text", ["http", "", "1ki", "1K", "1e", " 1", "1_000", "NaN", "Infinity", "1Gi ", "1\n"]
)
def test_strings_the_api_server_refuses_are_not_quantities(text: str) -> None:
    """Not a quantity by the API server's grammar (parse_quantity alone accepts "1K", "1_000",
    "NaN"): None, so such a string still compares as text and an edit to it is corrected."""
    assert quantity_value(text) is None


def test_canonical_spellings_are_the_same_quantity() -> None:
    """The server stores "0.5" as "500m" and may write "1Gi" as "1024Mi": equal by value;
    different values and two non-quantities are not."""
    assert same_quantity("0.5", "500m")
    assert same_quantity("1Gi", "1024Mi")
    assert same_quantity("2.", "2")
    assert not same_quantity("1Gi", "1G")
    assert not same_quantity("http", "http ")
