"""The router's versioned configuration, written by the operator into a ConfigMap.

The router reads only this file, never the InferenceService: it needs no access to custom
resources, and the config it runs with can be inspected with ``kubectl get configmap``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from pydantic import Field

from fleetpilot.api.base import ApiModel
from fleetpilot.api.spec import Affinity, ServingMode, Spillover
from fleetpilot.api.units import Duration

ROUTER_CONFIG_FILE = "router.yaml"


class EndpointGroup(ApiModel):
    """The engine pods of one role of a tier, as the router discovers them."""

    role: Literal["unified", "prefill", "decode"]
    service: str = Field(description="Headless Service whose EndpointSlices list the pods.")
    selector: dict[str, str] = Field(description="Pod labels of this group.")
    port: int = Field(ge=1, le=65535)
    max_num_seqs: int = Field(ge=1, description="Engine batch limit: the saturation point.")


class RouterTier(ApiModel):
    name: str
    model: str = Field(description="Name clients request (the tier's served model name).")
    up_to: float = Field(ge=0.0, le=1.0)
    mode: ServingMode
    endpoints: list[EndpointGroup]


class RouterConfig(ApiModel):
    """``fleetpilot.dev/v1alpha1 RouterConfig``."""

    api_version: Literal["fleetpilot.dev/v1alpha1"] = "fleetpilot.dev/v1alpha1"
    kind: Literal["RouterConfig"] = "RouterConfig"
    service: str
    namespace: str
    port: int = Field(8000, ge=1, le=65535)
    tiers: list[RouterTier] = Field(min_length=1)
    affinity: Affinity = Field(default_factory=Affinity)
    load_weight: float = Field(1.0, ge=0.0)
    retries: int = Field(2, ge=0)
    spillover: Spillover = Field(default_factory=Spillover)
    request_timeout: Duration = Field(timedelta(minutes=10))
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
