"""What the calibration measures (pure: no I/O): the closed-loop loads on the step recorder, the
lone requests, P/D hand-offs and router pairs between them, and the prompts they send - each
unlike any other, so steps compute every prompt token unless a load shares a prefix on purpose.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fleetpilot.loadgen.workloads import RequestSpec, words


@dataclass(frozen=True)
class Load:
    """One closed-loop load on the step recorder."""

    concurrency: int
    prompt_chars: int
    max_tokens: int  # the middle of each request's answer length (0.5x..1.5x)
    requests: int
    # A prefix of this many characters every prompt of the load starts with (cached after the
    # first few): steps whose prompts attend to a cached prefix.
    shared_chars: int = 0


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    loads: tuple[Load, ...]
    # One lone request / P/D hand-off each, spread over the gaps between loads.
    ttft_chars: tuple[int, ...]
    pull_chars: tuple[int, ...]
    # Lone requests through a router and straight to its engine, one of each a size.
    router_chars: tuple[int, ...]
    tokenize_per_workload: int
    # Launches of the real command; with none, the step recorder's own launch stands in (the
    # same engine, plus the recorder module's imports: ~0.5 s more), to keep quick runs quick.
    cold_starts: int


# Longest prompt: 1800 characters + framing stays under 2048 tokens with 1.5 x 64 answer tokens.
FULL = Plan(
    loads=tuple(
        Load(c, chars, max_tokens, requests=2 * c)
        for c in (1, 2, 4, 8, 12, 16)
        for chars, max_tokens in ((40, 128), (500, 96), (1800, 64))
    )
    # Questions after a cached prefix (a system prompt, a chat's history): the bench
    # workloads' shape. At most 1,300 + 400 characters and 1.5 x 64 answer tokens: under 2048.
    + tuple(
        Load(c, chars, 64, requests=3 * c, shared_chars=shared)
        for c in (1, 4, 12)
        for chars, shared in ((40, 600), (400, 600), (40, 1300), (400, 1300))
    ),
    # Mostly short and medium prompts, as the bench workloads' uncached parts are: the median
    # gap is what the simulator adds to every first token.
    ttft_chars=(40, 120, 240, 500, 960, 1500) * 4,
    pull_chars=(120, 500, 1000, 1500) * 3,
    router_chars=(40, 240, 500, 960) * 4,
    tokenize_per_workload=200,
    cold_starts=3,
)
QUICK = Plan(
    loads=(
        Load(1, 40, 24, 2),
        Load(4, 500, 16, 4),
        Load(16, 40, 16, 16),
        Load(4, 1200, 8, 4),
        Load(2, 40, 8, 4, shared_chars=800),
    ),
    ttft_chars=(40, 500, 1200),
    pull_chars=(500, 1200),
    router_chars=(40, 500),
    tokenize_per_workload=5,
    cold_starts=0,
)
# Before recording counts: torch's first calls and the allocator's growth are not a step cost.
WARM_UP = Load(2, 500, 8, 2)


class Prompts:
    """Chat requests of about ``chars`` characters that share no KV block with any other: a
    random hex tag comes first, inside the first block (steps must compute every prompt
    token; the prefix cache is the simulator's to model); with ``shared_chars``, after a
    prefix of that many characters they all share."""

    name = "calibration"

    def __init__(
        self, rng: random.Random, chars: int, max_tokens: int, shared_chars: int = 0
    ) -> None:
        self._rng = rng
        self._chars = chars
        self._max_tokens = max_tokens
        self._shared = ""
        if shared_chars:
            tag = f"{rng.getrandbits(48):012x} "
            self._shared = tag + words(rng, max(0, shared_chars - len(tag))) + " "

    def next(self) -> RequestSpec:
        tag = f"{self._rng.getrandbits(48):012x} "
        text = self._shared + tag + words(self._rng, max(0, self._chars - len(tag)))
        low, high = max(1, self._max_tokens // 2), max(1, self._max_tokens * 3 // 2)
        return RequestSpec(
            [{"role": "user", "content": text}], self._rng.randint(low, high), kind="calibration"
        )

    def take(self, n: int) -> list[RequestSpec]:
        return [self.next() for _ in range(n)]


class Listed:
    """A workload of given requests, in order."""

    name = "calibration"

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self._specs: Iterator[RequestSpec] = iter(specs)

    def next(self) -> RequestSpec:
        return next(self._specs)
