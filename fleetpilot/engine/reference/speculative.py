"""Speculative decoding: verification by rejection sampling. Purely computational.

A draft proposes tokens d_1..d_k, each sampled from its distribution q_i; the target scores all
of them in one forward pass, giving p_1..p_{k+1}. Draft token d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the step emits a token drawn from the
residual norm(max(0, p_i - q_i)) and stops; if all k are accepted it emits a bonus token from
p_{k+1}. Every emitted token is then distributed exactly as the target alone would sample it
(Leviathan et al. 2023, Chen et al. 2023), so speculation changes speed, never outputs' law.

``p`` and ``q`` are the *processed* distributions (temperature, top-k, top-p applied, see
``sampling.probs_from_logits``). For greedy requests both are one-hot and the rule reduces to
"accept while the draft equals the target's argmax, then emit the target's argmax".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft = the target's first ``draft_num_layers`` layers (early exit, shares the KV pool)."""

    num_speculative_tokens: int = 4
    draft_num_layers: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        if self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be at least 1, got {self.draft_num_layers}")


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Tokens emitted for a greedy request: the matching draft prefix, then the target's token.

    ``target_argmax`` has ``len(draft_tokens) + 1`` entries.
    """
    out: list[int] = []
    for d, t in zip(draft_tokens, target_argmax, strict=False):
        if d != t:
            break
        out.append(d)
    out.append(int(target_argmax[len(out)]))
    return out


def rejection_sample(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens emitted for one request: accepted drafts, then one corrected or bonus token.

    ``draft_probs`` [k, vocab] are the q_i the drafts were sampled from; ``target_probs``
    [k + 1, vocab] the target's p_i at the same positions plus the bonus position.
    """
    k = len(draft_tokens)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"{k} draft tokens need {k} draft and {k + 1} target rows, got "
            f"{draft_probs.shape[0]} and {target_probs.shape[0]}"
        )
    out: list[int] = []
    if k:
        p_d = target_probs[torch.arange(k), torch.tensor(list(draft_tokens))]
        q_d = draft_probs[torch.arange(k), torch.tensor(list(draft_tokens))]
        u = torch.rand(k, generator=generator, dtype=torch.float64)
        # u < p/q written as u * q < p: no division, and q = 0 (a draft token its own
        # distribution excludes, impossible unless the caller is wrong) is always rejected.
        accept = (u * q_d.double() < p_d.double()).tolist()
        for i, d in enumerate(draft_tokens):
            if not accept[i]:
                residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
                total = float(residual.sum())
                # p == q leaves no residual mass, but then rejection has probability 0; fall back
                # to p for float round-off.
                dist = residual / total if total > 0 else target_probs[i]
                out.append(int(torch.multinomial(dist, 1, generator=generator)))
                return out
            out.append(int(d))
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
