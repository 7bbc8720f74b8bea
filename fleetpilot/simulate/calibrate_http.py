"""The calibration's requests to a running engine, over HTTP (loopback only, never through a
proxy from the environment): closed-loop loads through the load generator ``fleetpilot bench``
uses, lone requests with the engine's own TTFT read around each, P/D hand-offs as the router
makes them, router/direct pairs, ``/tokenize`` counts, and what the engine's ``/metrics`` says.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference_launch import CPU_MODEL_CONFIG
from fleetpilot.loadgen.runner import RequestRecord, RunConfig, Runner
from fleetpilot.loadgen.workloads import WORKLOADS, RequestSpec, make_workload
from fleetpilot.routing.policies.pd import decode_request, kv_params_of, prefill_request
from fleetpilot.simulate.calibrate_fit import (
    LoadGap,
    PullSample,
    RouterSample,
    TtftSample,
    fit_tokenization,
)
from fleetpilot.simulate.calibrate_plan import WARM_UP, Listed, Load, Plan, Prompts

HOST = "127.0.0.1"
SERVED_NAME = f"reference-{CPU_MODEL_CONFIG}"
# The local fleet's smallest service: one tier, one reference engine, the router before it.
ROUTED_SERVICE = "calibrate"

Progress = Callable[[str], None]


class CalibrationError(RuntimeError):
    """A measurement that could not be made; the message says which and why."""


async def session(
    url: str, plan: Plan, rng: random.Random, seed: int, say: Progress
) -> tuple[
    float, tuple[TtftSample, ...], tuple[LoadGap, ...], tuple[PullSample, ...], tuple[float, int]
]:
    """The warm-up, then each load followed by its share of lone requests and P/D hand-offs:
    interleaved, because this machine's speed drifts by tens of percent within a minute and
    ``prefill_base_s`` and ``transfer_per_token_s`` are differences against the step fit."""
    await _run_load(url, WARM_UP, rng)
    since = time.time()
    ttft: list[TtftSample] = []
    gaps: list[LoadGap] = []
    pulls: list[PullSample] = []
    n = len(plan.loads)
    # Loopback only, and never through a proxy from the environment.
    async with httpx.AsyncClient(base_url=url, timeout=60.0, trust_env=False) as client:
        for i, load in enumerate(plan.loads):
            say(
                f"load {i + 1}/{n}: {load.concurrency} concurrent, ~{load.prompt_chars} prompt "
                f"chars, ~{load.max_tokens} tokens each"
            )
            before = await _engine_ttft(client)
            records = await _run_load(url, load, rng)
            gaps.append(_load_gap(load, records, before, await _engine_ttft(client)))
            ttft += await _ttft_samples(client, url, plan.ttft_chars[i::n], rng)
            pulls += await _pull_samples(client, plan.pull_chars[i::n], rng)
        say(f"tokenizing {plan.tokenize_per_workload} requests of each bench workload")
        tokenization = await _tokenization(client, plan.tokenize_per_workload, seed)
        _check_pulls((await client.get("/metrics")).text, len(pulls))
    return since, tuple(ttft), tuple(gaps), tuple(pulls), tokenization


async def _run_load(url: str, load: Load, rng: random.Random) -> list[RequestRecord]:
    prompts = Prompts(
        random.Random(rng.getrandbits(64)), load.prompt_chars, load.max_tokens, load.shared_chars
    )
    return await _run(url, prompts.take(load.requests), load.concurrency)


async def _run(
    url: str, specs: Sequence[RequestSpec], concurrency: int, model: str = SERVED_NAME
) -> list[RequestRecord]:
    """``specs`` through the load generator (closed loop); every one must succeed."""
    config = RunConfig(
        url + "/v1",
        model,
        concurrency=concurrency,
        max_requests=len(specs),
        timeout_s=120.0,
        ignore_eos=True,
    )
    result = await Runner(config, Listed(specs)).run()
    failed = [r for r in result.records if not r.ok]
    if failed:
        raise CalibrationError(
            f"{len(failed)} of {len(specs)} calibration requests failed, e.g. "
            f"{failed[0].error}: {failed[0].detail}"
        )
    return sorted(result.records, key=lambda r: r.index)


async def router_pairs(
    routed: str, direct: str, chars: Sequence[int], rng: random.Random
) -> tuple[RouterSample, ...]:
    # Warm both paths first: the router's first request opens its connection to the engine.
    for url, model in ((routed, ROUTED_SERVICE), (direct, SERVED_NAME)):
        await _run(url, Prompts(rng, 200, 4).take(2), 1, model)
    samples = []
    for i, c in enumerate(chars):
        prompts = Prompts(rng, c, 16).take(2)
        order = [(routed, ROUTED_SERVICE), (direct, SERVED_NAME)]
        if i % 2:
            order.reverse()
        ttft: dict[str, float | None] = {}
        for (url, model), spec in zip(order, prompts, strict=True):
            (record,) = await _run(url, [spec], 1, model)
            ttft[url] = record.ttft_s
        routed_s, direct_s = ttft[routed], ttft[direct]
        if routed_s is not None and direct_s is not None:
            samples.append(RouterSample(routed_s, direct_s))
    return tuple(samples)


async def _ttft_samples(
    client: httpx.AsyncClient, url: str, chars: Sequence[int], rng: random.Random
) -> tuple[TtftSample, ...]:
    """One request at a time, the engine's TTFT histogram read around each: its own count."""
    samples = []
    for c in chars:
        before = await _engine_ttft(client)
        (record,) = await _run(url, [Prompts(rng, c, 16).next()], 1)
        total, count = await _engine_ttft(client)
        if count != before[1] + 1:
            raise CalibrationError(f"the engine counted {count - before[1]:g} TTFTs for one")
        if record.ttft_s is not None and record.prompt_tokens:
            engine_s = total - before[0]
            samples.append(
                TtftSample(record.prompt_tokens, record.cached_tokens or 0, record.ttft_s, engine_s)
            )
    return tuple(samples)


