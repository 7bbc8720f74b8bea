"""One reconcile against the in-memory API server: what is applied, pruned and reported.

The same paths run against a real API server in e2e/test_operator.py, in minutes; these run in
milliseconds on ``tests/support/kube.py``, which keeps objects, field ownership and
resourceVersions as the server does (and answers a stale write with 409).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.autoscaler.actuator import (
    AutoscalerMetrics,
    KubernetesActuator,
    scaling_active_condition,
)
from fleetpilot.autoscaler.model import Decision, History, ReasonKind
from fleetpilot.kube.client import MERGE_CONTENT_TYPE, RESOURCES, Obj
from fleetpilot.kube.managers import AUTOSCALER_MANAGER, OPERATOR_MANAGER, owns_field
from fleetpilot.operator import reconcile
from fleetpilot.operator.plan_types import PlanOptions, ServicePlan
from fleetpilot.operator.planner import plan_service
from fleetpilot.operator.reconcile import EVENT_MESSAGE_MAX, Reconciler, change_summary
from tests.factories import make_manifest, make_tier
from tests.support.kube import FakeKube

NS = "ml"
USER = "kubectl"
# A replica of 8 GPUs on nodes of 4: the role runs as a LeaderWorkerSet of 2-pod groups.
MULTI_NODE = {"parallelism": {"tensor": 4, "pipeline": 2}, "resources": {"gpusPerNode": 4}}


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture
def reconciler(kube: FakeKube) -> Reconciler:
    return Reconciler(kube)


class Events:
    """The reconciler's event sink, kept."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def __call__(self, kind: str, reason: str, message: str) -> None:
        self.seen.append((kind, reason, message))

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.seen]


def manifest(*tiers: Obj, name: str = "chat") -> Obj:
    return make_manifest(name, namespace=NS, tiers=list(tiers) or [make_tier("small")])


def service(kube: FakeKube, name: str = "chat") -> Obj:
    live = kube.get("InferenceService", NS, name)
    assert live is not None
    return live


def condition(kube: FakeKube, kind: str, name: str = "chat") -> Obj:
    (found,) = [c for c in service(kube, name)["status"]["conditions"] if c["type"] == kind]
    return found  # type: ignore[no-any-return]


def deployment(kube: FakeKube, name: str) -> Obj:
    live = kube.object("Deployment", NS, name)
    assert live is not None, name
    return live


def roll_out(kube: FakeKube, service_name: str = "chat") -> None:
    """Play the Deployment controller and kubelet: every Deployment of the service at its
    spec, all replicas updated and ready."""
    for item in kube.objects("Deployment", NS):
        if item["metadata"]["labels"].get("fleetpilot.dev/service") != service_name:
            continue
        replicas = item["spec"].get("replicas", 1)
        kube.set_status(
            "Deployment",
            NS,
            item["metadata"]["name"],
            {
                "observedGeneration": item["metadata"]["generation"],
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": replicas,
            },
        )


def names_of(kube: FakeKube, kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in kube.objects(kind, NS)}


def test_an_unchanged_service_costs_no_write(kube: FakeKube, reconciler: Reconciler) -> None:
    """Idempotency, counted: the first reconcile creates the children and writes status; the
    next one, with nothing changed, performs zero writes; a rollout finishing is written once
    (Ready turns True) and then nothing again."""
    kube.apply(manifest(), USER)
    first = reconciler.reconcile(service(kube))
    assert "Deployment/chat-small" in first.applied
    assert "Deployment/chat-router" in first.applied
    assert first.status_written
    assert condition(kube, "Ready")["status"] == "False"

    writes = kube.writes
    again = reconciler.reconcile(service(kube))
    assert (again.applied, again.pruned, again.status_written) == ([], [], False)
    assert kube.writes == writes

    roll_out(kube)
    settled = reconciler.reconcile(service(kube))
    assert settled.applied == []
    assert settled.status_written
    assert condition(kube, "Ready")["status"] == "True"
    assert kube.writes == writes + 1

    quiet = reconciler.reconcile(service(kube))
    assert not quiet.status_written
    assert kube.writes == writes + 1


def listed(kube: FakeKube) -> list[str | None]:
    """The kinds the reconciler listed, in order."""
    return [
        c.kind
        for c in kube.calls
        if c.method == "GET" and c.kind and c.path.endswith("/" + RESOURCES[c.kind].plural)
    ]


