"""The workloads: seeded, deterministic, shaped as their names promise."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from fleetpilot.loadgen.workloads import (
    _WORDS,
    WORKLOADS,
    ModelMix,
    RequestSpec,
    make_workload,
    words,
)


def take(name: str, seed: int, n: int = 50) -> list[RequestSpec]:
    workload = make_workload(name, seed)
    return [workload.next() for _ in range(n)]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    """Every workload replays exactly under one seed and differs under another, so two benchmark
    runs compare like with like."""
    assert take(name, 7) == take(name, 7)
    assert take(name, 7) != take(name, 8)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bodies_stream_and_ask_for_usage(name: str) -> None:
    """Request bodies stream and ask for usage (TTFT, TPOT and cached tokens come from them);
    ignore_eos only when asked, since OpenAI's API refuses it."""
    body = take(name, 1, 1)[0].body("m")
    assert body["model"] == "m"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body  # OpenAI refuses it: only on request
    assert take(name, 1, 1)[0].body("m", ignore_eos=True)["ignore_eos"] is True


def test_shared_prefix_reuses_a_few_system_prompts() -> None:
    """shared-prefix sends a few long system prompts, each user sticking to one tenant's prompt: the
    traffic prefix-affinity routing is measured on."""
    specs = take("shared-prefix", 3, 200)
    systems = {s.messages[0]["content"] for s in specs}
    assert len(systems) == 4
    assert all(len(s) > 1000 for s in systems)
    users = {s.tags["user"] for s in specs}
    assert len(users) > 30
    # A user always talks to the same tenant's prompt.
    tenant_of: dict[str, str] = {}
    for s in specs:
        assert tenant_of.setdefault(s.tags["user"], s.tags["tenant"]) == s.tags["tenant"]


def test_shared_prefix_tenant_skew_makes_a_few_tenants_hot() -> None:
    """With a Zipf skew the hottest tenant takes about 1 / H(tenants, s) of the requests (12
    tenants at s = 1.1: ~0.30), which tenant that is depends on the seed, users still stick to
    their tenant, and the system prompts take the length asked for."""
    hottest: set[str] = set()
    for seed in range(4):
        workload = make_workload(
            "shared-prefix", seed, tenants=12, tenant_skew=1.1, system_chars=4000
        )
        specs = [workload.next() for _ in range(3000)]
        counts = Counter(s.tags["tenant"] for s in specs)
        (top, n), *_ = counts.most_common()
        hottest.add(top)
        expected = 1.0 / sum(1.0 / (k + 1) ** 1.1 for k in range(12))
        assert abs(n / len(specs) - expected) < 0.04
        assert len(counts) == 12
        tenant_of: dict[str, str] = {}
        system_of: dict[str, str] = {}
        for s in specs:
            assert tenant_of.setdefault(s.tags["user"], s.tags["tenant"]) == s.tags["tenant"]
            system = s.messages[0]["content"]
            assert system_of.setdefault(s.tags["tenant"], system) == system
        assert all(4000 <= len(system) <= 4100 for system in system_of.values())
    assert len(hottest) > 1  # the hot tenant is drawn, not always tenant 0


def test_shared_prefix_without_skew_weighs_tenants_alike() -> None:
    specs = take("shared-prefix", 3, 4000)
    counts = Counter(s.tags["tenant"] for s in specs)
    assert max(counts.values()) < 1.15 * min(counts.values())
    with pytest.raises(ValueError, match="tenant skew"):
        make_workload("shared-prefix", 0, tenant_skew=-1.0)


def test_multi_turn_history_grows_per_user_and_restarts() -> None:
    """multi-turn resends each user's growing history (a prefix of the next request) and starts over
    after the last turn."""
    workload = make_workload("multi-turn", 5, users=1, turns=3)
    specs = [workload.next() for _ in range(4)]
    assert [s.kind for s in specs] == ["turn-1", "turn-2", "turn-3", "turn-1"]
    for prev, cur in itertools.pairwise(specs[:3]):
        assert cur.messages[: len(prev.messages)] == prev.messages  # a growing prefix
        assert [m["role"] for m in cur.messages[len(prev.messages) :]] == ["assistant", "user"]
    assert len(specs[3].messages) == 2


