"""Every file the router reads is guarded (size, UTF-8, nesting, aliases): at start a bad one
is a one-line ``error:`` and a non-zero exit, never a traceback; at run time a bad
replacement is logged once, counted, and the router keeps serving with what it had."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from fleetpilot.api.router_config import AuthConfig, RouterConfig, TenantKeys
from fleetpilot.routing.auth import AuthGate
from fleetpilot.routing.config import ConfigWatcher
from fleetpilot.routing.discovery import FileSource
from fleetpilot.testing.polling import eventually
from tests.routing.support import make_config, router_process, stop_and_read_log, tier
from tests.support.cli import one_line_error

KEY = "sk-team-a-0123456789abcdef"


def _write_config(path: Path, *tiers: str) -> RouterConfig:
    config = make_config([tier(name, 1.0) for name in tiers])
    path.write_text(yaml.safe_dump(config.to_wire()))
    return config


def _replace(path: Path, data: bytes) -> None:
    """Swap ``path``'s content at once, as a ConfigMap update does (a rename), so the router
    never reads a half-written file."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_bytes(data)
    os.replace(staged, path)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The warnings captured; info records may be there too when an earlier test in the process
    turned the project's logging up (configure_logging)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def billion_laughs(key: str = "laughs") -> str:
    """The classic alias bomb: ten anchors, each a list of ten aliases of the one before -
    10^10 strings once expanded, from a file under 1 KiB."""
    lines = [f"  lol0: &lol0 [{', '.join(['lol'] * 10)}]"]
    lines += [f"  lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 10)}]" for i in range(1, 10)]
    return f"{key}:\n" + "\n".join(lines) + "\n"


DEEP_YAML = "service: " + "[" * 5000 + "]" * 5000 + "\n"
NOT_UTF8 = b"service: caf\xe9\n"


# -- at start: the CLI, as a user runs it --------------------------------------------------


def test_router_config_dev_zero_is_refused_at_the_size_cap() -> None:
    """Regression: `router --config /dev/zero` grew to 7.69 GB in 20 s and ended in a
    MemoryError traceback."""
    line = one_line_error("router", "--config", "/dev/zero")
    assert line == (
        "error: /dev/zero: larger than 1048576 bytes (1 MiB), the most a router config may "
        "be: is it the right file?"
    )


def test_router_config_5000_deep_is_one_line(tmp_path: Path) -> None:
    """Regression: a 5,000-deep YAML config was a RecursionError traceback."""
    path = tmp_path / "deep.yaml"
    path.write_text(DEEP_YAML)
    line = one_line_error("router", "--config", str(path))
    assert line == f"error: {path}: YAML nested deeper than 100 levels (at line 1, column 109)"


def test_router_config_not_utf8_names_the_byte(tmp_path: Path) -> None:
    """A Latin-1 config names the file and the offending byte's offset."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(NOT_UTF8)
    line = one_line_error("router", "--config", str(path))
    assert line == f"error: {path}: not UTF-8 text (byte 12: 0xe9)"


def test_router_config_alias_bomb_is_refused_by_its_expansion(tmp_path: Path) -> None:
    """A billion-laughs config is refused for what its aliases expand to, before anything
    walks the expansion."""
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs() + "service: chat\nnamespace: ml\ntiers: *lol9\n")
    line = one_line_error("router", "--config", str(path))
    assert line.startswith(f"error: {path}: YAML expands to more than 1048576 nodes")
    assert "aliases" in line


def test_endpoints_file_is_guarded_at_start(tmp_path: Path) -> None:
    """`--endpoints-file /dev/zero` and a too-deep endpoints file are one line each."""
    config = tmp_path / "router.yaml"
    _write_config(config, "small")
    base = ("router", "--config", str(config), "--discovery", "static", "--endpoints-file")
    line = one_line_error(*base, "/dev/zero")
    assert line.startswith("error: /dev/zero: larger than 1048576 bytes (1 MiB), the most an")
    deep = tmp_path / "endpoints.yaml"
    deep.write_text("endpoints: " + "[" * 5000 + "]" * 5000)
    line = one_line_error(*base, str(deep))
    assert line.startswith(f"error: {deep}: YAML nested deeper than 100 levels")


def test_api_key_files_are_guarded_at_start(tmp_path: Path) -> None:
    """A tenant's key file that is not UTF-8 (or is /dev/zero) stops the router at start,
    naming the file: started, it would refuse the tenant's every request."""
    keys = tmp_path / "a.keys"
    keys.write_bytes(KEY.encode() + b"\n\xff\n")
    config = make_config(
        [tier("small", 1.0)],
        auth=AuthConfig(tenants=[TenantKeys(name="a", key_files=[str(keys)])]),
    )
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config.to_wire()))
    line = one_line_error("router", "--config", str(path), "--discovery", "static")
    assert line == f"error: {keys}: not UTF-8 text (byte 27: 0xff)"


# -- at run time: reloads that cannot be used ---------------------------------------------


BAD_REPLACEMENTS: dict[str, Callable[[Path], None]] = {
    "not YAML": lambda p: _replace(p, b"service: [\n"),
    "too large": lambda p: _replace(p, b"#" * ((1 << 20) + 1)),
    "not UTF-8": lambda p: _replace(p, NOT_UTF8),
    "5,000 deep": lambda p: _replace(p, DEEP_YAML.encode()),
    "alias bomb": lambda p: _replace(p, (billion_laughs("x") + "tiers: *lol9\n").encode()),
}


