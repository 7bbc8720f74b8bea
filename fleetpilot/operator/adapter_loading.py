"""Loads the adapters of ``lora.dynamic`` tiers into their running engines.

Such engines start with LoRA on and no adapters, and serve vLLM's load/unload endpoints: the
adapter list is not in their pod template, so a changed list reaches them here, without a
rollout. The operator syncs a service's engines when one of its pods changes (a new or restarted
replica turns Ready holding nothing), after every reconcile (a changed list), and every
``RESYNC_S`` (an engine restarted in place, a load that failed). ``engines_to_sync`` is the pure
part: which pods, at which address, should hold which adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.engine.adapter_client import AdapterClient, EngineAdapterSync
from fleetpilot.engine.vllm_args import ENGINE_PORT, declared_adapters
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube
from fleetpilot.kube.events import post_event
from fleetpilot.operator import metrics

log = logging.getLogger(__name__)

COMPONENT = "fleetpilot-operator"
# Catches what no pod event announces: an engine process restarted inside a Ready pod (it lost
# its adapters), a load that failed (a PVC path written later, the Hub down).
RESYNC_S = 30.0


@dataclass(frozen=True)
class EngineTarget:
    """One Ready engine pod of a dynamic-LoRA tier and the adapters it should hold."""

    pod: str
    tier: str
    url: str
    adapters: Mapping[str, str]


def dynamic_tiers(service: InferenceService) -> dict[str, dict[str, str]]:
    """Tier name -> declared adapters (name -> path in the pod), for ``lora.dynamic`` tiers."""
    return {
        tier.name: declared_adapters(tier)
        for tier in service.spec.tiers
        if tier.lora is not None and tier.lora.dynamic
    }


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def engines_to_sync(
    service: InferenceService, pods: Iterable[Mapping[str, Any]]
) -> list[EngineTarget]:
    """The service's Ready engine pods of dynamic-LoRA tiers, with their address (a pod not
    Ready is skipped: its turn comes with the event that makes it Ready; so is a multi-node
    replica's worker: it serves no API, its leader loads for the whole group)."""
    tiers = dynamic_tiers(service)
    targets = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if labels.get(names.LWS_WORKER_INDEX_LABEL, "0") != "0":
            continue
        tier = labels.get(names.LABEL_TIER)
        ip = (pod.get("status") or {}).get("podIP")
        if tier not in tiers or not ip or metadata.get("deletionTimestamp") or not _ready(pod):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        targets.append(
            EngineTarget(
                metadata.get("name", ""), tier, f"http://{host}:{ENGINE_PORT}", tiers[tier]
            )
        )
    return sorted(targets, key=lambda t: t.pod)


def sync_service(
    kube: Kube, client: AdapterClient, service: InferenceService
) -> list[EngineAdapterSync]:
    """Bring every Ready engine of the service's dynamic-LoRA tiers to its declared adapters;
    report what changed and what failed as Events and metrics."""
    if not dynamic_tiers(service):
        return []
    pods = kube.list("Pod", service.namespace, names.engines_selector(service.name))
    outcomes = []
    for target in engines_to_sync(service, pods):
        outcome = client.sync(target.url, target.adapters)
        outcomes.append(outcome)
        # Each line starts with its call: load, reload, unload, or list.
        for result, lines in (("ok", outcome.done), ("error", outcome.errors)):
            for line in lines:
                metrics.ADAPTER_CALLS.labels(call=line.split(" ", 1)[0], result=result).inc()
        for reason, kind, lines, sep in (
            ("AdapterLoadFailed", "Warning", outcome.errors, "; "),
            ("AdaptersSynced", "Normal", outcome.done, ", "),
        ):
            if lines:
                post_event(
                    kube, service, reason=reason, kind=kind, component=COMPONENT,
                    message=f"engine pod {target.pod} (tier {target.tier}): " + sep.join(lines),
                )  # fmt: skip
    return outcomes
