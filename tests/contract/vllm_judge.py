"""vLLM's own code as the judge of what fleetpilot sends it, run inside ``.venv-vllm``.

The contract tests (``tests/contract``) run in the project's virtualenv, whose torch differs
from the one vLLM pins, so they cannot import vLLM; they start this script with
``.venv-vllm/bin/python`` once per session and ask it questions, one JSON object a line on
stdin, one JSON answer a line on stdout, after a first line saying it is ready and which
vLLM version it runs:

- ``{"op": "serve", "argv": [...]}``: parse the arguments after ``vllm serve`` exactly as the
  ``vllm`` command does (``vllm/entrypoints/cli/main.py``: a ``FlexibleArgumentParser`` with the
  serve subcommand's parser, its ``validate``, the positional model tag taking precedence), then
  build ``AsyncEngineArgs.from_cli_args``. Answer ``{"ok": true, "engine_args": {...},
  "lora_modules": [...], "headless": bool}`` (every field, nested configs as objects; the
  adapters the OpenAI server would register at start, ``--lora-modules`` as its parser read
  them; whether ``--headless`` is set, a frontend flag outside the engine arguments) or
  ``{"ok": false, "error": "<vLLM's message>"}``.
- ``{"op": "metrics", "argv": [...], "num_gpu_blocks": N}``: the metric families vLLM's
  Prometheus logger (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``) registers for
  an engine started
  with these ``vllm serve`` arguments (a local checkpoint folder the caller wrote: the config is
  built as ``vllm serve`` builds it, ``EngineArgs.create_engine_config``; no weights are read),
  with the cache-config info metric an engine registers once it found ``N`` KV blocks (and,
  with LoRA on, one scheduler step recorded, so the LoRA gauge has its labelled sample).
  Answer ``{"ok": true, "families": {name: {"type", "labels", "buckets", "samples"}}}``.
- ``{"op": "lora_info", "argv": [...], "snapshots": [{"running": [...], "waiting": [...]}]}``:
  the ``/metrics`` text vLLM's Prometheus logger exposes for an engine started with these
  arguments (LoRA on) after it recorded one scheduler step per snapshot, in order, each with
  those adapters' requests running and waiting. Answer ``{"ok": true, "text": "..."}``.
- ``{"op": "kv_decode", "payload": "<base64>"}``: a KV-event batch payload decoded with vLLM's
  own structs (``vllm/distributed/kv_events.py``, ``KVEventBatch``) as its subscribers decode
  it; answer the batch as builtins (each event with its ``type`` tag).
- ``{"op": "kv_encode", "ts": ..., "events": [{"type": "BlockStored", ...}], "rank": ...}``:
  the batch vLLM's publisher would send, built from vLLM's structs and encoded with its
  encoder; answer ``{"ok": true, "payload": "<base64>"}``.
- ``{"op": "pd_prefill", "argv": [...], "kind": "completions"|"chat", "body": {...},
  "prompt_token_ids": [...], "block_ids": [...]}``: vLLM as the prefill side of the NIXL
  hand-off. The hop-1 body is read by vLLM's own request model (``CompletionRequest`` or
  ``ChatCompletionRequest``) into its ``SamplingParams``, a ``Request`` is made from them, and
  the NIXL connector's scheduler side (``NixlConnectorScheduler``, built from the config of
  ``vllm serve <argv>``) sees it arrive and finish holding ``block_ids``: answer the
  ``kv_transfer_params`` its ``request_finished`` returns (what a vLLM prefill engine puts
  in its response).
- ``{"op": "pd_decode", "argv": [...], "kind": ..., "body": {...}, "prompt_token_ids": [...],
  "local_block_ids": [...]}``: vLLM as the decode side. The hop-2 body is read the same way;
  the scheduler side is asked how many tokens to load from the remote prefill
  (``get_num_new_matched_tokens``), is given the local blocks (``update_state_after_alloc``)
  and builds the metadata its workers would pull by (``build_connector_meta``): answer the
  pull it plans (remote engine, request, host, port, block ids; local blocks; TP size).
- ``{"op": "lora_adapters", "argv": [...]}``: the adapters of ``--lora-modules`` loaded as an
  engine started with ``vllm serve <argv>`` (LoRA on; a small local checkpoint: its model is
  built on the CPU, weights uninitialised) loads them at start, by vLLM's worker-side
  manager (``vllm/lora/worker_manager.py``, ``LRUCacheWorkerLoRAManager`` over the model,
  as ``LoRAModelRunnerMixin.load_lora_model`` makes it): ``_load_adapter`` (``PEFTHelper
  .from_local_dir``, ``validate_legal`` against the engine's ``LoRAConfig``,
  ``LoRAModel.from_local_checkpoint`` with the model's expected modules), then
  ``add_adapter``, which packs q/k/v and gate/up, folds each scaling into B and copies the
  adapter into a slot of the LoRA layers. Answer ``{"ok": true, "adapters": {name: ...}}``,
  each adapter ``{"ok": false, "error": "<vLLM's message>"}`` or ``{"ok": true, "peft":
  {r, lora_alpha, target_modules, use_rslora, scaling}, "modules": {module: {rank, scaling,
  lora_a, lora_b}}}`` (what ``_load_adapter`` read: shapes as lists) with ``"slots":
  {module: {"a": ..., "b": ...}}``: what the slot of every LoRA linear layer holds after the
  load, per sub-module (``q_proj`` ... of a packed ``qkv_proj``), ``A`` [max_lora_rank, in]
  and ``B`` [out, max_lora_rank] as ``{"shape", "float32": "<base64>"}``, zero where the
  adapter has no delta.
- ``{"op": "kv_offload", "argv": [...]}``: the host KV tier of an engine started with ``vllm
  serve <argv>`` (a local checkpoint folder the caller wrote; no weights are read). The config
  is built as ``vllm serve`` builds it (``AsyncEngineArgs.from_cli_args``,
  ``create_engine_config``), whose ``VllmConfig.__post_init__`` turns ``--kv-offloading-size``
  and ``--kv-offloading-backend`` into the ``kv_transfer_config`` (``_post_init_kv_transfer_
  config``). With an offloading connector, its native backend is then sized as an engine
  does: ``build_offloading_config`` over the KV cache one worker holds - a full-attention
  group of every layer, the worker's KV heads (``get_num_kv_heads`` of the parallel config),
  head size and the cache dtype, as ``_Nixl`` builds it - and ``CPUOffloadingSpec`` over that.
  Answer ``{"ok": true, "cache_config": {"kv_offloading_size", "kv_offloading_backend"},
  "kv_transfer_config": {...}, "kv_events_config": {...}, "offload": null | {"num_chunks",
  "blocks_per_chunk", "kv_bytes_per_chunk", "world_size", "replicated_layout",
  "self_describing_kv_events", "enable_kv_cache_events"}}``.
- ``{"op": "openai_request", "kind": "chat"|"completions"|"tokenize", "body": {...}}``: the
  body read by vLLM's own request model (``ChatCompletionRequest``, ``CompletionRequest``,
  ``TokenizeCompletionRequest``). Answer ``{"ok": true, "fields": {...}}`` with the fields a
  stream's continuation sets and the sampling parameters they become (``max_tokens``,
  ``allowed_token_ids``), or ``{"ok": false, "error"}`` with vLLM's refusal.
- ``{"op": "chat_render", "tokenizer": "<dir>", "messages": [...], "add_generation_prompt":
  ..., "continue_final_message": ...}``: the chat prompt text as vLLM renders it, through the
  tokenizer's own chat template (transformers' ``apply_chat_template``, which vLLM calls).
- ``{"op": "parallel", "argv": [...]}``: how one pod of a replica started with ``vllm serve
  <argv>`` (a local checkpoint folder the caller wrote; no weights are read) takes its part in
  the replica. The line is parsed as the ``serve`` op parses it, then vLLM's own dispatch
  (``ServeSubcommand.cmd`` in ``vllm/entrypoints/cli/serve.py``, its entry points replaced by
  recorders) picks what the command runs - ``run_headless`` (``--headless``: no API server),
  ``run_multi_api_server`` or ``run_server`` - and fixes ``api_server_count``; the engine
  config is built as that entry point builds it (``AsyncEngineArgs.from_cli_args``,
  ``create_engine_config(usage_context=OPENAI_API_SERVER, headless=...)``, the API-process
  count of ``run_multi_api_server``), with ``run_headless``'s own checks. Answer ``{"ok":
  true, "entrypoint", "api_server_count", "headless", "parallel": {...}, "model": {"is_moe",
  "num_experts"}, "launch": {...}}``: ``parallel`` the ``ParallelConfig`` fields a multi-node
  replica hangs on (nnodes, node_rank, master address and port, world sizes, tensor/pipeline/
  data sizes, data_parallel_size_local and _rank, the data-parallel master IP and RPC port,
  the load-balancing mode, nnodes_within_dp, node_rank_within_dp, expert parallelism, EPLB
  and ``eplb_config`` as an object); ``launch`` what the pod then starts: with
  ``run_headless``, ``"multiproc_executor"`` (``node_rank_within_dp > 0``: this node's workers
  of an engine whose head is elsewhere, at ``head_node_address``) or
  ``"engine_proc_manager"`` (``CoreEngineProcManager``: ``local_engine_count`` engines from
  ``start_index``, handshaking with ``handshake_address``); from an API server,
  ``"api_server"`` with the engines ``launch_core_engines`` starts here (``local_engines``) and
  handshakes with (``handshake_engines``). Every kind carries ``executor_worker_ranks``: the
  global ranks, within one data-parallel rank's world, of the workers a ``MultiprocExecutor``
  starts on this node (``global_start_rank = local_world_size x node_rank_within_dp``).
  The one device check on the way - ``ParallelConfig`` refuses ``enable_eplb`` unless the
  platform ``is_cuda_alike()`` (``vllm/config/parallel.py``), which this GPU-less CPU platform
  is not - is answered as on the GPU nodes the pods run on: only ``is_cuda_alike`` of the
  ``current_platform`` that module sees says True, every other platform question (``is_cuda``,
  ``device_count``, ``is_xpu``...) gets the CPU platform's answer, and the judge refuses to run
  if that module asks ``is_cuda_alike`` anywhere else (a vLLM release that gates more on it).
  No value is set by the judge: every field is what vLLM derived from the argv. Fields a
  platform chooses (the executor backend, worker class, the EPLB communicator) are the CPU
  platform's, not a GPU node's.

Nothing here is fleetpilot's: the script imports only vLLM, the standard library and
``metric_families`` beside it (plain code shared with the tests), so what it answers is what the
pinned vLLM release says.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
from typing import Any

# vLLM logs to stdout by default; stdout is this script's answer channel.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
# No GPU here: vLLM's own switch to its CPU platform (without it the parser's defaults cannot
# infer a device and building the parser fails, as `vllm serve --help` does on such a
# machine). Flags and their types do not depend on the platform; some defaults do, and the
# planner sets every value it relies on explicitly.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):  # block hashes
        return value.hex()
    if hasattr(value, "value") and isinstance(value.value, (str, int)):  # enums
        return value.value
    return repr(value)


class _ServeParser:
    """The ``vllm serve`` parser as ``vllm``'s main builds it, built once (it is large)."""

    def __init__(self) -> None:
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.command = ServeSubcommand()
        self.parser = FlexibleArgumentParser(description="vLLM CLI")
        subparsers = self.parser.add_subparsers(required=False, dest="subparser")
        self.command.subparser_init(subparsers).set_defaults(dispatch_function=self.command.cmd)

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """Parse and validate; argparse's own message (it prints and exits) becomes an error."""
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
                args = self.parser.parse_args(["serve", *argv])
        except SystemExit as exit_:
            # argparse prints the usage, then "<prog>: error: <message>" (several lines for a
            # config that pydantic refused): keep the message whole.
            text = captured.getvalue()
            message = text[text.find(": error: ") + 2 :] if ": error: " in text else text
            raise ValueError(message.strip() or f"argparse exited {exit_.code}") from None
        self.command.validate(args)
        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
        return args


