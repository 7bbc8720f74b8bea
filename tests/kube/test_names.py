"""Derived object names stay valid and distinct however long the inputs are."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.kube.names import MAX_NAME, bounded_name, engine_name, router_name

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
labels = st.from_regex(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)


def test_short_names_are_readable() -> None:
    """Short names are plain joins (unified roles add no suffix): the names users see in `kubectl
    get` and that the README documents."""
    assert engine_name("chat", "small", "unified") == "chat-small"
    assert engine_name("chat", "large", "decode") == "chat-large-decode"
    assert router_name("chat") == "chat-router"


def test_long_names_are_truncated_with_a_hash() -> None:
    """A 63-character service name still gives a 63-character DNS label, or the API server refuses
    the Deployment."""
    long = "a" * 63
    name = engine_name(long, "tier", "prefill")
    assert len(name) == MAX_NAME
    assert DNS_LABEL.match(name)


@given(labels, labels, st.sampled_from(["unified", "prefill", "decode"]))
def test_engine_names_are_dns_labels(service: str, tier: str, role: str) -> None:
    """Any valid service and tier names give a valid DNS-1035 label within the length limit (a
    trailing '-' after truncation would be refused)."""
    name = engine_name(service, tier, role)
    assert len(name) <= MAX_NAME
    assert DNS_LABEL.match(name), name


@given(labels, labels, labels)
def test_distinct_inputs_give_distinct_names(service: str, tier_a: str, tier_b: str) -> None:
    """Two tiers whose names differ only past the truncation point must not share a Deployment name
    (one would overwrite the other)."""
    if tier_a != tier_b:
        assert engine_name(service, tier_a, "decode") != engine_name(service, tier_b, "decode")


def test_names_are_stable() -> None:
    """A truncated name is pinned, not just equal to itself in one process: a salted hash()
    or a changed digest would rename every long-named Deployment on an operator restart or
    upgrade (new objects, the old ones pruned, every pod recreated)."""
    assert bounded_name("x" * 70, "y") == "x" * 54 + "-6f000f0c"
