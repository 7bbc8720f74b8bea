"""Concurrency at a fixed KV memory budget: paged blocks vs contiguous per-request buffers.

Both runs use the same engine, model, KV budget and mixed-length workload; the only difference
is allocation. "contiguous" reserves ``max_model_len`` tokens of KV for every request at
admission (what servers did before PagedAttention); "paged" commits 16-token blocks as tokens
arrive. Prints a table and writes bench/results/engine_paged_vs_contiguous.json.

Run: .venv/bin/python bench/engine_paged_vs_contiguous.py
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Literal

import torch
from router_support import save

from fleetpilot.engine.reference import (
    EngineConfig,
    LlamaModel,
    LLMEngine,
    ModelConfig,
    SamplingParams,
)

MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
# KV for 8 full-length requests: contiguous allocation can never run more than 8 at once.
BUDGET_TOKENS = 8 * MAX_MODEL_LEN
NUM_REQUESTS = 96


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """Mixed lengths, as chat traffic is: prompts 16-384 tokens, outputs 16-128 tokens."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randint(16, 384))], rng.randint(16, 128))
        for _ in range(NUM_REQUESTS)
    ]


def run(model: LlamaModel, reservation: Literal["paged", "contiguous"]) -> dict[str, Any]:
    engine = LLMEngine(
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=BUDGET_TOKENS // BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            kv_reservation=reservation,
        ),
        model,
    )
    for i, (prompt, max_tokens) in enumerate(workload()):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
    running: list[int] = []
    token_fill: list[float] = []  # KV slots holding real tokens / slots committed
    ttfts: list[float] = []
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        generated += sum(o.num_new_tokens for o in outs)
        ttfts += [o.metrics.ttft_s or 0.0 for o in outs if o.finished]
        running.append(len(engine.scheduler.running))
        committed = sum(len(t) for t in engine.blocks.tables.values()) * BLOCK_SIZE
        used = sum(r.num_computed_tokens for r in engine.scheduler.running)
        if committed:
            token_fill.append(used / committed)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {
        "allocation": reservation,
        "peak_running": max(running),
        "mean_running": statistics.fmean(running),
        "steps": len(running),
        "wall_s": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "mean_kv_slot_fill": statistics.fmean(token_fill),
        "ttft_mean_s": statistics.fmean(ttfts),
        "preemptions": stats.num_preemptions_total,
    }


def main() -> None:
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig())
    rows = [run(model, "contiguous"), run(model, "paged")]
    base, paged = rows
    print(
        f"KV budget {BUDGET_TOKENS} tokens ({BUDGET_TOKENS // BLOCK_SIZE} blocks of {BLOCK_SIZE}), "
        f"max_model_len {MAX_MODEL_LEN}, {NUM_REQUESTS} requests (prompt 16-384, output 16-128)"
    )
    header = f"{'allocation':<11} {'peak run':>8} {'mean run':>8} {'steps':>6} {'wall s':>7} "
    header += f"{'out tok/s':>9} {'KV fill':>7} {'TTFT s':>7}"
    print(header)
    for r in rows:
        print(
            f"{r['allocation']:<11} {r['peak_running']:>8} {r['mean_running']:>8.1f} "
            f"{r['steps']:>6} {r['wall_s']:>7.2f} {r['output_tokens_per_s']:>9.0f} "
            f"{r['mean_kv_slot_fill']:>7.0%} {r['ttft_mean_s']:>7.2f}"
        )
    ratio = paged["mean_running"] / base["mean_running"]
    speedup = paged["output_tokens_per_s"] / base["output_tokens_per_s"]
    print(f"paged / contiguous: {ratio:.1f}x mean concurrency, {speedup:.1f}x output throughput")
    out = {
        "benchmark": "engine_paged_vs_contiguous",
        "budget_tokens": BUDGET_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "num_requests": NUM_REQUESTS,
        "torch_threads": torch.get_num_threads(),
        "runs": rows,
        "concurrency_ratio": ratio,
        "throughput_ratio": speedup,
    }
    save("engine_paged_vs_contiguous", out)


if __name__ == "__main__":
    main()