def test_a_new_service_lists_no_children_and_then_costs_no_write(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """kopf's create cause: the service owns nothing yet, so no child is listed (ten LISTs a
    service, each scanning the namespace); it gets the same objects and status as with them
    listed, and the next reconcile, which lists, finds nothing to write."""
    kube.apply(manifest(), USER)
    created = reconciler.reconcile(service(kube), new=True)
    # Without watches (as here) the status lists the workloads and pods it reads; nothing else.
    assert set(listed(kube)) == {"Deployment", "LeaderWorkerSet", "Pod"}
    twin = FakeKube()
    twin.apply(manifest(), USER)
    assert created.applied == Reconciler(twin).reconcile(service(twin)).applied
    assert {"NetworkPolicy", "ConfigMap", "Job", "PersistentVolumeClaim"} <= set(listed(twin))
    assert created.status_written

    writes = kube.writes
    again = reconciler.reconcile(service(kube))
    assert (again.applied, again.pruned, again.status_written) == ([], [], False)
    assert kube.writes == writes


def test_a_reconcile_posts_one_event_for_everything_it_created(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """A thousand services created at once would post a dozen Events each if every object had
    its own: one Event per reconcile names them all, by kind."""
    kube.apply(manifest(), USER)
    events = Events()
    result = reconciler.reconcile(service(kube), events)
    (created,) = [message for _, reason, message in events.seen if reason == "Created"]
    assert events.reasons() == ["Created"]
    for applied in result.applied:
        kind, name = applied.split("/")
        assert f"{kind} " in created
        assert name in created
    assert "; Deployment chat-router, chat-small;" in created


def test_an_event_summary_too_long_for_one_message_counts_by_kind() -> None:
    keys = [("Deployment", f"service-with-a-long-name-{i:03d}") for i in range(60)]
    keys.append(("Service", "one"))
    summary = change_summary("created", keys)
    assert summary == "created 61 objects: 60 Deployment, 1 Service"
    assert len(change_summary("created", keys[:5])) <= EVENT_MESSAGE_MAX
    assert change_summary("created", keys[:2]) == (
        "created Deployment service-with-a-long-name-000, service-with-a-long-name-001"
    )


def test_a_removed_tier_is_pruned_and_nothing_someone_else_owns(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """Objects no longer planned are deleted, with an Event each; an object that carries the
    service's labels but is not owned by this InferenceService (no ownerReference, or another
    owner's uid) is left alone."""
    two_tiers = manifest(make_tier("small", up_to=0.4), make_tier("large", tensor=2))
    kube.apply(two_tiers, USER)
    reconciler.reconcile(service(kube))
    assert {"chat-small", "chat-large"} <= names_of(kube, "Deployment")
    labels = deployment(kube, "chat-large")["metadata"]["labels"]
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "chat-notes", "namespace": NS, "labels": labels},
            "data": {"written": "by hand"},
        }
    )
    foreign_owner = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "someone"}]
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "chat-other",
                "namespace": NS,
                "labels": labels,
                "ownerReferences": foreign_owner,
            },
            "spec": {"ports": [{"port": 80}]},
        }
    )

    one_tier = manifest(make_tier("small"))
    kube.apply(one_tier, USER)
    events = Events()
    result = reconciler.reconcile(service(kube), events)

    assert sorted(result.pruned) == [
        "Deployment/chat-large",
        "PodDisruptionBudget/chat-large",
        "Service/chat-large",
    ]
    # One Event for the reconcile's prunes, naming each object by kind.
    (pruned_message,) = [message for _, reason, message in events.seen if reason == "Pruned"]
    assert pruned_message == (
        "deleted (no longer planned) Service chat-large; Deployment chat-large; "
        "PodDisruptionBudget chat-large"
    )
    assert "chat-large" not in names_of(kube, "Deployment")
    assert "chat-small" in names_of(kube, "Deployment")
    assert "chat-notes" in names_of(kube, "ConfigMap")
    assert "chat-other" in names_of(kube, "Service")
    assert [t["name"] for t in service(kube)["status"]["tiers"]] == ["small"]


