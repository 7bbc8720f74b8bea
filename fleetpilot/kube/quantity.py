"""Resource quantities by value: ``"0.5"`` and ``"500m"``, ``"1Gi"`` and ``"1024Mi"`` are equal.

The API server canonicalizes the quantities it stores, so a live object rarely spells one the
way the plan did; comparing them as strings would re-apply an unchanged object on every resync.
"""

from __future__ import annotations

import re
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from fleetpilot.api.units import QUANTITY_PATTERN

# parse_quantity reads whatever Decimal reads ("1K", "1_000", " 1", "NaN"): the API server's
# grammar decides first what is a quantity at all (fullmatch: "$" alone lets "1\n" through),
# so other strings keep comparing as text.
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def quantity_value(text: str) -> Decimal | None:
    """The value of a resource quantity string, or None when it is not one."""
    if not _QUANTITY_RE.fullmatch(text):
        return None
    try:
        value: Decimal = parse_quantity(text)  # type: ignore[no-untyped-call]
    except ValueError:
        return None
    return value


def same_quantity(a: str, b: str) -> bool:
    """Whether two strings are quantities of the same value (two non-quantities never are)."""
    va, vb = quantity_value(a), quantity_value(b)
    return va is not None and va == vb
