"""The status table of ``fleetpilot up`` and ``make demo``: what a person reads of each role."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleetpilot.autoscaler.model import Metrics
from fleetpilot.runtime.autoscale import RoleScaling
from fleetpilot.runtime.local import StatusRow
from fleetpilot.runtime.stack import format_status

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
ROWS = [StatusRow("small", "unified", 2, 2, 2), StatusRow("large", "unified", 1, 1, 1)]


def test_a_role_that_holds_now_shows_why_and_its_last_scale_apart() -> None:
    """Regression (issue 12, item 2): a role that scaled up and now holds kept showing the
    old scale-up reason as if it were current."""
    scaled_up = "unified ttft p95 90ms > slo 10ms: 1 -> 2"
    holding = "unified has no data (prometheus down), holding 2"
    scaling = {
        ("small", "unified"): RoleScaling(
            desired=2,
            reason=holding,
            last_scale_reason=scaled_up,
            last_scale_time=NOW - timedelta(seconds=42),
            metrics=Metrics(ttft_p95_s=0.09, kv_cache_usage_frac=0.07),
            last_scale_from=1,
            last_scale_to=2,
        ),
        ("large", "unified"): RoleScaling(desired=1, reason="unified is idle: holding 1"),
    }
    header, small, large = format_status(ROWS, scaling, now=NOW).splitlines()
    assert header.split()[-3:] == ["LAST", "SCALE", "DECISION"]
    assert small.endswith(f"1 -> 2, 42s ago     {holding}")
    assert scaled_up not in small
    assert "90ms" in small
    assert "7%" in small
    # Never scaled: no last scale; the decision is still there.
    assert large.endswith(f"-{' ' * 19}unified is idle: holding 1")


def test_without_the_autoscaler_the_table_has_no_scaling_columns() -> None:
    """``fleetpilot up --no-autoscale``: only the replica columns, no empty decision ones."""
    header, small, _ = format_status(ROWS).splitlines()
    assert header.split() == ["TIER", "ROLE", "REPLICAS", "HEALTHY"]
    assert small.split() == ["small", "unified", "2", "2"]
