"""GatewayAccepted from the InferencePool's parents, as a gateway controller writes them
(inference.networking.k8s.io/v1 ParentStatus), and its place among the service's
conditions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from fleetpilot.api.spec import GatewayRouting
from fleetpilot.api.status import Condition, ConditionStatus, ConditionType
from fleetpilot.operator.gateway_status import GatewayObserved, gateway_condition
from fleetpilot.operator.status import Observed, compute_status
from tests.factories import make_service

NOW = datetime(2026, 12, 6, 16, 0, tzinfo=UTC)
ROUTED = GatewayRouting.model_validate({"parentRefs": [{"name": "gw"}]})
UNROUTED = GatewayRouting()


def parent(name: str, *conditions: tuple[str, str, str, str]) -> dict[str, Any]:
    return {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name},
        "controllerName": "example.com/gateway",
        "conditions": [
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": "2026-12-06T15:00:00Z",
            }
            for kind, status, reason, message in conditions
        ],
    }


ACCEPTED = ("Accepted", "True", "Accepted", "")
RESOLVED = ("ResolvedRefs", "True", "ResolvedRefs", "")


def pool(*parents: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "chat"}, "status": {"parents": list(parents)}}


def condition(
    observed: GatewayObserved, gateway: GatewayRouting | None = ROUTED
) -> Condition | None:
    return gateway_condition(gateway, observed, NOW, 3, "ml")


def test_accepted_when_every_gateway_accepted_and_resolved_the_pool() -> None:
    seen = condition(GatewayObserved(pool(parent("gw", ACCEPTED, RESOLVED))))
    assert seen is not None
    assert (seen.type, seen.status, seen.reason) == (
        ConditionType.GATEWAY_ACCEPTED,
        ConditionStatus.TRUE,
        "Accepted",
    )
    assert seen.message == "accepted by Gateway ml/gw"
    assert seen.observed_generation == 3


@pytest.mark.parametrize(
    ("parents", "status", "reason", "says"),
    [
        # One gateway refused it: False, with what that gateway said.
        (
            [
                parent("gw", ACCEPTED, RESOLVED),
                parent("other", ("Accepted", "False", "NotSupportedByParent", "no pools here")),
            ],
            ConditionStatus.FALSE,
            "NotAccepted",
            "Gateway ml/other: Accepted no pools here",
        ),
        # The picker's Service not found: ResolvedRefs False.
        (
            [parent("gw", ACCEPTED, ("ResolvedRefs", "False", "InvalidExtensionRef", ""))],
            ConditionStatus.FALSE,
            "NotAccepted",
            "Gateway ml/gw: ResolvedRefs InvalidExtensionRef",
        ),
        # Taken up, not yet resolved: still pending.
        ([parent("gw", ACCEPTED)], ConditionStatus.UNKNOWN, "Pending", "ResolvedRefs not reported"),
        ([], ConditionStatus.UNKNOWN, "NoParent", "no gateway controller has reported it"),
    ],
)
def test_what_a_gateway_reports_decides_the_condition(
    parents: list[dict[str, Any]], status: ConditionStatus, reason: str, says: str
) -> None:
    seen = condition(GatewayObserved(pool(*parents)))
    assert seen is not None
    assert (seen.status, seen.reason) == (status, reason)
    assert says in seen.message


def test_a_pool_no_route_names_waits_for_the_users_route() -> None:
    seen = condition(GatewayObserved(pool()), UNROUTED)
    assert seen is not None
    assert (seen.status, seen.reason) == (ConditionStatus.UNKNOWN, "NoParent")
    assert "parentRefs is empty" in seen.message


def test_a_cluster_without_the_crds_says_which_to_install() -> None:
    no_pools = condition(GatewayObserved(missing_kinds=("InferencePool", "HTTPRoute")))
    assert no_pools is not None
    assert (no_pools.status, no_pools.reason) == (ConditionStatus.FALSE, "InferencePoolMissing")
    assert "inference.networking.k8s.io/v1" in no_pools.message
    no_routes = condition(GatewayObserved(pool(), missing_kinds=("HTTPRoute",)))
    assert no_routes is not None
    assert (no_routes.status, no_routes.reason) == (ConditionStatus.FALSE, "HTTPRouteMissing")
    # Without parentRefs no HTTPRoute is wanted: its CRD is not missed.
    unrouted = condition(GatewayObserved(pool(), missing_kinds=("HTTPRoute",)), UNROUTED)
    assert unrouted is not None
    assert unrouted.reason == "NoParent"
    pending = condition(GatewayObserved())
    assert pending is not None
    assert pending.reason == "InferencePoolPending"


def test_no_condition_without_routing_gateway() -> None:
    assert condition(GatewayObserved(pool(parent("gw", ACCEPTED, RESOLVED))), None) is None


def test_the_service_status_carries_it_and_drops_it_with_the_gateway() -> None:
    accepted = GatewayObserved(pool(parent("gw", ACCEPTED, RESOLVED)))
    routed = make_service(routing={"gateway": {"parentRefs": [{"name": "gw"}]}})
    status = compute_status(routed, Observed({}, [], gateway=accepted), None, NOW)
    kinds = {c.type: c for c in status.conditions}
    assert kinds[ConditionType.GATEWAY_ACCEPTED.value].status == ConditionStatus.TRUE
    # Not a reason to be unready: the router's Service serves throughout.
    assert kinds[ConditionType.READY.value].reason != "Accepted"
    # The gateway removed from the spec: its condition goes with it.
    plain = make_service()
    after = compute_status(plain, Observed({}, []), status, NOW)
    assert ConditionType.GATEWAY_ACCEPTED.value not in {c.type for c in after.conditions}
