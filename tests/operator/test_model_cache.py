"""The model cache's garbage collection: the GC Job the planner adds for a cache the operator
created, what it keeps, when it is renamed, and the reconciler holding it until every download
is complete and every engine Deployment is rolled out to them."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from fleetpilot.api import parse_service
from fleetpilot.kube import names
from fleetpilot.kube.client import Obj
from fleetpilot.operator.model_cache import (
    ANNOTATION_AFTER_ROLLOUT,
    ANNOTATION_FETCH_JOB,
    GC_COMPONENT,
)
from fleetpilot.operator.plan_types import JobComplete, PlanOptions, RolledOut
from fleetpilot.operator.planner import plan, plan_service
from fleetpilot.operator.reconcile import Reconciler
from fleetpilot.operator.waits import unmet
from tests.factories import make_service
from tests.operator.delivery_support import (
    CACHE,
    MODEL,
    NS,
    S3,
    apply_service,
    complete,
    jobs_of,
    model_ready,
    planned,
    tier_with,
)
from tests.support.kube import FakeKube

DRAFT = "org/eagle3-draft"


def gc_of(objects: list[Obj]) -> Obj | None:
    found = jobs_of(objects, GC_COMPONENT)
    assert len(found) <= 1
    return found[0] if found else None


def command_of(job: Obj) -> list[str]:
    return job["spec"]["template"]["spec"]["containers"][0]["command"]  # type: ignore[no-any-return]


def keeps(job: Obj) -> list[str]:
    pairs = pairwise(command_of(job))
    return [f"{flag} {value}" for flag, value in pairs if flag.startswith("--keep-")]


def speculative(tier: Obj) -> Obj:
    return tier | {"engine": {"speculative": {"method": "eagle3", "model": DRAFT, "numTokens": 4}}}


# -- planning -------------------------------------------------------------------------------


def test_the_gc_job_keeps_every_planned_download_and_runs_as_the_fetch_jobs_run() -> None:
    """Each download the tiers plan (a model, its draft, an S3 location) is kept, once; the GC
    Job waits for every fetch Job and every engine Deployment, and its pod is a fetch pod's
    twin (image, security, the cache mounted writable) without the service's label."""
    options = PlanOptions(fleetpilot_image="registry.example/fleetpilot:1")
    small = speculative(tier_with({"huggingface": {"revision": "a1"}}, "small", up_to=0.4))
    objects = planned([small, tier_with({"s3": S3}, "large")], options, modelCache=CACHE)
    fetches = jobs_of(objects)
    gc = gc_of(objects)
    assert gc is not None
    # The S3 download is kept by its folder, where its fetch Job writes it.
    s3_dest = next(c[c.index("--dest") + 1] for c in map(command_of, fetches) if "--dest" in c)
    assert command_of(gc) == [
        "fleetpilot", "model", "gc", "--hub-cache-dir", "/model-cache/hub",
        "--s3-dir", "/model-cache/s3",
        "--keep-hub", f"{MODEL}@a1", "--keep-hub", f"{DRAFT}@main",
        "--keep-s3", s3_dest.removeprefix("/model-cache/s3/"),
    ]  # fmt: skip
    annotations = gc["metadata"]["annotations"]
    assert annotations[ANNOTATION_FETCH_JOB].split(",") == [j["metadata"]["name"] for j in fetches]
    assert annotations[ANNOTATION_AFTER_ROLLOUT] == "chat-small,chat-large"
    assert gc["metadata"]["labels"][names.LABEL_COMPONENT] == "model-gc"
    assert gc["metadata"]["labels"][names.LABEL_SERVICE] == "chat"  # listed and pruned as ours

    pod, fetch_pod = gc["spec"]["template"]["spec"], fetches[0]["spec"]["template"]["spec"]
    assert names.LABEL_SERVICE not in gc["spec"]["template"]["metadata"]["labels"]
    assert pod["securityContext"] == fetch_pod["securityContext"]
    assert pod["volumes"] == fetch_pod["volumes"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["readOnly"] is False
    (container,), (fetcher,) = pod["containers"], fetch_pod["containers"]
    for key in ("image", "securityContext", "volumeMounts"):
        assert container[key] == fetcher[key], key
    assert container["image"] == "registry.example/fleetpilot:1"
    assert "HF_TOKEN" not in str(container["env"])  # it reads nothing from the Hub


def test_no_gc_job_for_a_named_claim_and_one_keeping_nothing_without_downloads() -> None:
    """A claim named in the spec may be shared by other services: their downloads are not in
    this plan, so nothing is collected there. A created cache whose tiers no longer download
    (an OCI model now) is emptied once the engines rolled away from it."""
    hub = [tier_with({})]
    assert gc_of(planned(hub, modelCache={"claimName": "shared-models"})) is None
    assert gc_of(planned(hub)) is None
    gc = gc_of(planned([tier_with({"oci": {"image": "registry.example/m:1"}})], modelCache=CACHE))
    assert gc is not None
    assert keeps(gc) == []
    assert ANNOTATION_FETCH_JOB not in gc["metadata"]["annotations"]
    assert gc["metadata"]["annotations"][ANNOTATION_AFTER_ROLLOUT] == "chat-small"


def name_of(tiers: list[Obj], options: PlanOptions | None = None) -> str:
    gc = gc_of(planned(tiers, options, modelCache=CACHE))
    assert gc is not None
    return gc["metadata"]["name"]  # type: ignore[no-any-return]


def test_the_gc_job_is_renamed_when_what_it_keeps_changes_and_only_then() -> None:
    """Named by its container: the same kept set is the same Job (it ran; it does not run
    again), whatever the tiers around it; another revision, another model or another image is
    a new Job, which runs once."""
    small = tier_with({"huggingface": {"revision": "r1"}}, "small", up_to=0.4)
    large = tier_with({"huggingface": {"revision": "r1"}}, "large")
    first = name_of([small, large])
    assert name_of([small | {"name": "tiny"}, large]) == first  # renamed tier, same model
    assert name_of([tier_with({"huggingface": {"revision": "r1"}})]) == first  # one reader left
    bigger = large | {"resources": {"cpu": "8", "memory": "64Gi"}}
    assert name_of([small, bigger]) == first
    assert name_of([small, tier_with({"huggingface": {"revision": "r2"}}, "large")]) != first
    assert name_of([small, speculative(large)]) != first
    assert name_of([small, large], PlanOptions(fleetpilot_image="fleetpilot:2")) != first


def test_the_plan_says_what_the_gc_job_and_the_engines_wait_for() -> None:
    """The planner, not an annotation read back, says what holds each object: an engine
    workload its model's downloads; the GC Job every download and every engine's rollout."""
    small = speculative(tier_with({"huggingface": {"revision": "a1"}}, "small", up_to=0.4))
    service = make_service(tiers=[small, tier_with({"s3": S3}, "large")], modelCache=CACHE)
    planned_service = plan_service(service)
    waits = {item.key: item.waits_for for item in planned_service.objects if item.waits_for}
    small_jobs = [JobComplete(d.job) for d in planned_service.downloads[:2]]
    large_jobs = [JobComplete(planned_service.downloads[2].job)]
    (gc,) = [key for key in waits if key[0] == "Job"]
    assert waits == {
        ("Deployment", "chat-small"): tuple(small_jobs),
        ("Deployment", "chat-large"): tuple(large_jobs),
        gc: (
            *small_jobs,
            *large_jobs,
            RolledOut("Deployment", "chat-small"),
            RolledOut("Deployment", "chat-large"),
        ),
    }
    # The planner's objects as `fleetpilot plan` shows them, in the same order.
    assert [item.obj for item in planned_service.objects] == plan(service)


def workload(**status: Any) -> Obj:
    return {"metadata": {"generation": 2}, "status": status}


@pytest.mark.parametrize(
    ("live", "expected"),
    [
        (None, False),  # not created yet, or held back: not as planned
        (workload(observedGeneration=1, replicas=1, updatedReplicas=1), False),
        (workload(observedGeneration=2, replicas=3, updatedReplicas=1), False),
        (workload(observedGeneration=2, replicas=2, updatedReplicas=2), True),
        (workload(observedGeneration=2), True),  # scaled to zero
    ],
)
def test_a_rollout_waits_for_the_controller_and_for_every_old_pod_to_go(
    live: Obj | None, expected: bool
) -> None:
    as_planned = {("Deployment", "chat-small"): live} if live is not None else {}
    waits = [RolledOut("Deployment", "chat-small")]
    assert (unmet(waits, {}, as_planned) == []) is expected


def test_a_download_is_waited_for_until_its_job_completed() -> None:
    running = {"status": {"active": 1}}
    done = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    waits = [JobComplete("a"), JobComplete("b")]
    assert unmet(waits, {"a": running}, {}) == waits
    assert unmet(waits, {"a": done, "b": running}, {}) == [JobComplete("b")]
    assert unmet(waits, {"a": done, "b": done}, {}) == []


# -- reconcile ------------------------------------------------------------------------------


def roll_out(kube: FakeKube, replicas: int = 1, old_pods: int = 0) -> None:
    """Play the Deployment controller: it saw the spec; ``old_pods`` of the previous template
    are left beside ``replicas`` new ones."""
    live = kube.object("Deployment", NS, "chat-small")
    assert live is not None
    status = {"observedGeneration": live["metadata"]["generation"]}
    status |= {"replicas": replicas + old_pods, "updatedReplicas": replicas}
    kube.set_status("Deployment", NS, "chat-small", status)


def gc_jobs(kube: FakeKube) -> list[Obj]:
    return jobs_of(kube.objects("Job", NS), GC_COMPONENT)


def test_the_gc_runs_once_the_downloads_are_complete_and_the_engines_rolled_out(
    kube: FakeKube,
) -> None:
    """The GC Job is held while a download runs, and after it while the tier rolls (old pods
    could start again and read the old revision); the refresh that sees the rollout done asks
    for a reconcile, which applies it. A new revision prunes the old GC Job with the old fetch
    Job, and its own waits the same way. ModelReady never waits for it."""
    reconciler = Reconciler(kube)
    due: list[tuple[str, str]] = []
    reconciler.on_collection_due = lambda namespace, name: due.append((namespace, name))

    def refresh(revision: str) -> None:
        body = apply_service(kube, revision)
        reconciler.refresh_status(parse_service(body), body)

    first = reconciler.reconcile(apply_service(kube, "r1"))
    (r1,) = [j["metadata"]["name"] for j in kube.objects("Job", NS)]
    assert first.waiting_to_collect == [f"Job {r1}", "Deployment chat-small"]
    assert "chat-model-gc" not in str(first.waiting_for_model)

    complete(kube, r1)
    second = reconciler.reconcile(apply_service(kube, "r1"))
    assert second.waiting_to_collect == ["Deployment chat-small"]  # created, not rolled out
    assert model_ready(kube) == ("True", "Downloaded")
    refresh("r1")
    assert due == []

    roll_out(kube)
    refresh("r1")
    assert due == [(NS, "chat")]
    reconciler.reconcile(apply_service(kube, "r1"))
    (gc,) = gc_jobs(kube)
    assert keeps(gc) == [f"--keep-hub {MODEL}@r1"]
    assert due == [(NS, "chat")]  # the reconcile that applied it asks for none more
    due.clear()
    refresh("r1")
    assert due == []  # applied: nothing more to ask for
    assert reconciler.reconcile(apply_service(kube, "r1")).applied == []

    third = reconciler.reconcile(apply_service(kube, "r2"))
    (r2,) = [j["metadata"]["name"] for j in jobs_of(kube.objects("Job", NS))]
    assert r2 != r1
    assert gc_jobs(kube) == []  # pruned with the old download: it kept r1
    assert third.waiting_to_collect == [f"Job {r2}", "Deployment chat-small"]

    complete(kube, r2)
    fourth = reconciler.reconcile(apply_service(kube, "r2"))  # the tier rolls now
    assert fourth.waiting_to_collect == ["Deployment chat-small"]
    roll_out(kube, old_pods=1)  # the new pod is up, the old one still serves
    refresh("r2")
    assert due == []
    assert reconciler.reconcile(apply_service(kube, "r2")).waiting_to_collect == [
        "Deployment chat-small"
    ]
    assert gc_jobs(kube) == []

    roll_out(kube)
    refresh("r2")
    assert due == [(NS, "chat")]
    reconciler.reconcile(apply_service(kube, "r2"))
    (gc,) = gc_jobs(kube)
    assert keeps(gc) == [f"--keep-hub {MODEL}@r2"]
    assert model_ready(kube) == ("True", "Downloaded")


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()