def serve(parser: _ServeParser, argv: list[str]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        args = parser.parse(argv)
        engine_args = AsyncEngineArgs.from_cli_args(args)
    except Exception as error:  # vLLM's verdict, whatever its type
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {
        "ok": True,
        "engine_args": _jsonable(engine_args),
        "lora_modules": _jsonable(getattr(args, "lora_modules", None) or []),
        "headless": bool(args.headless),
    }


def metrics(parser: _ServeParser, argv: list[str], num_gpu_blocks: int) -> dict[str, Any]:
    """Every ``vllm:`` family the logger registers: type, label names (without ``le``),
    histogram bucket bounds (without +Inf) and the sample names it exposes."""
    from metric_families import summarize  # beside this script
    from prometheus_client import REGISTRY
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    try:
        config = AsyncEngineArgs.from_cli_args(parser.parse(argv)).create_engine_config()
        stat_logger = PrometheusStatLogger(config, engine_indexes=[0])
        # What the engine does once it has profiled memory: the info metric of the cache
        # config, with the block count it found (given here: nothing is profiled).
        config.cache_config.num_gpu_blocks = num_gpu_blocks
        stat_logger.log_engine_initialized()
        if config.lora_config is not None:
            # vllm:lora_requests_info has a sample (and so its labels) only once a scheduler
            # step was recorded: one, with no adapter running.
            from vllm.v1.metrics.stats import SchedulerStats

            stat_logger.record(scheduler_stats=SchedulerStats(), iteration_stats=None)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    families = summarize(REGISTRY.collect())
    return {"ok": True, "families": families}


def lora_info(parser: _ServeParser, argv: list[str], snapshots: list[Any]) -> dict[str, Any]:
    import time

    from prometheus_client import REGISTRY, generate_latest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    try:
        config = AsyncEngineArgs.from_cli_args(parser.parse(argv)).create_engine_config()
        stat_logger = PrometheusStatLogger(config, engine_indexes=[0])
        for snapshot in snapshots:
            stats = SchedulerStats(
                running_lora_adapters=dict.fromkeys(snapshot["running"], 1),
                waiting_lora_adapters=dict.fromkeys(snapshot["waiting"], 1),
            )
            stat_logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
            time.sleep(0.01)  # the gauge's value is the time: each snapshot a later one
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "text": generate_latest(REGISTRY).decode()}


