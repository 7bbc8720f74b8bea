"""One logging setup for every fleetpilot process (operator aside: kopf configures its own).

The router, the reference engine and the autoscaler take the same two flags, ``--log-level``
and ``--log-format``; JSON lines (the default) carry a record's ``extra`` fields as keys, so a
log pipeline can filter on ``replica`` or ``tier`` without parsing sentences. The formatting
itself is python-json-logger's; only the key names are ours (``ts``, ``level``, ``logger``,
``msg``), kept stable because tests and dashboards read them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "plain")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _FleetJsonFormatter(JsonFormatter):
    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        log_data["ts"] = round(float(log_data["ts"]), 3)
        log_data["level"] = str(log_data["level"]).lower()
        return log_data


def json_formatter() -> logging.Formatter:
    """One JSON object per line: ts, level, logger, msg, the record's extras, exc_info."""
    return _FleetJsonFormatter(
        "{created}{levelname}{name}{message}",
        style="{",
        rename_fields={"created": "ts", "levelname": "level", "name": "logger", "message": "msg"},
        exc_info_as_array=False,
    )


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
    handler.setFormatter(json_formatter() if fmt == "json" else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
