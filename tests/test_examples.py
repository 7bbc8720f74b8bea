"""Examples are tests: every file in examples/ is valid, plans valid objects, and plans what
its comment (and the README's list of examples) says it is for."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fleetpilot.api import load_services
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.operator.plan_types import K8sObject, PlanOptions
from fleetpilot.operator.planner import plan
from tests.crd_support import CrdValidator

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
KUBERNETES_VERSION = "1.36"
# Kinds from optional CRDs have no schema in kubernetes-validate; checked by shape instead (a
# LeaderWorkerSet's pod templates as core PodTemplates; the set itself on the real API server,
# e2e/test_multi_node.py).
OPTIONAL_KINDS = {
    "PodMonitor": "monitoring.coreos.com/v1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
}


@dataclass(frozen=True)
class Engine:
    """One engine Deployment (or LeaderWorkerSet, with ``nodes`` > 1) an example must plan."""

    role: str
    gpus: int  # per pod; 0: a CPU reference engine, which asks for none
    replicas: int
    # Flags of `vllm serve` (the leader's) or of the reference engine, and a text their value
    # must contain.
    flags: dict[str, str] = field(default_factory=dict)
    nodes: int = 1


@dataclass(frozen=True)
class Example:
    service: str
    # (tier, complexity upTo, serving mode) in routing order, as the router's config holds them.
    tiers: list[tuple[str, float, str]]
    engines: dict[str, Engine]
    # What the model cache's Jobs download (spec.modelCache), in plan order.
    downloads: tuple[str, ...] = ()
    # Tenants whose API keys the router checks (spec.routing.auth), in order.
    tenants: tuple[str, ...] = ()


NIXL = {"--kv-transfer-config": '"kv_connector":"NixlConnector"'}
EXPECTED = {
    "single-tier.yaml": Example(
        "assistant",
        [("main", 1.0, "unified")],
        {
            "assistant-main": Engine(
                "unified",
                1,
                1,
                {
                    "--served-model-name": "llama-8b",
                    # The router's KV index subscribes to every engine's events.
                    "--kv-events-config": '"replay_endpoint":"tcp://*:5558"',
                },
            )
        },
        downloads=("meta-llama/Llama-3.1-8B-Instruct@main",),
    ),
    "two-tier.yaml": Example(
        "chat",
        [("small", 0.4, "unified"), ("large", 1.0, "unified")],
        {
            "chat-small": Engine(
                "unified",
                1,
                1,
                {"--quantization": "awq", "--speculative-config": '"method":"ngram"'},
            ),
            "chat-large": Engine("unified", 4, 1, {"--tensor-parallel-size": "4"}),
        },
    ),
    "disaggregated.yaml": Example(
        "longctx",
        [("main", 1.0, "disaggregated")],
        {
            "longctx-main-prefill": Engine("prefill", 8, 1, NIXL),
            "longctx-main-decode": Engine("decode", 4, 2, NIXL),
        },
    ),
    "tp8-speculative.yaml": Example(
        "reasoning",
        [("main", 1.0, "unified")],
        {
            "reasoning-main": Engine(
                "unified",
                8,
                1,
                {
                    "--tensor-parallel-size": "8",
                    "--speculative-config": '"method":"eagle3","model":"yuhuili/EAGLE3',
                    "--kv-cache-dtype": "fp8",
                },
            )
        },
        downloads=(
            "meta-llama/Llama-3.3-70B-Instruct@main",
            "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B@main",
        ),
    ),
    "lora.yaml": Example(
        "assist",
        [("main", 1.0, "unified")],
        {
            "assist-main": Engine(
                "unified",
                1,
                1,
                {
                    "--max-loras": "2",
                    "--max-lora-rank": "32",
                    # The Hub adapter from its init container's emptyDir (the PVC one follows).
                    "--lora-modules": "sql=/adapters/0-sql",
                },
            )
        },
        downloads=("meta-llama/Llama-3.1-8B-Instruct@main",),
    ),
    "lora-dynamic.yaml": Example(
        "tutor",
        [("main", 1.0, "unified")],
        {
            "tutor-main": Engine(
                "unified",
                1,
                1,
                # LoRA on, no --lora-modules: the operator loads the list into running engines.
                {"--max-loras": "2", "--max-lora-rank": "16"},
            )
        },
        downloads=("Qwen/Qwen2.5-7B-Instruct@main",),
    ),
    "deepseek-wide-ep.yaml": Example(
        "moe",
        [("main", 1.0, "disaggregated")],
        {
            "moe-main-prefill": Engine(
                "prefill", 8, 1, {**NIXL, "--data-parallel-size": "8", "--quantization": "fp8"}
            ),
            # Wide expert parallelism: 16 ranks, 8 on each of 2 nodes, with EPLB.
            "moe-main-decode": Engine(
                "decode",
                8,
                1,
                {
                    **NIXL,
                    "--data-parallel-size": "16",
                    "--data-parallel-size-local": "8",
                    "--nnodes": "2",
                    "--eplb-config": '"num_redundant_experts":32',
                },
                nodes=2,
            ),
        },
    ),
    "llama-405b-multinode.yaml": Example(
        "dense",
        [("main", 1.0, "unified")],
        {
            "dense-main": Engine(
                "unified",
                8,
                1,
                {"--tensor-parallel-size": "8", "--pipeline-parallel-size": "2", "--nnodes": "2"},
                nodes=2,
            )
        },
    ),
    "tenants.yaml": Example(
        "gateway",
        [("small", 0.4, "unified"), ("large", 1.0, "unified")],
        {
            "gateway-small": Engine("unified", 1, 1, {"--served-model-name": "qwen-7b"}),
            "gateway-large": Engine("unified", 4, 1, {"--tensor-parallel-size": "4"}),
        },
        downloads=("Qwen/Qwen2.5-7B-Instruct@main", "Qwen/Qwen2.5-72B-Instruct@main"),
        tenants=("free", "pro"),
    ),
    "cpu-two-tier.yaml": Example(
        "cpu",
        [("small", 0.4, "unified"), ("large", 1.0, "unified")],
        {
            "cpu-small": Engine(
                "unified", 0, 1, {"--model-config": "tiny", "--served-model-name": "small-model"}
            ),
            "cpu-large": Engine(
                "unified", 0, 1, {"--model-config": "small", "--max-model-len": "4096"}
            ),
        },
    ),
    "host-kv-offload.yaml": Example(
        "support",
        [("main", 1.0, "unified")],
        {
            "support-main": Engine(
                "unified",
                1,
                1,
                {
                    "--kv-offloading-size": "128",
                    "--kv-offloading-backend": "native",
                    # Blocks in host memory published with their tokens, for the router.
                    "--kv-transfer-config": '"self_describing_kv_events":true',
                },
            )
        },
    ),
    "local-two-tier.yaml": Example(
        "local",
        [("small", 0.4, "unified"), ("large", 1.0, "unified")],
        {
            "local-small": Engine("unified", 1, 1, {"--served-model-name": "small-model"}),
            "local-large": Engine("unified", 1, 1, {"--served-model-name": "large-model"}),
        },
    ),
}


def _planned(path: Path) -> tuple[str, list[K8sObject]]:
    (service,) = load_services(path)
    return service.name, plan(service, PlanOptions(pod_monitor_available=True))


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_every_example_is_described_here() -> None:
    """A new example without expectations (or a removed one still expected) fails: each file
    in examples/ is checked for what it is for, not just that it parses."""
    assert sorted(path.name for path in EXAMPLES) == sorted(EXPECTED)


def _component(obj: K8sObject) -> str:
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def _kept(job: K8sObject) -> list[str]:
    """The Hub downloads a GC Job keeps."""
    argv = job["spec"]["template"]["spec"]["containers"][0]["command"]
    return [value for flag, value in pairwise(argv) if flag == "--keep-hub"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plans_the_tiers_and_roles_it_describes(path: Path) -> None:
    """The two-tier examples route by complexity to two tiers, the disaggregated one plans
    prefill and decode Deployments with NIXL, the TP=8 one eight GPUs with EAGLE-3 and an FP8
    KV cache, the LoRA one its adapters: an example that silently stopped showing its feature
    would still be valid."""
    expected = EXPECTED[path.name]
    name, objects = _planned(path)
    assert name == expected.service
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config = RouterConfig.model_validate(yaml.safe_load(config_map["data"][ROUTER_CONFIG_FILE]))
    assert [(t.name, t.up_to, t.mode.value) for t in config.tiers] == expected.tiers
    tenants = tuple(t.name for t in config.auth.tenants) if config.auth is not None else ()
    assert tenants == expected.tenants
    router = f"{expected.service}-router"
    workloads = {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] in ("Deployment", "LeaderWorkerSet") and o["metadata"]["name"] != router
    }
    assert sorted(workloads) == sorted(expected.engines)
    jobs = [o for o in objects if o["kind"] == "Job"]
    downloads = [j["metadata"]["annotations"]["fleetpilot.dev/model"] for j in jobs
                 if _component(j) == "model-fetch"]  # fmt: skip
    assert tuple(downloads) == expected.downloads
    # The examples' caches are claims the operator creates: a GC Job keeps what they download.
    kept = [_kept(j) for j in jobs if _component(j) == "model-gc"]
    assert kept == ([sorted(expected.downloads)] if expected.downloads else [])
    for deployment_name, engine in expected.engines.items():
        deployment = workloads[deployment_name]
        if engine.nodes > 1:
            assert deployment["kind"] == "LeaderWorkerSet", deployment_name
            group = deployment["spec"]["leaderWorkerTemplate"]
            assert group["size"] == engine.nodes
            pod: dict[str, Any] = group["leaderTemplate"]
        else:
            assert deployment["kind"] == "Deployment", deployment_name
            pod = deployment["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        assert pod["metadata"]["labels"]["fleetpilot.dev/role"] == engine.role, deployment_name
        if engine.gpus:
            assert container["resources"]["limits"]["nvidia.com/gpu"] == str(engine.gpus)
        else:
            assert not [r for r in container["resources"]["limits"] if "gpu" in r]
            assert "tolerations" not in pod["spec"], deployment_name
        assert deployment["spec"]["replicas"] == engine.replicas, deployment_name
        for flag, text in engine.flags.items():
            value = _flag(container["args"], flag)
            assert value is not None, (deployment_name, flag)
            assert text in value, (deployment_name, flag, value)
            if flag.endswith("-config") and flag != "--model-config":  # a preset's name
                json.loads(value)  # vLLM (and the reference engine) parse these as JSON


@pytest.fixture(scope="module")
def validator() -> CrdValidator:
    return CrdValidator()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_the_crd_schema_and_rules(path: Path, validator: CrdValidator) -> None:
    """Each example is accepted by the CRD's schema and CEL rules as the API server checks them:
    `kubectl apply -f examples/...` from the README must work."""
    for document in yaml.safe_load_all(path.read_text()):
        assert validator.validate(document) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_planned_object_passes_kubernetes_schemas(path: Path) -> None:
    """Every object an example plans is valid for Kubernetes 1.36 (strict: unknown fields refused),
    so the operator's apply of it is not rejected."""
    for service in load_services(path):
        objects = plan(service, PlanOptions(pod_monitor_available=True))
        kinds = {obj["kind"] for obj in objects}
        assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
        for obj in objects:
            if obj["kind"] in OPTIONAL_KINDS:
                assert obj["apiVersion"] == OPTIONAL_KINDS[obj["kind"]]
                for template in _pod_templates(obj):
                    kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)
                continue
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _pod_templates(obj: K8sObject) -> list[K8sObject]:
    """A LeaderWorkerSet's leader and worker templates as core PodTemplates."""
    if obj["kind"] != "LeaderWorkerSet":
        return []
    group = obj["spec"]["leaderWorkerTemplate"]
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{obj['metadata']['name']}-{part}"},
            "template": group[key],
        }
        for part, key in (("leader", "leaderTemplate"), ("worker", "workerTemplate"))
    ]
