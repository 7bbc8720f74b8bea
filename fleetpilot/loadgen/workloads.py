"""Seeded request generators for ``fleetpilot bench``: pure, no I/O.

Each workload turns a seed into the same sequence of chat requests on every run, so two runs
against two fleets compare like with like. A workload yields :class:`RequestSpec` objects (the
messages and ``max_tokens``); the runner adds the model name and the streaming options.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# A small vocabulary is enough: the engines under test see text, not meaning, and byte-level
# tokenizers (the reference engine's) count characters, so lengths below are in characters.
_VOCAB = (
    "fleet replica tier router prefix cache token latency budget scale queue batch decode "
    "prefill tenant policy request stream model engine metric window target spill affinity "
    "block memory kernel shard region node pod service rollout health drain warm cold"
)
_WORDS = tuple(_VOCAB.split())
_CHAT = (
    "hi there",
    "thanks!",
    "what time is it in Paris?",
    "tell me a joke",
    "how are you today?",
    "good morning",
    "can you say that again?",
    "ok, got it",
)
# Each hard prompt carries code, maths and reasoning cues together, as real hard requests
# usually do; one cue alone would leave it near the easy side of a complexity threshold.
_HARD = (
    "Write a Python function `def merge(intervals):` that merges overlapping intervals, "
    "prove it correct step by step and derive its complexity: ",
    "Prove the theorem that the sum of the first n odd numbers is n^2, then write "
    "```python\ndef check(n):\n    ...\n``` to test it, and justify each step: ",
    "Refactor this code to remove the race condition, add unit tests, and explain why the "
    "probability of a lost update was 1/n before: ",
    "Solve the recurrence T(n) = 2T(n/2) + n log n with the integral method, analyze the "
    "trade-offs, and implement it as `fn solve(n: u64) -> u64`: ",
)


_WORD_BITS = len(_WORDS).bit_length()


def words(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of filler text (never more).

    Each word is drawn as ``rng.choice(_WORDS)`` draws it in CPython (``getrandbits`` of the
    list length's bit length, redrawn while out of range), so seeded texts are what they were
    with ``choice``, at under half its cost: the simulator draws millions of these words.
    """
    out: list[str] = []
    size = 0
    bits = rng.getrandbits
    count = len(_WORDS)
    while True:
        r = bits(_WORD_BITS)
        while r >= count:
            r = bits(_WORD_BITS)
        word = _WORDS[r]
        if size + len(word) + 1 > chars:
            return " ".join(out)
        out.append(word)
        size += len(word) + 1


@dataclass(frozen=True)
class RequestSpec:
    """One request a workload asks for: the chat messages and how long an answer to allow."""

    messages: list[dict[str, str]]
    max_tokens: int
    kind: str  # what the summary groups by: "chat", "easy", "hard", "turn-3", ...
    tags: dict[str, str] = field(default_factory=dict)

    def body(self, model: str, *, ignore_eos: bool = False) -> dict[str, Any]:
        """A streaming chat/completions body asking for usage (cached tokens) in the stream."""
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            # vLLM's extension: every request decodes max_tokens, so load is what was asked
            # for even from a random model that hits EOS at once. OpenAI itself refuses it.
            body["ignore_eos"] = True
        return body


@dataclass(frozen=True)
class ModelMix:
    """Which model each request asks for: one of ``models`` by a Zipf popularity (the k-th
    weighs 1 / k^skew), drawn from the seed and the request's index alone, so a request asks
    for the same model whatever order the runs send them in (LoRA adapters of one base model,
    a few hot and a long tail)."""

    models: tuple[str, ...]
    skew: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a model mix needs at least one model")
        if not 0.0 <= self.skew <= 10.0:
            raise ValueError(f"the popularity skew must be within 0..10, got {self.skew}")

    def model(self, index: int) -> str:
        weights = [1.0 / (rank + 1) ** self.skew for rank in range(len(self.models))]
        rng = random.Random(f"model-mix:{self.seed}:{index}")
        return rng.choices(self.models, weights)[0]


