"""When an object is re-applied, and who owns replicas."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fleetpilot.kube.managers import AUTOSCALER_MANAGER, OPERATOR_MANAGER, owns_field
from fleetpilot.operator.drift import APPLIED_HASH, contains, needs_apply, with_hash
from fleetpilot.operator.reconcile import settle_replicas

DESIRED = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "chat-small", "labels": {"a": "b"}},
    "spec": {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "engine", "resources": {"cpu": "0.5"}}]}},
    },
}


def _live(obj: dict[str, Any], **managed: dict[str, Any]) -> dict[str, Any]:
    """What the server returns: our fields, plus defaults and managedFields."""
    live = copy.deepcopy(obj)
    live["metadata"]["uid"] = "u1"
    live["metadata"]["managedFields"] = [
        {"manager": m, "operation": "Apply", "fieldsV1": f} for m, f in managed.items()
    ]
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["cpu"] = "500m"
    live["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    live["spec"]["revisionHistoryLimit"] = 10
    return live


def test_unchanged_object_is_not_reapplied() -> None:
    """Server defaults, managedFields and a canonicalized quantity ("0.5" -> "500m") on the live
    object are not drift: otherwise every resync would write every object again."""
    desired = with_hash(DESIRED)
    assert not needs_apply(desired, _live(desired))


def test_new_object_is_applied() -> None:
    """An object that does not exist yet is created."""
    assert needs_apply(with_hash(DESIRED), None)


def test_edited_live_value_is_corrected() -> None:
    """Someone `kubectl edit`ed a field the operator sets: drift is corrected."""
    desired = with_hash(DESIRED)
    live = _live(desired)
    live["metadata"]["labels"]["a"] = "edited"
    assert needs_apply(desired, live)


def test_removed_planned_field_is_applied() -> None:
    """A field dropped from the plan is still on the live object; only the hash reveals it."""
    before = with_hash(DESIRED)
    after = copy.deepcopy(DESIRED)
    del after["metadata"]["labels"]
    assert needs_apply(with_hash(after), _live(before))


def test_hash_ignores_key_order() -> None:
    """A plan that builds the same object with keys in another order is not a change (no
    spurious re-apply after a refactor of the planner)."""
    reordered = dict(reversed(list(DESIRED.items())))
    assert (
        with_hash(reordered)["metadata"]["annotations"][APPLIED_HASH]
        == with_hash(DESIRED)["metadata"]["annotations"][APPLIED_HASH]
    )


@pytest.mark.parametrize(
    ("desired", "live", "expected"),
    [
        ({"cpu": "0.5"}, {"cpu": "500m"}, True),
        ({"memory": "1Gi"}, {"memory": "1024Mi"}, True),
        # A valid quantity the hand-written regex could not read: re-applied on every resync.
        ({"cpu": "2."}, {"cpu": "2"}, True),
        ({"memory": "1Gi"}, {"memory": "1G"}, False),
        ({"port": "http"}, {"port": "https"}, False),
        ({"on": True}, {"on": 1}, False),
        ({"n": 2}, {"n": 2.0}, True),
        ([1, 2], [1, 2, 3], False),
        ({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3}, True),
    ],
)
def test_contains(desired: Any, live: Any, expected: bool) -> None:
    """Quantities compare by value, booleans never equal numbers, lists must match in length,
    extra live fields are fine: each row is a false drift or a missed edit if it breaks."""
    assert contains(desired, live) is expected


def test_owns_field_reads_managed_fields() -> None:
    """Replica ownership is read per manager and per path from managedFields: a wrong answer
    makes the operator fight the autoscaler over spec.replicas."""
    live = _live(DESIRED, **{OPERATOR_MANAGER: {"f:spec": {"f:replicas": {}}}})
    assert owns_field(live, OPERATOR_MANAGER, ("spec", "replicas"))
    assert not owns_field(live, AUTOSCALER_MANAGER, ("spec", "replicas"))
    assert not owns_field(live, OPERATOR_MANAGER, ("spec", "template"))


def test_replicas_written_on_create() -> None:
    """A new Deployment gets the planned replica count even when autoscaled."""
    assert settle_replicas(DESIRED, None, autoscaled=True)["spec"]["replicas"] == 2


def test_replicas_kept_at_live_value_while_operator_still_owns_them() -> None:
    """Omitting a field one solely owns deletes it; keep writing the live value instead."""
    live = _live(DESIRED, **{OPERATOR_MANAGER: {"f:spec": {"f:replicas": {}}}})
    live["spec"]["replicas"] = 5
    assert settle_replicas(DESIRED, live, autoscaled=True)["spec"]["replicas"] == 5


def test_replicas_left_to_the_autoscaler_once_it_owns_them() -> None:
    """Once the autoscaler has written replicas, the operator's apply omits them and so never
    resets a scaled Deployment to the spec's initial count."""
    live = _live(DESIRED, **{AUTOSCALER_MANAGER: {"f:spec": {"f:replicas": {}}}})
    assert "replicas" not in settle_replicas(DESIRED, live, autoscaled=True)["spec"]


def test_replicas_follow_the_spec_when_autoscaling_is_off() -> None:
    """With autoscaling off the spec decides again, whoever last wrote replicas."""
    live = _live(DESIRED, **{AUTOSCALER_MANAGER: {"f:spec": {"f:replicas": {}}}})
    live["spec"]["replicas"] = 7
    assert settle_replicas(DESIRED, live, autoscaled=False)["spec"]["replicas"] == 2
