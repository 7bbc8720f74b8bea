"""Cold starts measured from the pods' own timestamps: each start counted once, the last ten
kept in status across pods going away, summarized as p50 and max, and observed once as a
metric by the status write that records it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from fleetpilot.api import parse_service
from fleetpilot.api.status import (
    COLD_START_SAMPLES,
    ColdStart,
    ColdStartSample,
    DurationSummary,
    InferenceServiceStatus,
    RoleStatus,
    ScaleRecord,
    TierStatus,
)
from fleetpilot.kube import names
from fleetpilot.kube.client import Obj
from fleetpilot.operator import metrics
from fleetpilot.operator.cold_start import (
    ENGINE_CONTAINER,
    cold_start,
    merge,
    new_samples,
    pod_sample,
    samples_by_role,
    summarize,
)
from fleetpilot.operator.planner import plan
from fleetpilot.operator.reconcile import Reconciler
from fleetpilot.operator.status import Observed, compute_status
from tests.factories import make_manifest, make_service, make_tier
from tests.support.kube import FakeKube

T0 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def engine_pod(
    name: str = "chat-small-7d4f9-abcde",
    *,
    created: datetime = T0 - timedelta(seconds=60),
    started: datetime | None = T0,
    ready: datetime | None = T0 + timedelta(seconds=42),
    ready_status: str = "True",
    restarts: int = 0,
    tier: str = "small",
    role: str = "unified",
    deleting: bool = False,
    service: str = "chat",
    namespace: str = "ml",
) -> Obj:
    """An engine pod as the API server returns it (the parts that matter here)."""
    metadata: Obj = {
        "name": name,
        "namespace": namespace,
        "creationTimestamp": _stamp(created),
        "labels": {
            names.LABEL_SERVICE: service,
            names.LABEL_TIER: tier,
            names.LABEL_ROLE: role,
            names.LABEL_COMPONENT: "engine",
        },
    }
    if deleting:
        metadata["deletionTimestamp"] = _stamp(NOW)
    state: Obj = (
        {"running": {"startedAt": _stamp(started)}}
        if started is not None
        else {"waiting": {"reason": "ContainerCreating"}}
    )
    conditions: list[Obj] = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": _stamp(created)}
    ]
    if ready is not None:
        conditions.append(
            {"type": "Ready", "status": ready_status, "lastTransitionTime": _stamp(ready)}
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": ENGINE_CONTAINER, "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "conditions": conditions,
            "containerStatuses": [
                {"name": ENGINE_CONTAINER, "restartCount": restarts, "state": state}
            ],
        },
    }


def sample(
    pod: str, started: datetime, start_s: int = 42, pod_s: int | None = 102
) -> ColdStartSample:
    return ColdStartSample(
        pod=pod,
        started_at=started,
        ready_at=started + timedelta(seconds=start_s),
        start_seconds=start_s,
        pod_seconds=pod_s,
    )


# -- one pod ------------------------------------------------------------------------------


def test_a_ready_pod_gives_its_start_and_pod_durations() -> None:
    """Container start 10:00:00 -> Ready 10:00:42 is the engine's 42 s; created 09:59:00 ->
    Ready is the 102 s a scale-up waited."""
    assert pod_sample(engine_pod()) == ColdStartSample(
        pod="chat-small-7d4f9-abcde",
        started_at=T0,
        ready_at=T0 + timedelta(seconds=42),
        start_seconds=42,
        pod_seconds=102,
    )


@pytest.mark.parametrize(
    "pod",
    [
        pytest.param(engine_pod(ready=None), id="no Ready condition yet"),
        pytest.param(engine_pod(ready_status="False"), id="Ready False"),
        pytest.param(engine_pod(started=None), id="engine container not running"),
        pytest.param(engine_pod(deleting=True), id="being deleted"),
        pytest.param(
            engine_pod(ready=T0 - timedelta(seconds=5)), id="Ready older than the container"
        ),
    ],
)
def test_no_sample_from_a_pod_that_has_not_completed_this_start(pod: Obj) -> None:
    assert pod_sample(pod) is None


def test_only_the_engine_container_is_timed() -> None:
    """A sidecar's start says nothing about the engine's: without an engine container's
    status there is no sample, and the engine's is the one read beside others."""
    pod = engine_pod()
    (engine,) = pod["status"]["containerStatuses"]
    sidecar = {**engine, "name": "proxy", "state": {"running": {"startedAt": _stamp(T0)}}}
    pod["status"]["containerStatuses"] = [sidecar]
    assert pod_sample(pod) is None
    engine["state"] = {"running": {"startedAt": _stamp(T0 + timedelta(seconds=12))}}
    pod["status"]["containerStatuses"] = [sidecar, engine]
    found = pod_sample(pod)
    assert found is not None
    assert found.start_seconds == 30


