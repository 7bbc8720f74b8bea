"""plan(service): the objects a service becomes, checked field by field."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetpilot.api import parse_service
from fleetpilot.api.capacity import GIB
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.api.status import ColdStartSample
from fleetpilot.operator.cold_start import summarize
from fleetpilot.operator.plan_types import K8sObject, PlanError, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import router_config
from tests.factories import make_manifest, make_service, make_tier, two_tier_manifest


def _find(objects: list[K8sObject], kind: str, name: str) -> K8sObject:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def _container(deployment: K8sObject) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


@pytest.fixture
def two_tier() -> list[K8sObject]:
    return plan(parse_service(two_tier_manifest()))


def test_one_deployment_service_and_pdb_per_role(two_tier: list[K8sObject]) -> None:
    """Each unified tier becomes exactly one Deployment, headless Service and PodDisruptionBudget: a
    missing Service hides the tier from the router, a duplicate fights itself."""
    for name in ("chat-small", "chat-large"):
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            _find(two_tier, kind, name)


def test_disaggregated_tier_has_prefill_and_decode() -> None:
    """A disaggregated tier becomes separate prefill and decode Deployments (no unified one),
    labelled by role, with NIXL's side-channel host set for the KV hand-off."""
    objects = plan(make_service(tiers=[make_tier("main", mode="disaggregated")]))
    deployments = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Deployment")
    assert deployments == ["chat-main-decode", "chat-main-prefill", "chat-router"]
    decode = _find(objects, "Deployment", "chat-main-decode")
    env = {e["name"] for e in _container(decode)["env"]}
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in env
    assert decode["spec"]["template"]["metadata"]["labels"]["fleetpilot.dev/role"] == "decode"


def test_gpu_request_is_tensor_times_pipeline(two_tier: list[K8sObject]) -> None:
    """A TP=4 replica requests and limits 4 GPUs and passes the same size to vLLM: a mismatch leaves
    GPUs idle or the engine unschedulable."""
    large = _container(_find(two_tier, "Deployment", "chat-large"))
    assert large["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert large["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert large["args"][large["args"].index("--tensor-parallel-size") + 1] == "4"


def test_shared_memory_only_for_multi_gpu_replicas(two_tier: list[K8sObject]) -> None:
    """Multi-GPU replicas get a memory-backed /dev/shm (NCCL fails without it); single-GPU ones do
    not spend the memory."""

    def volumes(name: str) -> set[str]:
        pod = _find(two_tier, "Deployment", name)["spec"]["template"]["spec"]
        return {v["name"] for v in pod["volumes"]}

    assert "dshm" in volumes("chat-large")
    assert "dshm" not in volumes("chat-small")


def test_gpu_product_selects_nodes_and_gpu_taint_is_tolerated() -> None:
    """resources.gpuProduct adds a node selector merged with the service's own, and the usual GPU
    taint is tolerated, or pods never schedule on GPU nodes."""
    tier = make_tier("main", resources={"gpuProduct": "NVIDIA-H100-80GB-HBM3"})
    service = make_service(
        tiers=[tier],
        scheduling={"nodeSelector": {"pool": "inference"}, "priorityClassName": "high"},
    )
    pod = _find(plan(service), "Deployment", "chat-main")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "pool": "inference",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["priorityClassName"] == "high"


def test_engine_pods_are_probed_labelled_and_scraped(two_tier: list[K8sObject]) -> None:
    """Engine pods carry the probes, the pinned image, the labels the router and PodMonitor select
    on, and scrape annotations; the selector is a subset of the pod labels; they expose the HTTP
    port and the KV-event PUB and replay ports their --kv-events-config binds."""
    deployment = _find(two_tier, "Deployment", "chat-small")
    template = deployment["spec"]["template"]
    container = _container(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["command"] == ["vllm", "serve"]
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"},
    ]
    assert "--kv-events-config" in container["args"]
    assert not container["image"].endswith(":latest")
    labels = template["metadata"]["labels"]
    assert labels["fleetpilot.dev/service"] == "chat"
    assert labels["fleetpilot.dev/tier"] == "small"
    assert labels["fleetpilot.dev/role"] == "unified"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()


def test_initial_replicas_come_from_bounds() -> None:
    """Initial replicas: `initial` when set, else min, but at least 1 (a min of 0 must not create a
    Deployment that never starts)."""
    tier = make_tier("main", serving={"replicas": {"min": 0, "max": 4}})
    deployment = _find(plan(make_service(tiers=[tier])), "Deployment", "chat-main")
    assert deployment["spec"]["replicas"] == 1
    tier = make_tier("main", serving={"replicas": {"min": 2, "max": 6, "initial": 3}})
    deployment = _find(plan(make_service(tiers=[tier])), "Deployment", "chat-main")
    assert deployment["spec"]["replicas"] == 3


def test_owner_references_only_with_a_uid() -> None:
    """With the service's uid every object is owned by it (deleting the service deletes them);
    without one (`fleetpilot plan`) no dangling reference is written."""
    without = plan(make_service())
    assert all("ownerReferences" not in o["metadata"] for o in without)
    owned = plan(make_service(uid="1234-abcd"))
    for obj in owned:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "fleetpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "chat",
            "uid": "1234-abcd",
            "controller": True,
            "blockOwnerDeletion": True,
        }


