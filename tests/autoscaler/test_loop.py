"""tick(): observe, decide, act and record every role of a service; failures stay local.

Most tests use a scripted metrics source and the in-memory actuator; the last one runs the
whole chain on a real Prometheus scraping fake engines, in real time: a TTFT burst scales up
with the right reason, and the scale-down waits for the stabilization window after the load
stops.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from fleetpilot.api import InferenceService
from fleetpilot.api.status import Condition
from fleetpilot.autoscaler.actuator import Replicas
from fleetpilot.autoscaler.loop import RoleKey, autoscaled_roles, interval_s, tick
from fleetpilot.autoscaler.model import (
    DataProblem,
    Decision,
    Direction,
    History,
    Metrics,
    ReasonKind,
    Recommendation,
)
from fleetpilot.autoscaler.prometheus import PrometheusSource
from fleetpilot.testing.polling import eventually
from tests.autoscaler.support import Fleet, Load
from tests.factories import make_manifest, make_service, make_tier
from tests.support.actuators import MemoryActuator

T0 = 1_800_000_000.0


def healthy(**values: Any) -> Metrics:
    base: dict[str, Any] = {
        "ttft_p95_s": 0.2,
        "ttft_samples": 100.0,
        "tpot_p95_s": 0.02,
        "tpot_samples": 1000.0,
        "kv_cache_usage_frac": 0.75,
        "waiting_requests": 0.0,
        "data_age_s": 1.0,
    }
    base.update(values)
    return Metrics(**base)


@dataclass
class ScriptedSource:
    """A MetricsSource answering from a table; ``raises`` makes one role's observe fail."""

    metrics: dict[tuple[str, str], Metrics]
    raises: set[tuple[str, str]] = field(default_factory=set)
    asked: list[tuple[str, str, str, timedelta, str | None]] = field(default_factory=list)

    def observe(
        self, service: str, tier: str, role: str, window: timedelta, *, namespace: str | None
    ) -> Metrics:
        self.asked.append((service, tier, role, window, namespace))
        if (tier, role) in self.raises:
            raise RuntimeError("scrape exploded")
        return self.metrics.get((tier, role), Metrics())


class FailingActuator(MemoryActuator):
    """Fails ``current`` for the roles in ``broken``, and ``record`` when asked to."""

    def __init__(self, *args: Any, broken: set[tuple[str, str]], fail_record: bool = False) -> None:
        super().__init__(*args)
        self.broken = broken
        self.fail_record = fail_record

    def current(self, service: InferenceService, tier: str, role: str) -> Replicas | None:
        if (tier, role) in self.broken:
            raise RuntimeError("API server said no")
        return super().current(service, tier, role)

    def record(
        self, service: InferenceService, decisions: Any, condition: Condition, now: Any
    ) -> None:
        if self.fail_record:
            raise RuntimeError("status write failed")
        super().record(service, decisions, condition, now)


def pd_service(**autoscaling: Any) -> InferenceService:
    return make_service(
        tiers=[
            make_tier(
                "large",
                mode="disaggregated",
                autoscaling={"slo": {"ttftP95": "500ms", "tpotP95": "50ms"}, **autoscaling},
            )
        ]
    )


def replicas(n: int = 2) -> dict[tuple[str, str], Replicas]:
    return {("large", "prefill"): Replicas(n, n), ("large", "decode"): Replicas(n, n)}


def test_prefill_scales_on_ttft_while_decode_holds() -> None:
    """Each role is observed with its own selector and decided on its own signals."""
    source = ScriptedSource(
        {
            ("large", "prefill"): healthy(ttft_p95_s=1.0),
            ("large", "decode"): healthy(ttft_p95_s=5.0),  # decode does not follow TTFT
        }
    )
    actuator = MemoryActuator(replicas())
    histories: dict[RoleKey, History] = {}
    decisions = tick(pd_service(), source, actuator, histories, T0)
    by_role = {d.role: d for d in decisions}
    assert by_role["prefill"].replicas == 4
    assert by_role["prefill"].reason == "prefill ttft p95 1s > slo 500ms: 2 -> 4"
    assert by_role["decode"].replicas == 2
    assert actuator.scaled == [("large", "prefill", 4)]
    assert {a[2] for a in source.asked} == {"prefill", "decode"}
    assert {(a[0], a[3], a[4]) for a in source.asked} == {("chat", timedelta(minutes=1), "ml")}
    assert set(histories) == {
        RoleKey("ml", "chat", "large", "prefill"),
        RoleKey("ml", "chat", "large", "decode"),
    }
    assert actuator.events == [("ScaledUp", "tier large: prefill ttft p95 1s > slo 500ms: 2 -> 4")]
    (condition,) = actuator.conditions
    assert condition.status.value == "True"


