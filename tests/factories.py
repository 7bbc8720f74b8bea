"""Small builders of InferenceService manifests and models for tests."""

from __future__ import annotations

import copy
from typing import Any

from fleetpilot.api import InferenceService, parse_service


def make_tier(
    name: str = "small",
    *,
    model: str = "Qwen/Qwen2.5-7B-Instruct",
    mode: str = "unified",
    up_to: float | None = None,
    tensor: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    """A tier manifest; ``mode="disaggregated"`` adds prefill and decode roles."""
    tier: dict[str, Any] = {"name": name, "model": {"name": model}}
    if tensor != 1:
        tier["parallelism"] = {"tensor": tensor}
    if mode == "disaggregated":
        tier["serving"] = {
            "mode": "disaggregated",
            "prefill": {"replicas": {"min": 1, "max": 4}},
            "decode": {"replicas": {"min": 1, "max": 8}},
        }
    else:
        tier["serving"] = {"replicas": {"min": 1, "max": 4}}
    if up_to is not None:
        tier["complexity"] = {"upTo": up_to}
    tier.update(copy.deepcopy(extra))
    return tier


def make_manifest(
    name: str = "chat",
    *,
    namespace: str = "ml",
    tiers: list[dict[str, Any]] | None = None,
    uid: str | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    """A valid InferenceService manifest; one unified tier unless ``tiers`` is given."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        metadata["uid"] = uid
    spec: dict[str, Any] = {"tiers": tiers if tiers is not None else [make_tier()]}
    spec.update(copy.deepcopy(spec_extra))
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": spec,
    }


def make_service(name: str = "chat", **kwargs: Any) -> InferenceService:
    """The parsed model of :func:`make_manifest`."""
    return parse_service(make_manifest(name, **kwargs))


def two_tier_manifest() -> dict[str, Any]:
    return make_manifest(
        tiers=[
            make_tier("small", up_to=0.4),
            make_tier("large", model="Qwen/Qwen2.5-72B-Instruct", tensor=4),
        ]
    )


def make_local_manifest(
    name: str,
    *,
    replicas: dict[str, int],
    ttft_p95: str,
    max_num_seqs: int | None = None,
    scale_up_stabilization: str | None = "0s",
    scale_down_stabilization: str | None = None,
) -> dict[str, Any]:
    """A one-tier service for tests of the local runtime (``fleetpilot up``'s processes).

    Tier ``small`` serves ``small-model`` with a 512-token context (the CPU reference engines
    start fast); Prometheus scrapes every second and the autoscaler decides every second over a
    10 s window, so decisions come within a test's patience. What each test is about is given:
    the replica bounds, the TTFT objective and the stabilization windows (None: the default).
    """
    autoscaling: dict[str, Any] = {"interval": "1s", "window": "10s", "slo": {"ttftP95": ttft_p95}}
    if scale_up_stabilization is not None:
        autoscaling["scaleUp"] = {"stabilization": scale_up_stabilization}
    if scale_down_stabilization is not None:
        autoscaling["scaleDown"] = {"stabilization": scale_down_stabilization}
    tier = make_tier("small", model="Qwen/Qwen2.5-0.5B-Instruct", autoscaling=autoscaling)
    tier["model"].update(servedName="small-model", maxModelLen=512)
    tier["serving"] = {"replicas": dict(replicas)}
    if max_num_seqs is not None:
        tier["engine"] = {"maxNumSeqs": max_num_seqs}
    return make_manifest(
        name, namespace="default", tiers=[tier], monitoring={"scrapeInterval": "1s"}
    )
