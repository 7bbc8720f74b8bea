"""The kopf shell's own decisions (its behaviour is tested end to end in e2e/test_operator.py)."""

from __future__ import annotations

import logging

import pytest

from fleetpilot.operator.handlers import (
    DEPLOYMENT_CHANGED,
    POD_CHANGED,
    SERVICE_EVENT,
    QuietWatchHandlers,
    build_registry,
    retry_delay,
)


def test_retry_backoff_is_exponential_and_capped() -> None:
    """Retryable API errors (409, 429, 5xx) back off 1s, 2s, 4s ... never beyond a minute."""
    assert [retry_delay(n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_delay(30) == 60.0


def test_only_the_watch_handlers_success_lines_are_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A line per pod event is noise; a reconcile's success and any failure are not."""
    logger = logging.getLogger("kopf.objects.test-quiet")
    logger.addFilter(QuietWatchHandlers())
    with caplog.at_level(logging.INFO, logger="kopf.objects.test-quiet"):
        logger.info(f"Handler {POD_CHANGED!r} succeeded.")
        logger.info(f"Handler {DEPLOYMENT_CHANGED!r} succeeded.")
        logger.info("Handler 'reconcile_service' succeeded.")
        logger.error(f"Handler {POD_CHANGED!r} failed with an exception and will stop now: boom")
    assert [r.getMessage() for r in caplog.records] == [
        "Handler 'reconcile_service' succeeded.",
        "Handler 'pod-changed' failed with an exception and will stop now: boom",
    ]


def test_the_quiet_ids_are_the_registered_handlers_ids() -> None:
    """The filter matches by handler id: a renamed handler would log again unnoticed."""
    registry = build_registry()
    # kopf has no public listing of a registry's handlers.
    ids = {handler.id for handler in registry._watching.get_all_handlers()}
    assert {SERVICE_EVENT, POD_CHANGED, DEPLOYMENT_CHANGED} <= ids