class Workload(Protocol):
    name: str

    def next(self) -> RequestSpec: ...


class SharedSystemPrompt:
    """Multi-tenant chat: a few long system prompts, each shared by many users.

    The shared prompt is the prefix a prefix-aware router and cache should reuse; users' short
    questions differ after it.
    """

    name = "shared-prefix"

    def __init__(
        self,
        seed: int,
        *,
        tenants: int = 4,
        users: int = 64,
        system_chars: int = 1200,
        user_chars: int = 120,
        max_tokens: int = 32,
        tenant_skew: float = 0.0,
    ) -> None:
        if tenants < 1 or users < 1:
            raise ValueError("tenants and users must be at least 1")
        if not 0.0 <= tenant_skew <= 10.0:
            raise ValueError("tenant skew must be between 0 (uniform) and 10")
        self._rng = random.Random(seed)
        self._systems = [
            f"You are the assistant of tenant {t}. " + words(self._rng, system_chars)
            for t in range(tenants)
        ]
        self._users = users
        self._user_chars = user_chars
        self._max_tokens = max_tokens
        # Zipf popularity of the tenants (rank k weighs 1 / k^skew): a few hot tenants whose
        # traffic outgrows one replica, the case that tests a prefix router's load bound. Which
        # tenant is hottest is part of the seed. Skew 0 keeps every user equally likely.
        self._skew = tenant_skew
        self._tenant_order = list(range(tenants))
        self._tenant_weights = [1.0 / (rank + 1) ** tenant_skew for rank in range(tenants)]
        if tenant_skew > 0:
            self._rng.shuffle(self._tenant_order)

    def _user(self) -> int:
        if self._skew == 0:
            return self._rng.randrange(self._users)
        tenants = len(self._systems)
        tenant = self._rng.choices(self._tenant_order, self._tenant_weights)[0]
        # A user of that tenant (user % tenants names the tenant, as for uniform draws).
        return tenant + tenants * self._rng.randrange(max(1, -(-self._users // tenants)))

    def next(self) -> RequestSpec:
        user = self._user()
        tenant = user % len(self._systems)  # each user belongs to one tenant, always
        question = f"user {user} asks: " + words(self._rng, self._user_chars)
        return RequestSpec(
            messages=[
                {"role": "system", "content": self._systems[tenant]},
                {"role": "user", "content": question},
            ],
            max_tokens=self._max_tokens,
            kind="chat",
            tags={"tenant": str(tenant), "user": str(user)},
        )


class MultiTurn:
    """Conversations whose history grows by one exchange per request of the same user.

    The assistant turns are synthesized from the seed, not the server's real answers: that keeps
    the generator pure and the requests identical across runs and servers, while each turn still
    extends the previous turn's prompt (the prefix a cache should hit).
    """

    name = "multi-turn"

    def __init__(
        self,
        seed: int,
        *,
        users: int = 16,
        turns: int = 6,
        turn_chars: int = 160,
        max_tokens: int = 32,
    ) -> None:
        if users < 1 or turns < 1:
            raise ValueError("users and turns must be at least 1")
        self._rng = random.Random(seed)
        self._users = users
        self._turns = turns
        self._turn_chars = turn_chars
        self._max_tokens = max_tokens
        self._history: dict[int, list[dict[str, str]]] = {}

    def next(self) -> RequestSpec:
        user = self._rng.randrange(self._users)
        history = self._history.get(user)
        if history is None or len(history) // 2 >= self._turns:
            # A finished conversation starts over: bounded prompts on long runs.
            history = [{"role": "system", "content": f"You are helping user {user}."}]
        else:
            history = [*history, {"role": "assistant", "content": words(self._rng, 80)}]
        turn = len(history) // 2 + 1
        history = [*history, {"role": "user", "content": words(self._rng, self._turn_chars)}]
        self._history[user] = history
        return RequestSpec(
            messages=history,
            max_tokens=self._max_tokens,
            kind=f"turn-{turn}",
            tags={"user": str(user), "turn": str(turn)},
        )


class MixedEasyHard:
    """Short chit-chat mixed with long code/maths prompts that want longer answers.

    What complexity routing should split: easy requests to the small tier, hard to the large.
    """

    name = "mixed"

    def __init__(
        self,
        seed: int,
        *,
        hard_fraction: float = 0.3,
        hard_chars: int = 800,
        easy_max_tokens: int = 16,
        hard_max_tokens: int = 128,
    ) -> None:
        if not 0.0 <= hard_fraction <= 1.0:
            raise ValueError("hard_fraction must be between 0 and 1")
        self._rng = random.Random(seed)
        self._hard_fraction = hard_fraction
        self._hard_chars = hard_chars
        self._easy_max = easy_max_tokens
        self._hard_max = hard_max_tokens

    def next(self) -> RequestSpec:
        if self._rng.random() < self._hard_fraction:
            prompt = self._rng.choice(_HARD) + words(self._rng, self._hard_chars)
            return RequestSpec(
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self._hard_max,
                kind="hard",
            )
        return RequestSpec(
            messages=[{"role": "user", "content": self._rng.choice(_CHAT)}],
            max_tokens=self._easy_max,
            kind="easy",
        )


class LongContext:
    """Long documents with a question at the end: prefill-heavy, little shared prefix."""

    name = "long-context"

    def __init__(
        self, seed: int, *, context_chars: int = 6000, documents: int = 8, max_tokens: int = 64
    ) -> None:
        if documents < 1:
            raise ValueError("documents must be at least 1")
        self._rng = random.Random(seed)
        # A few documents asked about repeatedly: the realistic "chat with a file" pattern.
        self._docs = [words(self._rng, context_chars) for _ in range(documents)]
        self._max_tokens = max_tokens

    def next(self) -> RequestSpec:
        doc = self._rng.randrange(len(self._docs))
        question = "Question: " + words(self._rng, 80)
        return RequestSpec(
            messages=[{"role": "user", "content": f"Document:\n{self._docs[doc]}\n\n{question}"}],
            max_tokens=self._max_tokens,
            kind="long",
            tags={"document": str(doc)},
        )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    SharedSystemPrompt.name: SharedSystemPrompt,
    MultiTurn.name: MultiTurn,
    MixedEasyHard.name: MixedEasyHard,
    LongContext.name: LongContext,
}


# The command lines' options that shape one workload, by the workload they shape.
SHAPE_OPTIONS: dict[str, str] = {
    "tenants": SharedSystemPrompt.name,
    "tenant_skew": SharedSystemPrompt.name,
    "system_chars": SharedSystemPrompt.name,
    "documents": LongContext.name,
    "context_chars": LongContext.name,
}


def workload_options(name: str, max_tokens: int | None = None, **shape: Any) -> dict[str, Any]:
    """``make_workload``'s options for the command-line flags given (None: not given):
    ``max_tokens`` for any workload (both of ``mixed``'s answers), ``SHAPE_OPTIONS`` for the
    workload they shape; ValueError naming the flag for one of another workload."""
    options: dict[str, Any] = {}
    for option, value in shape.items():
        if value is None:
            continue
        if SHAPE_OPTIONS.get(option) != name:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} applies to --workload {SHAPE_OPTIONS[option]} only")
        options[option] = value
    if max_tokens is not None:
        if name == MixedEasyHard.name:
            options.update(easy_max_tokens=max_tokens, hard_max_tokens=max_tokens)
        else:
            options["max_tokens"] = max_tokens
    return options


def make_workload(name: str, seed: int, **options: Any) -> Workload:
    """The workload called ``name``; unknown names are refused with the known ones listed."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise ValueError(f"unknown workload {name!r}; known: {known}") from None
    return factory(seed, **options)