def test_every_object_is_in_the_service_namespace(two_tier: list[K8sObject]) -> None:
    """No object lands outside the service's namespace."""
    assert {o["metadata"]["namespace"] for o in two_tier} == {"ml"}


def test_router_config_lists_tiers_and_their_endpoints(two_tier: list[K8sObject]) -> None:
    """The router's ConfigMap holds each tier's complexity threshold (the last tier takes up to 1.0)
    and the selector of its engine pods; the router runs 2 replicas with a read-only root."""
    config_map = _find(two_tier, "ConfigMap", "chat-router")
    config = RouterConfig.model_validate(yaml.safe_load(config_map["data"][ROUTER_CONFIG_FILE]))
    assert [(t.name, t.up_to) for t in config.tiers] == [("small", 0.4), ("large", 1.0)]
    (group,) = config.tiers[0].endpoints
    assert group.service == "chat-small"
    assert group.selector == {
        "fleetpilot.dev/service": "chat",
        "fleetpilot.dev/tier": "small",
        "fleetpilot.dev/role": "unified",
    }
    router = _find(two_tier, "Deployment", "chat-router")
    assert router["spec"]["replicas"] == 2
    assert _container(router)["securityContext"]["readOnlyRootFilesystem"] is True


def test_router_config_points_at_every_ranks_kv_events_and_the_models_tokenizer() -> None:
    """The router learns each group's KV-event and replay ports (the ones the engine pods
    publish on, data-parallel ranks included) and the tier model's tokenizer at the revision
    the engines load; weights on a PVC get no tokenizer (the router guesses there)."""
    hub = make_tier("small", parallelism={"data": 2})
    hub["model"]["source"] = {
        "huggingface": {"revision": "v2", "tokenSecretRef": {"name": "hf", "key": "t"}}
    }
    pvc = make_tier("large", up_to=1.0)
    pvc["model"]["source"] = {"pvc": {"claimName": "weights"}}
    hub["complexity"] = {"upTo": 0.4}
    service = make_service(tiers=[hub, pvc])
    config = router_config(service)
    small, large = config.tiers
    (group,) = small.endpoints
    assert (group.kv_events_port, group.kv_replay_port, group.data_parallel) == (5557, 5559, 2)
    assert small.tokenizer == "hf://Qwen/Qwen2.5-7B-Instruct@v2"
    assert large.tokenizer is None
    router = _find(plan(service), "Deployment", "chat-router")
    env = {e["name"]: e for e in _container(router)["env"]}
    assert env["HF_HUB_CACHE"]["value"] == "/var/cache/fleetpilot/hf"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "t"}}
    mounts = {m["mountPath"] for m in _container(router)["volumeMounts"]}
    assert "/var/cache/fleetpilot/hf" in mounts  # writable despite the read-only root


def test_router_may_only_read_endpoint_slices(two_tier: list[K8sObject]) -> None:
    """The router's Role grants only get/list/watch on EndpointSlices: anything more widens what a
    compromised router can do."""
    (rule,) = _find(two_tier, "Role", "chat-router")["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }


def test_pod_monitor_only_when_the_crd_exists() -> None:
    """A PodMonitor is planned only when the Prometheus Operator's CRD exists (applying it elsewhere
    fails the reconcile), with the role labels as target labels."""
    service = parse_service(two_tier_manifest())
    assert not [o for o in plan(service) if o["kind"] == "PodMonitor"]
    objects = plan(service, PlanOptions(pod_monitor_available=True))
    monitor = _find(objects, "PodMonitor", "chat-metrics")
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
    assert monitor["spec"]["podTargetLabels"] == [
        "fleetpilot.dev/service",
        "fleetpilot.dev/tier",
        "fleetpilot.dev/role",
    ]


REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
_SEPARATOR = "\n# ---- next example ----\n"
# `fleetpilot plan` (dicts in insertion order, lists as built) for each file named.
_PLAN_EACH = f"""
import sys
from fleetpilot.cli import main
for path in sys.argv[1:]:
    if main(["plan", "--pod-monitor", "-f", path]) != 0:
        sys.exit(f"plan failed: {{path}}")
    print({_SEPARATOR!r}, end="")
"""


def _plan_examples_in_a_process(hash_seed: str) -> dict[str, str]:
    """The YAML of every example as planned by a fresh interpreter with this hash seed."""
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_EACH, *map(str, EXAMPLES)],
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    texts = done.stdout.split(_SEPARATOR)
    assert texts[-1] == ""
    return {path.name: text for path, text in zip(EXAMPLES, texts[:-1], strict=True)}


