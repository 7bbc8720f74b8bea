"""One logging setup, and one JSON layout, for every fleetpilot process, the operator included.

The router, the reference engine, the autoscaler and the operator take the same
``--log-format``; JSON lines (the default) have the same keys whichever wrote them:
``timestamp`` (RFC 3339, UTC, milliseconds), ``level`` (debug, info, warning, error,
critical), ``logger``, ``message``, then the record's ``extra`` fields as keys of their own,
so a log pipeline can filter on ``replica`` or ``tier`` without parsing sentences, and
``exc_info`` for a traceback (inside the line). The operator's records of one object (kopf's
per-object loggers) also carry ``object``: the InferenceService's apiVersion, kind, namespace,
name and uid, as kopf's own JSON format names it. The formatting itself is python-json-logger's;
only the layout is ours, kept stable because log pipelines and tests read it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "plain")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The attributes kopf's per-object loggers (kopf._core.actions.loggers.ObjectLogger) add to a
# record: the object's reference (written as `object`), whether to skip posting it as a
# Kubernetes Event, and the operator's settings (not for a log line).
KOPF_REFERENCE = "k8s_ref"
_KOPF_ATTRS = frozenset({KOPF_REFERENCE, "k8s_skip", "settings"})
OBJECT_KEY = "object"


def _timestamp(created: float) -> str:
    """``2026-12-06T22:09:08.123Z``."""
    moment = datetime.fromtimestamp(created, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _FleetJsonFormatter(JsonFormatter):
    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_data, record, message_dict)
        reference = getattr(record, KOPF_REFERENCE, None)
        if isinstance(reference, dict):
            log_data[OBJECT_KEY] = {k: v for k, v in reference.items() if v is not None}

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        log_data["timestamp"] = _timestamp(float(log_data["timestamp"]))
        log_data["level"] = str(log_data["level"]).lower()
        return log_data


class _PlainFormatter(logging.Formatter):
    """PLAIN_FORMAT; a record of one object (kopf's) starts with ``[namespace/name]``."""

    def format(self, record: logging.LogRecord) -> str:
        reference = getattr(record, KOPF_REFERENCE, None)
        if not isinstance(reference, dict):
            return super().format(record)
        namespace, name = reference.get("namespace"), reference.get("name")
        prefix = f"[{namespace}/{name}]" if namespace else f"[{name}]"
        record = logging.makeLogRecord(record.__dict__)
        record.msg = f"{prefix} {record.msg}"
        return super().format(record)


def json_formatter() -> logging.Formatter:
    """One JSON object per line: timestamp, level, logger, message, the record's extras (and
    ``object`` for kopf's per-object records), exc_info."""
    return _FleetJsonFormatter(
        "{created}{levelname}{name}{message}",
        style="{",
        rename_fields={"created": "timestamp", "levelname": "level", "name": "logger"},
        reserved_attrs=[*RESERVED_ATTRS, *_KOPF_ATTRS],
        exc_info_as_array=False,
    )


def plain_formatter() -> logging.Formatter:
    return _PlainFormatter(PLAIN_FORMAT)


def add_log_arguments(parser: argparse.ArgumentParser, *, default_level: str = "info") -> None:
    parser.add_argument("--log-level", default=default_level, choices=LOG_LEVELS)
    parser.add_argument(
        "--log-format",
        default="json",
        choices=LOG_FORMATS,
        help="json: one object per line with structured fields (default); plain: text",
    )


def configure_logging(level: str, fmt: str) -> None:
    """Route every logger of the process to stderr in ``fmt`` at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else plain_formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def configure_operator_logging(fmt: str, *, verbose: bool) -> None:
    """The operator's logging, in place of ``kopf.configure``: the same layout as every other
    component's (kopf's own JSON would name its keys ``severity`` and no logger), at debug with
    ``verbose`` (every handler step) else info. As kopf.configure does, asyncio's own records
    stay out of the log."""
    configure_logging("debug" if verbose else "info", fmt)
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.propagate = False
    asyncio_logger.handlers[:] = [logging.NullHandler()]