def kv_decode(payload_b64: str) -> dict[str, Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    try:
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(base64.b64decode(payload_b64))
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    builtins = msgspec.to_builtins(batch, builtin_types=(bytes,))  # [ts, events, rank?]
    return {"ok": True, "batch": _jsonable(builtins)}


def kv_encode(request: dict[str, Any]) -> dict[str, Any]:
    import msgspec
    from vllm.distributed import kv_events

    kinds = {"BlockStored": kv_events.BlockStored, "BlockRemoved": kv_events.BlockRemoved,
             "AllBlocksCleared": kv_events.AllBlocksCleared}  # fmt: skip
    try:
        events = []
        for event in request["events"]:
            fields = dict(event)
            kind = kinds[fields.pop("type")]
            for key in ("block_hashes", "parent_block_hash"):
                if key in fields:  # JSON carries bytes hashes as hex strings
                    fields[key] = _hashes_from_json(fields[key])
            events.append(kind(**fields))
        batch = kv_events.KVEventBatch(
            ts=request["ts"], events=events, data_parallel_rank=request.get("rank")
        )
        payload = msgspec.msgpack.Encoder().encode(batch)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "payload": base64.b64encode(payload).decode()}


def _hashes_from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_hashes_from_json(v) for v in value]
    if isinstance(value, str):
        return bytes.fromhex(value)
    return value