def test_plan_is_deterministic_across_processes() -> None:
    """Re-planning an unchanged service must not change a byte (no spurious rollouts), also
    after an operator restart: a set or hash-ordered iteration anywhere in the planner would
    make two interpreters with different string-hash seeds write different objects."""
    assert len(EXAMPLES) >= 4
    first, second = _plan_examples_in_a_process("1"), _plan_examples_in_a_process("2")
    for name, text in first.items():
        assert "kind: Deployment" in text, name
        assert text == second[name], f"{name} plans differently under another hash seed"


def test_long_names_fit_kubernetes_limits() -> None:
    """63-character service and tier names still give object names within Kubernetes' 63-character
    limit."""
    service = make_service("s" * 63, tiers=[make_tier("t" * 63, mode="disaggregated")])
    for obj in plan(service):
        assert len(obj["metadata"]["name"]) <= 63


def test_replica_that_cannot_be_cut_into_nodes_is_refused() -> None:
    """A model copy of 12 GPUs on nodes of 8 cannot fill whole nodes: refused at its field,
    naming the numbers, instead of planning pods that never schedule or never meet."""
    tier = make_tier("main", parallelism={"tensor": 12})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].parallelism"
    assert "12 is not a multiple of resources.gpusPerNode 8" in info.value.message


def test_refusal_names_the_roles_own_parallelism() -> None:
    """A decode role's override that cannot be cut is reported at the override."""
    tier = make_tier("main", mode="disaggregated")
    tier["serving"]["decode"]["parallelism"] = {"tensor": 16, "data": 2}
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].serving.decode.parallelism"
    assert "data 2" in info.value.message


def test_managed_flags_in_extra_args_are_refused() -> None:
    """extraArgs repeating a flag the planner derives (--max-model-len) is refused, naming the exact
    list item."""
    tier = make_tier("main", engine={"extraArgs": ["--enforce-eager", "--max-model-len=4096"]})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].engine.extraArgs[1]"


def test_kv_events_config_in_extra_args_is_refused() -> None:
    """The planner sets --kv-events-config (the router subscribes to those ports); a second one
    in extraArgs would move the publisher away from the ports the pod and policy open."""
    tier = make_tier("main", engine={"extraArgs": ['--kv-events-config={"publisher":"null"}']})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].engine.extraArgs[0]"


def test_colliding_derived_names_are_refused() -> None:
    """Tier names whose derived object names collide ("a" disaggregated and "a-decode") are refused
    instead of two tiers overwriting one Deployment."""
    tiers = [
        make_tier("a", mode="disaggregated", up_to=0.3),
        make_tier("a-decode", up_to=0.6),
    ]
    with pytest.raises(PlanError, match="would both be named 'chat-a-decode'"):
        plan(make_service(tiers=tiers))


