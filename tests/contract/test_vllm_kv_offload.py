"""The reference engine's host tier is vLLM's native CPU offloading, judged by vLLM's own code:
the calls the engine makes on its tier, replayed on vLLM's ``CPUOffloadingManager`` behind its
``OffloadingEventsTracker``, give the same stores, evictions, lookups and KV events; the
engine's event batches with medium ``CPU`` decode with vLLM's ``KVEventBatch``; and its host
tier metrics are the families vLLM's logger exposes for ``--kv-offloading-size``."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference import EngineConfig, LlamaModel, LLMEngine, SamplingParams
from fleetpilot.engine.reference.offload import PAGE_BYTES, BlockMeta, HostTier, OffloadConfig
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockStored, Event, decode_batch
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.contract.conftest import VLLM_PYTHON, VllmJudge
from tests.contract.metric_families import summarize
from tests.support.kv_replay import DEADLINE_S, replay

JUDGE = Path(__file__).with_name("vllm_offload_judge.py")
# Importing vLLM takes ~10-30 s on a busy 2-core machine.
JUDGE_TIMEOUT_S = 300
BS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# Fields vLLM's offloading events carry that fleetpilot.kv_events' structs (shared, vLLM's
# fields up to medium and lora_name) do not: the offload group, always 0 for one group. A
# consumer decoding the engine's events with vLLM's structs reads None there.
VLLM_ONLY = {"group_idx": 0}


def as_wire(value: Any) -> Any:
    """Decoded structs in the judges' JSON shape (bytes hashes as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [as_wire(v) for v in value]
    return value


def event_fields(event: Any) -> dict[str, Any]:
    fields = {name: as_wire(getattr(event, name)) for name in event.__struct_fields__}
    return {"type": type(event).__name__, **fields}