def test_replicas_the_autoscaler_set_survive_a_reapplied_spec(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """The operator writes replicas on creation; once the autoscaler has scaled (through the
    scale subresource, under its own field manager), a changed spec re-applies the Deployment
    without replicas, so the autoscaler's value and its ownership stay."""
    tier = make_tier("small", autoscaling={"slo": {"ttftP95": "500ms"}})
    kube.apply(manifest(tier), USER)
    reconciler.reconcile(service(kube))
    created = deployment(kube, "chat-small")
    assert created["spec"]["replicas"] == 1
    assert owns_field(created, OPERATOR_MANAGER, ("spec", "replicas"))

    actuator = KubernetesActuator(kube, metrics=AutoscalerMetrics(CollectorRegistry()))
    actuator.scale(parse_service(service(kube)), "small", "unified", 3)
    changed = manifest(dict(tier, engine={"env": [{"name": "EXTRA", "value": "1"}]}))
    kube.apply(changed, USER)
    result = reconciler.reconcile(service(kube))

    assert "Deployment/chat-small" in result.applied
    updated = deployment(kube, "chat-small")
    (container,) = updated["spec"]["template"]["spec"]["containers"]
    assert {"name": "EXTRA", "value": "1"} in container["env"]
    assert updated["spec"]["replicas"] == 3
    assert owns_field(updated, AUTOSCALER_MANAGER, ("spec", "replicas"))
    assert not owns_field(updated, OPERATOR_MANAGER, ("spec", "replicas"))


@pytest.mark.parametrize(("mode", "kept"), [("external", 3), ("disabled", 1)])
def test_an_external_scalers_replicas_survive_a_reapplied_spec(
    kube: FakeKube, reconciler: Reconciler, mode: str, kept: int
) -> None:
    """mode external: an HPA (or KEDA) scales the Deployment through /scale under its own
    manager, and a changed spec leaves its replicas alone - where mode disabled writes the
    planned replicas back."""
    tier = make_tier("small", autoscaling={"mode": mode})
    kube.apply(manifest(tier), USER)
    reconciler.reconcile(service(kube))
    kube.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{NS}/deployments/chat-small/scale",
        body={"spec": {"replicas": 3}},
        content_type=MERGE_CONTENT_TYPE,
        query=[("fieldManager", "horizontal-pod-autoscaler")],
    )
    assert deployment(kube, "chat-small")["spec"]["replicas"] == 3
    kube.apply(manifest(dict(tier, engine={"env": [{"name": "EXTRA", "value": "1"}]})), USER)
    reconciler.reconcile(service(kube))
    assert deployment(kube, "chat-small")["spec"]["replicas"] == kept


