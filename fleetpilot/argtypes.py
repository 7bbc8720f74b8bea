"""argparse types shared by every command, so bad values are refused while parsing, before
anything starts, with one line that names the flag."""

from __future__ import annotations

import argparse

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