def test_mixed_has_short_easy_and_long_hard_requests() -> None:
    """mixed sends mostly short easy requests and about 30% long hard ones with more tokens: the
    traffic complexity routing splits between tiers."""
    specs = take("mixed", 11, 400)
    easy = [s for s in specs if s.kind == "easy"]
    hard = [s for s in specs if s.kind == "hard"]
    assert 0.2 < len(hard) / len(specs) < 0.4
    assert max(len(s.messages[0]["content"]) for s in easy) < 100
    assert min(len(s.messages[0]["content"]) for s in hard) > 500
    assert {s.max_tokens for s in easy} == {16}
    assert {s.max_tokens for s in hard} == {128}


def test_long_context_length_is_configurable() -> None:
    """long-context's prompt length follows --context-chars."""
    spec = make_workload("long-context", 0, context_chars=3000).next()
    assert 3000 < len(spec.messages[0]["content"]) < 3200


def test_unknown_workload_and_bad_options_are_refused() -> None:
    """An unknown workload name lists the known ones; out-of-range options are refused, not
    clamped."""
    with pytest.raises(ValueError, match=r"unknown workload 'nope'; known: long-context"):
        make_workload("nope", 0)
    with pytest.raises(ValueError, match="hard_fraction"):
        make_workload("mixed", 0, hard_fraction=1.5)
    with pytest.raises(ValueError, match="at least 1"):
        make_workload("shared-prefix", 0, tenants=0)


def _words_by_choice(rng: random.Random, chars: int) -> str:
    """``words`` as it was written, one ``rng.choice`` a word: the oracle of its fast draw."""
    out: list[str] = []
    size = 0
    while True:
        word = rng.choice(_WORDS)
        if size + len(word) + 1 > chars:
            return " ".join(out)
        out.append(word)
        size += len(word) + 1


@pytest.mark.parametrize("seed", range(20))
def test_words_draw_as_random_choice_does(seed: int) -> None:
    """The fast word draw gives the texts (and leaves the generator in the state) that
    ``random.choice`` would, so a seed names the same requests as before it."""
    fast, oracle = random.Random(seed), random.Random(seed)
    for chars in (0, 1, 7, 80, 1200, 6000):
        assert words(fast, chars) == _words_by_choice(oracle, chars)
    assert fast.random() == oracle.random()


def test_a_model_mix_is_seeded_per_request_and_zipf_popular() -> None:
    """A request's model depends on the seed and its index only; the first model is the most
    asked for, roughly 1/k^skew of it for the k-th; skew 0 asks for each alike; an empty mix
    or a skew out of range is refused."""
    mix = ModelMix(tuple(f"a{k}" for k in range(4)), 1.0, seed=7)
    assert [mix.model(i) for i in range(50)] == [mix.model(i) for i in range(50)]
    assert [mix.model(i) for i in range(50)] != [
        ModelMix(mix.models, 1.0, 8).model(i) for i in range(50)
    ]
    counts = Counter(mix.model(i) for i in range(20_000))
    share = counts["a0"] / 20_000
    assert 0.45 < share < 0.51  # 1 / (1 + 1/2 + 1/3 + 1/4) = 0.48
    assert counts["a0"] > counts["a1"] > counts["a2"] > counts["a3"]
    flat = Counter(ModelMix(mix.models, 0.0, 7).model(i) for i in range(20_000))
    assert all(0.23 < n / 20_000 < 0.27 for n in flat.values())
    with pytest.raises(ValueError, match="at least one"):
        ModelMix((), 1.0)
    with pytest.raises(ValueError, match="skew"):
        ModelMix(("a",), -1.0)
