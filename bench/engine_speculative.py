"""Speculative decoding: acceptance rate and tokens per target pass for k = 1..8.

The draft is the target's first layer (early exit; it shares the target's KV pool). Greedy
requests run one at a time, so every decode step is one target forward pass for one sequence;
k = 0 (no speculation) is the baseline measured in the same run, and every k must produce the
baseline's exact tokens (checked). Prints a table and writes
bench/results/engine_speculative.json.

Run: .venv/bin/python bench/engine_speculative.py
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from router_support import save

from fleetpilot.engine.reference import (
    EngineConfig,
    LlamaModel,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SpeculativeConfig,
)

KS = [0, 1, 2, 3, 4, 5, 6, 7, 8]
NUM_PROMPTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 48, 128
DRAFT_LAYERS = 1
MODEL = ModelConfig(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


def run(model: LlamaModel, k: int, prompts: list[list[int]]) -> tuple[dict[str, Any], list[Any]]:
    spec = SpeculativeConfig(num_speculative_tokens=k, draft_num_layers=DRAFT_LAYERS) if k else None
    engine = LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=512, speculative=spec), model)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    outputs = []
    decode_passes = 0
    start = time.perf_counter()
    for prompt in prompts:
        before = engine.stats().forward_passes_total
        outputs.append(engine.generate([prompt], params)[0].token_ids)
        decode_passes += engine.stats().forward_passes_total - before - 1  # minus the prefill
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    drafted = stats.spec_decode_num_draft_tokens_total
    decode_tokens = len(prompts) * (OUTPUT_TOKENS - 1)  # the first token comes from prefill
    return {
        "k": k,
        "acceptance_rate": stats.spec_decode_num_accepted_tokens_total / drafted
        if drafted
        else None,
        "tokens_per_target_pass": decode_tokens / decode_passes,
        "target_passes": decode_passes,
        "tokens_per_s": len(prompts) * OUTPUT_TOKENS / elapsed,
    }, outputs


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]
    model = LlamaModel(MODEL)
    run(model, 2, prompts[:1])  # warm-up
    rows, baseline = [], None
    for k in KS:
        row, outputs = run(model, k, prompts)
        if baseline is None:
            baseline = outputs
        row["identical_to_k0"] = outputs == baseline
        rows.append(row)
    base_tps = rows[0]["tokens_per_s"]
    print(
        f"greedy, {NUM_PROMPTS} requests x {OUTPUT_TOKENS} tokens, one at a time; target "
        f"{MODEL.num_hidden_layers} layers, draft = its first {DRAFT_LAYERS} "
        f"({torch.get_num_threads()} thread)"
    )
    print(f"{'k':>2} {'accept':>7} {'tok/pass':>8} {'passes':>6} {'tok/s':>6} {'vs k=0':>7} same")
    for r in rows:
        r["speedup_vs_k0"] = r["tokens_per_s"] / base_tps
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        print(
            f"{r['k']:>2} {acc:>7} {r['tokens_per_target_pass']:>8.2f} {r['target_passes']:>6} "
            f"{r['tokens_per_s']:>6.0f} {r['speedup_vs_k0']:>6.2f}x {r['identical_to_k0']}"
        )
    out = {
        "benchmark": "engine_speculative",
        "draft_layers": DRAFT_LAYERS,
        "target_layers": MODEL.num_hidden_layers,
        "output_tokens": OUTPUT_TOKENS,
        "torch_threads": torch.get_num_threads(),
        "runs": rows,
    }
    save("engine_speculative", out)


if __name__ == "__main__":
    main()
