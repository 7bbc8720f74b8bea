"""replica_layout: how a replica is cut into pods, one per node."""

from __future__ import annotations

import pytest

from fleetpilot.api.layout import LayoutError, ReplicaLayout, Span, replica_layout
from fleetpilot.api.spec import Parallelism


@pytest.mark.parametrize(
    ("parallelism", "per_node", "layout"),
    [
        # Fits on a node: one pod with every GPU of the replica.
        ({"tensor": 4, "data": 2}, 8, ReplicaLayout(1, 8, 2, Span.NONE)),
        ({"tensor": 1}, 8, ReplicaLayout(1, 1, 1, Span.NONE)),
        # A model copy larger than a node fills whole nodes (405B: TP 8 x PP 2 on nodes of 8).
        ({"tensor": 8, "pipeline": 2}, 8, ReplicaLayout(2, 8, 1, Span.MODEL)),
        ({"tensor": 16}, 4, ReplicaLayout(4, 4, 1, Span.MODEL)),
        # Ranks spread over nodes, as many per node as fit (DeepSeek decode: DP 16 on 2 x 8).
        ({"data": 16, "expert": True}, 8, ReplicaLayout(2, 8, 8, Span.DATA)),
        ({"tensor": 2, "data": 8}, 8, ReplicaLayout(2, 8, 4, Span.DATA)),
        # dataLocal chosen by the user: fewer ranks per node than would fit.
        ({"data": 8, "dataLocal": 2}, 8, ReplicaLayout(4, 2, 2, Span.DATA)),
        # dataLocal equal to data: one node after all.
        ({"data": 4, "dataLocal": 4}, 8, ReplicaLayout(1, 4, 4, Span.NONE)),
        # The default per node divides data evenly: 6 ranks on nodes of 4 go 3 and 3.
        ({"data": 6}, 4, ReplicaLayout(2, 3, 3, Span.DATA)),
    ],
)
def test_layout(parallelism: dict[str, object], per_node: int, layout: ReplicaLayout) -> None:
    """Each shape is cut into the pods vLLM's multi-node launch expects, and the GPUs of the pods
    add up to the replica's."""
    p = Parallelism.model_validate(parallelism)
    got = replica_layout(p, per_node)
    assert got == layout
    assert got.nodes * got.gpus_per_pod == p.gpus
    assert got.gpus_per_pod <= per_node


@pytest.mark.parametrize(
    ("parallelism", "per_node", "words"),
    [
        ({"tensor": 12}, 8, "12 is not a multiple of resources.gpusPerNode 8"),
        ({"tensor": 16, "data": 2}, 8, "a replica of data 2 such copies is not supported"),
        ({"tensor": 2, "data": 8, "dataLocal": 8}, 8, "need 16 GPUs per node, more than"),
        ({"tensor": 16, "data": 1, "dataLocal": 1}, 8, None),
    ],
)
def test_refusals_name_the_numbers(
    parallelism: dict[str, object], per_node: int, words: str | None
) -> None:
    """A shape that cannot be cut evenly is refused with the numbers to change."""
    p = Parallelism.model_validate(parallelism)
    if words is None:
        assert replica_layout(p, per_node).span is Span.MODEL
        return
    with pytest.raises(LayoutError, match=words):
        replica_layout(p, per_node)