# Block ids a scheduler test hands the connector are vLLM's ``BlockIds``: one list per KV-cache
# group. A dense Llama has one group (full attention).
_ENGINE_ID = {"prefill": "judge-prefill-engine", "decode": "judge-decode-engine"}


class _Nixl:
    """vLLM's NIXL connector, scheduler side, for an engine configured by ``vllm serve argv``."""

    def __init__(self, parser: _ServeParser, argv: list[str], side: str) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
            NixlConnectorScheduler,
        )
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        self.config = AsyncEngineArgs.from_cli_args(parser.parse(argv)).create_engine_config()
        model = self.config.model_config
        self.block_size = self.config.cache_config.block_size
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=model.get_num_kv_heads(self.config.parallel_config),
            head_size=model.get_head_size(),
            dtype=torch.float16,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=1024,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        self.scheduler = NixlConnectorScheduler(self.config, _ENGINE_ID[side], kv_cache_config)

    def request(self, kind: str, body: dict[str, Any], prompt: list[int], rid: str) -> Any:
        """The engine's ``Request`` for an HTTP body, through vLLM's own request models (the
        server would also render a chat and tokenize; the test gives the prompt's ids)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.v1.request import Request

        parsed: ChatCompletionRequest | CompletionRequest
        if kind == "chat":
            parsed = ChatCompletionRequest.model_validate(body)
            requested = parsed.max_completion_tokens
            requested = parsed.max_tokens if requested is None else requested
        else:
            parsed = CompletionRequest.model_validate(body)
            requested = parsed.max_tokens
        # As vLLM's chat and completion servers size the request before the engine sees it.
        limit = self.config.model_config.max_model_len
        max_tokens = get_max_tokens(limit, requested, len(prompt), {})
        params = parsed.to_sampling_params(max_tokens, {})
        return Request(rid, list(prompt), params, None)


def pd_prefill(parser: _ServeParser, request: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    try:
        nixl = _Nixl(parser, list(request["argv"]), "prefill")
        prompt = list(request["prompt_token_ids"])
        engine_request = nixl.request(request["kind"], request["body"], prompt, "cmpl-judge-p")
        nixl.scheduler.on_new_request(engine_request)
        engine_request.num_computed_tokens = engine_request.num_prompt_tokens
        engine_request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay_free, params = nixl.scheduler.request_finished(
            engine_request, (list(request["block_ids"]),)
        )
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {
        "ok": True,
        "max_tokens": engine_request.max_tokens,
        "delay_free_blocks": delay_free,
        "kv_transfer_params": _jsonable(params),
    }


def pd_decode(parser: _ServeParser, request: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    try:
        nixl = _Nixl(parser, list(request["argv"]), "decode")
        prompt = list(request["prompt_token_ids"])
        engine_request = nixl.request(request["kind"], request["body"], prompt, "cmpl-judge-d")
        nixl.scheduler.on_new_request(engine_request)
        tokens, load_async = nixl.scheduler.get_num_new_matched_tokens(engine_request, 0)
        local = [KVCacheBlock(b) for b in request["local_block_ids"]]
        nixl.scheduler.update_state_after_alloc(engine_request, KVCacheBlocks((local,)), tokens)
        meta = nixl.scheduler.build_connector_meta(None)  # type: ignore[arg-type]
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    pulls = {
        rid: {
            "local_block_ids": _jsonable(req.local_block_ids),
            "tp_size": req.tp_size,
            "remote": _jsonable(req.remote),
        }
        for rid, req in meta.reqs_to_recv.items()
    }
    return {"ok": True, "tokens_to_load": tokens, "load_async": load_async, "pulls": pulls}


def _tensor(tensor: Any) -> dict[str, Any]:
    """A tensor as JSON: its shape and its values as little-endian float32, base64."""
    values = tensor.detach().to("cpu").float().contiguous().numpy().astype("<f4")
    return {"shape": list(values.shape), "float32": base64.b64encode(values.tobytes()).decode()}


def _one_process_group() -> None:
    """The single-process tensor- and pipeline-parallel groups a model's layers are built in
    (once per judge: the groups outlive the call; a world of one changes no other answer)."""
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    if model_parallel_is_initialized():
        return
    method = get_distributed_init_method("127.0.0.1", get_open_port())
    init_distributed_environment(1, 0, method, 0, backend="gloo")
    initialize_model_parallel(1, 1)


def lora_adapters(parser: _ServeParser, argv: list[str]) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    try:
        args = parser.parse(argv)
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        if config.lora_config is None:
            raise ValueError("the judge loads adapters only with --enable-lora")
        device = torch.device("cpu")
        with (
            set_current_vllm_config(config),
            set_default_torch_dtype(config.model_config.dtype),
            device,
        ):
            _one_process_group()
            model = initialize_model(vllm_config=config)
            # As the GPU model runner does once the model is loaded (load_lora_model).
            worker = LRUCacheWorkerLoRAManager(config, device, model.embedding_modules)
            worker.create_lora_manager(model, config)
            adapters = {}
            # As the OpenAI server registers --lora-modules at start: ids from 1, in order.
            for lora_id, module in enumerate(args.lora_modules or [], start=1):
                request = LoRARequest(module.name, lora_id, module.path, module.base_model_name)
                adapters[module.name] = _load_lora(worker, request)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "adapters": adapters}


def _load_lora(worker: Any, request: Any) -> dict[str, Any]:
    """One adapter through the worker: what ``_load_adapter`` read, then what ``add_adapter``
    put into the LoRA layers' slot for it."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import get_adapter_absolute_path

    try:
        # What the worker will read, kept for the answer (_load_adapter reads it again).
        peft = PEFTHelper.from_local_dir(
            get_adapter_absolute_path(request.lora_path), worker.max_position_embeddings
        )
        loaded = worker._load_adapter(request)
        worker.add_adapter(request)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    modules = {
        name: {
            "rank": lora.rank,
            "scaling": lora.scaling,
            "lora_a": list(lora.lora_a.shape),
            "lora_b": list(lora.lora_b.shape),
        }
        for name, lora in sorted(loaded.loras.items())
    }
    manager = worker._adapter_manager
    slot = manager.lora_index_to_id.index(request.lora_int_id)
    slots = {}
    for name, layer in manager.modules.items():
        stacked_a = getattr(layer, "lora_a_stacked", None)
        if not isinstance(stacked_a, tuple):
            continue  # the embedding and logits layers: no linear delta
        parts = manager.packed_modules.get(name, [name])
        for part, a, b in zip(parts, stacked_a, layer.lora_b_stacked, strict=True):
            slots[part] = {"a": _tensor(a[slot, 0]), "b": _tensor(b[slot, 0])}
    return {
        "ok": True,
        "peft": {
            "r": peft.r,
            "lora_alpha": peft.lora_alpha,
            "target_modules": peft.target_modules,
            "use_rslora": peft.use_rslora,
            "scaling": peft.vllm_lora_scaling_factor,
        },
        "modules": modules,
        "slots": slots,
    }


