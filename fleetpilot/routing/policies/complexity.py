"""Complexity -> tier: a score in [0, 1] from cheap request features, the tier whose ``up_to``
covers it, explicit overrides, and capacity-aware spill-over. Purely computational.

The score is a weighted sum of components that each saturate at 1, so it is monotone in every
feature (a longer prompt, a larger ``max_tokens``, one more marker never lowers it) and the
weights read directly as "how much of the range this signal can move a request".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleetpilot.routing.errors import InvalidRequestError, UnknownModelError
from fleetpilot.routing.features import RequestFeatures

# Model names that ask the router to choose the tier (besides the service's own name).
AUTO_MODELS = frozenset({"auto", "fleetpilot", "router"})


@dataclass(frozen=True, slots=True)
class ComplexityWeights:
    """Weights (summing to 1) and the feature values at which each component saturates."""

    length: float = 0.30
    output: float = 0.15
    turns: float = 0.10
    code: float = 0.15
    math: float = 0.15
    reasoning: float = 0.10
    system: float = 0.05
    # A 4k-token prompt is long-context work for a small model; log scale because the step from
    # 10 to 100 tokens says more about a request than the step from 3000 to 3100.
    length_tokens: int = 4096
    # Asking for 2k tokens of output means a long answer: an essay, a program, a derivation.
    output_tokens: int = 2048
    # Eight user turns in, a conversation carries enough context to need the larger model.
    turns_full: int = 8
    # A 2k-token system prompt is an elaborate agent or a long instruction set.
    system_tokens: int = 2048


DEFAULT_WEIGHTS = ComplexityWeights()
# Log-scale knee: below ~32 tokens length barely registers.
_KNEE = 32.0


def _log_fraction(value: float, full: float) -> float:
    if value <= 0:
        return 0.0
    return min(1.0, math.log1p(value / _KNEE) / math.log1p(full / _KNEE))


def complexity_score(features: RequestFeatures, w: ComplexityWeights = DEFAULT_WEIGHTS) -> float:
    """The request's complexity in [0, 1]."""
    length = _log_fraction(features.approx_tokens, w.length_tokens)
    output = _log_fraction(features.max_tokens or 0, w.output_tokens)
    turns = min(1.0, max(0, features.turns - 1) / max(1, w.turns_full - 1))
    system = min(1.0, (features.system_chars / 4) / w.system_tokens)
    score = (
        w.length * length
        + w.output * output
        + w.turns * turns
        + w.code * features.has_code
        + w.math * features.has_math
        + w.reasoning * features.has_reasoning
        + w.system * system
    )
    return min(1.0, max(0.0, score))


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A tier as the tier choice sees it: its name, served model alias, threshold and the
    LoRA adapters its engines serve."""

    name: str
    model: str
    up_to: float
    adapters: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Target:
    """Where the request asked to go: the base tier and whether the client pinned it."""

    index: int
    reason: str  # "complexity", "header", "model" or "adapter"
    score: float | None = None

    @property
    def pinned(self) -> bool:
        return self.reason != "complexity"


def tier_for_score(score: float, tiers: Sequence[TierSpec]) -> int:
    """The first tier (cheapest first) whose ``up_to`` covers the score; the last takes the
    rest."""
    for i, tier in enumerate(tiers):
        if score <= tier.up_to:
            return i
    return len(tiers) - 1


def resolve_target(
    features: RequestFeatures,
    tiers: Sequence[TierSpec],
    service: str,
    weights: ComplexityWeights = DEFAULT_WEIGHTS,
) -> Target:
    """The base tier: the ``x-fleetpilot-tier`` header, else a requested tier model alias or
    LoRA adapter, else the complexity score. The service name, ``auto`` or no model mean
    "router's choice"; any other model name is refused (404, as an engine would)."""
    if features.tier_header is not None:
        for i, tier in enumerate(tiers):
            if tier.name == features.tier_header:
                return Target(i, "header")
        raise InvalidRequestError(
            f"unknown tier {features.tier_header!r} in header x-fleetpilot-tier; "
            f"tiers: {', '.join(t.name for t in tiers)}",
            param="x-fleetpilot-tier",
            reason="unknown_tier",
        )
    model = features.model
    if model is not None and model != service and model not in AUTO_MODELS:
        for i, tier in enumerate(tiers):
            if tier.model == model:
                return Target(i, "model")
            if model in tier.adapters:
                return Target(i, "adapter")
        adapters = [a for t in tiers for a in sorted(t.adapters)]
        known = [service, *(t.model for t in tiers), *adapters]
        raise UnknownModelError(
            f"The model `{model}` does not exist. Models: {', '.join(known)}",
            param="model",
            reason="model_not_found",
        )
    score = complexity_score(features, weights)
    return Target(tier_for_score(score, tiers), "complexity", score)


@dataclass(frozen=True, slots=True)
class TierState:
    """Capacity of one tier right now."""

    has_replicas: bool  # any Ready endpoint at all
    available: bool  # some replica below its hard queue limit
    saturated: bool  # a new request would queue (see load.group_saturated)


@dataclass(frozen=True, slots=True)
class TierChoice:
    """The tier to use (``None``: refuse), why, and the tier it spilled from, if any."""

    index: int | None
    reason: str
    spilled_from: int | None = None


def choose_tier(
    target: Target,
    count: int,
    state: Callable[[int], TierState],
    spillover: bool,
) -> TierChoice:
    """Apply capacity to the base tier.

    A pinned tier (header or model) is used or refused, never left. Otherwise, when the base
    tier is saturated, the request spills to the next tier up that is not, and comes back as
    soon as the base tier has room, since every request is decided afresh. When every tier in
    reach is saturated the request stays home (queueing on the cheap tier beats queueing on the
    expensive one); when none can take it at all, ``index`` is ``None`` with reason
    ``saturated`` (answer 429) or ``no-endpoints`` (answer 503). ``state`` is called lazily,
    base tier first, so the common case reads one tier's state.
    """
    base = target.index
    last = count - 1 if (spillover and not target.pinned) else base
    first_available: int | None = None
    any_replicas = False
    for i in range(base, last + 1):
        st = state(i)
        any_replicas = any_replicas or st.has_replicas
        if not st.available:
            continue
        if not st.saturated:
            return TierChoice(i, target.reason if i == base else "spillover", _from(base, i))
        if first_available is None:
            first_available = i
    if first_available is not None:
        reason = target.reason if first_available == base else "spillover"
        return TierChoice(first_available, reason, _from(base, first_available))
    return TierChoice(None, "saturated" if any_replicas else "no-endpoints")


def _from(base: int, chosen: int) -> int | None:
    return base if chosen != base else None