def test_one_failing_role_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    """prefill's Deployment cannot be read: decode is still decided, scaled and recorded."""
    source = ScriptedSource({("large", "decode"): healthy(kv_cache_usage_frac=1.0)})
    actuator = FailingActuator(replicas(), broken={("large", "prefill")})
    with caplog.at_level(logging.ERROR):
        decisions = tick(pd_service(), source, actuator, {}, T0)
    assert [(d.role, d.replicas) for d in decisions] == [("decode", 3)]
    assert actuator.scaled == [("large", "decode", 3)]
    assert [d.role for d in actuator.recorded] == ["decode"]
    assert "autoscaling chat/large/prefill failed" in caplog.text


def test_a_raising_source_is_no_data_and_holds(caplog: pytest.LogCaptureFixture) -> None:
    """A MetricsSource must not raise; if one does, that role holds and is flagged."""
    source = ScriptedSource({("large", "decode"): healthy()}, raises={("large", "prefill")})
    actuator = MemoryActuator(replicas(3))
    with caplog.at_level(logging.ERROR):
        decisions = tick(pd_service(), source, actuator, {}, T0)
    prefill = next(d for d in decisions if d.role == "prefill")
    assert prefill.replicas == 3
    assert prefill.data_problem is DataProblem.UNREACHABLE
    assert "metrics source failed: scrape exploded" in prefill.reason
    (condition,) = actuator.conditions
    assert (condition.status.value, condition.reason) == ("False", "PrometheusUnreachable")


def test_a_failed_record_keeps_the_decisions(caplog: pytest.LogCaptureFixture) -> None:
    """The status write fails after scaling: the scale already made stands, the decisions are still
    returned and the failure is logged, not raised."""
    source = ScriptedSource({("large", "decode"): healthy(kv_cache_usage_frac=1.0)})
    actuator = FailingActuator(replicas(), broken=set(), fail_record=True)
    with caplog.at_level(logging.ERROR):
        decisions = tick(pd_service(), source, actuator, {}, T0)
    assert len(decisions) == 2
    assert actuator.scaled == [("large", "decode", 3)]
    assert "recording the decisions of chat failed" in caplog.text


def test_recommend_mode_records_and_never_scales() -> None:
    """Mode recommend decides as auto would (2 -> 4, marked dry run) and emits ScaleRecommended, but
    never scales the Deployment."""
    source = ScriptedSource({("large", "prefill"): healthy(ttft_p95_s=1.0)})
    actuator = MemoryActuator(replicas())
    decisions = tick(pd_service(mode="recommend"), source, actuator, {}, T0)
    prefill = next(d for d in decisions if d.role == "prefill")
    assert prefill.dry_run
    assert prefill.replicas == 4
    assert actuator.scaled == []
    assert actuator.events[0][0] == "ScaleRecommended"


@pytest.mark.parametrize("mode", ["disabled", "external"])
def test_disabled_and_external_tiers_and_missing_deployments_are_skipped(mode: str) -> None:
    """mode disabled or external (an HPA's): not observed at all; no Deployment yet: nothing
    to decide."""
    service = make_service(
        tiers=[
            make_tier("small", up_to=0.3, autoscaling={"mode": mode}),
            make_tier("large", mode="disaggregated"),
        ]
    )
    assert [(t.name, r) for t, r in autoscaled_roles(service)] == [
        ("large", "prefill"),
        ("large", "decode"),
    ]
    source = ScriptedSource({("large", "decode"): healthy()})
    actuator = MemoryActuator({("large", "decode"): Replicas(2, 2)})
    decisions = tick(service, source, actuator, {}, T0)
    assert [d.role for d in decisions] == ["decode"]
    assert "small" not in {a[1] for a in source.asked}


def test_roles_are_decided_once_per_interval() -> None:
    """A timer firing more often than a tier's interval decides nothing in between."""
    source = ScriptedSource({("large", "decode"): healthy(), ("large", "prefill"): healthy()})
    actuator = MemoryActuator(replicas())
    histories: dict[RoleKey, History] = {}
    service = pd_service(interval="30s")
    assert interval_s(service) == 30
    assert len(tick(service, source, actuator, histories, T0)) == 2
    assert tick(service, source, actuator, histories, T0 + 10) == []
    assert len(tick(service, source, actuator, histories, T0 + 28)) == 2  # 90% is due
    assert len(actuator.conditions) == 2


