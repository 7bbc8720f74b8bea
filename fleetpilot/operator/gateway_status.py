"""``GatewayAccepted``: whether the gateways took up a service's InferencePool
(``routing.gateway``), from the parents a gateway controller writes into the pool's status.
Purely computational.

A gateway controller adds one entry to ``status.parents`` for each Gateway the pool is routed
from, with ``Accepted`` (the Gateway takes the pool as a backend) and ``ResolvedRefs`` (it
found the endpoint picker's Service). The service's requests flow through a gateway only when
both are True; until a controller writes anything (no HTTPRoute names the pool yet, or no
controller watches its Gateway) the answer is Unknown. The router's own Service serves
throughout, so this condition does not touch Ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fleetpilot.api.spec import GatewayRouting
from fleetpilot.api.status import Condition, ConditionStatus, ConditionType

# What a gateway reports of a pool, in the order a reader needs it: taken up, then resolved.
PARENT_CONDITIONS = ("Accepted", "ResolvedRefs")


@dataclass(frozen=True)
class GatewayObserved:
    """What the cluster shows of a service's gateway objects: the live InferencePool (None:
    not there yet) and the kinds it does not serve at all."""

    pool: dict[str, Any] | None = None
    missing_kinds: Sequence[str] = ()


def _parent_name(parent: dict[str, Any], namespace: str) -> str:
    ref = parent.get("parentRef") or {}
    kind = ref.get("kind", "Gateway")
    return f"{kind} {ref.get('namespace') or namespace}/{ref.get('name', '?')}"


def _unmet(parent: dict[str, Any]) -> tuple[str, str] | None:
    """The first of the parent's conditions that is not True, as (its status, what it says);
    None when both are True."""
    conditions = {c.get("type"): c for c in parent.get("conditions") or []}
    for kind in PARENT_CONDITIONS:
        condition = conditions.get(kind)
        if condition is None:
            return "Unknown", f"{kind} not reported"
        if condition.get("status") != "True":
            detail = condition.get("message") or condition.get("reason") or ""
            return str(condition.get("status", "Unknown")), f"{kind} {detail}".strip()
    return None


def gateway_condition(
    gateway: GatewayRouting | None,
    observed: GatewayObserved,
    now: datetime,
    generation: int | None,
    namespace: str,
) -> Condition | None:
    """``GatewayAccepted`` for a service with ``routing.gateway``; None without."""
    if gateway is None:
        return None

    def cond(status: ConditionStatus, reason: str, message: str) -> Condition:
        return Condition(
            type=ConditionType.GATEWAY_ACCEPTED,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )

    if "InferencePool" in observed.missing_kinds:
        return cond(
            ConditionStatus.FALSE,
            "InferencePoolMissing",
            "the cluster does not serve InferencePool (inference.networking.k8s.io/v1): "
            "install the Gateway API Inference Extension's CRDs, then restart the operator",
        )
    if gateway.parent_refs and "HTTPRoute" in observed.missing_kinds:
        return cond(
            ConditionStatus.FALSE,
            "HTTPRouteMissing",
            "the cluster does not serve HTTPRoute (gateway.networking.k8s.io/v1): install "
            "the Gateway API's CRDs, then restart the operator",
        )
    if observed.pool is None:
        pending = "InferencePool not created yet"
        return cond(ConditionStatus.UNKNOWN, "InferencePoolPending", pending)
    parents = (observed.pool.get("status") or {}).get("parents") or []
    if not parents:
        waiting = (
            "no gateway controller has reported it yet"
            if gateway.parent_refs
            else "no route names it yet (routing.gateway.parentRefs is empty: route to it "
            "from an HTTPRoute of your own)"
        )
        return cond(ConditionStatus.UNKNOWN, "NoParent", f"InferencePool: {waiting}")
    problems = [
        (status, f"{_parent_name(parent, namespace)}: {text}")
        for parent in parents
        if (unmet := _unmet(parent)) is not None
        for status, text in [unmet]
    ]
    if not problems:
        accepted = ", ".join(_parent_name(p, namespace) for p in parents)
        return cond(ConditionStatus.TRUE, "Accepted", f"accepted by {accepted}")
    refused = [text for status, text in problems if status == "False"]
    if refused:
        return cond(ConditionStatus.FALSE, "NotAccepted", "; ".join(refused))
    return cond(ConditionStatus.UNKNOWN, "Pending", "; ".join(text for _, text in problems))
