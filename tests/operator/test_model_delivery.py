"""How a tier's weights reach its engine pods: OCI images, S3, and the service's model cache
(its claim, the download Jobs, and engine Deployments that wait for them)."""

from __future__ import annotations

import io
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.api.status import ConditionStatus
from fleetpilot.delivery.plan import RemoteFile
from fleetpilot.delivery.progress import Progress
from fleetpilot.kube.client import KubeError, Obj
from fleetpilot.logs import json_formatter
from fleetpilot.operator.model_cache import (
    ANNOTATION_FETCH_JOB,
    DownloadProgress,
    download_progress,
    model_ready_condition,
)
from fleetpilot.operator.plan_types import PlanError, PlanOptions
from fleetpilot.operator.planner import plan_service
from fleetpilot.operator.reconcile import JOB_NAME_LABEL, Reconciler
from tests.factories import make_manifest, make_service, make_tier
from tests.operator.delivery_support import (
    CACHE,
    MODEL,
    NS,
    S3,
    apply_service,
    complete,
    env_of,
    jobs_of,
    model_ready,
    only,
    planned,
    pod_of,
    tier_with,
)
from tests.support.kube import FakeKube

# -- OCI ------------------------------------------------------------------------------------


def test_an_oci_model_is_an_image_volume_where_the_cluster_mounts_images() -> None:
    """On an API server with image volumes on (>= 1.35), the image's model directory is
    mounted read-only at /models and vLLM loads it there; no init container copies it."""
    oci = {"image": "registry.example/qwen@sha256:0f1e", "path": "/models/qwen"}
    pod = pod_of(planned([tier_with({"oci": oci})], PlanOptions(image_volumes=True)))
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert volume == {
        "name": "models",
        "image": {"reference": "registry.example/qwen@sha256:0f1e", "pullPolicy": "IfNotPresent"},
    }
    (engine,) = pod["containers"]
    (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "models"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True,
                     "subPath": "models/qwen"}  # fmt: skip
    assert engine["args"][0] == "/models"
    assert "initContainers" not in pod


def test_an_oci_model_is_copied_out_of_its_image_on_older_clusters() -> None:
    """Without image volumes (auto on an older server, or mount: copy), an init container
    running the image itself copies the directory into an emptyDir the engine reads."""
    oci = {"image": "registry.example/qwen:1", "path": "/models", "pullPolicy": "Always"}
    for options, mount in ((PlanOptions(image_volumes=False), "auto"),
                           (PlanOptions(image_volumes=True), "copy")):  # fmt: skip
        pod = pod_of(planned([tier_with({"oci": oci | {"mount": mount}})], options))
        (copier,) = pod["initContainers"]
        assert copier["image"] == "registry.example/qwen:1"
        assert copier["imagePullPolicy"] == "Always"
        assert copier["command"] == ["cp", "-R", "/models/.", "/models/"]
        assert {"name": "models", "emptyDir": {}} in pod["volumes"]
        assert pod["containers"][0]["args"][0] == "/models"


# -- S3 without a cache ---------------------------------------------------------------------