def test_hub_token_comes_from_a_secret_reference() -> None:
    """The Hugging Face token is read from the referenced Secret, never copied into the pod spec."""
    tier = make_tier("main")
    tier["model"]["source"] = {"huggingface": {"tokenSecretRef": {"name": "hf"}}}
    env = _container(_find(plan(make_service(tiers=[tier])), "Deployment", "chat-main"))["env"]
    token = next(e for e in env if e["name"] == "HF_TOKEN")
    secret = {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert token == {"name": "HF_TOKEN", "valueFrom": secret}


def test_a_tier_allowed_at_zero_makes_the_router_hold_requests_for_it() -> None:
    """Scale from zero: with some role's min at 0 the router waits for a replica (as long as
    any request may take) instead of answering 503; otherwise it answers at once."""
    always_on = make_service(tiers=[make_tier("small", serving={"replicas": {"min": 1}})])
    assert router_config(always_on).cold_start_wait == timedelta(0)
    may_sleep = make_service(tiers=[make_tier("small", serving={"replicas": {"min": 0}})])
    assert router_config(may_sleep).cold_start_wait == may_sleep.spec.routing.request_timeout


def _cold_start(pod_seconds: list[int | None]) -> dict[str, Any]:
    """A role's status.coldStart as the operator writes it: one sample a start, each 5 s from
    container start to Ready and ``pod_seconds`` from pod creation (None: a restart)."""
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    samples = [
        ColdStartSample(
            pod=f"p{i}",
            started_at=t0 + timedelta(minutes=i),
            ready_at=t0 + timedelta(minutes=i, seconds=5),
            start_seconds=5,
            pod_seconds=seconds,
        )
        for i, seconds in enumerate(pod_seconds)
    ]
    summary = summarize(samples)
    assert summary is not None
    return summary.to_wire()


def test_the_router_config_carries_each_tiers_observed_cold_start_from_status() -> None:
    """Issue 19 item 4: the router holds a request for a tier at zero for the tier's observed
    cold start (plus a margin), so its config carries, per tier, the longest pod-created-to-
    Ready among the kept starts of the roles the tier has now. Restarts (no pod time) and a
    role the tier no longer has do not count; a tier with nothing observed has none."""
    small = make_tier("small", mode="disaggregated", up_to=0.4)
    small["serving"]["prefill"]["replicas"]["min"] = 0
    manifest = make_manifest(tiers=[small, make_tier("large", up_to=0.7), make_tier("huge")])
    manifest["status"] = {
        "tiers": [
            {
                "name": "small",
                "roles": [
                    {"role": "prefill", "coldStart": _cold_start([30, 40, 35])},
                    {"role": "decode", "coldStart": _cold_start([50, None, 55])},
                    # From before the tier was disaggregated: not a role it has now.
                    {"role": "unified", "coldStart": _cold_start([500])},
                ],
            },
            {"name": "large", "roles": [{"role": "unified", "coldStart": _cold_start([None])}]},
            {"name": "gone", "roles": [{"role": "unified", "coldStart": _cold_start([900])}]},
        ]
    }
    service = parse_service(manifest)
    configmap = _find(plan(service), "ConfigMap", "chat-router")
    config = RouterConfig.model_validate(yaml.safe_load(configmap["data"][ROUTER_CONFIG_FILE]))
    observed = {tier.name: tier.cold_start_observed for tier in config.tiers}
    assert observed == {"small": timedelta(seconds=55), "large": None, "huge": None}
    # The hold's bound and margin: the request timeout, and 10 s plus a Prometheus scrape.
    assert config.cold_start_wait == service.spec.routing.request_timeout
    assert config.cold_start_margin == timedelta(seconds=10) + timedelta(seconds=15)
    # No status yet (a new service): nothing observed, the router holds up to the bound.
    del manifest["status"]
    assert all(t.cold_start_observed is None for t in router_config(parse_service(manifest)).tiers)


def test_max_cold_start_hold_bounds_the_routers_hold_within_the_request_timeout() -> None:
    """spec.routing.maxColdStartHold bounds the hold for a tier at zero; unset, the request
    timeout does (as before), and a larger one is cut to it: no request outlives its timeout."""
    tiers = [make_tier("small", serving={"replicas": {"min": 0}})]
    assert router_config(make_service(tiers=tiers)).cold_start_wait == timedelta(minutes=10)
    bounded = make_service(tiers=tiers, routing={"maxColdStartHold": "2m"})
    assert bounded.spec.routing.max_cold_start_hold == timedelta(minutes=2)
    assert router_config(bounded).cold_start_wait == timedelta(minutes=2)
    beyond = make_service(tiers=tiers, routing={"maxColdStartHold": "1h", "requestTimeout": "5m"})
    assert router_config(beyond).cold_start_wait == timedelta(minutes=5)
    off = make_service(tiers=tiers, routing={"maxColdStartHold": "0s"})
    assert router_config(off).cold_start_wait == timedelta(0)


def _lora_tier() -> dict[str, Any]:
    return make_tier(
        "main",
        adapters=[
            {
                "name": "sql",
                "source": {
                    "huggingface": {
                        "repo": "acme/sql-lora",
                        "revision": "abc123",
                        "tokenSecretRef": {"name": "acme-hub", "key": "hf"},
                    }
                },
            },
            {"name": "legal", "source": {"pvc": {"claimName": "loras", "path": "legal"}}},
            {"name": "chat", "source": {"huggingface": {"repo": "acme/chat-lora"}}},
            {"name": "tax", "source": {"pvc": {"claimName": "loras", "path": "tax/v2"}}},
        ],
    )


def test_hub_adapters_are_fetched_at_their_revision_before_the_engine_starts() -> None:
    """One init container per Hub adapter, in the engine's image: `hf download` of the repo
    at the pinned revision (none: the default branch) into the directory the engine's
    --lora-modules names, with that adapter's own token from its Secret; the engine mounts
    the adapters read-only."""
    deployment = _find(plan(make_service(tiers=[_lora_tier()])), "Deployment", "chat-main")
    pod = deployment["spec"]["template"]["spec"]
    sql, chat = pod["initContainers"]
    assert sql["image"] == _container(deployment)["image"]
    assert sql["command"] == [
        "hf", "download", "acme/sql-lora", "--local-dir", "/adapters/0-sql", "--revision", "abc123"
    ]  # fmt: skip
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "acme-hub", "key": "hf"}},
    } in sql["env"]
    assert chat["command"] == [
        "hf",
        "download",
        "acme/chat-lora",
        "--local-dir",
        "/adapters/2-chat",
    ]
    assert not any(e["name"] == "HF_TOKEN" for e in chat["env"])
    assert {"name": "adapters", "mountPath": "/adapters"} in sql["volumeMounts"]
    args = _container(deployment)["args"]
    modules = args[args.index("--lora-modules") + 1 : args.index("--kv-events-config")]
    assert modules[0] == "sql=/adapters/0-sql"
    assert modules[2] == "chat=/adapters/2-chat"
    mounts = _container(deployment)["volumeMounts"]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in mounts


