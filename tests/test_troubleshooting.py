"""docs/troubleshooting.md covers every condition the operator and its autoscaler write, with
every reason each is written with, and every alert of the chart (tests/charts/
test_observability.py checks that each alert's runbook_url leads to its section)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fleetpilot.api.status import ConditionType
from fleetpilot.autoscaler import actuator
from fleetpilot.operator import gateway_status, model_cache, plan_types, status

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "troubleshooting.md"
# The modules that write condition reasons as string literals, besides the named constants.
WRITERS = [status, model_cache, gateway_status]
_REASON = re.compile(r"[A-Z][A-Za-z]+")


def _literal_reasons(source: str) -> set[str]:
    """String literals a module passes as a condition's reason: ``cond(KIND, status,
    "Reason", ...)`` (the reason follows the status), ``reason="Reason"``, and
    ``status, reason, ... = ..., "Reason", ...``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        values: list[ast.expr] = []
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "cond":
                values += node.args[1:3]
            values += [k.value for k in node.keywords if k.arg == "reason"]
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Tuple)
        ):
            names = [t.id if isinstance(t, ast.Name) else "" for t in node.targets[0].elts]
            if "reason" in names and len(node.value.elts) == len(names):
                values.append(node.value.elts[names.index("reason")])
        found |= {
            v.value
            for v in values
            if isinstance(v, ast.Constant)
            and isinstance(v.value, str)
            and _REASON.fullmatch(v.value)
        }
    return found


def written_reasons() -> set[str]:
    reasons = {str(getattr(actuator, n)) for n in dir(actuator) if n.startswith("REASON_")}
    reasons |= {plan_types.PLAN_REFUSED, plan_types.LEADER_WORKER_SET_MISSING}
    reasons |= set(status._WAITING_REASONS.values()) | status._STALLING_REASONS
    for module in WRITERS:
        assert module.__file__ is not None
        reasons |= _literal_reasons(Path(module.__file__).read_text())
    return reasons


def test_every_condition_and_reason_has_a_row() -> None:
    page = PAGE.read_text()
    headings = re.findall(r"^### (.+)$", page, re.MULTILINE)
    for kind in ConditionType:
        assert any(re.search(rf"\b{kind.value}\b", h) for h in headings), kind.value
    reasons = written_reasons()
    # What the scan must find, whatever else it does: one of each way reasons are written.
    assert {"AllReplicasReady", "RolloutComplete", "Downloading", "NoParent", "Sized"} <= reasons
    assert {"CrashLooping", "RolloutStuck", "PlanRefused", "FreshMetrics"} <= reasons
    documented = set(re.findall(r"^\| [^|]+ \| ([^|]+) \|", page, re.MULTILINE))
    in_rows = {r for cell in documented for r in re.findall(r"`([A-Za-z]+)`", cell)}
    assert reasons - in_rows == set(), "reasons without a row in docs/troubleshooting.md"


def test_the_scan_sees_each_way_a_reason_is_written() -> None:
    source = (
        'cond(ConditionType.READY, True, "One", "message")\n'
        'Condition(type="X", status="True", reason="Two")\n'
        'status, reason, message = False, "Three", "why"\n'
        'other = cond(A, B, "lower case", "Message words")\n'
    )
    assert _literal_reasons(source) == {"One", "Two", "Three"}
