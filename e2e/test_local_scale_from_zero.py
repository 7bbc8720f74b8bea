"""Scale from zero on the local runtime: a request to a tier with no engine waits at the
router, the autoscaler sees it there and starts one, the request is answered; idle again, the
tier goes back to zero after its scale-down window.

Both sources are exercised: a real Prometheus scraping the router (its
``fleetpilot_router_pending_requests``), and the router's /metrics read directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from e2e.support import running_stack, step_until
from fleetpilot.runtime.stack import LocalStack
from tests.factories import make_local_manifest

SERVICE = yaml.safe_dump(
    make_local_manifest(
        "cold",
        replicas={"min": 0, "max": 1, "initial": 0},
        ttft_p95="5s",
        scale_down_stabilization="5s",
    )
)
SCALE_DOWN_WINDOW_S = 5.0


@pytest.fixture(params=["prometheus", "direct"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalStack]:
    with running_stack(tmp_path, SERVICE, prometheus=request.param == "prometheus") as local:
        yield local


def ask(url: str) -> httpx.Response:
    body = {"model": "small-model", "prompt": "Hello there", "max_tokens": 4}
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
        return client.post("/completions", json=body)


def test_a_request_to_a_tier_at_zero_waits_for_its_first_engine(stack: LocalStack) -> None:
    """A request to a tier at zero is held by the router, seen by the autoscaler, and
    answered by the engine started for it; idle again, the tier returns to zero only after
    its scale-down window."""
    fleet = stack.fleet
    assert fleet.role_replicas("small", "unified") == []
    assert [(r.tier, r.replicas) for r in fleet.status_rows()] == [("small", 0)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        sent = time.monotonic()
        answer = pool.submit(ask, fleet.endpoint)
        step_until(
            stack,
            lambda: any(d.replicas == 1 for d in stack.actuator.decisions),
            60,
            "a scale from zero",
        )
        scale_up = next(d for d in stack.actuator.decisions if d.replicas == 1)
        assert scale_up.current_replicas == 0
        assert "has 1 requests waiting and no replicas" in scale_up.reason, scale_up.reason
        assert scale_up.reason.endswith("0 -> 1")
        # The held request is answered by the engine started for it.
        step_until(stack, answer.done, 90, "the held request's answer")
        response = answer.result()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert time.monotonic() - sent > 1.0  # it did wait for an engine to start
    assert len(fleet.serving_addresses("small", "unified")) == 1

    idle_since = time.monotonic()
    down = step_until(
        stack,
        lambda: (
            not fleet.role_replicas("small", "unified")
            and stack.actuator.decisions[-1].replicas == 0
        ),
        60,
        "a scale back to zero",
    )
    when, scale_down = next((t, d) for t, d in down if d.replicas == 0)
    assert when - idle_since >= SCALE_DOWN_WINDOW_S, scale_down.reason
    assert scale_down.reason.endswith("1 -> 0"), scale_down.reason
