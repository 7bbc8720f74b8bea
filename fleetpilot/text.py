"""Text for log lines and error details. Purely computational."""

from __future__ import annotations


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters with
    ``...``: what a client or a server sent can be long and multi-line, a log line cannot."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
