"""TTFT with a 90%-shared prompt prefix: prefix caching on vs off.

Every request's prompt is one shared 1008-token prefix (a long system prompt or document) plus
112 unique tokens. Requests arrive one after another; with caching, every request after the
first finds the shared prefix's full blocks in the cache and prefills only its own tail. The
same engine, model and requests run with caching off as the baseline. Prints a table and writes
bench/results/engine_prefix_cache.json.

Run: .venv/bin/python bench/engine_prefix_cache.py
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch
from router_support import save

from fleetpilot.engine.reference import (
    EngineConfig,
    LlamaModel,
    LLMEngine,
    ModelConfig,
    SamplingParams,
)

SHARED, UNIQUE = 1008, 112  # 90% shared
NUM_REQUESTS = 24
# A model wide enough that prefill compute, not Python overhead, dominates TTFT.
MODEL = ModelConfig(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run(model: LlamaModel, caching: bool) -> dict[str, Any]:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(SHARED)]
    engine = LLMEngine(
        EngineConfig(
            num_kv_blocks=1024,
            max_model_len=2048,
            max_num_batched_tokens=2048,
            enable_prefix_caching=caching,
        ),
        model,
    )
    ttfts: list[float] = []
    cached: list[int] = []
    for i in range(NUM_REQUESTS):
        prompt = shared + [rng.randrange(256) for _ in range(UNIQUE)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ttfts.append(out.metrics.ttft_s or 0.0)
                    cached.append(out.num_cached_tokens)
    stats = engine.stats()
    return {
        "prefix_caching": caching,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_first_s": ttfts[0],
        "hit_rate": stats.prefix_cache_hits_total / max(1, stats.prefix_cache_queries_total),
        "mean_cached_tokens": statistics.fmean(cached),
    }


def main() -> None:
    model = LlamaModel(MODEL)
    run(model, True)  # warm-up: first-call allocations and kernel selection
    rows = [run(model, False), run(model, True)]
    off, on = rows
    print(
        f"{NUM_REQUESTS} sequential requests, prompt = {SHARED} shared + {UNIQUE} unique tokens "
        f"(hidden {MODEL.hidden_size}, {MODEL.num_hidden_layers} layers, "
        f"{torch.get_num_threads()} thread)"
    )
    print(f"{'caching':<8} {'TTFT mean':>10} {'p50':>8} {'p95':>8} {'first':>8} {'hit rate':>9}")
    for r in rows:
        print(
            f"{'on' if r['prefix_caching'] else 'off':<8} {r['ttft_mean_s'] * 1e3:>8.1f}ms "
            f"{r['ttft_p50_s'] * 1e3:>6.1f}ms {r['ttft_p95_s'] * 1e3:>6.1f}ms "
            f"{r['ttft_first_s'] * 1e3:>6.1f}ms {r['hit_rate']:>9.1%}"
        )
    speedup = off["ttft_mean_s"] / on["ttft_mean_s"]
    print(f"prefix caching: {speedup:.1f}x lower mean TTFT")
    out = {
        "benchmark": "engine_prefix_cache",
        "shared_tokens": SHARED,
        "unique_tokens": UNIQUE,
        "num_requests": NUM_REQUESTS,
        "torch_threads": torch.get_num_threads(),
        "runs": rows,
        "ttft_speedup": speedup,
    }
    save("engine_prefix_cache", out)


if __name__ == "__main__":
    main()
