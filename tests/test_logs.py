"""One log setup for the router, the engine, the autoscaler and the operator: JSON lines with
the same stable keys whichever component wrote them."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import kopf
import pytest

from fleetpilot.logs import (
    add_log_arguments,
    configure_logging,
    configure_operator_logging,
    json_formatter,
)


def _record(message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("fleetpilot.routing", logging.WARNING, "x", 1, message, args, None)


def test_json_log_lines_carry_extras() -> None:
    """A log record becomes one JSON object with its structured fields under stable keys."""
    record = _record("replica %s ejected", "b")
    record.replica = "10.0.0.1:8000"
    line = json.loads(json_formatter().format(record))
    assert (line["level"], line["logger"], line["message"], line["replica"]) == (
        "warning",
        "fleetpilot.routing",
        "replica b ejected",
        "10.0.0.1:8000",
    )
    assert list(line)[:4] == ["timestamp", "level", "logger", "message"]
    assert abs(datetime.fromisoformat(line["timestamp"]).timestamp() - record.created) < 0.001


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
    root, asyncio_logger = logging.getLogger(), logging.getLogger("asyncio")
    handlers, level = root.handlers[:], root.level
    asyncio_handlers, asyncio_propagates = asyncio_logger.handlers[:], asyncio_logger.propagate
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    asyncio_logger.handlers[:] = asyncio_handlers
    asyncio_logger.propagate = asyncio_propagates


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


SERVICE: kopf.RawBody = {
    "apiVersion": "fleetpilot.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"namespace": "ml", "name": "chat", "uid": "0d9a-42"},
}


def _lines(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


@pytest.mark.usefixtures("restored_root_logger")
def test_the_operator_and_the_router_write_one_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """A record from each path, as each process sets its logging up: the router's (and the
    engine's, the autoscaler's) configure_logging, and the operator's in place of kopf's -
    with a record from kopf's own per-object logger, which carries the object and kopf's
    internals. Both lines have the same keys in the same order, the same level words, and
    their extras; kopf's own layout (severity, no logger) and its internals are not there."""
    configure_logging("info", "json")
    logging.getLogger("fleetpilot.routing").warning("replica ejected", extra={"replica": "b"})
    (router,) = _lines(capsys.readouterr().err)

    configure_operator_logging("json", verbose=False)
    objects = kopf.ObjectLogger(body=kopf.Body(SERVICE), settings=kopf.OperatorSettings())
    objects.warning("plan refused", extra={"tier": "small"})
    logging.getLogger("fleetpilot.operator.handlers").debug("hidden without --verbose")
    logging.getLogger("asyncio").warning("kopf keeps asyncio's records out; so do we")
    (operator,) = _lines(capsys.readouterr().err)

    layout = ["timestamp", "level", "logger", "message"]
    assert list(router)[:4] == list(operator)[:4] == layout
    assert {k: router[k] for k in layout[1:]} == {
        "level": "warning",
        "logger": "fleetpilot.routing",
        "message": "replica ejected",
    }
    assert router["replica"] == "b"
    assert {k: operator[k] for k in layout[1:]} == {
        "level": "warning",
        "logger": "kopf.objects",
        "message": "plan refused",
    }
    assert operator["tier"] == "small"
    assert operator["object"] == {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "namespace": "ml",
        "name": "chat",
        "uid": "0d9a-42",
    }
    assert set(operator) == {*layout, "tier", "object"}
    for line in (router, operator):
        assert datetime.fromisoformat(line["timestamp"]).tzinfo == UTC
        assert line["timestamp"].endswith("Z")


@pytest.mark.usefixtures("restored_root_logger")
def test_the_operator_logs_debug_when_verbose_and_plain_names_the_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_operator_logging("plain", verbose=True)
    objects = kopf.ObjectLogger(body=kopf.Body(SERVICE), settings=kopf.OperatorSettings())
    objects.debug("handler step")
    logging.getLogger("fleetpilot.operator").info("started")
    err = capsys.readouterr().err
    assert "DEBUG kopf.objects: [ml/chat] handler step" in err
    assert "INFO fleetpilot.operator: started" in err
