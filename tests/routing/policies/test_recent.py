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


def test_holders_name_the_replicas_sent_a_prompts_keys_at_the_deepest_they_were_sent() -> None:
    """Where to look for a prompt in a large group: every replica sent some of its keys within
    the TTL, with the deepest such key; only depths over ``above``; confirmed, expired,
    trimmed and dropped replicas' keys leave it."""
    recent = RecentSends(ttl_s=2.0, max_keys=4)
    recent.record("a", KEYS[:4], now=0.0)
    recent.record("b", KEYS[:2], now=0.5)
    recent.record("c", KEYS[5:6], now=0.5)
    assert recent.holders(KEYS, now=1.0) == {"a": 4, "b": 2, "c": 6}
    assert recent.holders(KEYS[:5], now=1.0, above=2) == {"a": 4}
    assert recent.holders(KEYS, now=2.2) == {"b": 2, "c": 6}  # a's expired
    recent.confirm("b", KEYS[1:2])
    assert recent.holders(KEYS[:3], now=1.0) == {"a": 3, "b": 1}
    recent.record("a", KEYS[4:6], now=1.0)  # over max_keys: a's oldest (the tail first) go
    assert recent.size("a") == 4
    assert recent.holders(KEYS[2:4], now=1.5) == {}
    assert recent.holders(KEYS[:2], now=1.5) == {"a": 2, "b": 1}
    assert recent.holders(KEYS, now=1.5) == {"a": 6, "b": 1, "c": 6}
    recent.retain(["a"])
    assert recent.holders(KEYS, now=1.5) == {"a": 6}
