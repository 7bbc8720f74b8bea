"""Reading a file a user names, bounded: a mistaken path (``/dev/zero``, a disk image, a log)
is refused after ``limit`` bytes instead of filling memory."""

from __future__ import annotations

from pathlib import Path


class TooLargeError(ValueError):
    """The file holds more than the limit."""

    def __init__(self, path: Path, limit: int) -> None:
        super().__init__(f"{path}: larger than {limit} bytes")
        self.limit = limit


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of ``path``; ``TooLargeError`` past ``limit`` bytes (a regular file is
    refused by its size before any is read; anything else after reading ``limit + 1``),
    ``OSError`` when it cannot be read."""
    with path.open("rb") as file:
        if path.is_file() and path.stat().st_size > limit:
            raise TooLargeError(path, limit)
        data = file.read(limit + 1)
    if len(data) > limit:
        raise TooLargeError(path, limit)
    return data