def test_adapter_pvcs_are_mounted_once_each_read_only() -> None:
    """Two adapters on one claim share one read-only volume, mounted where their
    --lora-modules paths point."""
    deployment = _find(plan(make_service(tiers=[_lora_tier()])), "Deployment", "chat-main")
    pod = deployment["spec"]["template"]["spec"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [
        {"name": "adapters-0", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}}
    ]
    mount = {"name": "adapters-0", "mountPath": "/adapter-volumes/loras", "readOnly": True}
    assert mount in _container(deployment)["volumeMounts"]
    args = _container(deployment)["args"]
    assert "legal=/adapter-volumes/loras/legal" in args
    assert "tax=/adapter-volumes/loras/tax/v2" in args


def test_a_tier_without_adapters_has_no_init_container_or_adapter_volume() -> None:
    deployment = _find(plan(make_service(tiers=[make_tier("main")])), "Deployment", "chat-main")
    pod = deployment["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert not any(v["name"].startswith("adapters") for v in pod["volumes"])


def _dynamic_tier(**lora: Any) -> dict[str, Any]:
    tier = make_tier(
        "main",
        adapters=[
            {"name": "chat", "source": {"huggingface": {"repo": "acme/chat-lora"}}},
            {"name": "tax", "source": {"pvc": {"claimName": "loras", "path": "tax/v2"}}},
        ],
    )
    tier["lora"] = {"dynamic": True, **lora}
    return tier


def test_dynamic_adapters_leave_the_pod_template_to_the_operator() -> None:
    """With `lora.dynamic` the engines start with LoRA on but no --lora-modules and no
    fetchers, and serve vLLM's load/unload endpoints: the adapter list is then not in the pod
    template, so changing it rolls nothing (the operator loads it, engine.adapter_sync). The
    adapters' claims stay mounted: their paths are read at load time."""
    deployment = _find(plan(make_service(tiers=[_dynamic_tier()])), "Deployment", "chat-main")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert "initContainers" not in pod
    assert "--enable-lora" in container["args"]
    assert "--lora-modules" not in container["args"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container["env"]
    assert [v["name"] for v in pod["volumes"] if v["name"].startswith("adapters")] == ["adapters-0"]
    changed = _dynamic_tier()
    legal = {"name": "legal", "source": {"pvc": {"claimName": "loras", "path": "legal"}}}
    changed["adapters"] = [changed["adapters"][0], legal]
    again = _find(plan(make_service(tiers=[changed])), "Deployment", "chat-main")
    assert again["spec"]["template"] == deployment["spec"]["template"]


def test_static_adapters_change_the_pod_template() -> None:
    """Without `lora.dynamic` the list is in the engines' command: a changed list rolls them."""
    tier = _lora_tier()
    before = _find(plan(make_service(tiers=[tier])), "Deployment", "chat-main")
    tier["adapters"] = tier["adapters"][1:]
    after = _find(plan(make_service(tiers=[tier])), "Deployment", "chat-main")
    assert before["spec"]["template"] != after["spec"]["template"]


@pytest.mark.parametrize(
    ("hub", "field"),
    [
        ({"revision": "abc123"}, "revision"),
        ({"tokenSecretRef": {"name": "acme-hub", "key": "hf"}}, "tokenSecretRef"),
    ],
)
def test_dynamic_hub_adapters_that_vllm_cannot_fetch_as_declared_are_refused(
    hub: dict[str, Any], field: str
) -> None:
    """vLLM's run-time load downloads a repo id at its default branch with the model's
    token: a pinned revision or an adapter's own token would be silently ignored."""
    tier = _dynamic_tier()
    tier["adapters"][0]["source"]["huggingface"].update(hub)
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == f"spec.tiers[0].adapters[0].source.huggingface.{field}"
    assert "chat" in info.value.message


def test_lora_flags_in_extra_args_are_refused() -> None:
    tier = make_tier("main", engine={"extraArgs": ["--lora-modules", "x=/y"]})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].engine.extraArgs[0]"


def test_the_router_is_told_which_tier_serves_each_adapter() -> None:
    """The router's config lists each tier's adapters, so a request naming one goes to the
    tier whose engines load it (any other name is a 404 there)."""
    two = [make_tier("small", up_to=0.4), _lora_tier()]
    tiers = router_config(make_service(tiers=two)).tiers
    assert [t.adapters for t in tiers] == [[], ["sql", "legal", "chat", "tax"]]


def test_dynamic_adapters_with_data_parallel_ranks_run_one_api_server() -> None:
    """vLLM 0.33 starts one API server per data-parallel rank and refuses to with runtime LoRA
    updating: a dynamic tier's engines run one (and an extra arg asking for more is refused)."""
    tier = _dynamic_tier()
    tier["parallelism"] = {"data": 2}
    args = _container(_find(plan(make_service(tiers=[tier])), "Deployment", "chat-main"))["args"]
    assert args[args.index("--api-server-count") + 1] == "1"
    static = make_tier("main", parallelism={"data": 2})
    static_args = _container(_find(plan(make_service(tiers=[static])), "Deployment", "chat-main"))
    assert "--api-server-count" not in static_args["args"]
    tier["engine"] = {"extraArgs": ["--api-server-count=4"]}
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].engine.extraArgs[0]"


