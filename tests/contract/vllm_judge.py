"""vLLM's own code as the judge of what fleetpilot sends it, run inside ``.venv-vllm``.

The contract tests (``tests/contract``) run in the project's virtualenv, whose torch differs
from the one vLLM pins, so they cannot import vLLM; they start this script with
``.venv-vllm/bin/python`` once per session and ask it questions, one JSON object a line on
stdin, one JSON answer a line on stdout:

- ``{"op": "serve", "argv": [...]}``: parse the arguments after ``vllm serve`` exactly as the
  ``vllm`` command does (``vllm/entrypoints/cli/main.py``: a ``FlexibleArgumentParser`` with the
  serve subcommand's parser, its ``validate``, the positional model tag taking precedence), then
  build ``AsyncEngineArgs.from_cli_args``. Answer ``{"ok": true, "engine_args": {...}}`` (every
  field, nested configs as objects) or ``{"ok": false, "error": "<vLLM's message>"}``.
- ``{"op": "version"}``: the installed vLLM's version.

Nothing here is fleetpilot's: the script imports only vLLM and the standard library, so what it
answers is what the pinned vLLM release says.
"""

from __future__ import annotations

import argparse
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
        elif op == "version":
            answer = {"ok": True, "version": vllm.__version__}
        else:
            answer = {"ok": False, "error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
