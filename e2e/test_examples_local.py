"""Every example in examples/ that fits on a CPU is brought up locally and answers.

Parametrized over a glob of examples/, so a new example is covered without touching this file.
Each one runs as a LocalFleet (CPU reference engines, GPU and parallelism settings ignored) with
at most one replica per role; every tier gets one chat completion through the router, asked for
by its served model name, and must answer from that tier (both hops for a disaggregated tier).
An example is skipped only for a reason computed from its spec: more engine processes than a
small CI runner should start, or a role that starts without replicas.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from e2e.support import route_fields
from fleetpilot.api import InferenceService, load_services
from fleetpilot.runtime.local import LocalFleet

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# Greedy tokens compared between a stand-in adapter and its base model: a seeded rank-8
# adapter on the tiny model can leave the first few unchanged (`math` does for 4).
ANSWER_TOKENS = 16
MAX_REPLICAS_PER_ROLE = 1
# Engine processes one fleet may start on a 2-core runner (each loads its own tiny model).
MAX_ENGINES = 4


def local_engines(service: InferenceService) -> dict[tuple[str, str], int]:
    """Engines the local runtime starts per (tier, role): LocalFleet's own rule."""
    return {
        (tier.name, role.name): min(role.replicas.start, MAX_REPLICAS_PER_ROLE)
        for tier in service.spec.tiers
        for role in tier.roles()
    }


def cpu_misfit(service: InferenceService) -> str | None:
    """Why this service cannot be served on a CPU runner, or None when it can."""
    engines = local_engines(service)
    empty = [f"{tier}/{role}" for (tier, role), count in engines.items() if count == 0]
    if empty:
        return f"{', '.join(empty)} start(s) with 0 replicas, so the tier could not answer"
    total = sum(engines.values())
    if total > MAX_ENGINES:
        return f"needs {total} engine processes at one replica per role; the limit is {MAX_ENGINES}"
    return None


def test_the_examples_are_found() -> None:
    """The glob finds examples, so the parametrized test cannot pass by running none."""
    assert EXAMPLES, "no examples/*.yaml found"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_serves_every_tier_locally(example: Path, tmp_path: Path) -> None:
    """An example that fits a CPU comes up locally, and every tier answers a chat asked by
    its served name, from that tier (both hops for a P/D tier), and by each of its LoRA
    adapters' names."""
    (service,) = load_services(example)
    reason = cpu_misfit(service)
    if reason is not None:
        pytest.skip(f"{example.name}: {reason}")
    engines = local_engines(service)
    fleet = LocalFleet(
        service,
        tmp_path,
        0,  # every process on a free port
        max_replicas_per_role=MAX_REPLICAS_PER_ROLE,
    )
    ports = fleet.ports()
    # The router's two, and per engine its HTTP port and its KV-event publisher and replay ports.
    assert len(ports) == len(set(ports.values())) == 2 + 3 * sum(engines.values())
    with (
        fleet,
        # The client's default retries: on a starved machine a fresh engine's first forward pass
        # (torch's first run) can outlast the router's first-byte budget while its /health
        # starves too, and the router's 504 is then retried as any OpenAI client would (seen
        # with CI's two CPU hogs and a compile on the same two cores).
        openai.OpenAI(base_url=fleet.endpoint, api_key="unused", max_retries=2) as client,
    ):
        for tier in service.spec.tiers:
            raw = client.chat.completions.with_raw_response.create(
                model=tier.model.alias,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=ANSWER_TOKENS,
                temperature=0,
            )
            completion = raw.parse()
            assert completion.choices[0].message.content, f"{tier.name}: empty answer"
            assert completion.model == tier.model.alias
            route = route_fields(raw.headers.get("x-fleetpilot-route"))
            assert route["tier"] == tier.name
            assert route["reason"] == "model"
            answering = "decode" if (tier.name, "decode") in engines else "unified"
            addresses = [r.address for r in fleet.role_replicas(tier.name, answering)]
            assert route["replica"] in addresses
            if answering == "decode":
                prefill = [r.address for r in fleet.role_replicas(tier.name, "prefill")]
                assert route["prefill"] in prefill, "the prefill hop was skipped"
            else:
                assert "prefill" not in route
            for adapter in tier.adapters:
                # A stand-in adapter (seeded by its name): asked for by name, it answers from
                # its tier, and differently from the base model to the same greedy prompt.
                raw = client.chat.completions.with_raw_response.create(
                    model=adapter.name,
                    messages=[{"role": "user", "content": "Say hello."}],
                    max_tokens=ANSWER_TOKENS,
                    temperature=0,
                )
                adapted = raw.parse()
                assert adapted.model == adapter.name
                route = route_fields(raw.headers.get("x-fleetpilot-route"))
                assert (route["tier"], route["adapter"]) == (tier.name, adapter.name)
                answer = adapted.choices[0].message.content
                assert answer != completion.choices[0].message.content, adapter.name
    assert fleet.leftovers() == []
