"""The table of cross-field rules: a valid base object, one mutation, the expected message.

Shared by the unit tests (pydantic and cel-python) and the control-plane tests (a real API
server), so all three enforcers are held to the same cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetpilot.api import Rule
from fleetpilot.api.pod_template import OverlayRule
from tests.factories import make_manifest, make_tier

Manifest = dict[str, Any]


@dataclass(frozen=True)
class RuleCase:
    id: str
    mutate: Callable[[Manifest], None]
    message: str
    # Dotted path of the node the CEL rule sits on (where the server reports it).
    path: str


def base_manifest() -> Manifest:
    """Valid, and touching every rule's node: two tiers, one disaggregated, speculation, a
    host KV tier."""
    return make_manifest(
        tiers=[
            make_tier(
                "small",
                up_to=0.4,
                engine={
                    "maxNumSeqs": 64,
                    "maxNumBatchedTokens": 4096,
                    "speculative": {"method": "ngram", "numTokens": 4},
                    "kvOffload": {"size": "32Gi"},
                },
                adapters=[
                    {
                        "name": "sql",
                        "source": {"huggingface": {"repo": "acme/sql-lora"}},
                        "baseModel": "Qwen/Qwen2.5-7B-Instruct",
                    },
                    {"name": "legal", "source": {"pvc": {"claimName": "loras", "path": "legal"}}},
                ],
                lora={"maxLoras": 2, "maxCpuLoras": 4},
            ),
            make_tier(
                "large",
                mode="disaggregated",
                tensor=4,
                adapters=[{"name": "support", "source": {"pvc": {"claimName": "l", "path": "s"}}}],
            ),
        ]
    )


def _tier(m: Manifest, i: int) -> Manifest:
    return m["spec"]["tiers"][i]  # type: ignore[no-any-return]


def _set(path: list[str | int], value: Any) -> Callable[[Manifest], None]:
    def mutate(m: Manifest) -> None:
        node: Any = m
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
        node[path[-1]] = value

    return mutate


def _delete(path: list[str | int]) -> Callable[[Manifest], None]:
    def mutate(m: Manifest) -> None:
        node: Any = m
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

    return mutate


def _all(*mutations: Callable[[Manifest], None]) -> Callable[[Manifest], None]:
    def mutate(m: Manifest) -> None:
        for one in mutations:
            one(m)

    return mutate


T0 = ["spec", "tiers", 0]
T1 = ["spec", "tiers", 1]

RULE_CASES = [
    RuleCase(
        "replicas-min-above-max",
        _set([*T0, "serving", "replicas"], {"min": 5, "max": 2}),
        Rule.REPLICAS_ORDER,
        "spec.tiers[0].serving.replicas",
    ),
    RuleCase(
        "role-replicas-min-above-max",
        _set([*T1, "serving", "decode", "replicas"], {"min": 9, "max": 8}),
        Rule.REPLICAS_ORDER,
        "spec.tiers[1].serving.decode.replicas",
    ),
    RuleCase(
        "replicas-initial-outside-bounds",
        _set([*T0, "serving", "replicas"], {"min": 1, "max": 2, "initial": 3}),
        Rule.REPLICAS_INITIAL,
        "spec.tiers[0].serving.replicas",
    ),
    RuleCase(
        "gpus-per-engine-over-64",
        _set([*T1, "parallelism"], {"tensor": 16, "pipeline": 8}),
        Rule.GPUS_PER_ENGINE,
        "spec.tiers[1].parallelism",
    ),
    RuleCase(
        "role-gpus-per-engine-over-64",
        _set([*T1, "serving", "prefill", "parallelism"], {"tensor": 64, "pipeline": 2}),
        Rule.GPUS_PER_ENGINE,
        "spec.tiers[1].serving.prefill.parallelism",
    ),
    RuleCase(
        "data-local-not-dividing-data",
        _set([*T1, "parallelism"], {"tensor": 4, "data": 4, "dataLocal": 3}),
        Rule.DATA_LOCAL_DIVIDES,
        "spec.tiers[1].parallelism",
    ),
    RuleCase(
        "expert-parallel-on-one-gpu",
        _set([*T0, "parallelism"], {"expert": True}),
        Rule.EXPERT_NEEDS_RANKS,
        "spec.tiers[0].parallelism",
    ),
    RuleCase(
        "role-eplb-without-expert-parallel",
        _set(
            [*T1, "serving", "decode", "parallelism"],
            {"data": 8, "eplb": {"redundantExperts": 8}},
        ),
        Rule.EPLB_NEEDS_EXPERT,
        "spec.tiers[1].serving.decode.parallelism",
    ),
    RuleCase(
        "duplicate-tenant-names",
        _set(
            ["spec", "routing", "auth"],
            {
                "tenants": [
                    {"name": "team-a", "keysSecretRef": {"name": "keys", "key": "a"}},
                    {"name": "team-a", "keysSecretRef": {"name": "keys", "key": "b"}},
                ]
            },
        ),
        Rule.TENANT_NAMES_UNIQUE,
        "spec.routing.auth",
    ),
    RuleCase(
        "gateway-failing-open-past-api-keys",
        _set(
            ["spec", "routing"],
            {
                "gateway": {"failureMode": "FailOpen"},
                "auth": {
                    "tenants": [{"name": "team-a", "keysSecretRef": {"name": "keys", "key": "a"}}]
                },
            },
        ),
        Rule.GATEWAY_FAIL_OPEN_AUTH,
        "spec.routing",
    ),
    RuleCase(
        "gateway-failing-open-over-two-tiers",
        _set(["spec", "routing"], {"gateway": {"failureMode": "FailOpen"}}),
        Rule.GATEWAY_FAIL_OPEN_TIERS,
        "spec",
    ),
    RuleCase(
        "disaggregated-without-decode",
        _delete([*T1, "serving", "decode"]),
        Rule.DISAGG_NEEDS_ROLES,
        "spec.tiers[1].serving",
    ),
    RuleCase(
        "unified-with-prefill",
        _set([*T0, "serving", "prefill"], {"replicas": {"min": 1, "max": 2}}),
        Rule.UNIFIED_NO_ROLES,
        "spec.tiers[0].serving",
    ),
    RuleCase(
        "disaggregated-with-unified-replicas",
        _set([*T1, "serving", "replicas"], {"min": 1, "max": 2}),
        Rule.DISAGG_NO_REPLICAS,
        "spec.tiers[1].serving",
    ),
    RuleCase(
        "kv-transfer-in-unified",
        _set([*T0, "serving", "kvTransfer"], {"connector": "NixlConnector"}),
        Rule.KV_TRANSFER_DISAGG_ONLY,
        "spec.tiers[0].serving",
    ),
    RuleCase(
        "kv-offload-to-lmcache",
        _set([*T0, "engine", "kvOffload", "backend"], "lmcache"),
        Rule.KV_OFFLOAD_LMCACHE,
        "spec.tiers[0].engine.kvOffload",
    ),
    RuleCase(
        "kv-offload-with-prefill-and-decode",
        _set([*T1, "engine", "kvOffload"], {"size": "64Gi"}),
        Rule.KV_OFFLOAD_UNIFIED_ONLY,
        "spec.tiers[1]",
    ),
    RuleCase(
        "eagle-without-model",
        _set([*T0, "engine", "speculative"], {"method": "eagle3", "numTokens": 3}),
        Rule.SPEC_MODEL_REQUIRED,
        "spec.tiers[0].engine.speculative",
    ),
    RuleCase(
        "ngram-with-model",
        _set([*T0, "engine", "speculative", "model"], "org/draft"),
        Rule.SPEC_MODEL_FORBIDDEN,
        "spec.tiers[0].engine.speculative",
    ),
    RuleCase(
        "batched-tokens-below-seqs",
        _set([*T0, "engine", "maxNumBatchedTokens"], 32),
        Rule.BATCHED_TOKENS,
        "spec.tiers[0].engine",
    ),
    RuleCase(
        "two-model-sources",
        _set(
            [*T0, "model", "source"],
            {"pvc": {"claimName": "models"}, "huggingface": {"revision": "main"}},
        ),
        Rule.SOURCE_ONE_OF,
        "spec.tiers[0].model.source",
    ),
    RuleCase(
        "oci-and-s3-model-sources",
        _set(
            [*T0, "model", "source"],
            {"oci": {"image": "registry.example/qwen@sha256:0f"}, "s3": {"bucket": "models"}},
        ),
        Rule.SOURCE_ONE_OF,
        "spec.tiers[0].model.source",
    ),
    RuleCase(
        "model-cache-size-and-claim",
        _set(["spec", "modelCache"], {"size": "200Gi", "claimName": "shared-models"}),
        Rule.CACHE_SIZE_OR_CLAIM,
        "spec.modelCache",
    ),
    RuleCase(
        "model-cache-without-size-or-claim",
        _set(["spec", "modelCache"], {"storageClassName": "nfs"}),
        Rule.CACHE_SIZE_OR_CLAIM,
        "spec.modelCache",
    ),
    RuleCase(
        "duplicate-tier-names",
        _set([*T1, "name"], "small"),
        Rule.TIER_NAMES_UNIQUE,
        "spec",
    ),
    RuleCase(
        "complexity-decreasing",
        _set([*T1, "complexity"], {"upTo": 0.2}),
        Rule.COMPLEXITY_INCREASING,
        "spec",
    ),
    RuleCase(
        "complexity-equal-by-default",
        _delete([*T0, "complexity"]),
        Rule.COMPLEXITY_INCREASING,
        "spec",
    ),
    RuleCase(
        "scale-down-window-shorter-than-up",
        _set(
            [*T0, "autoscaling"],
            {"scaleUp": {"stabilization": "2m"}, "scaleDown": {"stabilization": "30s"}},
        ),
        Rule.SCALE_DOWN_WINDOW,
        "spec.tiers[0].autoscaling",
    ),
    *[
        RuleCase(
            f"pod-template-{name}",
            _set([*T0, "podTemplate"], overlay),
            message,
            "spec.tiers[0].podTemplate",
        )
        for name, overlay, message in [
            ("owned-label", {"labels": {"fleetpilot.dev/tier": "x"}}, OverlayRule.LABELS),
            ("app-label", {"labels": {"app.kubernetes.io/name": "x"}}, OverlayRule.LABELS),
            (
                "scrape-annotation",
                {"annotations": {"prometheus.io/port": "9"}},
                OverlayRule.ANNOTATIONS,
            ),
            ("owned-env", {"env": [{"name": "HF_TOKEN", "value": "x"}]}, OverlayRule.ENV),
            (
                "owned-volume",
                {"volumes": [{"name": "cache", "emptyDir": {}}]},
                OverlayRule.VOLUMES,
            ),
            (
                "adapter-volume",
                {"volumes": [{"name": "adapters-0", "emptyDir": {}}]},
                OverlayRule.VOLUMES,
            ),
            (
                "owned-mount",
                {"volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]},
                OverlayRule.MOUNTS,
            ),
            (
                "adapter-mount",
                {"volumeMounts": [{"name": "x", "mountPath": "/adapter-volumes/loras"}]},
                OverlayRule.MOUNTS,
            ),
            (
                "gpu-product",
                {"nodeSelector": {"nvidia.com/gpu.product": "A100"}},
                OverlayRule.GPU_PRODUCT,
            ),
            ("command", {"command": ["sh"]}, OverlayRule.CONTAINER),
            ("ports", {"ports": [{"containerPort": 9000}]}, OverlayRule.CONTAINER),
            ("resources", {"resources": {"limits": {"cpu": "1"}}}, OverlayRule.CONTAINER),
        ]
    ],
    RuleCase(
        "role-pod-template-image",
        _set([*T1, "serving", "decode", "podTemplate"], {"image": "other:1"}),
        OverlayRule.CONTAINER,
        "spec.tiers[1].serving.decode.podTemplate",
    ),
    RuleCase(
        "adapter-two-sources",
        _set([*T0, "adapters", 1, "source", "huggingface"], {"repo": "acme/legal-lora"}),
        Rule.ADAPTER_SOURCE_ONE_OF,
        "spec.tiers[0].adapters[1].source",
    ),
    RuleCase(
        "adapter-no-source",
        _set([*T0, "adapters", 1, "source"], {}),
        Rule.ADAPTER_SOURCE_ONE_OF,
        "spec.tiers[0].adapters[1].source",
    ),
    RuleCase(
        "lora-cpu-below-gpu",
        _set([*T0, "lora", "maxCpuLoras"], 1),
        Rule.LORA_CPU_LORAS,
        "spec.tiers[0].lora",
    ),
    RuleCase(
        "adapter-of-another-model",
        _set([*T0, "adapters", 0, "baseModel"], "meta-llama/Llama-3.1-8B-Instruct"),
        Rule.ADAPTER_BASE_MODEL,
        "spec.tiers[0]",
    ),
    RuleCase(
        "adapter-name-twice-in-a-tier",
        _set([*T0, "adapters", 1, "name"], "sql"),
        Rule.ADAPTER_NAMES_UNIQUE,
        "spec",
    ),
    RuleCase(
        "adapter-name-in-two-tiers",
        _set([*T1, "adapters", 0, "name"], "legal"),
        Rule.ADAPTER_NAMES_UNIQUE,
        "spec",
    ),
    RuleCase(
        "adapter-named-like-a-model",
        _set([*T1, "adapters", 0, "name"], "Qwen/Qwen2.5-7B-Instruct"),
        Rule.ADAPTER_NOT_A_MODEL,
        "spec",
    ),
    RuleCase(
        "adapter-named-like-a-served-name",
        _all(
            _set([*T1, "model", "servedName"], "chat-large"),
            _set([*T0, "adapters", 0, "name"], "chat-large"),
        ),
        Rule.ADAPTER_NOT_A_MODEL,
        "spec",
    ),
    RuleCase(
        "name-not-dns-label",
        _set(["metadata", "name"], "9chat"),
        Rule.NAME_LABEL,
        "",
    ),
]
