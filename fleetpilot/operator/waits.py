"""What a planned object waits for, checked against what was observed. Purely computational.

The planner says what each object waits for (plan_types.Planned.waits_for); the reconciler
holds an object back while any of it is unmet, and a status refresh asks for a reconcile when
an object held back waits for nothing any more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fleetpilot.operator.model_cache import job_complete, rolled_out
from fleetpilot.operator.plan_types import (
    Dependency,
    JobComplete,
    Planned,
    RolledOut,
    ServicePlan,
)

Obj = dict[str, Any]
Key = tuple[str, str]  # (kind, name)


def unmet(
    waits: Iterable[Dependency], jobs: Mapping[str, Obj], workloads: Mapping[Key, Obj]
) -> list[Dependency]:
    """Those of ``waits`` not met yet: a Job not complete among the live ``jobs`` (by name); a
    workload not rolled out among ``workloads`` (by kind and name), which holds only the ones
    that are as planned - a reconcile leaves out those it holds back, whose live object is an
    older plan's."""
    left: list[Dependency] = []
    for wait in waits:
        if isinstance(wait, JobComplete):
            met = job_complete(jobs.get(wait.job))
        else:
            assert isinstance(wait, RolledOut)
            met = rolled_out(workloads.get((wait.kind, wait.name)))
        if not met:
            left.append(wait)
    return left


def due(plan: ServicePlan, present: Mapping[Key, Obj], jobs: Mapping[str, Obj]) -> list[Planned]:
    """The planned objects that wait for something, are not there yet and wait for nothing
    any more, by what a status refresh observed: ``present``, the service's objects there
    (workloads and Jobs). Their workloads are as watched, not known to be as planned: a
    reconcile, which this asks for, checks again and applies them."""
    return [
        planned
        for planned in plan.objects
        if planned.waits_for
        and planned.key not in present
        and not unmet(planned.waits_for, jobs, present)
    ]