# vLLM's entry points of ``vllm serve``, which ``ServeSubcommand.cmd`` picks between.
_ENTRYPOINTS = ("run_headless", "run_multi_api_server", "run_dp_supervisor", "run_server")
_PARALLEL_FIELDS = (
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "world_size",
    "world_size_across_dp",
    "local_world_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "data_parallel_size",
    "data_parallel_size_local",
    "data_parallel_rank",
    "data_parallel_master_ip",
    "data_parallel_rpc_port",
    "data_parallel_backend",
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
    "local_engines_only",
    "nnodes_within_dp",
    "node_rank_within_dp",
    "enable_expert_parallel",
    "enable_eplb",
    "eplb_config",
    "is_moe_model",
    "_api_process_count",
    "_api_process_rank",
)


def _serve_dispatch(args: argparse.Namespace) -> str:
    """The entry point ``vllm serve`` runs for these arguments, as ``ServeSubcommand.cmd``
    decides it (it also sets ``args.api_server_count``, as it does before running it)."""
    from unittest import mock

    import vllm.entrypoints.cli.serve as serve_module

    chosen: list[str] = []

    def recorder(name: str) -> Any:
        def record(*_args: Any, **_kwargs: Any) -> None:
            chosen.append(name)

        return record

    with contextlib.ExitStack() as stack:
        for name in _ENTRYPOINTS:
            stack.enter_context(mock.patch.object(serve_module, name, recorder(name)))
        # run_server's coroutine is run by uvloop: the recorder returns no coroutine to run.
        stack.enter_context(
            mock.patch.object(serve_module, "uvloop", mock.Mock(run=lambda _coro: None))
        )
        serve_module.ServeSubcommand.cmd(args)
    if len(chosen) != 1:
        raise RuntimeError(f"vllm serve ran {chosen or 'nothing'}; the judge expects one entry")
    return chosen[0]