def test_the_planned_engine_container_has_the_name_that_is_timed() -> None:
    """Held to engine_objects: a renamed container would silently stop every measurement."""
    (deployment,) = [
        o
        for o in plan(make_service())
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-small"
    ]
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [ENGINE_CONTAINER]


def test_a_restarted_container_is_a_new_start_without_a_pod_duration() -> None:
    """restartCount 1, running since 10:05:00, Ready 10:05:30: a 30 s start; the pod was
    created long before for its first start, so no pod duration."""
    restarted = engine_pod(
        started=T0 + timedelta(minutes=5), ready=T0 + timedelta(minutes=5, seconds=30), restarts=1
    )
    found = pod_sample(restarted)
    assert found is not None
    assert (found.start_seconds, found.pod_seconds) == (30, None)
    first = cold_start(None, [pod_sample(engine_pod())])  # type: ignore[list-item]
    both = cold_start(first, [found])
    assert both is not None
    assert [(s.started_at, s.start_seconds) for s in both.samples] == [
        (T0, 42),
        (T0 + timedelta(minutes=5), 30),
    ]
    assert both.pod == DurationSummary(count=1, p50_seconds=102, max_seconds=102)


def test_pods_are_grouped_by_tier_and_role_and_others_ignored() -> None:
    router = engine_pod("chat-router-1")
    del router["metadata"]["labels"][names.LABEL_TIER]
    del router["metadata"]["labels"][names.LABEL_ROLE]
    found = samples_by_role(
        [
            engine_pod("a", tier="small", role="prefill"),
            engine_pod("b", tier="small", role="decode"),
            engine_pod("c", tier="small", role="decode", ready=None),
            router,
        ]
    )
    assert {key: [s.pod for s in samples] for key, samples in found.items()} == {
        ("small", "prefill"): ["a"],
        ("small", "decode"): ["b"],
    }


def test_a_multi_node_groups_start_is_its_leaders() -> None:
    """Of a LeaderWorkerSet group only the leader is timed: a worker (no HTTP server, no
    readiness probe) is Ready as soon as it runs, long before the engine serves."""
    leader = engine_pod("dense-main-0", ready=T0 + timedelta(seconds=300))
    worker = engine_pod("dense-main-0-1", ready=T0 + timedelta(seconds=1))
    leader["metadata"]["labels"][names.LWS_WORKER_INDEX_LABEL] = "0"
    worker["metadata"]["labels"][names.LWS_WORKER_INDEX_LABEL] = "1"
    found = samples_by_role([leader, worker])
    assert [s.pod for s in found[("small", "unified")]] == ["dense-main-0"]


# -- a role's history ---------------------------------------------------------------------


def test_the_same_start_seen_again_is_one_sample_as_first_recorded() -> None:
    """Every status refresh sees the Ready pod again: still one sample. After a readiness flap
    (Ready False, then True again at 10:30, same container) it is still the 42 s start."""
    first = cold_start(None, [pod_sample(engine_pod())])  # type: ignore[list-item]
    again = cold_start(first, [pod_sample(engine_pod())])  # type: ignore[list-item]
    assert again == first
    flapped = pod_sample(engine_pod(ready=T0 + timedelta(minutes=30)))
    assert flapped is not None
    after_flap = cold_start(first, [flapped])
    assert after_flap == first
    assert after_flap is not None
    assert after_flap.count == 1
    assert after_flap.samples[0].start_seconds == 42


def test_only_the_last_ten_starts_are_kept_and_an_older_one_never_comes_back() -> None:
    """Twelve starts a minute apart: the ten latest by startedAt stay, oldest first. A start
    pushed out (its pod still Ready, then flapping: its Ready moved to now) is not added back,
    nor is a start older than every kept one."""
    starts = [sample(f"pod-{i:02d}", T0 + timedelta(minutes=i)) for i in range(12)]
    kept = merge([], starts)
    assert len(kept) == COLD_START_SAMPLES == 10
    assert [s.pod for s in kept] == [f"pod-{i:02d}" for i in range(2, 12)]
    flapped = sample("pod-00", T0, start_s=3000)
    older = sample("pod-old", T0 - timedelta(hours=1))
    assert merge(kept, [flapped, older]) == kept
    newer = sample("pod-12", T0 + timedelta(minutes=12))
    assert [s.pod for s in merge(kept, [newer])] == [f"pod-{i:02d}" for i in range(3, 13)]


