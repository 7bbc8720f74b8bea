"""Bounded reads of files a user names."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetpilot.files import TooLargeError, read_limited


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