def test_an_s3_model_is_downloaded_by_an_init_container_with_the_secrets_keys() -> None:
    """Without a model cache, every engine pod downloads the objects before its engine starts:
    the fleetpilot image's fetcher, credentials by reference to the Secret (never values)."""
    options = PlanOptions(fleetpilot_image="registry.example/fleetpilot:1")
    pod = pod_of(planned([tier_with({"s3": S3})], options))
    (fetch,) = pod["initContainers"]
    assert fetch["image"] == "registry.example/fleetpilot:1"
    assert fetch["command"] == [
        "fleetpilot", "model", "fetch", "s3", "--bucket", "models", "--dest", "/models",
        "--prefix", "qwen/7b/", "--endpoint", "https://minio.storage:9000",
    ]  # fmt: skip
    env = env_of(fetch)
    assert env["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "minio-creds", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert env["AWS_SESSION_TOKEN"]["secretKeyRef"]["optional"] is True
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["containers"][0]["args"][0] == "/models"
    assert "AWS_ACCESS_KEY_ID" not in env_of(pod["containers"][0])  # the engine needs none


# -- the model cache ------------------------------------------------------------------------


def test_a_hub_model_in_the_cache_is_fetched_by_one_job_and_read_offline() -> None:
    """With spec.modelCache: a claim owned by the service, one Job that downloads the repo at
    its revision into the Hub cache layout (with the token), and engines that mount the cache
    read-only and read it offline - without the token."""
    hub = {"revision": "a1b2c3", "tokenSecretRef": {"name": "hf-token"}}
    objects = planned([tier_with({"huggingface": hub})], modelCache=CACHE)
    claim = only(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "chat-model-cache"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "nfs",
    }
    (job,) = jobs_of(objects)
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == [
        "fleetpilot", "model", "fetch", "hub", "--repo", MODEL, "--revision", "a1b2c3",
        "--cache-dir", "/model-cache/hub",
    ]  # fmt: skip
    assert env_of(fetch)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert job["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "chat-model-cache", "readOnly": False},
    }
    # Not the service's label: status counts the service's pods as engines.
    assert "fleetpilot.dev/service" not in job["spec"]["template"]["metadata"]["labels"]

    deployment = only(objects, "Deployment", "chat-small")
    assert deployment["metadata"]["annotations"][ANNOTATION_FETCH_JOB] == job["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    env = env_of(engine)
    assert env["HF_HUB_CACHE"] == "/model-cache/hub"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in env
    assert engine["args"][:1] == [MODEL]
    assert "a1b2c3" in engine["args"]
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in engine[
        "volumeMounts"
    ]
    assert "initContainers" not in pod


def test_one_job_per_distinct_download_and_a_new_one_for_a_new_revision() -> None:
    """Two tiers of the same model at the same revision share one Job; another revision is
    another Job (beside the first: Jobs are never patched)."""
    same = planned([tier_with({}, "small", up_to=0.4), tier_with({}, "large")], modelCache=CACHE)
    (job,) = jobs_of(same)
    for name in ("chat-small", "chat-large"):
        annotations = only(same, "Deployment", name)["metadata"]["annotations"]
        assert annotations[ANNOTATION_FETCH_JOB] == job["metadata"]["name"]
    moved = planned([tier_with({"huggingface": {"revision": "v2"}})], modelCache=CACHE)
    assert [j["metadata"]["name"] for j in jobs_of(moved)] != [job["metadata"]["name"]]


def test_an_s3_model_in_the_cache_is_read_from_its_own_directory_there() -> None:
    objects = planned([tier_with({"s3": S3})], modelCache=CACHE)
    ((fetch,),) = [j["spec"]["template"]["spec"]["containers"] for j in jobs_of(objects)]
    dest = fetch["command"][fetch["command"].index("--dest") + 1]
    assert dest.startswith("/model-cache/s3/models-")
    pod = pod_of(objects)
    assert pod["containers"][0]["args"][0] == dest
    assert "initContainers" not in pod


def test_a_named_claim_is_used_and_not_created_and_pvc_and_oci_sources_skip_the_cache() -> None:
    objects = planned(
        [
            tier_with({"pvc": {"claimName": "weights"}}, "small", up_to=0.4),
            tier_with({"oci": {"image": "registry.example/m:1"}}, "large"),
        ],
        modelCache={"claimName": "shared-models"},
    )
    assert [o for o in objects if o["kind"] in ("Job", "PersistentVolumeClaim")] == []
    for name in ("chat-small", "chat-large"):
        annotations = only(objects, "Deployment", name)["metadata"]["annotations"]
        assert ANNOTATION_FETCH_JOB not in annotations
    hub = planned([tier_with({})], modelCache={"claimName": "shared-models"})
    volumes = pod_of(hub)["volumes"]
    assert {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "shared-models", "readOnly": True},
    } in volumes


# -- reconcile: engines wait for their download ---------------------------------------------


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


def engine_args(kube: FakeKube) -> list[str]:
    live = kube.object("Deployment", NS, "chat-small")
    assert live is not None
    return live["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]


def test_engines_start_only_once_their_model_is_downloaded_and_roll_when_a_new_one_is(
    kube: FakeKube,
) -> None:
    """A new service gets its claim and download Job but no engine Deployment (an Event says
    why); the Job completing lets the next reconcile create it. A new revision starts a new Job
    while the engines keep the old revision; they roll only once it completes, and the old
    Job goes."""
    now = [datetime(2026, 12, 4, 12, 0, tzinfo=UTC)]
    reconciler = Reconciler(kube, clock=lambda: now[0])
    events: list[tuple[str, str, str]] = []

    def emit(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    first = reconciler.reconcile(apply_service(kube, "r1"), emit)
    (job,) = [o["metadata"]["name"] for o in kube.objects("Job", NS)]
    assert kube.object("PersistentVolumeClaim", NS, "chat-model-cache") is not None
    assert kube.object("Deployment", NS, "chat-small") is None
    assert first.waiting_for_model == {"chat-small": job}
    assert ("Normal", "WaitingForModel") in [(k, r) for k, r, _ in events]
    assert kube.object("Deployment", NS, "chat-router") is not None  # the rest is applied

    assert model_ready(kube) == ("False", "Downloading")
    # Nothing changed: no status write, and ModelReady keeps its transition time (a minute
    # later, so a condition stamped afresh each time would differ).
    now[0] += timedelta(minutes=1)
    assert not reconciler.reconcile(apply_service(kube, "r1"), emit).status_written

    complete(kube, job)
    second = reconciler.reconcile(apply_service(kube, "r1"), emit)
    assert second.waiting_for_model == {}
    assert "r1" in engine_args(kube)
    assert model_ready(kube) == ("True", "Downloaded")

    third = reconciler.reconcile(apply_service(kube, "r2"), emit)
    (new_job,) = [o["metadata"]["name"] for o in kube.objects("Job", NS)]
    assert new_job != job  # the old Job was pruned: its revision's engines still run
    assert third.waiting_for_model == {"chat-small": new_job}
    assert "r1" in engine_args(kube)

    assert model_ready(kube) == ("False", "Downloading")

    complete(kube, new_job)
    reconciler.reconcile(apply_service(kube, "r2"), emit)
    assert "r2" in engine_args(kube)

    # Without the cache the engines download again, and no ModelReady is left behind.
    manifest = make_manifest(namespace=NS, tiers=[tier_with({"huggingface": {"revision": "r2"}})])
    kube.apply(manifest, "kubectl")
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    reconciler.reconcile(live, emit)
    assert model_ready(kube) is None
    assert kube.objects("Job", NS) == []


# -- the ModelReady condition ---------------------------------------------------------------

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def test_model_ready_says_what_is_downloading_done_or_failed() -> None:
    """Pending, running (with failed attempts), complete, failed: each says which model and
    Job; one failure makes the whole condition DownloadFailed; no cache, no condition."""
    tiers = [tier_with({}, "small", up_to=0.4), tier_with({"s3": S3}, "large")]
    jobs = plan_service(make_service(tiers=tiers, modelCache=CACHE)).downloads
    hub, s3 = (download.job for download in jobs)
    pending = model_ready_condition(jobs, {}, NOW, 3)
    assert pending is not None
    assert (pending.status, pending.reason, pending.observed_generation) == (
        ConditionStatus.FALSE, "Downloading", 3,
    )  # fmt: skip
    assert f"{MODEL}@main (Job {hub}): pending" in pending.message

    live = {
        hub: {"status": {"active": 1, "failed": 2}},
        s3: {"status": {"conditions": [{"type": "Complete", "status": "True"}]}},
    }
    running = model_ready_condition(jobs, live, NOW, 3)
    assert running is not None
    assert running.reason == "Downloading"
    assert "running, 2 pods failed" in running.message
    assert "done: s3://models/qwen/7b/" in running.message

    gave_up = {"type": "Failed", "status": "True", "message": "reached the backoff limit"}
    live[hub] = {"status": {"conditions": [gave_up]}}
    failed = model_ready_condition(jobs, live, NOW, 3)
    assert failed is not None
    assert (failed.status, failed.reason) == (ConditionStatus.FALSE, "DownloadFailed")
    assert "backoff limit" in failed.message

    live[hub] = live[s3]
    ready = model_ready_condition(jobs, live, NOW, 3)
    assert ready is not None
    assert (ready.status, ready.reason) == (ConditionStatus.TRUE, "Downloaded")
    assert model_ready_condition([], live, NOW, 3) is None


# -- how far a download is --------------------------------------------------------------------


def fetcher_log(done: int) -> str:
    """What ``fleetpilot model fetch`` logs (its Progress through the JSON formatter) after
    ``done`` of its three files (1 GiB, 1 GiB, 2 GiB), with a line that is not JSON."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(json_formatter())
    logger = logging.getLogger("fleetpilot.delivery")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        files = [RemoteFile(f"model-{i}.safetensors", size) for i, size in enumerate([1, 1, 2])]
        files = [RemoteFile(f.path, f.size * 2**30) for f in files]
        progress = Progress(f"{MODEL}@main", files)
        progress.plan()
        for file in files[:done]:
            progress.file_done(file, fetched=True)
    finally:
        logger.removeHandler(handler)
    return out.getvalue() + "Traceback? no: a stray line\n"


def test_the_fetchers_log_says_how_far_its_download_is() -> None:
    """The operator reads the counts the fetcher logs (the same JSON lines), the latest first;
    a log without any yet says nothing."""
    assert download_progress(fetcher_log(0)) == DownloadProgress(0, 4 * 2**30, 0, 3)
    latest = download_progress(fetcher_log(2))
    assert latest == DownloadProgress(2 * 2**30, 4 * 2**30, 2, 3)
    assert str(latest) == "2.00 of 4.00 GiB (50%), 2 of 3 files"
    assert download_progress("starting\n{}\n[1, 2]\n") is None
    assert download_progress('{"bytes_done": true, "bytes_total": 1, "files_done": 0, '
                             '"files_total": 1}') is None  # fmt: skip


def running_pod(kube: FakeKube, job: str, log: str | None) -> None:
    """Play the Job controller and the kubelet: the Job's pod runs and has logged ``log``."""
    kube.set_status("Job", NS, job, {"active": 1})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-x1", "namespace": NS, "labels": {JOB_NAME_LABEL: job}},
        "status": {"phase": "Running"},
    }
    kube.put(pod)
    if log is not None:
        kube.logs[(NS, f"{job}-x1")] = log


def parse(kube: FakeKube) -> InferenceService:
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    return parse_service(live, f"{NS}/chat")


def model_ready_message(kube: FakeKube) -> str:
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    (ready,) = [c for c in live["status"]["conditions"] if c["type"] == "ModelReady"]
    return str(ready["message"])


def test_model_ready_shows_a_running_downloads_progress_from_its_pods_log(
    kube: FakeKube,
) -> None:
    """A running download's condition carries the bytes and files its pod logged; a pod that
    has logged nothing yet, or a log the operator may not read, leaves just "running"."""
    reconciler = Reconciler(kube)
    reconciler.reconcile(apply_service(kube, "r1"), lambda *_: None)
    (job,) = [o["metadata"]["name"] for o in kube.objects("Job", NS)]

    running_pod(kube, job, fetcher_log(1))
    reconciler.refresh_status(parse(kube), kube.get("InferenceService", NS, "chat") or {})
    assert f"(Job {job}): running, 1.00 of 4.00 GiB (25%), 1 of 3 files" in (
        model_ready_message(kube)
    )
    assert kube.writes_of("GET", "Pod", "log")[-1].query == [("tailLines", "20")]

    kube.logs.clear()  # the kubelet has nothing (yet): no progress, no failure
    reconciler.refresh_status(parse(kube), kube.get("InferenceService", NS, "chat") or {})
    assert model_ready_message(kube).endswith(f"(Job {job}): running")

    def forbidden(namespace: str, name: str, tail_lines: int) -> str | None:
        raise KubeError(403, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}/log", "{}")

    kube.pod_log = forbidden  # type: ignore[method-assign]  # a chart without pods/log
    kube.logs[(NS, f"{job}-x1")] = fetcher_log(2)
    reconciler.refresh_status(parse(kube), kube.get("InferenceService", NS, "chat") or {})
    assert model_ready_message(kube).endswith(f"(Job {job}): running")


def test_a_draft_model_is_downloaded_too_and_dynamic_hub_adapters_are_refused() -> None:
    """Engines reading the Hub cache offline could not fetch a speculative draft model: it
    gets its own Job, and the tier waits for both. Hub adapters loaded at run time would need
    the Hub: refused, naming the adapter's field."""
    speculative = {"method": "eagle3", "model": "org/eagle3-draft", "numTokens": 4}
    tier = tier_with({}) | {"engine": {"speculative": speculative}}
    objects = planned([tier], modelCache=CACHE)
    commands = [j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs_of(objects)]
    assert [c[c.index("--repo") + 1] for c in commands] == [MODEL, "org/eagle3-draft"]
    waits = only(objects, "Deployment", "chat-small")["metadata"]["annotations"]
    assert waits[ANNOTATION_FETCH_JOB].split(",") == [
        j["metadata"]["name"] for j in jobs_of(objects)
    ]

    adapters = [{"name": "sql", "source": {"huggingface": {"repo": "acme/sql-lora"}}}]
    dynamic = tier_with({}) | {"adapters": adapters, "lora": {"dynamic": True}}
    with pytest.raises(PlanError) as refused:
        planned([dynamic], modelCache=CACHE)
    assert refused.value.field == "spec.tiers[0].adapters[0].source.huggingface"
    assert "offline" in refused.value.message
    planned([dynamic])  # without the cache the engine fetches it


# -- a reference tier's checkpoint, through the cache; a Hub mirror -------------------------

CHECKPOINT = "acme/tiny-llm"
MIRROR = "https://artifactory.example/api/huggingfaceml/hf"


def reference_checkpoint_tier(revision: str | None = "v1", **hub: Any) -> Obj:
    source = {"huggingface": {**({"revision": revision} if revision else {}), **hub}}
    tier = make_tier("small", model=CHECKPOINT, engine={"backend": "reference"})
    tier["model"] = {"name": CHECKPOINT, "servedName": "tiny", "source": source}
    return tier


def test_a_reference_checkpoint_is_fetched_by_the_cache_job_and_read_offline() -> None:
    """A reference tier with a Hub source and spec.modelCache gets what a cached vLLM tier
    gets: one fetch Job (from the source's mirror, HF_ENDPOINT), its Deployment held by that
    Job, the cache mounted read-only and named by HF_HUB_CACHE with HF_HUB_OFFLINE=1 - and
    the reference engine told --model/--revision instead of its preset, under the served
    name."""
    tier = reference_checkpoint_tier(endpoint=MIRROR, tokenSecretRef={"name": "hf-token"})
    objects = planned([tier], modelCache={"claimName": "shared-models"})
    (job,) = jobs_of(objects)
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == [
        "fleetpilot", "model", "fetch", "hub", "--repo", CHECKPOINT, "--revision", "v1",
        "--cache-dir", "/model-cache/hub",
    ]  # fmt: skip
    assert env_of(fetch)["HF_ENDPOINT"] == MIRROR
    assert env_of(fetch)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}

    deployment = only(objects, "Deployment", "chat-small")
    assert deployment["metadata"]["annotations"][ANNOTATION_FETCH_JOB] == job["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["command"] == ["fleetpilot", "engine"]
    args = engine["args"]
    assert args[args.index("--model") + 1] == CHECKPOINT
    assert args[args.index("--revision") + 1] == "v1"
    assert args[args.index("--served-model-name") + 1] == "tiny"
    assert "--model-config" not in args
    env = env_of(engine)
    assert (env["HF_HUB_CACHE"], env["HF_HUB_OFFLINE"]) == ("/model-cache/hub", "1")
    # Offline: no token, no mirror in the engine.
    assert "HF_TOKEN" not in env
    assert "HF_ENDPOINT" not in env
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in engine[
        "volumeMounts"
    ]
    assert {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "shared-models", "readOnly": True},
    } in pod["volumes"]
    assert "initContainers" not in pod
    # No GPU, as any reference pod.
    assert "nvidia.com/gpu" not in engine["resources"].get("limits", {})


def test_a_reference_checkpoint_without_a_revision_reads_the_default_branch() -> None:
    """No revision: the Job fetches main, and the engine gets no --revision (its default is
    main too), so both name the same snapshot."""
    objects = planned([reference_checkpoint_tier(None)], modelCache=CACHE)
    (job,) = jobs_of(objects)
    assert job["metadata"]["annotations"]["fleetpilot.dev/model"] == f"{CHECKPOINT}@main"
    args = pod_of(objects)["containers"][0]["args"]
    assert "--revision" not in args
    assert args[args.index("--model") + 1] == CHECKPOINT


def test_the_router_tokenizes_a_reference_checkpoints_tier_with_the_shipped_tokenizer() -> None:
    """The reference engine tokenizes every model, a checkpoint's included, with its shipped
    byte tokenizer (a save_checkpoint folder holds none): the router reads the same files
    from its ConfigMap, not the Hub repo."""
    from fleetpilot.operator.router_objects import REFERENCE_TOKENIZER_DIR, tokenizer_ref

    service = make_service(tiers=[reference_checkpoint_tier()], modelCache=CACHE)
    assert tokenizer_ref(service.spec.tiers[0]) == REFERENCE_TOKENIZER_DIR


def test_a_reference_checkpoints_engines_start_once_the_job_completed(kube: FakeKube) -> None:
    """The reconciler holds a reference tier's Deployment until its checkpoint is on the
    volume, as it does a vLLM tier's."""
    manifest = make_manifest(
        namespace=NS, tiers=[reference_checkpoint_tier()], modelCache={"claimName": "m"}
    )
    kube.apply(manifest, "kubectl")
    reconciler = Reconciler(kube)
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    first = reconciler.reconcile(live, lambda *_: None)
    (job,) = [o["metadata"]["name"] for o in kube.objects("Job", NS)]
    assert first.waiting_for_model == {"chat-small": job}
    assert kube.object("Deployment", NS, "chat-small") is None
    complete(kube, job)
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    assert reconciler.reconcile(live, lambda *_: None).waiting_for_model == {}
    assert "--model" in engine_args(kube)


def test_a_hub_mirror_reaches_an_engine_that_downloads_at_start_and_not_an_offline_one() -> None:
    """Without a cache vLLM downloads the repo itself: from the mirror (HF_ENDPOINT). With
    one the Job does, and the engines read offline: the mirror is the Job's only."""
    source = {"huggingface": {"endpoint": MIRROR}}
    env = env_of(pod_of(planned([tier_with(source)]))["containers"][0])
    assert env["HF_ENDPOINT"] == MIRROR
    cached = planned([tier_with(source)], modelCache=CACHE)
    assert "HF_ENDPOINT" not in env_of(pod_of(cached)["containers"][0])
    ((fetch,),) = [j["spec"]["template"]["spec"]["containers"] for j in jobs_of(cached)]
    assert env_of(fetch)["HF_ENDPOINT"] == MIRROR
    # Unset: huggingface.co, the library's own default; nothing is set.
    plain = planned([tier_with({"huggingface": {}})], modelCache=CACHE)
    ((fetch,),) = [j["spec"]["template"]["spec"]["containers"] for j in jobs_of(plain)]
    assert "HF_ENDPOINT" not in env_of(fetch)
    assert "HF_ENDPOINT" not in env_of(pod_of(planned([tier_with({})]))["containers"][0])


def test_the_summary_says_where_a_reference_checkpoint_comes_from() -> None:
    """`fleetpilot plan -o summary`: a checkpoint's repo, revision and mirror, fetched once
    by a Job; a reference tier without one is its seeded preset, as before."""
    from fleetpilot.operator.model_delivery import weights_summary

    service = make_service(
        tiers=[reference_checkpoint_tier(endpoint=MIRROR)], modelCache={"claimName": "m"}
    )
    assert weights_summary(service, service.spec.tiers[0]) == (
        f"hub {CHECKPOINT}@v1 from {MIRROR} "
        "(downloaded once into the model cache by a Job; engines wait for it)"
    )
    seeded = make_service(tiers=[make_tier("small", engine={"backend": "reference"})])
    assert weights_summary(seeded, seeded.spec.tiers[0]).startswith("none: a seeded random model")
