"""The shared base of every API model: camelCase on the wire, unknown fields refused."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base for spec and status models.

    Kubernetes objects use camelCase keys; Python code uses snake_case attributes. Unknown
    fields are refused (``extra="forbid"``) so a typo in a manifest is an error, not a silently
    ignored setting - the same behaviour the API server gives with a structural schema.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        serialize_by_alias=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as it appears in a manifest: camelCase keys, no unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def cel_rules(*rules: tuple[str, str]) -> dict[str, Any]:
    """JSON-schema extra carrying CEL rules as ``x-kubernetes-validations``.

    Each rule is ``(expression, message)``; the same message is raised by the model's
    Python validator so ``fleetpilot plan`` refuses exactly what the API server would.
    """
    return {"x-kubernetes-validations": [{"rule": rule, "message": msg} for rule, msg in rules]}


def nested(model: type[ApiModel], description: str) -> Any:
    """A sub-object that is always present, defaulted in the CRD to the model's defaults.

    The CRD default is the whole defaulted object, not ``{}``: the API server checks a
    default against the node's CEL rules as written, without applying the nested defaults
    first, so ``{}`` would fail any rule that reads a defaulted field.
    """
    return Field(
        default_factory=model,
        description=description,
        json_schema_extra={"default": model().to_wire()},
    )