def ask_offload_judge(request: dict[str, Any]) -> dict[str, Any]:
    """One question to ``vllm_offload_judge.py`` in ``.venv-vllm`` (a process of its own)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} is absent: `make vllm` installs the real vLLM")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    # vLLM 0.33 publishes each hash as its low 64 bits (an int) unless this is 0; the reference
    # engine publishes the hashes themselves (bytes), on both media, which vLLM's structs also
    # carry (ExternalBlockHash = bytes | int). Compared like for like here.
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    done = subprocess.run(
        [str(VLLM_PYTHON), str(JUDGE)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=JUDGE_TIMEOUT_S,
        cwd=JUDGE.parent,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answer: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert answer["ok"], answer["error"]
    return answer


# ---- the engine's calls on its tier, replayed on vLLM's manager --------------------------


class RecordingHostTier(HostTier):
    """A host tier that writes down every call the engine makes, with what it answered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[dict[str, Any], Any]] = []

    def prepare_store(
        self,
        request_id: str,
        keys: Any,
        positions: Any,
        meta: Any = None,
    ) -> tuple[list[bytes], list[int]] | None:
        result = super().prepare_store(request_id, keys, positions, meta)
        described = None
        if meta is not None:
            described = [
                {"parent": m.parent.hex() if m.parent else None, "token_ids": list(m.token_ids),
                 "lora": list(m.lora) if m.lora else None}
                for m in meta
            ]  # fmt: skip
        op = {"op": "store", "req": request_id, "keys": [k.hex() for k in keys],
              "positions": list(positions), "meta": described}  # fmt: skip
        self.calls.append((op, None if result is None else [k.hex() for k in result[0]]))
        return result

    def complete_store(self, keys: Any) -> None:
        keys = list(keys)
        self.calls.append(({"op": "complete_store", "keys": [k.hex() for k in keys]}, None))
        super().complete_store(keys)

    def lookup(self, keys: Any) -> int | None:
        result = super().lookup(keys)
        self.calls.append(({"op": "lookup", "keys": [k.hex() for k in keys]}, result))
        return result

    def prepare_load(self, request_id: str, keys: Any, positions: Any) -> list[int]:
        op = {"op": "load", "req": request_id, "keys": [k.hex() for k in keys],
              "positions": list(positions)}  # fmt: skip
        self.calls.append((op, None))
        return super().prepare_load(request_id, keys, positions)

    def complete_load(self, keys: Any) -> None:
        keys = list(keys)
        self.calls.append(({"op": "complete_load", "keys": [k.hex() for k in keys]}, None))
        super().complete_load(keys)

    def finish(self, request_id: str) -> None:
        self.calls.append(({"op": "finish", "req": request_id}, None))
        super().finish(request_id)

    def take_events(self) -> list[Event]:
        events = super().take_events()
        self.calls.append(({"op": "take"}, [event_fields(e) for e in events]))
        return events

    def reset(self) -> None:
        self.calls.append(({"op": "reset"}, None))
        super().reset()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine_session(self_describing: bool) -> tuple[RecordingHostTier, dict[str, Any]]:
    """A small engine's life with a host tier of 12 blocks, its calls on the tier recorded:
    a prompt stored; a longer one that cannot be stored beside it; the first reloaded; two
    prompts at once, one sharing a prefix, evicting while both run; a reset of the tier, a
    prompt stored afterwards, and one met while its store is in flight. Copies take 0.5 s a
    block; the clock moves by the step."""
    model = LlamaModel(MODEL_PRESETS["tiny"])
    clock = Clock()
    block = 2 * 3 * 2 * 16 * 4 * BS
    offload = OffloadConfig(
        capacity_bytes=12 * PAGE_BYTES,
        bandwidth_bytes_per_s=block / 0.5,
        self_describing_kv_events=self_describing,
    )
    config = EngineConfig(num_kv_blocks=16, block_size=BS, max_model_len=128,
                          enable_kv_cache_events=True, kv_offload=offload)  # fmt: skip
    engine = LLMEngine(config, model, clock=clock)
    assert engine.host is not None
    tier = RecordingHostTier(engine.host.num_blocks, enable_kv_cache_events=True,
                             self_describing_kv_events=self_describing)  # fmt: skip
    engine.host = engine.scheduler.host = tier

    def run(prompts: dict[str, list[int]], dt: float) -> None:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, GREEDY)
        while engine.has_unfinished_requests() or engine.has_transfers_in_flight():
            clock.now += dt
            engine.step()
            engine.take_kv_events()

    prompt = list(range(3, 43))
    run({"a": prompt}, 0.01)
    run({"filler": list(range(200, 256))}, 1.0)
    run({"again": prompt}, 1.0)
    run({"c": list(range(60, 76)), "d": prompt[:24] + list(range(90, 102))}, 0.3)
    engine.reset_prefix_cache(reset_external=True)
    engine.take_kv_events()
    run({"e": list(range(120, 134))}, 0.3)
    # A block-aligned prompt, and the same again while its last block is still being written:
    # past its device hit, the second meets that block pending and is deferred.
    aligned = list(range(140, 152))
    engine.add_request("f", aligned, GREEDY)
    while engine.has_unfinished_requests():
        clock.now += 0.01
        engine.step()
        engine.take_kv_events()
    run({"f2": aligned}, 0.3)
    ops = [op for op, _ in tier.calls]
    scenario = {"num_blocks": tier.num_blocks, "block_size": BS,
                "self_describing": self_describing, "ops": ops}  # fmt: skip
    return tier, scenario


@pytest.fixture(scope="module")
def replays() -> dict[bool, tuple[RecordingHostTier, list[Any]]]:
    """Both sessions (placeholder and self-describing events), and vLLM's results for them."""
    sessions = {mode: engine_session(mode) for mode in (False, True)}
    answer = ask_offload_judge({"scenarios": [scenario for _, scenario in sessions.values()]})
    return {
        mode: (tier, results)
        for (mode, (tier, _)), results in zip(sessions.items(), answer["results"], strict=True)
    }


