"""Guarded reads of files a user names: size, UTF-8, nesting, aliases, changes told once."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetpilot.files import (
    MAX_DEPTH,
    MAX_YAML_NODES,
    FileError,
    TooLargeError,
    UnreadableError,
    WatchedFile,
    parse_json,
    parse_yaml,
    parse_yaml_documents,
    read_limited,
    read_text,
)


def test_a_file_within_the_limit_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_limited(path, 10) == b"x" * 10


def test_a_regular_file_over_the_limit_is_refused_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 11)
    with pytest.raises(TooLargeError, match="larger than 10 bytes") as err:
        read_limited(path, 10)
    assert err.value.limit == 10


def test_an_endless_device_is_refused_after_the_limit() -> None:
    with pytest.raises(TooLargeError):
        read_limited(Path("/dev/zero"), 1 << 20)


def test_a_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_limited(tmp_path / "missing", 10)


# -- the guarded reads every entry point shares ----------------------------------------------


def test_read_text_refuses_an_endless_device_a_stray_byte_and_a_missing_file(
    tmp_path: Path,
) -> None:
    """/dev/zero is refused at the cap (not swallowed); a Latin-1 byte is named with its
    offset; a missing file is UnreadableError, each a one-line FileError naming the file."""
    with pytest.raises(FileError) as err:
        read_text(Path("/dev/zero"), what="router config")
    assert str(err.value) == (
        "/dev/zero: larger than 1048576 bytes (1 MiB), the most a router config may be: "
        "is it the right file?"
    )
    latin1 = tmp_path / "latin1"
    latin1.write_bytes(b"abc\xe9")
    with pytest.raises(FileError, match=r"latin1: not UTF-8 text \(byte 3: 0xe9\)$"):
        read_text(latin1)
    with pytest.raises(UnreadableError, match="No such file"):
        read_text(tmp_path / "missing")


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_yaml_and_json_nesting_is_capped_at_max_depth() -> None:
    """MAX_DEPTH levels load; one more, or 100,000, is a FileError (never a RecursionError)
    that says where."""
    assert parse_yaml(_nested(MAX_DEPTH), "f") is not None
    assert parse_json(_nested(MAX_DEPTH), "f") is not None
    with pytest.raises(FileError, match=r"^f: YAML nested deeper than 100 levels \(at line 1"):
        parse_yaml(_nested(MAX_DEPTH + 1), "f")
    with pytest.raises(FileError, match=r"^f: JSON nested deeper than 100 levels$"):
        parse_json(_nested(MAX_DEPTH + 1), "f")
    for text in (_nested(100_000), "a: " + _nested(100_000), "- " * 5000 + "1"):
        with pytest.raises(FileError, match="nested deeper"):
            parse_yaml(text, "f")
    with pytest.raises(FileError, match="nested deeper"):
        parse_json(_nested(100_000), "f")


def test_yaml_aliases_are_budgeted_by_what_they_expand_to() -> None:
    """Anchors that share settings load; a billion-laughs bomb (10^10 strings from a few
    hundred bytes) is refused at the alias that crosses the budget, in milliseconds; an alias
    inside its own anchor (a node that contains itself) is refused."""
    shared = "defaults: &d {a: 1, b: 2}\nx: *d\ny: *d\n"
    assert parse_yaml(shared, "f") == {"defaults": {"a": 1, "b": 2}, "x": {"a": 1, "b": 2},
                                        "y": {"a": 1, "b": 2}}  # fmt: skip
    lines = [f"l0: &l0 [{', '.join(['lol'] * 10)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb = "\n".join(lines)
    with pytest.raises(FileError) as err:
        parse_yaml(bomb, "f")
    assert f"expands to more than {MAX_YAML_NODES} nodes" in str(err.value)
    assert "(at line 6, column" in str(err.value)  # l5: 1,111,111 nodes
    with pytest.raises(FileError, match=r"alias \*a refers to a node that contains it"):
        parse_yaml("a: &a [1, *a]", "f")


def test_other_yaml_and_json_failures_are_file_errors() -> None:
    """A syntax error names line and column; a 5,000-digit integer (past Python's conversion
    limit) and a second document where one is expected are refused, not raised as
    ValueError from deep inside."""
    with pytest.raises(FileError, match=r"^f: YAML syntax error at line 2, column 1: "):
        parse_yaml("a: b\n\tc", "f")
    with pytest.raises(FileError, match=r"^f: invalid JSON at line 1, column 2: "):
        parse_json("{", "f")
    with pytest.raises(FileError, match="YAML value refused"):
        parse_yaml("a: " + "1" * 5000, "f")
    with pytest.raises(FileError, match="JSON value refused"):
        parse_json("1" * 5000, "f")
    with pytest.raises(FileError, match="holds 2 YAML documents; expected one"):
        parse_yaml("a: 1\n---\nb: 2\n", "f")
    assert parse_yaml_documents("a: 1\n---\n---\nb: 2\n", "f") == [{"a": 1}, {"b": 2}]


def test_a_watched_file_tells_each_change_once(tmp_path: Path) -> None:
    """New content is returned once; the same refusal (too large, not UTF-8, missing) is
    raised once however many polls see it; content equal to the last read is no change."""
    path = tmp_path / "watched"
    path.write_text("one")
    watched = WatchedFile(path, limit=10)
    assert watched.read_change() == "one"
    assert watched.read_change() is None
    refusals = []
    for data in (b"x" * 11, b"\xff", None):
        if data is None:
            path.unlink()
        else:
            path.write_bytes(data)
        for _ in range(3):
            try:
                assert watched.read_change() is None
            except FileError as exc:
                refusals.append(type(exc).__name__)
    assert refusals == ["FileError", "FileError", "UnreadableError"]
    path.write_text("two")
    assert watched.read_change() == "two"


def test_priming_takes_the_current_content_as_seen_but_reports_a_refusal_later(
    tmp_path: Path,
) -> None:
    """A watcher primed on the file its caller just loaded reports no change; primed on a
    file that has just become unreadable, it still reports the refusal at the next read."""
    path = tmp_path / "watched"
    path.write_text("one")
    primed = WatchedFile(path)
    primed.prime()
    assert primed.read_change() is None
    path.write_bytes(b"\xff")
    late = WatchedFile(path)
    late.prime()
    with pytest.raises(FileError, match="not UTF-8"):
        late.read_change()