@contextlib.contextmanager
def _eplb_allowed_as_on_a_gpu() -> Any:
    """``ParallelConfig``'s EPLB device check answered as on a GPU node (module docstring)."""
    import inspect

    import vllm.config.parallel as parallel_module

    if inspect.getsource(parallel_module).count("is_cuda_alike") != 1:
        raise RuntimeError(
            "vllm/config/parallel.py asks is_cuda_alike() in more than the EPLB check: "
            "the judge's stand-in for a GPU platform would answer more than that check"
        )
    real = parallel_module.current_platform

    class _CudaAlike:
        def is_cuda_alike(self) -> bool:
            return True

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    parallel_module.current_platform = _CudaAlike()
    try:
        yield
    finally:
        parallel_module.current_platform = real


def parallel(parser: _ServeParser, argv: list[str]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import propagate_flash_late_interaction
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.network_utils import get_tcp_uri

    try:
        args = parser.parse(argv)
        entrypoint = _serve_dispatch(args)
        headless = entrypoint == "run_headless"
        if headless and args.api_server_count > 1:  # run_headless's first check
            raise ValueError("api_server_count can't be set in headless mode")
        if entrypoint not in ("run_headless", "run_multi_api_server", "run_server"):
            raise ValueError(f"the judge does not build the config {entrypoint} builds")
        engine_args = AsyncEngineArgs.from_cli_args(args)
        propagate_flash_late_interaction(args, engine_args)
        if entrypoint == "run_multi_api_server":
            engine_args._api_process_count = args.api_server_count
            engine_args._api_process_rank = -1
        with _eplb_allowed_as_on_a_gpu():
            config = engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER, headless=headless
            )
        p = config.parallel_config
        fields = {name: _jsonable(getattr(p, name)) for name in _PARALLEL_FIELDS}
        # MultiprocExecutor (vllm/v1/executor/multiproc_executor.py): this node's workers.
        start = p.local_world_size * p.node_rank_within_dp
        worker_ranks = list(range(start, start + p.local_world_size))
        launch: dict[str, Any]
        if headless:
            # run_headless, after create_engine_config.
            if engine_args.data_parallel_hybrid_lb:
                raise ValueError("data_parallel_hybrid_lb is not applicable in headless mode")
            if p.data_parallel_size_local <= 0:
                raise ValueError("data_parallel_size_local must be > 0 in headless mode")
            if p.node_rank_within_dp > 0:
                launch = {
                    "kind": "multiproc_executor",
                    "head_node_address": f"{p.master_addr}:{p.master_port}",
                }
            else:
                launch = {
                    "kind": "engine_proc_manager",
                    "local_engine_count": p.data_parallel_size_local,
                    "start_index": p.data_parallel_rank,
                    "handshake_address": get_tcp_uri(
                        p.data_parallel_master_ip, p.data_parallel_rpc_port
                    ),
                }
        else:
            # launch_core_engines (vllm/v1/engine/utils.py), which either API-server path
            # runs: rank 0 handshakes with every engine and starts the first
            # data_parallel_size_local of them; another rank only its own (never with
            # internal load balancing, which vLLM asserts).
            size, local = p.data_parallel_size, p.data_parallel_size_local
            rank = p.data_parallel_rank
            if entrypoint == "run_multi_api_server" and not (p.local_engines_only or rank == 0):
                raise ValueError("run_multi_api_server: internal LB needs data_parallel_rank 0")
            if rank == 0:
                engines = [(i, i < local) for i in range(size)]
            elif p.local_engines_only:
                engines = [(i, True) for i in range(rank, rank + local)]
            else:
                raise ValueError(
                    "Attempting to launch core_engines from dp_rank > 0, but found internal "
                    "DPLB, which is incompatible."
                )
            launch = {
                "kind": "api_server",
                "local_engines": [i for i, here in engines if here],
                "handshake_engines": [i for i, _ in engines],
            }
        launch["executor_worker_ranks"] = worker_ranks
        model = config.model_config
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {
        "ok": True,
        "entrypoint": entrypoint,
        "api_server_count": args.api_server_count,
        "headless": headless,
        "parallel": fields,
        "model": {"is_moe": model.is_moe, "num_experts": model.get_num_experts()},
        "launch": launch,
    }