def test_histories_of_removed_roles_are_dropped() -> None:
    """A tier renamed away leaves no history behind; other services' histories stay."""
    stale = RoleKey("ml", "chat", "old", "unified")
    foreign = RoleKey("ml", "other", "large", "decode")
    histories = {stale: History((Recommendation(T0, 3),)), foreign: History()}
    tick(pd_service(), ScriptedSource({}), MemoryActuator(replicas()), histories, T0)
    assert stale not in histories
    assert foreign in histories


def test_a_raw_object_from_the_api_server_is_parsed() -> None:
    """kopf hands the body as a dict; tick parses it (status and server fields included)."""
    manifest = make_manifest(tiers=[make_tier("large", mode="disaggregated")])
    manifest["metadata"].update(generation=3, resourceVersion="9", uid="u")
    manifest["status"] = {"observedGeneration": 3}
    actuator = MemoryActuator(replicas())
    decisions = tick(manifest, ScriptedSource({}), actuator, {}, T0)
    assert len(decisions) == 2
    assert actuator.conditions[0].observed_generation == 3


# ------------------------------------------------------------------------------ real Prometheus


def _decisions_until(
    what: str,
    step: Callable[[], list[Decision]],
    done: Callable[[Decision], bool],
    timeout_s: float,
) -> list[tuple[float, Decision]]:
    """Tick until a decision is ``done``; every decision up to it, at the time the policy saw:
    the ones before it are the test's evidence."""
    seen: list[tuple[float, Decision]] = []

    def next_tick() -> list[tuple[float, Decision]]:
        for decision in step():
            seen.append((decision.history.recommendations[-1].time_s, decision))
            if done(decision):
                break
        return seen

    return eventually(
        what, next_tick, timeout_s, until=lambda s: bool(s) and done(s[-1][1]), interval=0.2
    )


def test_burst_scales_up_then_down_after_the_window_on_real_prometheus(fleet: Fleet) -> None:
    """Real Prometheus, real time: TTFT p95 1.75 s against a 500 ms SLO scales 2 -> 4 with
    that reason; when the load stops, the scale-down waits until a whole stabilization
    window (3 s here) has recommended less."""
    service = make_service(
        "burst",
        tiers=[
            make_tier(
                "small",
                # min 2: idle ticks before the load reaches Prometheus must not shrink it.
                serving={"replicas": {"min": 2, "max": 4}},
                autoscaling={
                    "slo": {"ttftP95": "500ms"},
                    "window": "3s",
                    "interval": "1s",
                    "scaleDown": {"stabilization": "3s"},
                },
            )
        ],
        monitoring={"scrapeInterval": "1s"},
    )
    engines = fleet.of("ml", "burst", "small", "unified")
    for engine in engines:
        engine.set(kv=0.3)
        engine.drive(Load(ttft_s=(0.05,) * 9 + (1.5,), successes=10))
    actuator = MemoryActuator({("small", "unified"): Replicas(2, 2)})
    histories: dict[RoleKey, History] = {}
    with PrometheusSource(fleet.prometheus.url, timeout_s=2.0) as source:

        def step() -> list[Decision]:
            return tick(service, source, actuator, histories)

        up = _decisions_until("a scale-up", step, lambda d: d.direction is Direction.UP, 20)
        first_up = up[-1][1]
        assert re.fullmatch(
            r"unified ttft p95 1\.7\ds > slo 500ms: 2 -> 4 \(at most x2 per step, wanted \d+\)",
            first_up.reason,
        ), first_up.reason
        assert first_up.reason_kind is ReasonKind.TTFT
        assert first_up.panic

        for engine in engines:
            engine.drive(None)
            engine.set(kv=0.0)
        lull = _decisions_until("a scale-down", step, lambda d: d.direction is Direction.DOWN, 30)

    down_at, down = lull[-1]
    assert down.reason_kind is ReasonKind.IDLE, down.reason
    assert down.replicas == 2
    # The window: the last recommendation to keep 4 was at least 3 s before the scale-down.
    kept = [when for when, d in lull if d.recommendation >= 4]
    assert kept, [d.reason for _, d in lull]
    assert down_at - kept[-1] >= 3.0
    assert all(d.direction is not Direction.DOWN for _, d in lull[:-1])
