"""Suspicion before ejection (issue 41): a replica is passed over for new requests once a
request has waited a fraction of the first-byte budget there while its scrape or probe went
unanswered."""

from __future__ import annotations

import pytest

from fleetpilot.routing.policies.suspicion import FirstByteWaits, is_suspect


@pytest.mark.parametrize(
    ("scenario", "oldest", "silent", "suspect"),
    [
        ("frozen: a request waited 1.2 s, the scrape failed", 8.8, 9.5, True),
        ("exactly the threshold", 9.0, 9.5, True),
        ("slow but live: scrapes answer", 1.0, None, False),
        ("quiet: its scrape failed, nothing waits", None, 9.5, False),
        ("the wait is younger than the threshold", 9.5, 9.0, False),
    ],
)
def test_suspect_only_when_a_wait_and_a_silence_agree(
    scenario: str, oldest: float | None, silent: float | None, suspect: bool
) -> None:
    """A replica that answers its scrapes is never suspect however long its requests wait
    (a long generation), nor one with nothing waiting (its metrics endpoint may be the only
    thing broken); the first answer clears suspicion (silent back to None)."""
    assert is_suspect(10.0, oldest, silent, 1.0) is suspect, scenario


def test_first_byte_waits_report_the_oldest_still_waiting() -> None:
    """The oldest wait is the one that began first and has not ended, whichever ended."""
    waits = FirstByteWaits()
    first, second, third = waits.begin(1.0), waits.begin(2.0), waits.begin(3.0)
    assert waits.oldest() == 1.0
    waits.end(second)
    assert waits.oldest() == 1.0
    waits.end(first)
    assert waits.oldest() == 3.0
    waits.end(third)
    waits.end(third)  # ending twice is harmless
    assert (waits.oldest(), len(waits)) == (None, 0)


def test_a_wait_given_up_on_stays_evidence_until_the_replica_answers() -> None:
    """Requests moved off a frozen replica must not end its suspicion (new requests would go
    back to it and wait again): a given-up wait counts until the replica is heard from."""
    waits = FirstByteWaits()
    stuck, later = waits.begin(1.0), waits.begin(2.0)
    waits.end(stuck, given_up=True)
    waits.end(later)
    assert waits.oldest() == 1.0
    waits.heard_from()
    assert waits.oldest() is None
