"""vLLM's own code as the judge of what fleetpilot sends it, run inside ``.venv-vllm``.

The contract tests (``tests/contract``) run in the project's virtualenv, whose torch differs
from the one vLLM pins, so they cannot import vLLM; they start this script with
``.venv-vllm/bin/python`` once per session and ask it questions, one JSON object a line on
stdin, one JSON answer a line on stdout, after a first line saying it is ready and which
vLLM version it runs:

- ``{"op": "serve", "argv": [...]}``: parse the arguments after ``vllm serve`` exactly as the
  ``vllm`` command does (``vllm/entrypoints/cli/main.py``: a ``FlexibleArgumentParser`` with the
  serve subcommand's parser, its ``validate``, the positional model tag taking precedence), then
  build ``AsyncEngineArgs.from_cli_args``. Answer ``{"ok": true, "engine_args": {...}}`` (every
  field, nested configs as objects) or ``{"ok": false, "error": "<vLLM's message>"}``.
- ``{"op": "metrics", "argv": [...], "num_gpu_blocks": N}``: the metric families vLLM's
  Prometheus logger (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``) registers for
  an engine started
  with these ``vllm serve`` arguments (a local checkpoint folder the caller wrote: the config is
  built as ``vllm serve`` builds it, ``EngineArgs.create_engine_config``; no weights are read),
  with the cache-config info metric an engine registers once it found ``N`` KV blocks.
  Answer ``{"ok": true, "families": {name: {"type", "labels", "buckets", "samples"}}}``.
- ``{"op": "kv_decode", "payload": "<base64>"}``: a KV-event batch payload decoded with vLLM's
  own structs (``vllm/distributed/kv_events.py``, ``KVEventBatch``) as its subscribers decode
  it; answer the batch as builtins (each event with its ``type`` tag).
- ``{"op": "kv_encode", "ts": ..., "events": [{"type": "BlockStored", ...}], "rank": ...}``:
  the batch vLLM's publisher would send, built from vLLM's structs and encoded with its
  encoder; answer ``{"ok": true, "payload": "<base64>"}``.

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
    return {"ok": True, "engine_args": _jsonable(engine_args)}


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
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    families = summarize(REGISTRY.collect())
    return {"ok": True, "families": families}


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
        elif op == "kv_decode":
            answer = kv_decode(request["payload"])
        elif op == "kv_encode":
            answer = kv_encode(request)
        else:
            answer = {"ok": False, "error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