def kv_offload(parser: _ServeParser, argv: list[str]) -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    try:
        config = AsyncEngineArgs.from_cli_args(parser.parse(argv)).create_engine_config()
        transfer = config.kv_transfer_config
        offload = None
        if transfer is not None and transfer.kv_connector == "OffloadingConnector":
            model, parallel = config.model_config, config.parallel_config
            spec = FullAttentionSpec(
                block_size=config.cache_config.block_size,
                num_kv_heads=model.get_num_kv_heads(parallel),
                head_size=model.get_head_size(),
                dtype=kv_cache_dtype_str_to_dtype(config.cache_config.cache_dtype, model),
            )
            layers = [
                f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(parallel))
            ]
            kv_cache_config = KVCacheConfig(
                num_blocks=1024,
                kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
            )
            offloading = build_offloading_config(config, kv_cache_config)
            cpu = CPUOffloadingSpec(offloading)
            offload = {
                "num_chunks": cpu.num_chunks,
                "blocks_per_chunk": cpu.blocks_per_chunk,
                "kv_bytes_per_chunk": cpu.kv_bytes_per_chunk,
                "world_size": offloading.parallel.world_size,
                "replicated_layout": cpu.replicated_layout,
                "self_describing_kv_events": cpu.kv_events_config.self_describing_kv_events,
                "enable_kv_cache_events": cpu.kv_events_config.enable_kv_cache_events,
            }
        cache = config.cache_config
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {
        "ok": True,
        "cache_config": {
            "kv_offloading_size": cache.kv_offloading_size,
            "kv_offloading_backend": cache.kv_offloading_backend,
        },
        "kv_transfer_config": _jsonable(transfer),
        "kv_events_config": _jsonable(config.kv_events_config),
        "offload": offload,
    }


