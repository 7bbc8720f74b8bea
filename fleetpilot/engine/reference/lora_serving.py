"""The server's side of LoRA: the adapter names it serves, and vLLM's rules for changing them.

Purely computational; the HTTP handlers (server.py) read the adapter and talk to the engine.
As vLLM's ``OpenAIServingModels`` (``vllm/entrypoints/openai/models/serving.py``):

* a request's ``model`` names the base model (any served name: no adapter) or an adapter;
* ``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` adds one: 400
  (``InvalidUserInput``) without a name or path, for a name a base model has, or for a loaded
  name without ``load_inplace`` (which keeps the adapter's id and replaces its weights); 404
  (``NotFoundError``) when nothing is at the path; else 200 with a plain-text success line;
* ``POST /v1/unload_lora_adapter {lora_name}`` removes one: 400 without a name, 404 for a name
  not loaded;
* ``/v1/models`` lists each adapter with ``root`` = its path and ``parent`` = its base model;
* ``--lora-modules`` entries are ``name=path`` or JSON ``{"name", "path", "base_model_name"}``
  (vLLM's ``LoRAParserAction``), loaded at start.

Both endpoints exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or ``true``.
Deliberately unlike vLLM 0.33: an adapter that exists but cannot be served (a refused PEFT
feature, a rank over ``--max-lora-rank``, shapes that do not fit the model) is a 400 naming
the problem, where vLLM answers 500 because the error crossed its engine-core process; and
unloading also drops the adapter's weights from the engine (vLLM forgets only the name).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from fleetpilot.engine.reference.lora import LoRARequest

RUNTIME_UPDATING_ENV: Final = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_ROUTE: Final = "/v1/load_lora_adapter"
UNLOAD_ROUTE: Final = "/v1/unload_lora_adapter"


def runtime_updating_allowed(value: str | None) -> bool:
    """vLLM's reading of ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""
    return (value or "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """``name=path`` (no comma) or a JSON object, as vLLM reads them; ValueError otherwise."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoRAModulePath(name, path)
    try:
        data = json.loads(item)
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from e
    if not isinstance(data, dict):
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}")
    unknown = sorted(set(data) - {"name", "path", "base_model_name", "is_3d_lora_weight"})
    missing = sorted({"name", "path"} - set(data))
    if unknown or missing:
        raise ValueError(
            f"Invalid fields for --lora-modules: {item} - unknown {unknown}, missing {missing}"
        )
    base = data.get("base_model_name")
    if not all(isinstance(data[k], str) for k in ("name", "path")) or not (
        base is None or isinstance(base, str)
    ):
        raise ValueError(f"Invalid fields for --lora-modules: {item} - values must be strings")
    return LoRAModulePath(data["name"], data["path"], base)


class LoRAServingError(Exception):
    """A refused load or unload: the HTTP status, vLLM's error type and its message."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message


def not_found(name: str, path: str) -> LoRAServingError:
    """vLLM's ``LoRAAdapterNotFoundError`` answer."""
    return LoRAServingError(
        404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}"
    )


class LoRARegistry:
    """Adapter names -> ``LoRARequest``; ids are never reused, so a name unloaded and loaded
    again does not share the engine's cached weights with its former self."""

    def __init__(self, base_model_names: Sequence[str]) -> None:
        self.base_model_names = tuple(base_model_names)
        self.adapters: dict[str, LoRARequest] = {}
        self._last_id = 0

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def prepare_load(
        self,
        name: str,
        path: str,
        *,
        load_inplace: bool = False,
        base_model_name: str | None = None,
    ) -> LoRARequest:
        """The adapter a load would add (checked as vLLM checks it); ``commit`` it once the
        engine has it. Raises ``LoRAServingError``."""
        if not name or not path:
            raise LoRAServingError(
                400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."
            )
        if name in self.base_model_names:
            raise LoRAServingError(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' conflicts with a served base model.",
            )
        previous = self.adapters.get(name)
        if previous is not None and not load_inplace:
            raise LoRAServingError(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        if previous is not None:
            lora_id = previous.lora_int_id
        else:
            self._last_id += 1
            lora_id = self._last_id
        base = base_model_name if base_model_name in self.base_model_names else None
        return LoRARequest(name, lora_id, path, base)

    def commit(self, lora: LoRARequest) -> str:
        """Record a loaded adapter; vLLM's success line."""
        self.adapters[lora.name] = lora
        return f"Success: LoRA adapter '{lora.name}' added successfully."

    def unload(self, name: str) -> tuple[LoRARequest, str]:
        """Forget an adapter; it and vLLM's success line. Raises ``LoRAServingError``."""
        if not name:
            raise LoRAServingError(
                400,
                "InvalidUserInput",
                "'lora_name' needs to be provided to unload a LoRA adapter.",
            )
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise LoRAServingError(
                404, "NotFoundError", f"The lora adapter '{name}' cannot be found."
            )
        return lora, f"Success: LoRA adapter '{name}' removed successfully."

    def parent(self, lora: LoRARequest) -> str:
        """The base model ``/v1/models`` names as the adapter's parent."""
        return lora.base_model_name or self.base_model_names[0]
