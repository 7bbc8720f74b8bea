"""Kubernetes-style scalar types: durations (``800ms``, ``5m``) and resource quantities."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
# Go's time.ParseDuration grammar without the sign: what CEL's duration() and kubectl accept.
# Parsed here, not by pydantic: its timedelta takes ISO 8601 and bare numbers, which the API
# server's CEL rules would read differently (or refuse).
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
_DURATION_RE = re.compile(DURATION_PATTERN)
_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: Any) -> timedelta:
    """Parse ``"1h30m"``, ``"800ms"``, ``"0s"`` into a timedelta; pass timedeltas through.

    A bare number is refused: ``300`` could mean seconds or milliseconds, and guessing wrong
    by a factor of 1000 on an SLO is worse than an error.
    """
    if isinstance(value, timedelta):
        return value
    if not isinstance(value, str) or not _DURATION_RE.fullmatch(value):
        raise ValueError(
            f"invalid duration {value!r}: use a number with a unit, e.g. 800ms, 15s, 5m, 1h30m"
        )
    seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _PART_RE.findall(value))
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """The shortest canonical string: 0.8s -> ``"800ms"``, 90s -> ``"90s"``, 300s -> ``"5m"``."""
    micros = round(value.total_seconds() * 1_000_000)
    if micros == 0:
        return "0s"
    if micros % 1_000_000:
        if micros % 1000:
            return f"{micros}us"
        return f"{micros // 1000}ms"
    seconds = micros // 1_000_000
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN}),
]

# resource.Quantity's grammar, as the API server checks it.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def parse_quantity(value: Any) -> str:
    """Accept ``8``, ``"500m"``, ``"64Gi"``; keep it as the string Kubernetes will see."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"invalid quantity {value!r}: use e.g. 8, 500m, 64Gi")
    text = str(value)
    if not _QUANTITY_RE.fullmatch(text):
        raise ValueError(f"invalid quantity {value!r}: use e.g. 8, 500m, 64Gi")
    return text


_SUFFIX_FACTORS = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
}


def quantity_decimal(text: str) -> Decimal:
    """The value of a quantity the grammar accepts (``"80Gi"``: 85899345920), for the planner,
    which may not import the Kubernetes client (kubernetes' own parse_quantity is the test's
    judge of this one). Raises ValueError for anything else."""
    if not _QUANTITY_RE.fullmatch(text):
        raise ValueError(f"invalid quantity {text!r}")
    suffix = text[-2:] if text[-2:] in _SUFFIX_FACTORS else text[-1:]
    if suffix in _SUFFIX_FACTORS:
        return Decimal(text[: -len(suffix)]) * _SUFFIX_FACTORS[suffix]
    return Decimal(text)  # digits, or an exponent ("1e3") Decimal reads as the grammar does


Quantity = Annotated[
    str,
    BeforeValidator(parse_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

# A quantity above zero: no minus, and a digit other than 0 in the number before any suffix or
# exponent ("0.5Gi" and "64Gi", not "0", "0Gi", "0e3" or "-1Gi"). Written without lookahead:
# the API server checks patterns with Go's RE2. An integer is held to ``minimum`` instead.
POSITIVE_QUANTITY_PATTERN = (
    r"^\+?(([0-9]*[1-9][0-9]*(\.[0-9]*)?)|([0-9]*\.[0-9]*[1-9][0-9]*))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_POSITIVE_QUANTITY_RE = re.compile(POSITIVE_QUANTITY_PATTERN)


def parse_positive_quantity(value: Any) -> str:
    """A quantity above zero (``"64Gi"``, ``"512Mi"``, ``1073741824``); zero or a sign is
    refused, as the CRD's pattern and minimum refuse them."""
    text = parse_quantity(value)
    if not _POSITIVE_QUANTITY_RE.fullmatch(text):
        raise ValueError(f"invalid quantity {value!r}: must be more than 0, e.g. 512Mi, 64Gi")
    return text


PositiveQuantity = Annotated[
    str,
    BeforeValidator(parse_positive_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": POSITIVE_QUANTITY_PATTERN,
            "minimum": 1,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
