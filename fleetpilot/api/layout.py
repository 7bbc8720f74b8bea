"""How one replica is cut into pods, one per node: a pure function of its parallelism and the
GPUs a node has.

A replica that fits on a node is one pod (a Deployment's). One that does not is a group of
pods - a LeaderWorkerSet group, the leader serving the API - cut one of two ways:

- **the model spans nodes**: one tensor x pipeline group is larger than a node (a 405B-class
  dense model, TP 8 x PP 2 on nodes of 8). Each pod holds ``gpusPerNode`` GPUs of it; vLLM runs
  one engine whose workers sit on every node. Only with ``data`` 1: a replica of several such
  groups is not something vLLM's launcher cuts evenly, so it is refused.
- **the data-parallel ranks span nodes**: each rank fits on a node, the replica's ``data``
  ranks do not (wide expert parallelism for a DeepSeek-V3-class MoE, DP 16 on 2 nodes of 8).
  Each pod holds ``dataLocal`` ranks.

Every refusal names the numbers, so a user can see which one to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleetpilot.api.spec import Parallelism, ResolvedRole


class Span(StrEnum):
    """What crosses node boundaries in a replica."""

    NONE = "none"  # one pod
    MODEL = "model"  # one tensor x pipeline group spans nodes
    DATA = "data"  # data-parallel ranks are spread over nodes


class LayoutError(ValueError):
    """A parallelism that cannot be cut evenly into nodes; the message names the numbers."""


@dataclass(frozen=True)
class ReplicaLayout:
    """One replica's pods: how many (``nodes``), the GPUs each asks for, and the data-parallel
    ranks each runs."""

    nodes: int
    gpus_per_pod: int
    data_local: int
    span: Span

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


def _default_data_local(data: int, ranks_per_node: int) -> int:
    """The most ranks a node holds that still divide ``data`` evenly."""
    return max(d for d in range(1, min(data, ranks_per_node) + 1) if data % d == 0)


def replica_layout(parallelism: Parallelism, gpus_per_node: int) -> ReplicaLayout:
    """The pods of one replica, or :class:`LayoutError` saying why it cannot be cut."""
    p = parallelism
    group = p.tensor * p.pipeline
    shape = f"tensor {p.tensor} x pipeline {p.pipeline} = {group} GPUs"
    if group > gpus_per_node:
        if group % gpus_per_node:
            raise LayoutError(
                f"one model copy ({shape}) spans nodes, so it must fill whole nodes: {group} "
                f"is not a multiple of resources.gpusPerNode {gpus_per_node}"
            )
        if p.data > 1:
            raise LayoutError(
                f"one model copy ({shape}) spans nodes, and a replica of data {p.data} such "
                "copies is not supported: set data 1 and raise replicas instead"
            )
        if p.data_local not in (None, 1):
            raise LayoutError(f"dataLocal {p.data_local} needs data ranks that fit on a node")
        return ReplicaLayout(group // gpus_per_node, gpus_per_node, 1, Span.MODEL)
    ranks_per_node = gpus_per_node // group
    if p.data_local is None and p.gpus <= gpus_per_node:
        return ReplicaLayout(1, p.gpus, p.data, Span.NONE)
    data_local = p.data_local or _default_data_local(p.data, ranks_per_node)
    if data_local > ranks_per_node:
        raise LayoutError(
            f"dataLocal {data_local} ranks of {shape} need {data_local * group} GPUs per node, "
            f"more than resources.gpusPerNode {gpus_per_node}"
        )
    nodes = p.data // data_local
    if nodes == 1:
        return ReplicaLayout(1, p.gpus, p.data, Span.NONE)
    return ReplicaLayout(nodes, data_local * group, data_local, Span.DATA)


def role_layout(role: ResolvedRole) -> ReplicaLayout:
    """The layout of one role's replicas on its tier's nodes."""
    return replica_layout(role.parallelism, role.tier.resources.gpus_per_node)
