"""Sampling parameters and the logits -> token step. Purely computational.

The order of the transforms follows vLLM: temperature, then top-k, then top-p. A temperature of
0 means greedy. The processed distribution (``probs_from_logits``) is also what speculative
decoding compares between draft and target, so both sides go through the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature, sampling is greedy: dividing logits by ~0 overflows, and vLLM uses the
# same cut-off.
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop logic (OpenAI request fields)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids: the only tokens the request may generate (empty: all).
    allowed_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids contains out-of-vocab token id!")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def restrict(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` with every token outside ``allowed_token_ids`` impossible (-inf)."""
    if not params.allowed_token_ids:
        return logits
    # The engine refused ids past the vocabulary when the request came in.
    allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)
    mask = torch.full_like(logits, float("-inf"))
    mask[..., allowed] = 0.0
    return logits + mask


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of ``logits`` [n, vocab] -> the distribution the request samples from [n, vocab].

    Greedy requests get a one-hot distribution on the argmax, which makes speculative
    verification with rejection sampling reduce to "accept iff the draft equals the argmax".
    """
    logits = restrict(logits.float(), params)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass strictly
        # before it is below top_p (so the most likely token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """One token per row of ``probs`` [n, vocab]."""
    return [int(t) for t in torch.multinomial(probs, 1, generator=generator).view(-1)]


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """One token per row of ``logits``; greedy rows consume no randomness."""
    logits = restrict(logits, params)
    if params.greedy:
        return [int(t) for t in logits.argmax(dim=-1)]
    return sample_from_probs(probs_from_logits(logits, params), generator)