def vllm_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's events without the fields fleetpilot's structs lack, checked to be as expected."""
    out = []
    for event in events:
        event = dict(event)
        for name, value in VLLM_ONLY.items():
            assert event.pop(name, None) == value, (name, event)
        out.append(event)
    return out


@pytest.mark.parametrize("self_describing", [False, True], ids=["placeholder", "self-describing"])
def test_vllms_manager_given_the_engines_calls_answers_and_publishes_the_same(
    replays: dict[bool, tuple[RecordingHostTier, list[Any]]], self_describing: bool
) -> None:
    """Every store's blocks to copy (or its failure), every lookup's hit count (or deferral)
    and every batch of CPU events - which blocks a store evicted, in which order, and each
    stored block's payload - are what vLLM's CPUOffloadingManager (LRU) and its events tracker
    give for the same calls; and the session exercised what matters (evictions, a failed
    store, a deferral, loads, a reset)."""
    tier, results = replays[self_describing]
    assert len(results) == len(tier.calls)
    kinds: set[str] = set()
    for (op, ours), theirs in zip(tier.calls, results, strict=True):
        if op["op"] == "take":
            assert ours == vllm_events(theirs), op
            kinds.update(f"{e['type']}/{e['medium']}" for e in ours)
        else:
            assert ours == theirs, op
    assert kinds == {f"BlockStored/{MEDIUM_CPU}", f"BlockRemoved/{MEDIUM_CPU}"}
    ops = [op["op"] for op, _ in tier.calls]
    assert {"load", "complete_load", "finish", "reset"} <= set(ops)
    assert any(op["op"] == "store" and result is None for op, result in tier.calls)
    assert any(op["op"] == "lookup" and result is None for op, result in tier.calls)
    stored = [e for (op, ours) in tier.calls if op["op"] == "take" for e in ours
              if e["type"] == "BlockStored"]  # fmt: skip
    if self_describing:
        assert all(e["block_size"] == BS and len(e["token_ids"]) == BS for e in stored)
    else:
        assert all(e["block_size"] == 0 and e["token_ids"] == [] for e in stored)


# ---- a server's batches, decoded by vLLM ----------------------------------------------------


PROMPTS = (
    "The quick brown fox jumps over the lazy dog; the dog sleeps on, dreaming of foxes and hens!",
    "Pack my box with five dozen liquor jugs, said the sphinx of black quartz to the judge, twice",
)


def server_payloads(extra: list[str]) -> tuple[list[bytes], str]:
    """Every batch a reference engine with 8 device blocks and 8 host blocks published for the
    first prompt, the second (evicting the first from the device, and part of it from host
    memory) and the first again (loaded from host memory), by replay from seq 0; and its
    /metrics."""
    events = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0",
        }
    )
    # The tiny model's 16-token block takes 3 pages: 0.0001 GiB holds 8 of them.
    server = BackgroundServer.from_argv(
        ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len",
         "256", "--num-gpu-blocks-override", "8", "--kv-events-config", events,
         "--kv-offloading-size", "0.0001", *extra]
    ).start()  # fmt: skip
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for prompt in (*PROMPTS, PROMPTS[0]):
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            httpx.post(server.url + "/v1/completions", json=body, timeout=30).raise_for_status()
        runner = server.server.runner
        assert runner is not None
        eventually(
            "the host tier's copies completed",
            lambda: asyncio.run(runner.call(lambda e: e.has_transfers_in_flight())),
            DEADLINE_S,
            until=lambda busy: not busy,
            interval=0.01,
        )
        asyncio.run(runner.call(lambda e: None))  # a step's events are published before
        publisher = server.server.kv_publisher
        assert publisher is not None
        assert publisher.replay_endpoint is not None
        payloads = [p for _, _, p in replay(ctx, publisher.replay_endpoint, 0)]
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        return payloads, metrics
    finally:
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.parametrize("self_describing", [False, True], ids=["placeholder", "self-describing"])
def test_a_servers_batches_with_host_tier_events_decode_with_vllms_structs(
    vllm_judge: VllmJudge, self_describing: bool
) -> None:
    """With --kv-offloading-size (and kv_connector_extra_config.self_describing_kv_events),
    each payload decodes with vLLM's KVEventBatch to what the router's decoder reads; blocks
    go to the CPU and leave it, next to the GPU's events."""
    extra = json.dumps({"kv_connector_extra_config": {"self_describing_kv_events": True}})
    payloads, _ = server_payloads(["--kv-transfer-config", extra] if self_describing else [])
    seen: set[tuple[str, str]] = set()
    for payload in payloads:
        answer = vllm_judge.ask({"op": "kv_decode", "payload": base64.b64encode(payload).decode()})
        assert answer["ok"], answer["error"]
        _, events, *_ = answer["batch"]
        ours = decode_batch(payload)
        assert events == [event_fields(e) for e in ours.events]
        seen.update((e["type"], e.get("medium")) for e in events)
        for event in ours.events:
            if isinstance(event, BlockStored) and event.medium == MEDIUM_CPU:
                assert (event.block_size == 16) is self_describing
                assert (len(event.token_ids) == 16) is self_describing
    assert {("BlockStored", MEDIUM_GPU), ("BlockStored", MEDIUM_CPU),
            ("BlockRemoved", MEDIUM_GPU), ("BlockRemoved", MEDIUM_CPU)} <= seen  # fmt: skip