def test_p50_and_max_of_each_duration() -> None:
    """start 10/20/30/50 s: p50 20 (the lower middle, an observed value), max 50. Pod
    durations only where the start was the pod's first: 100/300 -> p50 100, max 300."""
    samples = [
        sample("a", T0, 30, 300),
        sample("b", T0 + timedelta(minutes=1), 10, None),
        sample("c", T0 + timedelta(minutes=2), 50, 100),
        sample("d", T0 + timedelta(minutes=3), 20, None),
    ]
    summary = summarize(samples)
    assert summary is not None
    assert summary.count == 4
    assert summary.start == DurationSummary(count=4, p50_seconds=20, max_seconds=50)
    assert summary.pod == DurationSummary(count=2, p50_seconds=100, max_seconds=300)
    odd = summarize(samples[:3])
    assert odd is not None
    assert odd.start.p50_seconds == 30
    assert summarize([]) is None
    restarts_only = summarize([samples[1]])
    assert restarts_only is not None
    assert restarts_only.pod is None


def test_new_samples_are_those_the_status_did_not_record_before() -> None:
    def status(*samples: ColdStartSample) -> InferenceServiceStatus:
        role = RoleStatus(role="unified", cold_start=summarize(list(samples)))
        return InferenceServiceStatus(tiers=[TierStatus(name="small", roles=[role])])

    a, b = sample("a", T0), sample("b", T0 + timedelta(minutes=1))
    assert new_samples(None, status(a)) == [("small", "unified", a)]
    assert new_samples(status(a), status(a, b)) == [("small", "unified", b)]
    assert new_samples(status(a, b), status(a, b)) == []
    assert new_samples(status(a, b), status()) == []


# -- in the status ------------------------------------------------------------------------


def test_compute_status_records_cold_starts_per_role_and_keeps_them_when_pods_go() -> None:
    """A disaggregated tier: the decode pod's start lands on decode, prefill has none yet; the
    autoscaler's fields stay beside it; with the pod gone, the next status still has it."""
    service = make_service(tiers=[make_tier("small", mode="disaggregated")])
    pod = engine_pod("chat-small-decode-1", role="decode")
    status = compute_status(service, Observed({}, [pod]), None, NOW)
    roles = {r.role: r for r in status.tiers[0].roles}
    assert roles["prefill"].cold_start is None
    decode = roles["decode"].cold_start
    assert decode is not None
    assert (decode.count, decode.start.p50_seconds, decode.pod) == (
        1,
        42,
        DurationSummary(count=1, p50_seconds=102, max_seconds=102),
    )
    wire = {r["role"]: r for r in status.to_wire()["tiers"][0]["roles"]}
    assert "coldStart" not in wire["prefill"]
    assert wire["decode"]["coldStart"] == {
        "count": 1,
        "start": {"count": 1, "p50Seconds": 42, "maxSeconds": 42},
        "pod": {"count": 1, "p50Seconds": 102, "maxSeconds": 102},
        "samples": [
            {
                "pod": "chat-small-decode-1",
                "startedAt": "2026-12-04T10:00:00Z",
                "readyAt": "2026-12-04T10:00:42Z",
                "startSeconds": 42,
                "podSeconds": 102,
            }
        ],
    }

    scaled = RoleStatus(
        role="decode",
        desired=3,
        last_scale=ScaleRecord(time=NOW, from_replicas=1, to_replicas=3, reason="r"),
        cold_start=decode,
    )
    written = InferenceServiceStatus.model_validate(status.to_wire(), by_alias=True)
    previous = written.model_copy(
        update={"tiers": [TierStatus(name="small", roles=[roles["prefill"], scaled])]}
    )
    later = compute_status(service, Observed({}, []), previous, NOW + timedelta(minutes=1))
    (kept,) = [r for r in later.tiers[0].roles if r.role == "decode"]
    assert kept.cold_start == decode
    assert kept.desired == 3
    assert kept.last_scale == scaled.last_scale