def test_a_status_write_that_loses_the_race_is_retried_on_a_fresh_read(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """The autoscaler records a decision between the operator's read and its status write:
    the operator's patch (preconditioned on the old resourceVersion) gets 409, is computed
    again from the fresh object and lands, keeping what the autoscaler wrote."""
    tier = make_tier("small", autoscaling={"slo": {"ttftP95": "500ms"}})
    kube.apply(manifest(tier), USER)
    reconciler.reconcile(service(kube))
    roll_out(kube)
    stale = service(kube)

    now = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    scaled = Decision(
        tier="small",
        role="unified",
        current_replicas=1,
        replicas=2,
        recommendation=2,
        reason="unified ttft p95 900ms > slo 500ms: 1 -> 2",
        reason_kind=ReasonKind.TTFT,
        history=History(),
    )
    actuator = KubernetesActuator(kube, metrics=AutoscalerMetrics(CollectorRegistry()))

    def autoscaler_writes() -> None:
        generation = stale["metadata"]["generation"]
        condition = scaling_active_condition([scaled], generation, now)
        actuator.record(parse_service(stale), [scaled], condition, now)

    kube.interleave("PATCH", "InferenceService", autoscaler_writes, subresource="status")
    assert reconciler.refresh_status(parse_service(stale), stale)

    operator_writes = [
        c
        for c in kube.writes_of("PATCH", "InferenceService", "status")
        if ("fieldManager", OPERATOR_MANAGER) in c.query
    ]
    assert len(operator_writes) == 3  # the first reconcile's, the refused one, the retry
    refused, retried = operator_writes[1:]
    assert refused.body is not None
    assert retried.body is not None
    assert refused.body["metadata"] == {"resourceVersion": stale["metadata"]["resourceVersion"]}
    assert retried.body["metadata"] != refused.body["metadata"]
    assert condition(kube, "Ready")["status"] == "True"
    assert condition(kube, "ScalingActive")["status"] == "True"
    (role,) = service(kube)["status"]["tiers"][0]["roles"]
    assert role["desired"] == 2
    assert role["lastScale"]["toReplicas"] == 2
    assert role["ready"] == 1


def test_a_refused_plan_writes_no_child_and_reports_degraded(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """A spec the planner refuses (a port flag fleetpilot must own) creates nothing, and on a
    running service changes none of its children: only the status (Ready False, Degraded
    True, both PlanRefused, naming the field) and a Warning Event say why."""
    kube.apply(manifest(), USER)
    reconciler.reconcile(service(kube))
    children_before = {
        kind: kube.objects(kind, NS) for kind in ("Deployment", "Service", "ConfigMap")
    }
    refused = make_tier("small", engine={"extraArgs": ["--port=9000"]})
    kube.apply(manifest(refused), USER)
    seen = len(kube.calls)
    events = Events()
    result = reconciler.reconcile(service(kube), events)

    writes = [(c.kind, c.subresource) for c in kube.calls[seen:] if c.method != "GET"]
    assert writes == [("InferenceService", "status")]
    assert result.refusal is not None
    assert result.refusal.reason == "PlanRefused"
    assert "spec.tiers[0].engine.extraArgs[0]" in result.refusal.message
    assert (result.applied, result.pruned) == ([], [])
    assert {kind: kube.objects(kind, NS) for kind in children_before} == children_before
    degraded, ready = condition(kube, "Degraded"), condition(kube, "Ready")
    assert (degraded["status"], degraded["reason"]) == ("True", "PlanRefused")
    assert (ready["status"], ready["reason"]) == ("False", "PlanRefused")
    assert "spec.tiers[0].engine.extraArgs[0]" in degraded["message"]
    assert ("Warning", "PlanRefused") in [(kind, reason) for kind, reason, _ in events.seen]


def test_a_child_event_after_a_refused_plan_keeps_the_refusal_in_status(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """The old children still report (a pod turns ready, a Deployment's status moves): the
    status refreshed from them still says the latest spec was refused - Stalled and Degraded
    True - instead of reporting the old children as the service (seen in a CI run: Flux
    then read Current where it should read Failed)."""
    kube.apply(manifest(), USER)
    reconciler.reconcile(service(kube))
    kube.apply(manifest(make_tier("small", engine={"extraArgs": ["--port=9000"]})), USER)
    reconciler.reconcile(service(kube))
    body = service(kube)
    assert reconciler.refresh_status(parse_service(body), body) is False  # nothing changed
    stalled, degraded = condition(kube, "Stalled"), condition(kube, "Degraded")
    assert (stalled["status"], stalled["reason"]) == ("True", "PlanRefused")
    assert (degraded["status"], degraded["reason"]) == ("True", "PlanRefused")
    # A spec the planner accepts again: the same refresh clears it.
    kube.apply(manifest(), USER)
    body = service(kube)
    reconciler.refresh_status(parse_service(body), body)
    assert condition(kube, "Stalled")["status"] == "False"


def test_a_refresh_reuses_the_plan_its_spec_was_reconciled_with(
    kube: FakeKube, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconcile of a spec planned it: the status refreshes of the same spec (each child
    event) read its refusal, downloads and sizes from that plan, and plan only a spec no
    reconcile has seen yet (a new generation, or after a restart)."""
    planned: list[int | None] = []

    def counted(svc: InferenceService, options: PlanOptions | None = None) -> ServicePlan:
        planned.append(svc.metadata.generation)
        return plan_service(svc, options)

    monkeypatch.setattr(reconcile, "plan_service", counted)
    kube.apply(manifest(make_tier("small", engine={"extraArgs": ["--port=9000"]})), USER)
    reconciler.reconcile(service(kube))
    body = service(kube)
    reconciler.refresh_status(parse_service(body), body)
    reconciler.refresh_status(parse_service(body), body)
    assert planned == [1]
    assert condition(kube, "Stalled")["reason"] == "PlanRefused"

    kube.apply(manifest(), USER)  # generation 2, not reconciled yet
    body = service(kube)
    reconciler.refresh_status(parse_service(body), body)
    assert planned == [1, 2]
    assert condition(kube, "Stalled")["status"] == "False"
    reconciler.forget(NS, "chat")
    reconciler.refresh_status(parse_service(body), body)
    assert planned == [1, 2, 2]


def test_a_new_service_with_a_refused_plan_creates_nothing(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """Never half-applied: a refused service's first reconcile writes its status and nothing
    else, and other services in the namespace are served as usual."""
    kube.apply(manifest(make_tier("small", engine={"extraArgs": ["--port=9000"]})), USER)
    kube.apply(manifest(name="other"), USER)
    refused = reconciler.reconcile(service(kube))
    served = reconciler.reconcile(service(kube, "other"))

    assert refused.refusal is not None
    assert refused.status_written
    assert served.refusal is None
    owners = {
        o["metadata"]["labels"]["fleetpilot.dev/service"]
        for kind in ("Deployment", "Service", "ConfigMap")
        for o in kube.objects(kind, NS)
    }
    assert owners == {"other"}
    assert condition(kube, "Degraded")["reason"] == "PlanRefused"


# -- multi-node roles (LeaderWorkerSet) ------------------------------------------------------


def leader_worker_set(kube: FakeKube, name: str) -> Obj:
    live = kube.object("LeaderWorkerSet", NS, name)
    assert live is not None, name
    return live


def roll_out_groups(kube: FakeKube, name: str, ready: int | None = None) -> None:
    """Play the LeaderWorkerSet controller: every group at the spec, ``ready`` of them
    (default all) Ready."""
    live = leader_worker_set(kube, name)
    groups = live["spec"]["replicas"]
    status = {
        "observedGeneration": live["metadata"]["generation"],
        "replicas": groups,
        "updatedReplicas": groups,
        "readyReplicas": groups if ready is None else ready,
    }
    kube.set_status("LeaderWorkerSet", NS, name, status)


def test_a_role_that_turns_multi_node_becomes_a_leader_worker_set_and_back(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """A role whose replica outgrows a node: its LeaderWorkerSet is applied, and its Deployment
    (and the Service the router found it by) pruned; its status counts the set's groups. Back
    on one node, the set is pruned and a Deployment runs the role again."""
    kube.apply(manifest(make_tier("small")), USER)
    reconciler.reconcile(service(kube))
    roll_out(kube)
    assert "chat-small" in names_of(kube, "Deployment")

    kube.apply(manifest(make_tier("small", **MULTI_NODE)), USER)
    events = Events()
    result = reconciler.reconcile(service(kube), events)
    assert "LeaderWorkerSet/chat-small" in result.applied
    assert "Service/chat-small-leaders" in result.applied
    assert sorted(result.pruned) == ["Deployment/chat-small", "Service/chat-small"]
    assert names_of(kube, "Deployment") == {"chat-router"}
    created = leader_worker_set(kube, "chat-small")
    assert created["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert created["spec"]["replicas"] == 1
    assert condition(kube, "Ready")["message"] == "tier small role unified: 0/1 ready"

    two_groups = {"replicas": {"min": 2, "max": 2}}
    fixed = make_tier("small", serving=two_groups, autoscaling={"mode": "disabled"}, **MULTI_NODE)
    kube.apply(manifest(fixed), USER)
    reconciler.reconcile(service(kube))
    roll_out_groups(kube, "chat-small", ready=1)
    body = service(kube)
    reconciler.refresh_status(parse_service(body), body)
    (role,) = service(kube)["status"]["tiers"][0]["roles"]
    assert (role["replicas"], role["ready"]) == (2, 1)  # groups, not their 4 pods
    roll_out_groups(kube, "chat-small")
    reconciler.refresh_status(parse_service(body), body)
    assert condition(kube, "Ready")["status"] == "True"
    assert reconciler.reconcile(service(kube)).applied == []  # settled: no write

    kube.apply(manifest(make_tier("small")), USER)
    back = reconciler.reconcile(service(kube))
    assert "Deployment/chat-small" in back.applied
    assert sorted(back.pruned) == ["LeaderWorkerSet/chat-small", "Service/chat-small-leaders"]
    assert kube.objects("LeaderWorkerSet", NS) == []


def test_without_leader_worker_set_a_multi_node_role_stalls_and_changes_nothing() -> None:
    """A cluster without the LeaderWorkerSet API: the operator neither lists nor prunes the
    kind (it is not served), a one-node service is served as usual, and a service whose role
    turns multi-node keeps its children as they are and reports Ready False, Degraded and
    Stalled True, reason LeaderWorkerSetMissing, with the planner's words (role, nodes, GPUs,
    what to install)."""
    kube = FakeKube(unserved=("PodMonitor", "LeaderWorkerSet"))
    reconciler = Reconciler(kube, PlanOptions(leader_worker_set_available=False))
    kube.apply(manifest(), USER)
    assert reconciler.reconcile(service(kube)).refusal is None
    children_before = {kind: kube.objects(kind, NS) for kind in ("Deployment", "Service")}

    kube.apply(manifest(make_tier("small", **MULTI_NODE)), USER)
    seen = len(kube.calls)
    events = Events()
    result = reconciler.reconcile(service(kube), events)

    writes = [(c.kind, c.subresource) for c in kube.calls[seen:] if c.method != "GET"]
    assert writes == [("InferenceService", "status")]
    assert (result.applied, result.pruned) == ([], [])
    assert {kind: kube.objects(kind, NS) for kind in children_before} == children_before
    assert result.refusal is not None
    assert result.refusal.reason == "LeaderWorkerSetMissing"
    for kind, state in [("Ready", "False"), ("Degraded", "True"), ("Stalled", "True")]:
        found = condition(kube, kind)
        assert (found["status"], found["reason"]) == (state, "LeaderWorkerSetMissing"), kind
        assert found["message"] == result.refusal.message
    message = result.refusal.message
    for words in ("tier 'small' role unified", "2 nodes", "8 GPUs", "gpusPerNode 4"):
        assert words in message
    assert "install LeaderWorkerSet" in message
    assert ("Warning", "LeaderWorkerSetMissing") in [(k, r) for k, r, _ in events.seen]
    # A child event refreshes the status: the refusal stays.
    body = service(kube)
    reconciler.refresh_status(parse_service(body), body)
    assert condition(kube, "Stalled")["reason"] == "LeaderWorkerSetMissing"
    assert [c.path for c in kube.calls if c.kind == "LeaderWorkerSet"] == []  # never asked


def test_a_leader_worker_set_crd_removed_after_start_fails_no_reconcile() -> None:
    """The operator found LeaderWorkerSet at start, and the CRD is uninstalled since: listing
    the kind (to prune) answers 404, which means none - a one-node service still reconciles
    and rolls out, instead of every reconcile failing until the operator restarts."""
    kube = FakeKube(unserved=("PodMonitor", "LeaderWorkerSet"))
    reconciler = Reconciler(kube, PlanOptions(leader_worker_set_available=True))
    kube.apply(manifest(), USER)
    result = reconciler.reconcile(service(kube))
    assert "Deployment/chat-small" in result.applied
    # Listed (children to prune, workloads for the status), found missing: no write tried.
    assert {c.method for c in kube.calls if c.kind == "LeaderWorkerSet"} == {"GET"}
    roll_out(kube)
    assert reconciler.reconcile(service(kube)).status_written
    assert condition(kube, "Ready")["status"] == "True"


def test_replicas_the_autoscaler_set_on_a_leader_worker_set_survive_a_reapplied_spec(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """The autoscaler scales a multi-node role's LeaderWorkerSet through its /scale (groups,
    under its own field manager); a changed spec re-applies the set without replicas, so the
    autoscaler's value and its ownership stay."""
    tier = make_tier("small", autoscaling={"slo": {"ttftP95": "500ms"}}, **MULTI_NODE)
    kube.apply(manifest(tier), USER)
    reconciler.reconcile(service(kube))
    created = leader_worker_set(kube, "chat-small")
    assert created["spec"]["replicas"] == 1
    assert owns_field(created, OPERATOR_MANAGER, ("spec", "replicas"))

    actuator = KubernetesActuator(kube, metrics=AutoscalerMetrics(CollectorRegistry()))
    actuator.scale(parse_service(service(kube)), "small", "unified", 3)
    (scaled,) = kube.writes_of("PATCH", "LeaderWorkerSet", "scale")
    assert scaled.path.endswith("/leaderworkersets/chat-small/scale")
    assert kube.writes_of("PATCH", "Deployment", "scale") == []
    changed = manifest(dict(tier, engine={"env": [{"name": "EXTRA", "value": "1"}]}))
    kube.apply(changed, USER)
    result = reconciler.reconcile(service(kube))

    assert "LeaderWorkerSet/chat-small" in result.applied
    updated = leader_worker_set(kube, "chat-small")
    leader = updated["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert {"name": "EXTRA", "value": "1"} in leader["env"]
    assert updated["spec"]["replicas"] == 3
    assert owns_field(updated, AUTOSCALER_MANAGER, ("spec", "replicas"))
    assert not owns_field(updated, OPERATOR_MANAGER, ("spec", "replicas"))


def test_a_multi_node_role_waits_for_its_model_and_the_gc_waits_for_its_rollout(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """With a model cache: the LeaderWorkerSet is applied only once its download is complete,
    and the cache's GC Job only once the set is rolled out to it (its groups, read from the
    set's status)."""
    hub = make_tier("big", **MULTI_NODE) | {
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "source": {"huggingface": {}}}
    }
    cached = make_manifest(
        namespace=NS, tiers=[hub], modelCache={"size": "200Gi", "storageClassName": "nfs"}
    )
    kube.apply(cached, USER)
    first = reconciler.reconcile(service(kube))
    (download,) = [j["metadata"]["name"] for j in kube.objects("Job", NS)]
    assert first.waiting_for_model == {"chat-big": download}
    assert kube.objects("LeaderWorkerSet", NS) == []
    kube.set_status(
        "Job",
        NS,
        download,
        {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]},
    )

    second = reconciler.reconcile(service(kube))
    assert "LeaderWorkerSet/chat-big" in second.applied
    assert second.waiting_to_collect == ["LeaderWorkerSet chat-big"]  # created, not rolled out
    assert names_of(kube, "Job") == {download}

    roll_out_groups(kube, "chat-big", ready=0)  # every group at the spec, none Ready yet
    third = reconciler.reconcile(service(kube))
    assert third.waiting_to_collect == []
    assert len(names_of(kube, "Job")) == 2  # the GC Job now


def test_a_gateway_services_pool_is_applied_and_its_acceptance_reaches_status(
    kube: FakeKube, reconciler: Reconciler
) -> None:
    """routing.gateway: the InferencePool and HTTPRoute are applied with the rest; the status
    says Unknown until a gateway controller writes the pool's parents, then what it said; the
    gateway removed from the spec prunes both and the condition."""
    body = manifest()
    body["spec"]["routing"] = {"gateway": {"parentRefs": [{"name": "gw"}]}}
    kube.apply(body, USER)
    result = reconciler.reconcile(service(kube))
    assert "InferencePool/chat" in result.applied
    assert "HTTPRoute/chat" in result.applied
    assert condition(kube, "GatewayAccepted")["reason"] == "NoParent"
    kube.set_status(
        "InferencePool",
        NS,
        "chat",
        {
            "parents": [
                {
                    "parentRef": {"name": "gw"},
                    "conditions": [
                        {"type": kind, "status": "True", "reason": kind, "message": ""}
                        for kind in ("Accepted", "ResolvedRefs")
                    ],
                }
            ]
        },
    )
    reconciler.refresh_status(parse_service(service(kube)), service(kube))
    accepted = condition(kube, "GatewayAccepted")
    assert (accepted["status"], accepted["message"]) == ("True", "accepted by Gateway ml/gw")
    kube.apply(manifest(), USER)
    pruned = reconciler.reconcile(service(kube))
    assert {"InferencePool/chat", "HTTPRoute/chat"} <= set(pruned.pruned)
    kinds = {c["type"] for c in service(kube)["status"]["conditions"]}
    assert "GatewayAccepted" not in kinds


def test_a_cluster_without_inference_pools_still_serves_and_says_so(kube: FakeKube) -> None:
    reconciler = Reconciler(kube, PlanOptions(inference_pools_available=False))
    body = manifest()
    body["spec"]["routing"] = {"gateway": {}}
    kube.apply(body, USER)
    result = reconciler.reconcile(service(kube))
    assert result.refusal is None
    assert not [key for key in result.applied if key.startswith("InferencePool/")]
    missing = condition(kube, "GatewayAccepted")
    assert (missing["status"], missing["reason"]) == ("False", "InferencePoolMissing")