# ---- metrics ---------------------------------------------------------------------------------

HOST_TIER_FAMILIES = (
    "vllm:kv_offload",
    "vllm:external_prefix_cache",
    "vllm:prompt_tokens_cached_by_source",
)
# vLLM's offloading families the reference engine does not export: the lookup delays (its
# lookups take no time worth a histogram) and the deprecated transfer_type-labelled series.
NOT_EXPORTED = {
    "vllm:kv_offload_lookup_sync_delay_seconds",
    "vllm:kv_offload_lookup_async_delay_seconds",
    "vllm:kv_offload_total_bytes",
    "vllm:kv_offload_total_time",
    "vllm:kv_offload_size",
}


def test_the_host_tier_metrics_are_the_families_vllm_exposes_for_offloading(
    tiny_checkpoint: Path,
) -> None:
    """vLLM's logger for an engine with --kv-offloading-size, after a step that reported the
    offloading connector's stats, has these host-tier families; the reference engine with a
    host tier exports each of them, but those listed as not exported, with vLLM's type, labels
    and buckets; and it had a host hit to count."""
    argv = [str(tiny_checkpoint), "--max-model-len", "256", "--kv-offloading-size", "1"]
    theirs = {
        name: family
        for name, family in ask_offload_judge({"metrics_argv": argv})["families"].items()
        if name.startswith(HOST_TIER_FAMILIES)
    }
    _, text = server_payloads([])
    ours = {
        name: family
        for name, family in summarize(text_string_to_metric_families(text)).items()
        if name.startswith(HOST_TIER_FAMILIES)
    }
    assert set(theirs) - set(ours) == NOT_EXPORTED
    assert set(ours) <= set(theirs)
    for name, family in ours.items():
        for key in ("type", "labels", "buckets"):
            assert family[key] == theirs[name][key], (name, key, family[key], theirs[name][key])
    hits = next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:prompt_tokens_cached_by_source_total" and s.labels["source"] == "host"
    )
    assert hits > 0


def test_vllms_own_encoder_agrees_on_a_placeholder_event() -> None:
    """The placeholder payload our tier emits is byte for byte msgspec's encoding of the same
    fields (no field left to a default that vLLM's decoder would lack)."""
    tier = HostTier(1, enable_kv_cache_events=True)
    result = tier.prepare_store("r", [b"\x01" * 16], [16], [BlockMeta(None, (), 16)])
    assert result is not None
    tier.complete_store(result[0])
    (event,) = tier.take_events()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
    assert wire == {"type": "BlockStored", "block_hashes": [b"\x01" * 16],
                    "parent_block_hash": None, "token_ids": [], "block_size": 0,
                    "lora_id": None, "medium": MEDIUM_CPU, "lora_name": None}  # fmt: skip
