"""A reference server with a host KV tier: its runner drives paced loads to completion without
spinning, and a prompt served from host memory answers as when it was computed."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference import EngineConfig, LlamaModel, LLMEngine, SamplingParams
from fleetpilot.engine.reference.offload import PAGE_BYTES, OffloadConfig
from fleetpilot.engine.reference.runner import EngineRunner
from tests.engine.reference.server_support import start_server

PROMPTS = (
    "The quick brown fox jumps over the lazy dog; the dog sleeps on, dreaming of foxes and hens!",
    "Pack my box with five dozen liquor jugs, said the sphinx of black quartz to the judge, twice",
)


def test_a_prompt_served_from_host_memory_answers_as_when_it_was_computed() -> None:
    """8 device blocks: the second prompt pushes the first off the device, so the first again is
    loaded from host memory (10 MB/s: a millisecond a block) - the same greedy text, its cached
    tokens reported in usage and counted as host hits."""
    server = start_server("--num-gpu-blocks-override", "8", "--kv-offloading-size", "0.001",
                          "--kv-offload-gb-per-second", "0.01")  # fmt: skip
    try:
        texts, cached = [], []
        for prompt in (*PROMPTS, PROMPTS[0]):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            answer.raise_for_status()
            texts.append(answer.json()["choices"][0]["text"])
            details = answer.json()["usage"].get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens", 0))
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    assert texts[2] == texts[0]
    host = {
        s.labels["source"]: s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "vllm:prompt_tokens_cached_by_source_total"
    }
    assert host["host"] >= 16
    assert cached[2] >= host["host"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_runner_waits_for_a_load_instead_of_spinning(model: LlamaModel) -> None:
    """While the engine's only work is a copy in flight (its last step ran nothing), the runner
    waits until that copy completes, up to its idle tick; with a request to run it does not
    wait at all."""
    clock = Clock()
    config = EngineConfig(
        num_kv_blocks=8, block_size=16, max_model_len=128,
        kv_offload=OffloadConfig(capacity_bytes=64 * PAGE_BYTES, bandwidth_bytes_per_s=12288.0),
    )  # fmt: skip
    engine = LLMEngine(config, model, clock=clock)
    runner = EngineRunner(engine, idle_wait_s=0.25)
    prompt = list(range(3, 67))  # 4 blocks
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    assert runner._wait_s() == 0.25  # nothing to do: the idle tick
    engine.add_request("a", prompt, greedy)
    assert runner._wait_s() == 0.0
    while engine.has_unfinished_requests() or engine.has_transfers_in_flight():
        clock.now += 1.0
        engine.step()
    engine.add_request("filler", list(range(100, 226)), greedy)  # 8 blocks: the whole pool
    while engine.has_unfinished_requests():
        clock.now += 100.0
        engine.step()
    engine.add_request("again", prompt, greedy)
    engine.step()  # admitted: its 4 blocks load at a block a second
    assert engine.last_step_idle
    done_at = engine.next_transfer_done_at()
    assert done_at == pytest.approx(clock.now + 4.0)
    assert runner._wait_s() == 0.25
    clock.now = done_at - 0.1
    assert runner._wait_s() == pytest.approx(0.1)
    clock.now = done_at
    engine.step()  # the load completes at its end
    engine.step()  # and the request runs
    assert not engine.last_step_idle
    assert runner._wait_s() == 0.0
