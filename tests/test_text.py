"""One-line text for logs and error details."""

from __future__ import annotations

from fleetpilot.text import one_line


def test_whitespace_collapses_and_long_text_is_cut_to_the_limit() -> None:
    """Client text in a log line stays on one line, and past the limit is cut to exactly the limit,
    ending in '...'."""
    assert one_line("bad\r\n  request\tline") == "bad request line"
    cut = one_line("x" * 500, limit=20)
    assert (cut, len(cut)) == ("x" * 17 + "...", 20)
    assert one_line("y" * 20, limit=20) == "y" * 20