# -- engine.backend reference: what one CPU process cannot run ------------------------------


def _reference(**extra: Any) -> dict[str, Any]:
    engine = {"backend": "reference", **extra.pop("engine", {})}
    return make_tier("main", model="reference-tiny", engine=engine, **extra)


def _with_model(tier: dict[str, Any], **model: Any) -> dict[str, Any]:
    tier["model"] = {**tier["model"], **model}
    return tier


def _decode_data_2() -> dict[str, Any]:
    tier = _reference(mode="disaggregated")
    tier["serving"]["decode"]["parallelism"] = {"data": 2}
    return tier


REFERENCE_REFUSALS = [
    # (case, tier, field, words the message must hold)
    ("tensor", _reference(tensor=2), "spec.tiers[0].parallelism.tensor", ["tensor 2 > 1"]),
    (
        "a replica spanning nodes",
        _reference(tensor=16),
        "spec.tiers[0].parallelism.tensor",
        ["tensor 16 > 1", "no multi-node groups"],
    ),
    (
        "a role's own data parallelism",
        _decode_data_2(),
        "spec.tiers[0].serving.decode.parallelism.data",
        ["role decode", "data 2 > 1"],
    ),
    (
        "maxModelLen over the tiny preset",
        _with_model(_reference(), maxModelLen=4096),
        "spec.tiers[0].model.maxModelLen",
        ["maxModelLen 4096 > 2048", "tiny preset", "referenceModel small (4096)"],
    ),
    (
        "maxModelLen over the small preset",
        _with_model(_reference(engine={"referenceModel": "small"}), maxModelLen=8192),
        "spec.tiers[0].model.maxModelLen",
        ["maxModelLen 8192 > 4096", "small preset"],
    ),
    (
        "weights on a PVC",
        _with_model(_reference(), source={"pvc": {"claimName": "models"}}),
        "spec.tiers[0].model.source.pvc",
        ["reads no weights"],
    ),
    (
        "quantization",
        _with_model(_reference(), quantization="awq"),
        "spec.tiers[0].model.quantization",
        ["float32"],
    ),
    (
        "an fp8 KV cache",
        _reference(engine={"kvCache": {"dtype": "fp8"}}),
        "spec.tiers[0].engine.kvCache.dtype",
        ["remove engine.kvCache.dtype"],
    ),
    (
        "speculative decoding",
        _reference(engine={"speculative": {"method": "ngram"}}),
        "spec.tiers[0].engine.speculative",
        ["proposers"],
    ),
    (
        "LoRA adapters",
        _reference(
            adapters=[{"name": "sql", "source": {"pvc": {"claimName": "a", "path": "sql"}}}]
        ),
        "spec.tiers[0].adapters",
        ["LoRA"],
    ),
    (
        "vLLM arguments",
        _reference(engine={"extraArgs": ["--enforce-eager"]}),
        "spec.tiers[0].engine.extraArgs",
        ["no vLLM arguments"],
    ),
    (
        "a host KV tier without prefix caching",
        _reference(engine={"kvOffload": {"size": "1Gi"}, "kvCache": {"prefixCaching": False}}),
        "spec.tiers[0].engine.kvOffload",
        ["prefix hashes", "kvCache.prefixCaching false"],
    ),
]


