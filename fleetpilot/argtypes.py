"""argparse types shared by every command, so bad values are refused while parsing, before
anything starts, with one line that names the flag."""

from __future__ import annotations

import argparse
import math
import re

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


# Go's time.ParseDuration grammar without the sign, as Kubernetes and kubectl write durations
# (``500ms``, ``30s``, ``2m``, ``1h30m``): the grammar of fleetpilot.api.units.parse_duration,
# which this module may not import (it sits below the API models); a test holds the two to the
# same answers. A command line also takes a plain number, as seconds: every flag this replaced
# took one, and scripts pass them.
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ns|us|µs|ms|s|m|h))+")
_DURATION_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
_PLAIN_SECONDS_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
DURATION_EXAMPLES = "500ms, 30s, 2m, 1h30m; a plain number is seconds"


def parse_duration_seconds(text: str) -> float:
    """``500ms``, ``30s``, ``2m``, ``1h30m`` or a plain number of seconds (``90``, ``0.5``),
    as seconds; ``ValueError`` for anything else (a sign, ``nan``, ``inf``, a unit of days,
    an empty string)."""
    if _PLAIN_SECONDS_RE.fullmatch(text):
        return float(text)
    if _DURATION_RE.fullmatch(text):
        return sum(
            float(number) * _UNIT_SECONDS[unit] for number, unit in _DURATION_PART_RE.findall(text)
        )
    if text.startswith("-"):
        raise ValueError(f"{text!r} is negative: a duration is 0 or more")
    raise ValueError(f"{text!r} is not a duration: use e.g. {DURATION_EXAMPLES}")


def duration_seconds(text: str) -> float:
    """A duration flag, 0 or more (``0s``, ``500ms``, ``1h30m``, ``90``), in seconds; argparse
    names the flag in its error."""
    try:
        seconds = parse_duration_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not math.isfinite(seconds):  # a number of 309 digits
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite duration")
    return seconds


def positive_duration(text: str) -> float:
    """A duration flag above 0 (a period, a timeout, a run's length), in seconds."""
    seconds = duration_seconds(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration above 0")
    return seconds


# The name the router's flags import: the same type.
non_negative_seconds = duration_seconds


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
