"""The router's KV index over what an offloading vLLM really publishes (issue 46): device events
and the host tier's self-describing events built by vLLM's own ``OffloadingEventsTracker``
(``vllm_offload_events.py``, run in ``.venv-vllm``), decoded with the router's decoder, extra
fields and all; and the placeholders vLLM sends without ``self_describing_kv_events``."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.kv_events import MEDIUM_CPU, BlockStored, decode_batch
from fleetpilot.routing.policies.kv_index import KVIndex, chain_keys
from tests.contract.conftest import START_TIMEOUT_S, VLLM_PYTHON

SCRIPT = Path(__file__).with_name("vllm_offload_events.py")
BLOCK = 4


@pytest.fixture(scope="module")
def published() -> dict[str, Any]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} is absent: `make vllm` installs the real vLLM")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=SCRIPT.parent,
        timeout=START_TIMEOUT_S,
        check=True,
    )
    answer: dict[str, Any] = json.loads(done.stdout)
    assert answer["ok"], answer["error"]
    return answer


def batches(payloads: list[str]) -> list[Any]:
    return [decode_batch(base64.b64decode(p)).events for p in payloads]


def tiers(index: KVIndex, tokens: list[int]) -> tuple[int, int]:
    match = index.match_tiers(chain_keys(tokens, BLOCK))
    return match.blocks.get("e", 0), match.host.get("e", 0)


def test_vllms_host_tier_events_index_as_host_blocks_reference_counted(
    published: dict[str, Any],
) -> None:
    """Written through to host memory, both prompts are device hits; once the device evicts
    every block they are host hits, all 4 blocks each; when the host tier evicts X's second
    chunk, the block Y's second chunk re-announced (x2) stays, so X still matches 3 blocks
    from host memory; once Y's goes too, both match their first chunk only."""
    x, y = published["tokens"]["x"], published["tokens"]["y"]
    device, host, device_evicted, x_evicted, y_evicted = batches(published["tiered"])
    stored = [e for e in host if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == [MEDIUM_CPU] * 3
    assert stored[2].block_hashes[0] == stored[1].block_hashes[0]  # x2, announced twice
    index = KVIndex()
    applied = index.apply("e", device + host)
    assert (applied.invalid_events, applied.placeholder_events) == (0, 0)
    assert (tiers(index, x), tiers(index, y)) == ((4, 0), (4, 0))
    index.apply("e", device_evicted)
    assert (tiers(index, x), tiers(index, y)) == ((4, 4), (4, 4))
    index.apply("e", x_evicted)
    assert (tiers(index, x), tiers(index, y)) == ((3, 3), (4, 4))
    index.apply("e", y_evicted)
    assert (tiers(index, x), tiers(index, y)) == ((2, 2), (2, 2))
    assert index.stats.unknown_removed == 0


def test_vllms_placeholder_host_events_are_counted_not_keyed(published: dict[str, Any]) -> None:
    """Without self-describing events vLLM's host tier names each chunk by one hash, with no
    tokens: the index counts them and keys nothing."""
    (placeholders,) = batches(published["placeholders"])
    assert all(isinstance(e, BlockStored) and e.block_size == 0 for e in placeholders)
    index = KVIndex()
    applied = index.apply("e", placeholders)
    assert applied.placeholder_events == len(placeholders) == 3
    assert (index.blocks, len(index)) == (0, 0)
