"""The InferenceService API: pydantic models that are the single source of truth of the CRD,
and what a spec means in bytes (``capacity``). No I/O but ``loading``'s reads of the manifest
files it is given: no cluster, HTTP or Prometheus client."""

from fleetpilot.api.loading import FieldProblem, InvalidManifestError, load_services, parse_service
from fleetpilot.api.service import API_VERSION, GROUP, KIND, VERSION, InferenceService, ObjectMeta
from fleetpilot.api.spec import (
    InferenceServiceSpec,
    Parallelism,
    ReplicaBounds,
    ResolvedRole,
    RoleName,
    RoleSpec,
    Rule,
    ServingMode,
    Tier,
)
from fleetpilot.api.status import InferenceServiceStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "VERSION",
    "FieldProblem",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "InvalidManifestError",
    "ObjectMeta",
    "Parallelism",
    "ReplicaBounds",
    "ResolvedRole",
    "RoleName",
    "RoleSpec",
    "Rule",
    "ServingMode",
    "Tier",
    "load_services",
    "parse_service",
]