@pytest.mark.parametrize(
    ("tier", "field", "words"),
    [case[1:] for case in REFERENCE_REFUSALS],
    ids=[case[0] for case in REFERENCE_REFUSALS],
)
def test_reference_tier_refuses_what_the_cpu_engine_cannot_run(
    tier: dict[str, Any], field: str, words: list[str]
) -> None:
    """A cluster user chose backend reference, so a setting the CPU engine cannot honour is
    refused at its field with the numbers (not capped, as the local runtime caps a GPU spec):
    otherwise the pods would crash-loop on a refused flag, or silently serve less context than
    the spec promises."""
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == field
    for text in words:
        assert text in info.value.message


def test_reference_preset_limits_are_accepted() -> None:
    """The presets' own limits plan: tiny at 2048 tokens, small at 4096."""
    plan(make_service(tiers=[_with_model(_reference(), maxModelLen=2048)]))
    small = _reference(engine={"referenceModel": "small"})
    plan(make_service(tiers=[_with_model(small, maxModelLen=4096)]))


HUB_CHECKPOINT = {"huggingface": {"revision": "v1"}}
CACHE = {"claimName": "shared-models"}


def test_a_reference_checkpoint_without_a_model_cache_is_refused() -> None:
    """The reference engine downloads nothing at start: a Hub source without spec.modelCache
    would start engines that cannot find their checkpoint (or, read as the preset, serve
    another model under the spec's name). Refused at the source, saying what to add."""
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[_with_model(_reference(), source=HUB_CHECKPOINT)]))
    assert info.value.field == "spec.tiers[0].model.source.huggingface"
    assert "add spec.modelCache" in info.value.message


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({"pvc": {"claimName": "models"}}, "spec.tiers[0].model.source.pvc"),
        ({"s3": {"bucket": "models"}}, "spec.tiers[0].model.source.s3"),
        ({"oci": {"image": "registry.example/m:1"}}, "spec.tiers[0].model.source.oci"),
    ],
)
def test_a_reference_tier_reads_no_other_source_even_with_a_model_cache(
    source: dict[str, Any], field: str
) -> None:
    """Only a Hub checkpoint comes through the cache; other sources stay refused, cache or
    not (a vLLM tier beside it keeps the cache from being refused first)."""
    tiers = [_with_model(_reference(up_to=0.4), source=source), make_tier("gpu")]
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=tiers, modelCache=CACHE))
    assert info.value.field == field
    assert "reads no weights" in info.value.message


def test_a_reference_checkpoint_with_a_model_cache_plans_without_the_presets_limit() -> None:
    """With spec.modelCache a reference tier may read a Hub checkpoint, and the cache is not
    refused though every tier is a reference tier. The preset's context limit is not the
    checkpoint's (the engine checks its config.json at start): 8192 plans."""
    tier = _with_model(_reference(), source=HUB_CHECKPOINT, maxModelLen=8192)
    objects = plan(make_service(tiers=[tier], modelCache=CACHE))
    assert [o["kind"] for o in objects].count("Job") == 1  # the download
    # Without the checkpoint the same limit is the preset's, and refused.
    seeded = _with_model(_reference(up_to=0.4), maxModelLen=8192)
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[seeded, make_tier("gpu")], modelCache=CACHE))
    assert info.value.field == "spec.tiers[0].model.maxModelLen"