async def _engine_ttft(client: httpx.AsyncClient) -> tuple[float, float]:
    return ttft_totals((await client.get("/metrics")).text)


def ttft_totals(metrics: str) -> tuple[float, float]:
    """Sum and count of the ``vllm:time_to_first_token_seconds`` histogram in an engine's
    ``/metrics`` text."""
    total = sum(v for _, v in _samples(metrics, "vllm:time_to_first_token_seconds_sum"))
    count = sum(v for _, v in _samples(metrics, "vllm:time_to_first_token_seconds_count"))
    return total, count


def _load_gap(
    load: Load,
    records: Sequence[RequestRecord],
    before: tuple[float, float],
    after: tuple[float, float],
) -> LoadGap:
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    count = after[1] - before[1]
    if not ttfts or count != len(records):
        raise CalibrationError(
            f"a load of {len(records)} requests: {len(ttfts)} client TTFTs, {count:g} counted "
            "by the engine"
        )
    return LoadGap(load.concurrency, statistics.fmean(ttfts), (after[0] - before[0]) / count)


async def _pull_samples(
    client: httpx.AsyncClient, chars: Sequence[int], rng: random.Random
) -> tuple[PullSample, ...]:
    """The router's two hops per request: prefill (pin the KV), then decode (pull it)."""
    samples = []
    for c in chars:
        body = Prompts(rng, c, 16).next().body(SERVED_NAME, ignore_eos=True)
        hop = prefill_request(body, SERVED_NAME)
        answer = _json_of(await client.post("/v1/chat/completions", json=hop))
        params = kv_params_of(answer)
        if params is None:
            raise CalibrationError(f"the prefill hop pinned no KV: {answer}")
        ttft = await _stream_ttft(client, decode_request(body, SERVED_NAME, params))
        if ttft is not None:
            samples.append(PullSample(int(answer["usage"]["prompt_tokens"]), ttft))
    return tuple(samples)


async def _stream_ttft(client: httpx.AsyncClient, body: dict[str, Any]) -> float | None:
    """Seconds to the first chunk with content, as ``fleetpilot bench`` counts it; the stream is
    read to its end so the engine finishes the request rather than aborting it."""
    start = time.monotonic()
    first: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code >= 400:
            detail = (await response.aread()).decode(errors="replace")
            raise CalibrationError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]" or first is not None:
                continue
            chunk = json.loads(data)
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                first = time.monotonic() - start
    return first


async def _tokenization(
    client: httpx.AsyncClient, per_workload: int, seed: int
) -> tuple[float, int]:
    """How the engine's tokenizer and chat template count the bench workloads' prompts: bytes
    of content per token and tokens a message adds (:func:`fit_tokenization`)."""
    samples: list[tuple[int, int, int]] = []
    for name in sorted(WORKLOADS):
        workload = make_workload(name, seed)
        for _ in range(per_workload):
            messages = workload.next().messages
            ids = _json_of(
                await client.post("/tokenize", json={"model": SERVED_NAME, "messages": messages})
            )["tokens"]
            content = sum(len(m["content"].encode("utf-8")) for m in messages)
            samples.append((len(messages), content, len(ids)))
    try:
        return fit_tokenization(samples)
    except ValueError as e:  # a measurement that went wrong, reported as the others are
        raise CalibrationError(str(e)) from e


def _json_of(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise CalibrationError(
            f"{response.request.method} {response.request.url.path}: HTTP "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response.json()


def _samples(metrics: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == name
    ]


def _check_pulls(metrics: str, expected: int) -> None:
    """Every decode hop must have pulled: a fallback would time a local prefill instead."""
    pulls = sum(v for _, v in _samples(metrics, "fleetpilot_kv_transfer_pulls_total"))
    if pulls < expected:
        raise CalibrationError(f"only {pulls:g} of {expected} P/D decode hops pulled their KV")


def kv_pool(port: int) -> tuple[int, int]:
    """(blocks, block size) the engine on ``port`` reports in ``vllm:cache_config_info``."""
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        metrics = client.get(f"http://{HOST}:{port}/metrics").text
    for labels, _ in _samples(metrics, "vllm:cache_config_info"):
        return int(labels["num_gpu_blocks"]), int(labels["block_size"])
    raise CalibrationError("the engine's /metrics has no vllm:cache_config_info")
