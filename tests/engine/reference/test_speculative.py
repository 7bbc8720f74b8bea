"""Speculative decoding: exact target distribution, identical greedy output."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from fleetpilot.engine.reference import (
    EngineConfig,
    LlamaModel,
    LLMEngine,
    SamplingParams,
    SpeculativeConfig,
)
from fleetpilot.engine.reference.speculative import rejection_sample, verify_greedy
from tests.engine.reference.conftest import TINY, EngineFactory


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), by the Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: Counter[int], probs: dict[int, float], n: int) -> tuple[float, int]:
    """Pearson's statistic, with outcomes of expected count < 5 pooled into one bin."""
    stat, df = 0.0, -1
    small_obs, small_exp = 0, 0.0
    for outcome, p in probs.items():
        if n * p < 5:
            small_obs += counts[outcome]
            small_exp += n * p
            continue
        stat += (counts[outcome] - n * p) ** 2 / (n * p)
        df += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / max(small_exp, 1e-9)
        df += 1
    assert sum(counts.values()) == n
    assert set(counts) <= set(probs)
    return stat, df


def test_verify_greedy_accepts_the_matching_prefix() -> None:
    """Greedy verification keeps drafts while they equal the target's argmax, then corrects."""
    assert verify_greedy([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert verify_greedy([4, 5], [4, 5, 7]) == [4, 5, 7]  # all accepted + bonus
    assert verify_greedy([3], [4, 0]) == [4]


def test_rejection_sampler_emits_the_target_distribution() -> None:
    """Drafts from q, verified against p: the first emitted token follows p_1 and the second
    (when the first draft was accepted) follows p_2, however far q is from p."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    n = 12_000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = rejection_sample(drafts, q, p, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    stat, df = chi_square(first, dict(enumerate(p[0].tolist())), n)
    assert stat < chi_square_critical(df)
    m = sum(second.values())
    stat, df = chi_square(second, dict(enumerate(p[1].tolist())), m)
    assert stat < chi_square_critical(df)
    # Power check: the draft's own law is far from p, so the same test rejects it.
    stat_q, df_q = chi_square(first, dict(enumerate(q[0].tolist())), n)
    assert stat_q > 10 * chi_square_critical(df_q)


def test_rejection_sampler_validates_shapes() -> None:
    """k drafts need k draft rows and k + 1 target rows."""
    with pytest.raises(ValueError, match="2 draft tokens"):
        rejection_sample([1, 2], torch.ones(2, 4) / 4, torch.ones(2, 4) / 4, None)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_identical_with_and_without_speculation(
    make_engine: EngineFactory, k: int
) -> None:
    """Speculation with an early-exit draft never changes greedy tokens, and does accept some."""
    prompts = ["Speculative decoding", "is exact", "for greedy requests too", "!" * 30]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = make_engine().generate(prompts, params)
    spec_engine = make_engine(speculative=SpeculativeConfig(num_speculative_tokens=k))
    spec = spec_engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = spec_engine.stats()
    assert (
        0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    )
    assert stats.forward_passes_total < 40  # fewer target passes than tokens per request


def test_sampled_output_distribution_equals_the_target_model() -> None:
    """With temperature sampling, tokens 2-4 (produced by drafts, verification, corrections and
    bonus tokens) follow the target model's exact distribution, computed from its dense forward
    pass: the marginal of token 2 and the joints of tokens 2-3 and 2-4 all pass a chi-square
    test at the 0.1% level, while the same test rejects the draft model's distribution."""
    vocab = 6
    # A flatter, deeper-differing model than the default: the draft then disagrees often
    # (acceptance ~75%), so corrections from the residual distribution carry real weight.
    config = replace(TINY, vocab_size=vocab, init_logit_std=1.5, init_residual_std=0.5)
    model = LlamaModel(config)
    prompt = [1, 2, 3, 4, 5, 0, 1]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    engine = LLMEngine(
        EngineConfig(
            num_kv_blocks=1024,
            max_model_len=32,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            speculative=SpeculativeConfig(num_speculative_tokens=2, draft_num_layers=1),
            seed=1,
        ),
        model,
    )
    n = 4000
    for i in range(n):
        engine.add_request(f"r{i}", prompt, params)
    samples: list[tuple[int, ...]] = []
    while engine.has_unfinished_requests():
        samples += [out.token_ids[1:4] for out in engine.step() if out.finished]
    stats = engine.stats()
    drafted = stats.spec_decode_num_draft_tokens_total
    assert drafted >= 2 * n  # every request's first decode step verified two drafts
    assert 0.5 * drafted < stats.spec_decode_num_accepted_tokens_total < 0.9 * drafted

    def laws(num_layers: int | None) -> list[dict[int, float]]:
        """Exact P(t2), P(t2, t3), P(t2, t3, t4) by the chain rule, summed over t1 (which the
        target samples at prefill). Outcomes are encoded base ``vocab``."""

        def probs(ids: list[int], layers: int | None = num_layers) -> list[float]:
            logits = model.forward_dense(torch.tensor(ids), num_layers=layers)[-1]
            return [float(x) for x in torch.softmax(logits.double(), -1)]

        out = [dict.fromkeys(range(vocab**d), 0.0) for d in (1, 2, 3)]
        p1 = probs(prompt, None)
        for t1 in range(vocab):
            p2 = probs([*prompt, t1])
            for t2 in range(vocab):
                out[0][t2] += p1[t1] * p2[t2]
                p3 = probs([*prompt, t1, t2])
                for t3 in range(vocab):
                    out[1][t2 * vocab + t3] += p1[t1] * p2[t2] * p3[t3]
                    p4 = probs([*prompt, t1, t2, t3])
                    for t4, p in enumerate(p4):
                        out[2][(t2 * vocab + t3) * vocab + t4] += p1[t1] * p2[t2] * p3[t3] * p
        return out

    def encode(t: tuple[int, ...]) -> int:
        return sum(x * vocab**i for i, x in enumerate(reversed(t)))

    observed = [Counter(encode(t[:d]) for t in samples) for d in (1, 2, 3)]
    for counts, law in zip(observed, laws(None), strict=True):
        stat, df = chi_square(counts, law, n)
        assert stat < chi_square_critical(df)
    for counts, law in zip(observed, laws(1), strict=True):
        stat, df = chi_square(counts, law, n)
        assert stat > 5 * chi_square_critical(df)
