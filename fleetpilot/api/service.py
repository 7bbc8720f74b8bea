"""The InferenceService custom resource as a whole: metadata, spec, status."""

from __future__ import annotations

import re
from typing import Any, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from fleetpilot.api.base import ApiModel
from fleetpilot.api.spec import DNS_LABEL_PATTERN, InferenceServiceSpec, Rule
from fleetpilot.api.status import InferenceServiceStatus

GROUP = "fleetpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["fpsvc"]

_NAME_RE = re.compile(DNS_LABEL_PATTERN)


class ObjectMeta(ApiModel):
    """The parts of metadata fleetpilot reads; whatever else the server adds is kept as is."""

    model_config = ConfigDict(**{**ApiModel.model_config, "extra": "allow"})

    name: str = Field(description="Object name.")
    namespace: str = Field("default", max_length=63, description="Namespace.")
    uid: str | None = Field(None, description="Set by the server; needed for ownerReferences.")
    generation: int | None = Field(None, ge=0, description="Spec generation, set by the server.")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_name(self) -> Self:
        if len(self.name) > 63 or not _NAME_RE.match(self.name):
            raise ValueError(Rule.NAME_LABEL)
        return self


class InferenceService(ApiModel):
    """``fleetpilot.dev/v1alpha1 InferenceService``."""

    api_version: Literal["fleetpilot.dev/v1alpha1"] = "fleetpilot.dev/v1alpha1"
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> InferenceService:
        """Validate a manifest or an object read from the API server."""
        return cls.model_validate(obj, by_alias=True)