def openai_request(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest

    try:
        if kind == "tokenize":
            tokenize = TokenizeCompletionRequest.model_validate(body)
            return {
                "ok": True,
                "fields": {
                    "prompt": tokenize.prompt,
                    "add_special_tokens": tokenize.add_special_tokens,
                },
            }
        fields: dict[str, Any]
        parsed: Any
        if kind == "chat":
            parsed = ChatCompletionRequest.model_validate(body)
            requested = parsed.max_completion_tokens
            requested = parsed.max_tokens if requested is None else requested
            fields = {
                "continue_final_message": parsed.continue_final_message,
                "add_generation_prompt": parsed.add_generation_prompt,
                "messages": len(parsed.messages),
            }
        else:
            parsed = CompletionRequest.model_validate(body)
            requested = parsed.max_tokens
            fields = {"prompt": parsed.prompt}
        params = parsed.to_sampling_params(requested or 16, {})
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    fields["max_tokens"] = params.max_tokens
    fields["allowed_token_ids"] = params.allowed_token_ids
    return {"ok": True, "fields": fields}


def chat_render(request: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(request["tokenizer"])
        text = tokenizer.apply_chat_template(
            request["messages"],
            tokenize=False,
            add_generation_prompt=request["add_generation_prompt"],
            continue_final_message=request["continue_final_message"],
        )
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "text": text}


def main() -> None:
    logging.disable(logging.WARNING)
    import vllm

    parser = _ServeParser()
    print(json.dumps({"ready": True, "version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        if op == "serve":
            answer = serve(parser, list(request["argv"]))
        elif op == "metrics":
            answer = metrics(parser, list(request["argv"]), int(request["num_gpu_blocks"]))
        elif op == "lora_info":
            answer = lora_info(parser, list(request["argv"]), list(request["snapshots"]))
        elif op == "kv_decode":
            answer = kv_decode(request["payload"])
        elif op == "kv_encode":
            answer = kv_encode(request)
        elif op == "pd_prefill":
            answer = pd_prefill(parser, request)
        elif op == "pd_decode":
            answer = pd_decode(parser, request)
        elif op == "lora_adapters":
            answer = lora_adapters(parser, list(request["argv"]))
        elif op == "openai_request":
            answer = openai_request(str(request["kind"]), dict(request["body"]))
        elif op == "chat_render":
            answer = chat_render(request)
        elif op == "parallel":
            answer = parallel(parser, list(request["argv"]))
        elif op == "kv_offload":
            answer = kv_offload(parser, list(request["argv"]))
        else:
            answer = {"ok": False, "error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
