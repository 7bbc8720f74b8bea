"""``fleetpilot engine --backend reference`` as a user runs it: a config file that cannot be
used, or a port that cannot be listened on, is one ``error:`` line and a non-zero exit, never
a traceback."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.cli import one_line_error

ENGINE = ("engine", "--backend", "reference", "--host", "127.0.0.1")


def test_model_config_not_utf8_names_the_file_and_byte(tmp_path: Path) -> None:
    """Regression: a Latin-1 --model-config file was a UnicodeDecodeError traceback."""
    path = tmp_path / "model.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    line = one_line_error(*ENGINE, "--model-config", str(path))
    assert line == f"error: --model-config: {path}: not UTF-8 text (byte 13: 0xe9)"


def test_model_config_100k_deep_is_one_line(tmp_path: Path) -> None:
    """Regression: a 100,000-deep --model-config JSON file was a RecursionError traceback."""
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = one_line_error(*ENGINE, "--model-config", str(path))
    assert line == f"error: --model-config: {path}: JSON nested deeper than 100 levels"


def test_model_config_file_larger_than_the_cap_is_refused_unread(tmp_path: Path) -> None:
    """A multi-MiB file given as --model-config (a weights file by mistake) is refused by its
    size."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * (2 << 20))
    line = one_line_error(*ENGINE, "--model-config", str(path))
    assert line == (
        f"error: --model-config: {path}: larger than 1048576 bytes (1 MiB), the most a "
        "--model-config file may be: is it the right file?"
    )


@contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another socket is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_engine_on_a_taken_port_is_one_line() -> None:
    """Regression: `fleetpilot engine` on a taken port printed a 30-line OSError traceback
    (`router` and `up` printed one line)."""
    with taken_port() as port:
        line = one_line_error(*ENGINE, "--port", str(port), "--model-config", "tiny", returncode=1)
    assert line == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_kv_event_publisher_on_a_taken_port_is_one_line() -> None:
    """The KV-event publisher's port taken: one line naming the endpoint, before the HTTP port
    is bound."""
    with taken_port() as port:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
        }
        line = one_line_error(
            *ENGINE, "--port", "0", "--model-config", "tiny",
            "--kv-events-config", json.dumps(events),
        )  # fmt: skip
    assert line.startswith("error: --kv-events-config: cannot bind: Address already in use")
    assert f"tcp://127.0.0.1:{port}" in line
