"""P/D disaggregation between reference servers: the servers' settings, the router's prefill
hop and the metric reads shared by the P/D test modules."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.routing.policies.pd import PREFILL_KV_PARAMS
from fleetpilot.testing.engine_server import BackgroundServer

MODEL = "pd-model"
PROMPT = "Disaggregated serving moves the prompt's KV cache from prefill to decode."
REQUEST: dict[str, Any] = {
    "model": MODEL,
    "prompt": PROMPT,
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}
# What vLLM's toy proxy (and so our router) sends to the prefill server.
PREFILL_PARAMS = PREFILL_KV_PARAMS
NIXL = '{"kv_connector": "NixlConnector", "kv_role": "%s"%s}'
COMMON = [
    "--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len", "256",
    "--served-model-name", MODEL,
]  # fmt: skip


def start(*extra: str) -> BackgroundServer:
    return BackgroundServer.from_argv([*COMMON, *extra]).start()


def metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(url: str, name: str, **labels: str) -> float:
    want = {("model_name", MODEL), ("engine", "0"), *labels.items()}
    hits = [v for (n, got), v in metrics(url).items() if n == name and want <= got]
    assert len(hits) == 1, (name, labels)
    return hits[0]


def fallbacks(url: str, reason: str) -> float:
    return value(url, "fleetpilot_kv_transfer_fallbacks_total", reason=reason)


def post(srv: BackgroundServer, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    resp = httpx.post(srv.url + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def do_prefill(prefill: BackgroundServer, body: dict[str, Any] = REQUEST) -> dict[str, Any]:
    first = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    params = first["kv_transfer_params"]
    assert params is not None
    return dict(params)
