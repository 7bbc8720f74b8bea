"""The router's KV-event index, this checkout's against an earlier commit's, in one process: the
CPU of indexing engine events and of matching a request, and the memory of an entry (issue 46:
the index keeps each block's medium).

Both ``kv_index.py`` modules are loaded side by side (the earlier one from ``git show
BASE:fleetpilot/routing/policies/kv_index.py``) and run on the same events, rounds alternating;
the best of the rounds is reported, per (replica, block) event and per request.

Workload: 400 prompts of 128 blocks of 16 tokens, each stored by 4 of 16 replicas; a request
shares the first 96 blocks of one of them. ``device`` arms publish GPU events only (a fleet
without offloading); ``both media`` arms publish each batch twice, GPU then CPU (vLLM's
write-through host tier, self-describing events) - which the earlier index drops, counted. The
memory arm stores 2,000 prompts of 128 blocks with 32-byte engine hashes over 16 replicas and
divides what ``tracemalloc`` sees by the index's entries.

Run: .venv/bin/python bench/router_kv_index.py [--base 6c66ff9] [--rounds 3] [--save]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

from router_support import ROOT, commit, machine, save

from fleetpilot.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockHash, BlockStored
from fleetpilot.routing.policies import kv_index as current

BLOCK = 16
BLOCKS = 128
SHARED = 96
REPLICAS = 16
HOLDERS = 4


def load_base(rev: str, folder: Path) -> ModuleType:
    """``kv_index.py`` as it was at ``rev``, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:fleetpilot/routing/policies/kv_index.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = folder / "kv_index_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kv_index_base", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_index_base"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def workload(seed: int) -> tuple[list[tuple[str, list[Any], list[int]]], list[list[bytes]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(32000) for _ in range(BLOCKS * BLOCK)] for _ in range(400)]
    stores = []
    for p, tokens in enumerate(prompts):
        for r in range(HOLDERS):
            hashes = [rng.getrandbits(63) for _ in range(BLOCKS)]
            stores.append((f"r{(p + r * 5) % REPLICAS}", hashes, tokens))
    requests = []
    for tokens in prompts:
        head = current.chain_keys(tokens, BLOCK)[:SHARED]
        tail = [rng.randrange(32000) for _ in range((BLOCKS - SHARED) * BLOCK)]
        requests.append(head + current.chain_keys(tail, BLOCK, parent=head[-1]))
    return stores, requests


def timed(
    module: ModuleType, both: bool, stores: list[Any], requests: list[Any]
) -> dict[str, float]:
    media = [MEDIUM_GPU, MEDIUM_CPU] if both else [MEDIUM_GPU]
    batches = [
        (rid, [BlockStored(hashes, None, tokens, BLOCK, None, m, None) for m in media])
        for rid, hashes, tokens in stores
    ]
    index = module.KVIndex(max_blocks=1 << 22)
    gc.collect()
    started = time.perf_counter()
    for rid, events in batches:
        index.apply(rid, events)
    apply_s = time.perf_counter() - started
    match = index.match_keys
    started = time.perf_counter()
    for keys in requests:
        match(keys)
    match_s = time.perf_counter() - started
    return {
        "apply_us_per_block_event": apply_s / (len(batches) * len(media) * BLOCKS) * 1e6,
        "match_us_per_request": match_s / len(requests) * 1e6,
    }


def bytes_per_entry(module: ModuleType, both: bool, seed: int) -> float:
    rng = random.Random(seed)
    media = [MEDIUM_GPU, MEDIUM_CPU] if both else [MEDIUM_GPU]
    gc.collect()
    tracemalloc.start()
    index = module.KVIndex(max_blocks=1 << 22)
    for p in range(2000):
        tokens = [rng.randrange(32000) for _ in range(BLOCKS * BLOCK)]
        hashes: list[BlockHash] = [rng.randbytes(32) for _ in range(BLOCKS)]
        for medium in media:
            event = BlockStored(hashes, None, tokens, BLOCK, None, medium, None)
            index.apply(f"r{p % REPLICAS}", [event])
        del tokens, hashes
    gc.collect()
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return float(size / max(index.blocks, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="6c66ff9", help="the earlier commit (before issue 46)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, Path(tmp))
    trees = {"base": base, "this": current}
    stores, requests = workload(args.seed)
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for tree, module in trees.items():
            for both in (False, True):
                arm = f"{tree}, {'both media' if both else 'device'}"
                for key, value in timed(module, both, stores, requests).items():
                    row = best.setdefault(arm, {})
                    row[key] = min(value, row.get(key, value))
    for tree, module in trees.items():
        for both in (False, True):
            arm = f"{tree}, {'both media' if both else 'device'}"
            best[arm]["bytes_per_entry"] = bytes_per_entry(module, both, args.seed)
    for arm, row in best.items():
        print(
            f"{arm:22} apply {row['apply_us_per_block_event']:.2f} us/block event, "
            f"match {row['match_us_per_request']:.1f} us/request, "
            f"{row['bytes_per_entry']:.0f} bytes/entry"
        )
    if args.save:
        path = save(
            "router_kv_index",
            {
                "commit": commit(),
                "base": args.base,
                "date": time.strftime("%Y-%m-%d"),
                "machine": machine(),
                "rounds": args.rounds,
                "arms": [{"arm": arm, **row} for arm, row in best.items()],
            },
        )
        print(f"saved {path}")


if __name__ == "__main__":
    main()
