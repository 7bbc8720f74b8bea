"""Decode throughput (output tokens/s) vs batch size 1..64, continuous batching.

For each batch size B, B requests with 32-token prompts are prefilled, then the decode steps
that follow are timed until all B have generated 64 tokens. Batch size 1 is the baseline
measured in the same run: the speedup column is what batching decodes together buys. Prints a
table and writes bench/results/engine_decode_batch.json.

Run: .venv/bin/python bench/engine_decode_batch.py
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
)

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64]
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 64
MODEL = ModelConfig(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


def run(model: LlamaModel, batch: int) -> dict[str, Any]:
    rng = random.Random(batch)
    engine = LLMEngine(EngineConfig(num_kv_blocks=1024, max_model_len=256, max_num_seqs=64), model)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(PROMPT_TOKENS)], params)
    # Prefill (and the first token) is not part of decode throughput.
    while (
        any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    start = time.perf_counter()
    steps = generated = 0
    while engine.has_unfinished_requests():
        generated += sum(o.num_new_tokens for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    return {
        "batch": batch,
        "decode_steps": steps,
        "step_ms": elapsed / steps * 1e3,
        "tokens_per_s": generated / elapsed,
    }


def main() -> None:
    model = LlamaModel(MODEL)
    run(model, 8)  # warm-up
    rows = [run(model, b) for b in BATCH_SIZES]
    base = rows[0]["tokens_per_s"]
    print(
        f"decode of {OUTPUT_TOKENS} tokens after {PROMPT_TOKENS}-token prompts "
        f"(hidden {MODEL.hidden_size}, {MODEL.num_hidden_layers} layers, "
        f"{torch.get_num_threads()} thread)"
    )
    print(f"{'batch':>5} {'step ms':>8} {'tokens/s':>9} {'vs batch 1':>10}")
    for r in rows:
        r["speedup_vs_batch_1"] = r["tokens_per_s"] / base
        print(
            f"{r['batch']:>5} {r['step_ms']:>8.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['speedup_vs_batch_1']:>9.1f}x"
        )
    out = {
        "benchmark": "engine_decode_batch",
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "torch_threads": torch.get_num_threads(),
        "runs": rows,
    }
    save("engine_decode_batch", out)


if __name__ == "__main__":
    main()
