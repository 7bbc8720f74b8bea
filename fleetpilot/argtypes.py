"""argparse types shared by every command, so bad values are refused while parsing, before
anything starts, with one line that names the flag."""

from __future__ import annotations

import argparse
import math

MAX_PORT = 65535


def port_number(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535; argparse names the flag in its error."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0 to {MAX_PORT})")
    return port


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of seconds, 0 or more")
    return seconds


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows each flag's default, unless its text already says it or there is none
    worth showing (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or "%(default)" in text
            or default in (None, False, argparse.SUPPRESS)
            or default == []
            or action.option_strings == []
        ):
            return action.help
        return f"{text} (default: %(default)s)"
