"""Deciding whether a planned object must be (re)applied. Purely computational.

Server-side apply of an unchanged object is harmless but still a write, and an operator that
writes on every resync loads the API server and the audit log for nothing. An object is
re-applied when what fleetpilot last applied differs from the plan (a hash in an annotation
catches removed fields, which a comparison with the live object cannot see), or when the
live object no longer holds a value fleetpilot set (someone edited it: drift is corrected).
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from typing import Any

from fleetpilot.kube.quantity import same_quantity

APPLIED_HASH = "fleetpilot.dev/applied-hash"


def contains(desired: Any, live: Any) -> bool:
    """Whether ``live`` holds every value of ``desired`` (extra live fields are fine).

    Quantities compare by value, since the server canonicalizes them ("0.5" -> "500m").
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and contains(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(contains(d, item) for d, item in zip(desired, live, strict=True))
        )
    if isinstance(desired, str) and isinstance(live, str) and desired != live:
        return same_quantity(desired, live)
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    if isinstance(desired, int | float) and isinstance(live, int | float):
        return Decimal(str(desired)) == Decimal(str(live))
    return bool(desired == live)


def content_hash(obj: dict[str, Any]) -> str:
    """A stable hash of an object as planned (before the hash annotation is added)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its content hash recorded in an annotation."""
    digest = content_hash(obj)
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), APPLIED_HASH: digest}
    return {**obj, "metadata": meta}


def needs_apply(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """``desired`` must already carry its hash annotation (see :func:`with_hash`)."""
    if live is None:
        return True
    applied = live.get("metadata", {}).get("annotations", {}).get(APPLIED_HASH)
    if applied != desired["metadata"]["annotations"][APPLIED_HASH]:
        return True
    return not contains(desired, live)