@pytest.mark.parametrize("bad", list(BAD_REPLACEMENTS), ids=list(BAD_REPLACEMENTS))
def test_watcher_tells_a_refused_change_once_not_per_poll(
    tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A config replaced by one that cannot be used is one warning naming the file and the
    reason and one count, however many polls see it; the next good one is applied."""
    path = tmp_path / "router.yaml"
    _write_config(path, "a")
    applied: list[RouterConfig] = []
    results: list[str] = []
    watcher = ConfigWatcher(path, applied.append, on_result=results.append)
    BAD_REPLACEMENTS[bad](path)
    with caplog.at_level(logging.WARNING, logger="fleetpilot.routing.config"):
        for _ in range(3):
            assert not watcher.check()
    (warning,) = _warnings(caplog)
    assert warning.getMessage().startswith("config reload refused")
    assert warning.__dict__["path"] == str(path)
    assert warning.__dict__["reason"]
    assert results == ["invalid"]
    _replace(path, yaml.safe_dump(make_config([tier("b", 1.0)]).to_wire()).encode())
    assert watcher.check()
    assert [c.tiers[0].name for c in applied] == ["b"]
    assert results == ["invalid", "applied"]


def test_a_config_swapped_for_invalid_ones_at_run_time_is_logged_counted_and_ignored(
    tmp_path: Path,
) -> None:
    """Regression: a config replaced at run time by an invalid one was ignored without a log
    line (a 5,000-deep one killed the reload loop with it, silently, and the router then hung
    on SIGTERM). Now each bad replacement is one warning and one count of
    fleetpilot_router_config_reloads_total{result="invalid"}; the router keeps serving the
    last good config and applies the next good one."""
    path = tmp_path / "router.yaml"
    _write_config(path, "small")
    with router_process(path, extra=("--reload-interval", "0.05")) as (proc, port):
        url = f"http://127.0.0.1:{port}"

        def invalid_count() -> float:
            for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
                if line.startswith('fleetpilot_router_config_reloads_total{result="invalid"}'):
                    return float(line.split()[-1])
            return 0.0

        def served_models() -> list[str]:
            return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]

        for count, bad in enumerate(BAD_REPLACEMENTS, start=1):
            BAD_REPLACEMENTS[bad](path)
            _wait_for(invalid_count, float(count), f"{bad} counted")
            assert served_models() == ["chat", "small-model"]
        _replace(path, yaml.safe_dump(make_config([tier("large", 1.0)]).to_wire()).encode())
        _wait_for(served_models, ["chat", "large-model"], "the good config applied")
        lines = stop_and_read_log(proc, 30)
    refused = [line for line in lines if line["message"].startswith("config reload refused")]
    assert len(refused) == len(BAD_REPLACEMENTS)
    assert all(line["level"] == "warning" and line["path"] == str(path) for line in refused)
    assert [line["result"] for line in refused] == ["invalid"] * len(BAD_REPLACEMENTS)


def _wait_for(read: Callable[[], object], expected: object, what: str) -> None:
    """Poll until ``read()`` gives ``expected``; a generous deadline for a busy machine."""
    eventually(what, read, 60.0, until=lambda seen: seen == expected, interval=0.05)


def test_endpoints_file_refusals_are_told_once_and_keep_the_endpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The endpoints file replaced by one too large, not UTF-8 or too deep keeps the last
    endpoints, with one warning and one count per change."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(yaml.safe_dump({"endpoints": [{"tier": "a", "address": "10.0.0.1:80"}]}))
    results: list[str] = []
    source = FileSource(path, on_result=results.append)
    with caplog.at_level(logging.WARNING, logger="fleetpilot.routing.discovery"):
        for data in (b"#" * ((1 << 20) + 1), NOT_UTF8, b"endpoints: " + b"[" * 5000):
            _replace(path, data)
            assert not source.reload()
            assert not source.reload()
    assert [e.id for e in source.endpoints()] == ["10.0.0.1:80"]
    assert results == ["invalid"] * 3
    assert [r.__dict__["path"] for r in _warnings(caplog)] == [str(path)] * 3
    _replace(
        path, yaml.safe_dump({"endpoints": [{"tier": "a", "address": "10.0.0.2:80"}]}).encode()
    )
    assert source.reload()
    assert results[-1] == "applied"


def test_key_file_refusals_are_told_once_and_keep_the_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key file replaced by a non-UTF-8 one, or one that vanished, keeps the tenant's keys;
    each change is one warning (naming the file, never a key) and one count, not one per
    poll."""
    keys = tmp_path / "a.keys"
    keys.write_text(f"{KEY}\n")
    results: list[str] = []
    gate = AuthGate(
        AuthConfig(tenants=[TenantKeys(name="a", key_files=[str(keys)])]),
        on_result=results.append,
    )
    with caplog.at_level(logging.WARNING, logger="fleetpilot.routing.auth"):
        _replace(keys, KEY.encode() + b"\n\xff\n")
        gate.check()
        gate.check()
        keys.unlink()
        gate.check()
        gate.check()
    assert gate.ring is not None
    assert gate.ring.authenticate(f"Bearer {KEY}").name == "a"
    assert results == ["invalid", "unreadable"]
    assert [r.__dict__["file"] for r in _warnings(caplog)] == [str(keys)] * 2
    assert KEY not in caplog.text