def test_the_status_round_trips_through_its_wire_form() -> None:
    """What the operator writes is what it reads back as the previous status: the same
    samples, so nothing is counted twice after a restart."""
    summary = cold_start(None, [sample("a", T0), sample("b", T0, 7, None)])
    assert summary is not None
    role = RoleStatus(role="unified", cold_start=summary)
    status = InferenceServiceStatus(tiers=[TierStatus(name="small", roles=[role])])
    read = InferenceServiceStatus.model_validate(status.to_wire(), by_alias=True)
    assert read == status
    assert new_samples(read, status) == []


# -- the metric, observed by the status write ---------------------------------------------


@pytest.fixture
def forgotten() -> Iterator[None]:
    yield
    metrics.forget("coldstart", "chat")


def _observations(phase: str) -> float | None:
    labels = {
        "namespace": "coldstart",
        "service": "chat",
        "tier": "small",
        "role": "unified",
        "phase": phase,
    }
    return REGISTRY.get_sample_value("fleetpilot_operator_engine_cold_start_seconds_count", labels)


def _sum(phase: str) -> float | None:
    labels = {
        "namespace": "coldstart",
        "service": "chat",
        "tier": "small",
        "role": "unified",
        "phase": phase,
    }
    return REGISTRY.get_sample_value("fleetpilot_operator_engine_cold_start_seconds_sum", labels)


def test_each_recorded_start_is_observed_once_by_the_write_that_records_it(
    forgotten: None,
) -> None:
    """The reconciler (against the in-memory API server) writes the status with the pod's
    start and observes 42 s (start) and 102 s (pod); refreshes that record nothing new
    observe nothing; a restart adds one start observation; deleting the service's series
    drops them."""
    kube = FakeKube()
    reconciler = Reconciler(kube)
    live = kube.apply(make_manifest("chat", namespace="coldstart"), "kubectl")
    kube.put(engine_pod(namespace="coldstart"))
    reconciler.reconcile(live)
    live = kube.get("InferenceService", "coldstart", "chat")
    assert live is not None
    (role,) = live["status"]["tiers"][0]["roles"]
    assert role["coldStart"]["samples"][0]["startSeconds"] == 42
    assert (_observations("start"), _sum("start")) == (1.0, 42.0)
    assert (_observations("pod"), _sum("pod")) == (1.0, 102.0)

    assert not reconciler.refresh_status(parse_service(live), live)
    assert (_observations("start"), _observations("pod")) == (1.0, 1.0)

    kube.put(
        engine_pod(
            namespace="coldstart",
            started=T0 + timedelta(minutes=5),
            ready=T0 + timedelta(minutes=5, seconds=30),
            restarts=1,
        )
    )
    live = kube.get("InferenceService", "coldstart", "chat")
    assert live is not None
    assert reconciler.refresh_status(parse_service(live), live)
    assert (_observations("start"), _sum("start")) == (2.0, 72.0)
    assert _observations("pod") == 1.0

    metrics.forget("coldstart", "chat")
    assert _observations("start") is None


def test_cold_start_in_the_status_bounds_of_the_crd() -> None:
    """The model refuses what the CRD refuses: more samples than are kept, none at all."""
    too_many = [sample(f"p{i}", T0 + timedelta(minutes=i)) for i in range(11)]
    with pytest.raises(ValueError, match="at most 10"):
        ColdStart(
            count=10,
            start=DurationSummary(count=10, p50_seconds=42, max_seconds=42),
            samples=too_many,
        )
    with pytest.raises(ValueError, match="at least 1"):
        ColdStart(count=1, start=DurationSummary(count=1, p50_seconds=1, max_seconds=1), samples=[])


def test_a_status_export_keeps_the_observations_and_forgetting_the_service_drops_them(
    forgotten: None,
) -> None:
    """export_status replaces the service's gauges on every event; the histogram is not a
    gauge of the status and must survive it (a scrape between events would lose it)."""
    metrics.observe_cold_starts("coldstart", "chat", [("small", "unified", sample("a", T0))])
    metrics.export_status({"metadata": {"namespace": "coldstart", "name": "chat"}, "status": {}})
    assert (_observations("start"), _observations("pod")) == (1.0, 1.0)
    metrics.forget("coldstart", "chat")
    assert (_observations("start"), _observations("pod")) == (None, None)
