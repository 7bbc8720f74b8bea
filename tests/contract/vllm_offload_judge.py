"""vLLM's CPU offloading manager and its KV-event tracker as the judge of the reference engine's
host tier: run as a script in ``.venv-vllm``.

``python vllm_offload_judge.py`` reads one JSON object from stdin, ``{"scenarios": [...]}``,
and prints one JSON answer. Each scenario is ``{"num_blocks", "block_size",
"self_describing", "ops": [...]}``: the calls the reference engine made on its host tier, in
order, replayed on vLLM's own ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``,
LRU policy, events on) behind its ``OffloadingEventsTracker``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``), called as vLLM's
offloading connector calls them (``offloading/scheduler.py``). Hashes are hex; each op is one
of:

- ``{"op": "store", "req", "keys", "positions", "meta"}``: ``prepare_store`` with the
  request's context (each key's end-token position set, as ``update_offload_keys`` does), then
  ``record_store`` for each key to store (``meta``: per key ``{"parent", "token_ids",
  "lora"}`` or null); answers the keys to store, or null when vLLM's allocation fails;
- ``{"op": "complete_store", "keys"}`` and ``{"op": "complete_load", "keys"}``;
- ``{"op": "lookup", "keys"}``: the connector's ``_maximal_prefix_lookup`` then its check for
  blocks being loaded; answers the hit count, or null when vLLM defers the request;
- ``{"op": "load", "req", "keys", "positions"}``: ``prepare_load``;
- ``{"op": "finish", "req"}``: ``on_request_finished``;
- ``{"op": "take"}``: the events ``take_events`` publishes, as builtins with the type tag;
- ``{"op": "reset"}``: ``reset_cache`` (and the flush completing), and the tracker's reset.

Answer ``{"ok": true, "results": [[...one result per op...], ...]}`` or ``{"ok": false,
"error"}``. One offload group (index 0), one block a chunk: the engine's layout.

``{"metrics_argv": [...]}`` instead: the ``vllm:`` metric families vLLM's Prometheus logger
exposes for an engine started with ``vllm serve <argv>`` (with ``--kv-offloading-size``: its
offloading connector's metrics) once it recorded one scheduler step whose stats carry what the
offloading connector reports: a load and a store (counters, sizes), its CPU manager's own stats
after a store (usage gauges, allocation sizes), its config info, an allocation failure and a
host-tier prefix hit. Answer ``{"ok": true, "families": {...}}`` (``metric_families.summarize``).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from types import SimpleNamespace
from typing import Any

# As vllm_judge.py: no GPU here, so vLLM's own switch to its CPU platform, set before vLLM is
# imported (without it building the serve parser cannot infer a device).
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def replay(scenario: dict[str, Any]) -> list[Any]:
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventGroupSpec,
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadingKVEventsConfig,
        ReqContext,
        get_offload_block_hash,
        make_offload_key,
    )
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    bs = int(scenario["block_size"])
    manager = CPUOffloadingManager(num_chunks=int(scenario["num_blocks"]), enable_events=True)
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(
            enable_kv_cache_events=True,
            self_describing_kv_events=bool(scenario["self_describing"]),
        ),
        {0: OffloadingEventGroupSpec(None, None)},
    )
    group = SimpleNamespace(
        group_idx=0,
        tokens_per_block=bs,
        tokens_per_chunk=bs,
        hashes_per_chunk=1,
        sliding_window_size_in_chunks=None,
        kv_event_group_spec=OffloadingEventGroupSpec(None, None),
    )
    contexts: dict[str, Any] = {}
    loading: Counter[bytes] = Counter()  # the connector's _chunks_being_loaded
    anyone = ReqContext(req_id="-")

    def context(request_id: str) -> Any:
        if request_id not in contexts:
            contexts[request_id] = ReqContext(req_id=request_id)
            manager.on_new_request(contexts[request_id])
        return contexts[request_id]

    def keys_of(op: dict[str, Any]) -> list[Any]:
        return [make_offload_key(bytes.fromhex(k), 0) for k in op["keys"]]

    results: list[Any] = []
    for op in scenario["ops"]:
        kind = op["op"]
        result: Any = None
        if kind == "store":
            ctx = context(op["req"])
            keys = keys_of(op)
            for key, position in zip(keys, op["positions"], strict=True):
                ctx.set_offload_key_position(key, position)
            out = manager.prepare_store(keys, ctx)
            if out is not None:
                meta = dict(zip(keys, op["meta"] or [None] * len(keys), strict=True))
                for key in out.keys_to_store:
                    m = meta[key]
                    if m is None:
                        continue
                    own = get_offload_block_hash(key)
                    parent = bytes.fromhex(m["parent"]) if m["parent"] else None
                    lora = m["lora"]
                    request = SimpleNamespace(
                        block_hashes=[parent, own] if parent else [own],
                        all_token_ids=([0] * bs if parent else []) + list(m["token_ids"]),
                        lora_request=(
                            SimpleNamespace(adapter_id=lora[0], name=lora[1]) if lora else None
                        ),
                    )
                    tracker.record_store(request, group, 1 if parent else 0, key)
                result = [get_offload_block_hash(k).hex() for k in out.keys_to_store]
        elif kind == "complete_store":
            manager.complete_store(keys_of(op), anyone)
        elif kind == "lookup":
            hits, defer = 0, False
            for key in keys_of(op):
                found = manager.lookup(key, anyone)
                if found is LookupResult.MISS:
                    break
                defer |= found is LookupResult.HIT_PENDING
                hits += 1
            if any(loading[k] for k in keys_of(op)[:hits]):
                defer = True
            result = None if defer else hits
        elif kind == "load":
            ctx = context(op["req"])
            keys = keys_of(op)
            for key, position in zip(keys, op["positions"], strict=True):
                ctx.set_offload_key_position(key, position)
            manager.prepare_load(keys, ctx)
            loading.update(keys)
        elif kind == "complete_load":
            keys = keys_of(op)
            manager.complete_load(keys, anyone)
            loading.subtract(keys)
        elif kind == "finish":
            if op["req"] in contexts:
                manager.on_request_finished(contexts.pop(op["req"]))
        elif kind == "take":
            events = list(tracker.take_events(list(manager.take_events())))
            result = _jsonable(msgspec.to_builtins(events, builtin_types=(bytes,)))
        elif kind == "reset":
            manager.reset_cache()
            manager.on_reset_flushed()
            tracker.reset()
            loading.clear()
        else:
            raise ValueError(f"unknown op {kind!r}")
        results.append(result)
    return results


def metrics(argv: list[str]) -> dict[str, Any]:
    from metric_families import summarize  # beside this script
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
        _ConnectorMetricName,
        _TransferMetricName,
    )
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
    from vllm_judge import _ServeParser  # beside this script

    config = AsyncEngineArgs.from_cli_args(_ServeParser().parse(argv)).create_engine_config()
    stat_logger = PrometheusStatLogger(config, engine_indexes=[0])
    info = CPUOffloadingInfo(
        cpu_num_chunks=4,
        cpu_blocks_per_chunk=1,
        cpu_kv_cache_size_bytes=4 * 4096,
        cpu_kv_cache_size_tokens=64,
    )
    manager = CPUOffloadingManager(num_chunks=4, info=info)
    manager.prepare_store([make_offload_key(b"\x01" * 16, 0)], ReqContext(req_id="r"))
    stats = OffloadingConnectorStats()
    for name, value in (
        (_TransferMetricName.LOAD_BYTES, 4096),
        (_TransferMetricName.LOAD_TIME, 0.001),
        (_TransferMetricName.STORE_BYTES, 4096),
        (_TransferMetricName.STORE_TIME, 0.001),
        (_ConnectorMetricName.ALLOCATION_FAILURE, 1),
    ):
        stats.increase_counter(name, value)
    stats.observe_histogram(_TransferMetricName.LOAD_SIZE, 4096)
    stats.observe_histogram(_TransferMetricName.STORE_SIZE, 4096)
    manager_stats = manager.get_stats()
    assert manager_stats is not None
    stats.aggregate(manager_stats)
    stats.set_info(manager.config_info())
    hits = PrefixCacheStats()
    hits.record(num_tokens=32, num_hits=16, preempted=False,
                hits_by_source={CacheHitSource.HOST: 16})  # fmt: skip
    stat_logger.record(
        scheduler_stats=SchedulerStats(
            kv_connector_stats=stats.to_dict(), connector_prefix_cache_stats=hits
        ),
        iteration_stats=None,
    )
    return {"ok": True, "families": summarize(REGISTRY.collect())}


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        if "metrics_argv" in request:
            answer = metrics(list(request["metrics_argv"]))
        else:
            answer = {"ok": True, "results": [replay(s) for s in request["scenarios"]]}
    except Exception as error:  # the judge's verdict, whatever vLLM raised
        answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
