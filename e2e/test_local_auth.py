"""API keys end to end on the local fleet: examples/tenants.yaml with its keys in --auth-dir
files laid out as a cluster mounts the Secret, reference engines, the real router process and
the official openai client - refused without a tenant's key, limited to the tenant's tiers,
held to its request limit, a rotated key taken without a restart, and the tenants' metrics
on the router's metrics port only."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from e2e.support import route_fields
from e2e.test_local_runtime import HARD
from fleetpilot.api import load_services
from fleetpilot.runtime.local import LocalFleet

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.yaml"
FREE = "sk-free-0123456789abcdef0123"
PRO = "sk-pro-0123456789abcdef01234"
ROTATED = "sk-free-rotated-fedcba98765432"


def test_tenants_of_the_example_behind_the_local_router(tmp_path: Path) -> None:
    (service,) = load_services(EXAMPLE)
    keys = tmp_path / "keys" / "api-keys"
    keys.mkdir(parents=True)
    (keys / "free").write_text(f"{FREE}\n")
    (keys / "pro").write_text(f"{PRO}\n")
    fleet = LocalFleet(service, tmp_path / "work", 0, max_replicas_per_role=1, auth_dir=keys.parent)
    fleet.start()
    try:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=fleet.endpoint, api_key=key, max_retries=0)

        with (
            client("sk-nobody-0123456789abcdef") as nobody,
            pytest.raises(openai.AuthenticationError),
        ):
            nobody.chat.completions.create(
                model="gateway", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        hard = HARD  # the prompt the local runtime's test sees routed to the large tier
        with client(FREE) as free, client(PRO) as pro:
            raw = free.chat.completions.with_raw_response.create(
                model="gateway", messages=[{"role": "user", "content": hard}], max_tokens=4
            )
            # The free tenant's hard prompt stays on its one tier; the pro tenant's goes large.
            assert route_fields(raw.headers.get("x-fleetpilot-route"))["tier"] == "small"
            assert raw.headers["x-ratelimit-limit-requests"] == "30"  # 60 over 2 routers
            raw = pro.chat.completions.with_raw_response.create(
                model="gateway", messages=[{"role": "user", "content": hard}], max_tokens=4
            )
            assert route_fields(raw.headers.get("x-fleetpilot-route"))["tier"] == "large"
            with pytest.raises(openai.PermissionDeniedError):
                free.chat.completions.create(
                    model="qwen-72b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
        # The tenants' names and counts only on the metrics port, as a cluster's PodMonitor
        # scrapes it; the public port refuses /metrics, with a key too.
        public = fleet.endpoint.removesuffix("/v1") + "/metrics"
        for headers in ({}, {"Authorization": f"Bearer {PRO}"}):
            refused = httpx.get(public, headers=headers, timeout=30, trust_env=False)
            assert refused.status_code == 404
            assert "free" not in refused.text
        scraped = httpx.get(
            f"http://{fleet.router_metrics_address}/metrics", timeout=30, trust_env=False
        ).text
        assert 'fleetpilot_router_tenant_requests_total{tenant="free"}' in scraped
        (keys / "free").write_text(f"{ROTATED}\n")
        deadline = time.monotonic() + 15
        with client(ROTATED) as rotated:
            while True:
                try:
                    rotated.completions.create(model="qwen-7b", prompt="hi", max_tokens=2)
                    break
                except openai.AuthenticationError:
                    assert time.monotonic() < deadline, "the rotated key was not taken"
                    time.sleep(0.5)
    finally:
        fleet.stop()