def test_fleetpilot_up_refuses_a_reference_checkpoint_by_its_field() -> None:
    """The local fleet has no model cache: check_reference_tiers (what `fleetpilot up` runs)
    refuses a checkpoint, with or without spec.modelCache, rather than serve the preset
    under the checkpoint's name."""
    from fleetpilot.operator.planner import check_reference_tiers

    tier = _with_model(_reference(), source=HUB_CHECKPOINT)
    for extra in ({}, {"modelCache": CACHE}):
        with pytest.raises(PlanError) as info:
            check_reference_tiers(make_service(tiers=[tier], **extra))
        assert info.value.field == "spec.tiers[0].model.source.huggingface"
        assert "fleetpilot up cannot run a reference checkpoint" in info.value.message
    check_reference_tiers(make_service(tiers=[_reference()]))  # the preset runs


def test_model_cache_of_only_reference_tiers_is_refused() -> None:
    """A model cache no tier downloads into would be a claim (and its GC Job) for nothing."""
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[_reference()], modelCache={"size": "10Gi"}))
    assert info.value.field == "spec.modelCache"
    assert "every tier's engine.backend is reference" in info.value.message


@pytest.mark.parametrize("flag", ["--kv-offloading-size=64", "--kv-offloading-backend"])
def test_offloading_flags_in_extra_args_are_refused(flag: str) -> None:
    """The host KV tier is engine.kvOffload: an offloading flag in extraArgs would size a tier
    the pod's memory, /dev/shm and the planner's capacity know nothing of."""
    tier = make_tier("main", engine={"extraArgs": [flag, "native"]})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]))
    assert info.value.field == "spec.tiers[0].engine.extraArgs[0]"


def _offload_tier(size: str, **extra: Any) -> dict[str, Any]:
    return make_tier(
        "main",
        model="meta-llama/Llama-3.1-8B-Instruct",
        engine={"kvOffload": {"size": size}},
        resources={"gpuProduct": "NVIDIA-H100-80GB-HBM3", "memory": "64Gi"},
        **extra,
    )


def test_an_engine_pod_larger_than_a_node_is_refused_naming_the_host_tier() -> None:
    """With the node's memory known, a pod asking for more than it (resources.memory plus the
    host KV tier and its margin) could never be scheduled: refused at engine.kvOffload.size
    with the numbers, instead of a Pending pod. At the node's size it plans."""
    service = make_service(tiers=[_offload_tier("1Ti")])
    with pytest.raises(PlanError) as info:
        plan(service, PlanOptions(node_memory=1024 * GIB))
    assert info.value.field == "spec.tiers[0].engine.kvOffload.size"
    words = ["asks for 1190 GiB", "resources.memory 64Gi", "engine.kvOffload.size 1Ti", "10%"]
    words += ["more than the 1024 GiB", "lower engine.kvOffload.size or resources.memory"]
    for text in words:
        assert text in info.value.message
    asked = 64 * GIB + math.ceil(1024 * GIB * 1.1)
    plan(service, PlanOptions(node_memory=asked))
    with pytest.raises(PlanError):
        plan(service, PlanOptions(node_memory=asked - 1))
    plan(service)  # node memory unknown: not checked


def test_a_pod_of_several_engines_asks_for_a_host_tier_each() -> None:
    """Two data-parallel ranks in a pod are two engines, each with its own host tier (vLLM's
    --kv-offloading-size is per engine): the refusal counts both and says so."""
    service = make_service(tiers=[_offload_tier("100Gi", parallelism={"data": 2})])
    plan(service, PlanOptions(node_memory=300 * GIB))
    with pytest.raises(PlanError) as info:
        plan(service, PlanOptions(node_memory=250 * GIB))
    assert "engine.kvOffload.size 100Gi for each of its 2 data-parallel ranks" in info.value.message


def test_a_pod_larger_than_a_node_without_a_host_tier_names_resources_memory() -> None:
    tier = make_tier("main", resources={"memory": "2Ti"})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]), PlanOptions(node_memory=1536 * GIB))
    assert info.value.field == "spec.tiers[0].resources.memory"
    assert "resources.memory 2Ti" in info.value.message


def test_a_reference_pod_larger_than_a_node_is_refused_too() -> None:
    """A reference engine's host tier is memory of its pod as well."""
    tier = _reference(engine={"kvOffload": {"size": "8Gi"}})
    with pytest.raises(PlanError) as info:
        plan(make_service(tiers=[tier]), PlanOptions(node_memory=8 * GIB))
    assert info.value.field == "spec.tiers[0].engine.kvOffload.size"
    assert "the reference engine's own" in info.value.message
    plan(make_service(tiers=[tier]), PlanOptions(node_memory=10 * GIB))
