"""Brings one running engine's LoRA adapters to a declared list over vLLM's HTTP API.

``GET /v1/models`` says what the engine holds; ``POST /v1/unload_lora_adapter {lora_name}`` and
``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` change it (vLLM 0.33 serves
both only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, and answers 200 with a plain-text
line, or an OpenAI error). The plan is ``engine.adapter_sync``'s; this module only calls.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus

import httpx

from fleetpilot.engine.adapter_sync import AdapterSyncPlan, adapters_listed, plan_adapter_sync

log = logging.getLogger(__name__)

MODELS_ROUTE = "/v1/models"
LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"
# A load reads the adapter's files (and, for a Hub repo id, downloads them first): seconds to
# minutes, not the milliseconds of a listing.
LIST_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 300.0


class AdapterCallError(Exception):
    """An engine refused or failed one adapter call; the message is the engine's own."""


@dataclass
class EngineAdapterSync:
    """What one sync of one engine did: the calls that succeeded, and the failures."""

    url: str
    plan: AdapterSyncPlan = field(default_factory=AdapterSyncPlan)
    done: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.done)


def _error_message(response: httpx.Response) -> str:
    """The engine's error text: vLLM's ``{"error": {"message"}}``, its older top-level
    ``{"message"}``, or the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("message"):
            return str(body["message"])
    return response.text.strip()[:500]


class AdapterClient:
    """Adapter calls to engines at ``http://host:port``; one connection pool for all of them."""

    def __init__(self, client: httpx.Client | None = None) -> None:
        self._client = client or httpx.Client(timeout=LIST_TIMEOUT_S)

    def close(self) -> None:
        self._client.close()

    def listed(self, url: str) -> dict[str, str]:
        response = self._client.get(url + MODELS_ROUTE, timeout=LIST_TIMEOUT_S)
        if response.status_code != HTTPStatus.OK:
            raise AdapterCallError(f"GET {MODELS_ROUTE}: {_error_message(response)}")
        return adapters_listed(response.json())

    def load(self, url: str, name: str, path: str, *, inplace: bool = False) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        response = self._client.post(url + LOAD_ROUTE, json=body, timeout=LOAD_TIMEOUT_S)
        if response.status_code != HTTPStatus.OK:
            raise AdapterCallError(f"load {name} from {path}: {_error_message(response)}")

    def unload(self, url: str, name: str) -> None:
        response = self._client.post(
            url + UNLOAD_ROUTE, json={"lora_name": name}, timeout=LIST_TIMEOUT_S
        )
        # 404: the engine no longer holds it (a restart, another sync): what was wanted.
        if response.status_code not in (HTTPStatus.OK, HTTPStatus.NOT_FOUND):
            raise AdapterCallError(f"unload {name}: {_error_message(response)}")

    def sync(self, url: str, desired: Mapping[str, str]) -> EngineAdapterSync:
        """Bring the engine at ``url`` to ``desired`` (name -> path in its pod). A failed call
        is recorded and the rest still tried: one bad adapter does not keep the others out."""
        outcome = EngineAdapterSync(url)
        try:
            outcome.plan = plan_adapter_sync(desired, self.listed(url))
        except (httpx.HTTPError, AdapterCallError, ValueError) as exc:
            outcome.errors.append(f"list adapters: {exc}")
            return outcome
        plan = outcome.plan
        calls = [
            *(("unload", name, "") for name in plan.unload),
            *(("load", name, path) for name, path in plan.load),
            *(("reload", name, path) for name, path in plan.reload),
        ]
        for kind, name, path in calls:
            try:
                if kind == "unload":
                    self.unload(url, name)
                else:
                    self.load(url, name, path, inplace=kind == "reload")
            except AdapterCallError as exc:
                outcome.errors.append(str(exc))
            except httpx.HTTPError as exc:
                outcome.errors.append(f"{kind} {name}: {type(exc).__name__}: {exc}")
            else:
                outcome.done.append(f"{kind} {name}")
        if outcome.done or outcome.errors:
            log.info(
                "adapters synced",
                extra={"engine": url, "done": outcome.done, "errors": outcome.errors},
            )
        return outcome
