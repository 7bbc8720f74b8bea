"""The kopf shell's own decisions (its behaviour is tested end to end in e2e/test_operator.py)."""

from __future__ import annotations

from fleetpilot.operator.handlers import retry_delay


def test_retry_backoff_is_exponential_and_capped() -> None:
    """Retryable API errors (409, 429, 5xx) back off 1s, 2s, 4s ... never beyond a minute."""
    assert [retry_delay(n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_delay(30) == 60.0
