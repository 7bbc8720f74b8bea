"""One log setup for the router, the engine and the autoscaler: JSON lines with stable keys."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from fleetpilot.logs import add_log_arguments, configure_logging, json_formatter


def _record(message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("fleetpilot.routing", logging.WARNING, "x", 1, message, args, None)


def test_json_log_lines_carry_extras() -> None:
    """A log record becomes one JSON object with its structured fields under stable keys."""
    record = _record("replica %s ejected", "b")
    record.replica = "10.0.0.1:8000"
    line = json.loads(json_formatter().format(record))
    assert (line["level"], line["logger"], line["msg"], line["replica"]) == (
        "warning",
        "fleetpilot.routing",
        "replica b ejected",
        "10.0.0.1:8000",
    )
    assert isinstance(line["ts"], float)


def test_an_exception_stays_inside_its_json_line() -> None:
    """A traceback must not break the one-object-per-line contract log shippers rely on."""
    record = _record("scrape failed")
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError:
        record.exc_info = sys.exc_info()
    text = json_formatter().format(record)
    assert "\n" not in text
    assert "ZeroDivisionError" in json.loads(text)["exc_info"]


@pytest.fixture
def restored_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restored_root_logger")
def test_flags_choose_format_and_level(capsys: pytest.CaptureFixture[str]) -> None:
    """--log-format plain --log-level warning: info is dropped, warnings are plain text."""
    parser = argparse.ArgumentParser()
    add_log_arguments(parser)
    args = parser.parse_args(["--log-format", "plain", "--log-level", "warning"])
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("fleetpilot.test").info("hidden")
    logging.getLogger("fleetpilot.test").warning("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "WARNING fleetpilot.test: shown" in err
    assert parser.parse_args([]).log_format == "json"
