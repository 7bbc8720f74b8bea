"""What the router just sent where: held as about to be cached until the engine reports the
blocks or the TTL passes, bounded per replica."""

from __future__ import annotations

import pytest

from fleetpilot.routing.policies.recent import RecentSends

KEYS = [bytes([i]) * 16 for i in range(6)]


def test_sent_blocks_match_until_the_ttl_passes() -> None:
    """A prompt sent at t=0 matches its leading keys on that replica only, until t=ttl."""
    recent = RecentSends(ttl_s=2.0)
    recent.record("a", KEYS[:4], now=0.0)
    assert recent.matched("a", KEYS, now=1.0) == 4
    assert recent.matched("b", KEYS, now=1.0) == 0
    assert recent.matched("a", KEYS, now=2.0) == 0


def test_a_resend_refreshes_and_expired_entries_are_dropped() -> None:
    """Sending again renews the TTL; expired keys leave the map at the next record."""
    recent = RecentSends(ttl_s=2.0)
    recent.record("a", KEYS[:2], now=0.0)
    recent.record("a", KEYS[:1], now=1.5)
    assert recent.matched("a", KEYS, now=2.5) == 1
    recent.record("a", KEYS[4:5], now=3.0)
    assert recent.size("a") == 2  # KEYS[1] expired and was dropped; KEYS[0] lives until 3.5


def test_confirmed_blocks_are_left_to_the_events() -> None:
    """Blocks the engine reported stored are no longer held here: a later eviction the
    events report must not be hidden by a stale 'just sent'."""
    recent = RecentSends(ttl_s=10.0)
    recent.record("a", KEYS[:3], now=0.0)
    recent.confirm("a", KEYS[:3])
    assert recent.matched("a", KEYS, now=1.0) == 0
    recent.confirm("unknown", KEYS)  # a replica never sent to: nothing to do


def test_the_bound_holds_and_departed_replicas_are_forgotten() -> None:
    """At most max_keys per replica (the oldest go first); retain drops replicas that left."""
    recent = RecentSends(ttl_s=10.0, max_keys=3)
    recent.record("a", KEYS, now=0.0)
    assert recent.size("a") == 3
    assert recent.matched("a", KEYS, now=1.0) == 3  # the head is kept, the tail trimmed
    recent.record("b", KEYS[:1], now=0.0)
    recent.retain(["b"])
    assert (recent.size("a"), recent.size("b")) == (0, 1)
    with pytest.raises(ValueError, match="ttl_s"):
        RecentSends(ttl_s=0)
