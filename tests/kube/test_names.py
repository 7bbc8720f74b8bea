"""Derived object names stay valid and distinct however long the inputs are."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.kube.names import MAX_NAME, bounded_name, engine_name, router_name

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
labels = st.from_regex(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)


def test_short_names_are_readable() -> None:
    assert engine_name("chat", "small", "unified") == "chat-small"
    assert engine_name("chat", "large", "decode") == "chat-large-decode"
    assert router_name("chat") == "chat-router"


def test_long_names_are_truncated_with_a_hash() -> None:
    long = "a" * 63
    name = engine_name(long, "tier", "prefill")
    assert len(name) == MAX_NAME
    assert DNS_LABEL.match(name)


@given(labels, labels, st.sampled_from(["unified", "prefill", "decode"]))
def test_engine_names_are_dns_labels(service: str, tier: str, role: str) -> None:
    name = engine_name(service, tier, role)
    assert len(name) <= MAX_NAME
    assert DNS_LABEL.match(name), name


@given(labels, labels, labels)
def test_distinct_inputs_give_distinct_names(service: str, tier_a: str, tier_b: str) -> None:
    if tier_a != tier_b:
        assert engine_name(service, tier_a, "decode") != engine_name(service, tier_b, "decode")


def test_names_are_stable() -> None:
    assert bounded_name("x" * 70, "y") == bounded_name("x" * 70, "y")
