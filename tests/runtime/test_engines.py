"""A local fleet's engine backends: what each engine process runs, on which ports, with what env.

Protects the default (the reference engine, argv exactly as before backends existed) and the
vLLM backend of the GPU check: the launcher's own ``vllm serve`` line with the local
checkpoint, loopback binds, a share of the GPU, a NIXL side channel of its own per engine,
and the router told the checkpoint's tokenizer and the planned batch limit.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.engine.reference_launch import (
    CPU_MAX_NUM_SEQS,
    REFERENCE_TOKENIZER,
    reference_argv,
)
from fleetpilot.engine.vllm_args import EngineLaunch, launch_for, vllm_serve_args
from fleetpilot.runtime.engines import (
    NIXL_SIDE_CHANNEL,
    SHARED_GPU_MEMORY_UTILIZATION,
    VllmBackend,
)
from fleetpilot.runtime.local import HOST, LocalFleet, Replica
from tests.factories import make_manifest, make_tier

MODEL_DIR = Path("/models/check")


def two_tier() -> InferenceService:
    """A unified tier and a P/D tier, one engine per role, batch limit 64."""
    unified = make_tier("small", up_to=0.4, engine={"maxNumSeqs": 64})
    unified["serving"] = {"replicas": {"min": 1, "max": 1}}
    pd = make_tier("pd", mode="disaggregated", engine={"maxNumSeqs": 64})
    return parse_service(make_manifest(tiers=[unified, pd]))


def launch_of(service: InferenceService, replica: Replica) -> EngineLaunch:
    """The planner's launch of the replica's role, on the replica's ports."""
    tier = next(t for t in service.spec.tiers if t.name == replica.tier)
    role = tier.role(replica.role)
    assert role is not None
    assert replica.kv_ports is not None
    events, replay = replica.kv_ports
    return replace(
        launch_for(role), port=replica.port, kv_events_port=events, kv_replay_port=replay
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_default_backend_runs_the_reference_engine_as_before(tmp_path: Path) -> None:
    """Without a backend every engine is the reference engine of its role's launch on its
    own ports, byte for byte what reference_argv gives, and the router tokenizes with the
    shipped tokenizer at the CPU batch limit; no port beyond HTTP and KV events is taken."""
    service = two_tier()
    fleet = LocalFleet(service, tmp_path, 9100, python="py")
    assert len(fleet.replicas) == 3
    for replica in fleet.replicas:
        assert replica.argv == reference_argv(launch_of(service, replica), HOST, "py")
        assert replica.env == {}
    # Engines on 9101-9103, then each one's two KV-event ports, then the router's metrics.
    assert sorted(fleet.ports().values()) == list(range(9100, 9111))
    assert fleet.ports()["router metrics"] == 9110
    config = fleet.router_config()
    for tier in config.tiers:
        assert tier.tokenizer == str(REFERENCE_TOKENIZER)
        assert {g.max_num_seqs for g in tier.endpoints} == {CPU_MAX_NUM_SEQS}


def test_a_reference_tier_runs_its_own_preset_and_batch_locally(tmp_path: Path) -> None:
    """A tier with engine.backend reference runs locally as its pods would (its preset, its
    batch limit, uncapped), and the router expects that batch; a GPU tier beside it is still
    capped for the CPU."""
    reference = make_tier(
        "small",
        up_to=0.4,
        model="reference-small",
        engine={"backend": "reference", "referenceModel": "small", "maxNumSeqs": 64},
    )
    reference["serving"] = {"replicas": {"min": 1, "max": 1}}
    gpu = make_tier("large", engine={"maxNumSeqs": 64})
    gpu["serving"] = {"replicas": {"min": 1, "max": 1}}
    service = parse_service(make_manifest(tiers=[reference, gpu]))
    fleet = LocalFleet(service, tmp_path, 9100, python="py")
    argv = {r.tier: r.argv for r in fleet.replicas}
    assert (flag(argv["small"], "--model-config"), flag(argv["small"], "--max-num-seqs")) == (
        "small",
        "64",
    )
    assert (flag(argv["large"], "--model-config"), flag(argv["large"], "--max-num-seqs")) == (
        "tiny",
        str(CPU_MAX_NUM_SEQS),
    )
    batches = {t.name: {g.max_num_seqs for g in t.endpoints} for t in fleet.router_config().tiers}
    assert batches == {"small": {64}, "large": {CPU_MAX_NUM_SEQS}}


def test_the_vllm_backend_runs_the_launchers_serve_line_on_loopback(tmp_path: Path) -> None:
    """Each engine runs ``vllm serve`` with the launcher's flags for its role, serving the
    local checkpoint with a share of the GPU, binding HTTP and KV events on loopback; each
    has a NIXL side channel of its own, listed among the fleet's ports; the router reads the
    checkpoint's tokenizer and the planned batch limit."""
    service = two_tier()
    fleet = LocalFleet(service, tmp_path, 0, backend=VllmBackend("/v/bin/vllm", MODEL_DIR))
    side_channels = set()
    for replica in fleet.replicas:
        launch = replace(
            launch_of(service, replica),
            model=str(MODEL_DIR),
            gpu_memory_utilization=SHARED_GPU_MEMORY_UTILIZATION,
        )
        assert replica.argv == ["/v/bin/vllm", "serve", *vllm_serve_args(launch, HOST)]
        assert flag(replica.argv, "--host") == HOST
        assert replica.kv_ports is not None
        assert json.loads(flag(replica.argv, "--kv-events-config"))["endpoint"] == (
            f"tcp://{HOST}:{replica.kv_ports[0]}"
        )
        assert flag(replica.argv, "--gpu-memory-utilization") == "0.2"
        (side_channel,) = replica.extra_ports
        assert replica.env == {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        assert fleet.ports()[f"{replica.name} {NIXL_SIDE_CHANNEL}"] == side_channel
        side_channels.add(side_channel)
    assert len(side_channels) == 3
    ports = list(fleet.ports().values())
    assert len(ports) == len(set(ports)) == 2 + 3 * 4
    config = fleet.router_config()
    for tier in config.tiers:
        assert tier.tokenizer == str(MODEL_DIR)
        assert {g.max_num_seqs for g in tier.endpoints} == {64}


def test_a_scaled_up_vllm_engine_gets_ports_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine the autoscaler adds takes free ports for HTTP, KV events and its NIXL side
    channel, none of them another engine's (it is not started here: no vllm to run)."""
    fleet = LocalFleet(two_tier(), tmp_path, 0, backend=VllmBackend("/v/bin/vllm", MODEL_DIR))
    taken = set(fleet.ports().values())
    started: list[Replica] = []
    monkeypatch.setattr(fleet, "_start_engine", started.append)
    replica = fleet.add_replica("pd", "decode")
    assert started == [replica]
    assert replica.name == "pd/decode#1"
    assert replica.kv_ports is not None
    new = {replica.port, *replica.kv_ports, *replica.extra_ports}
    assert len(new) == 4
    assert not new & taken
    assert replica.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(replica.extra_ports[0])


def test_a_cold_start_reaches_every_engine_the_fleet_starts_or_adds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cold_start_s`` reaches the argv of every reference engine, the initial ones and one
    the autoscaler adds, and lengthens the wait for an engine's /health by as much; it is the
    reference backend's only (a vLLM engine's start is its own)."""
    service = two_tier()
    fleet = LocalFleet(service, tmp_path, 0, python="py", cold_start_s=4)
    started: list[Replica] = []
    monkeypatch.setattr(fleet, "_start_engine", started.append)
    added = fleet.add_replica("small", "unified")
    assert started == [added]
    assert len(fleet.replicas) == 4
    for replica in fleet.replicas:
        expected = reference_argv(launch_of(service, replica), HOST, "py", cold_start_s=4)
        assert replica.argv == expected
        assert flag(replica.argv, "--cold-start-seconds") == "4"
    assert fleet.engine_timeout_s == fleet.health_timeout_s + 4
    assert "--cold-start-seconds" not in LocalFleet(service, tmp_path, 0).replicas[0].argv
    with pytest.raises(ValueError, match="cold_start_s"):
        LocalFleet(service, tmp_path, 0, backend=VllmBackend("/v", MODEL_DIR), cold_start_s=1)
    with pytest.raises(ValueError, match="cold_start_s"):
        LocalFleet(service, tmp_path, 0, cold_start_s=-1)
    with pytest.raises(ValueError, match="step_delay_s"):
        LocalFleet(service, tmp_path, 0, backend=VllmBackend("/v", MODEL_DIR), step_delay_s=1)
    with pytest.raises(ValueError, match="step_delay_s"):
        LocalFleet(service, tmp_path, 0, step_delay_s=float("nan"))


def test_each_engine_joining_the_router_is_a_cold_start_of_its_role(tmp_path: Path) -> None:
    """Launch to joining the router, in whole seconds, kept per role as the operator keeps a
    pod's (the last ten), and reported in the fleet's status; a replica launched again (a
    restart) is another start."""
    fleet = LocalFleet(two_tier(), tmp_path, 0, python="py")
    small = fleet.role_replicas("small", "unified")[0]
    launched = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
    small.launched_at = launched
    fleet._mark_serving(small, launched + timedelta(seconds=12.4))
    status = fleet.status()
    (small_status,) = next(t for t in status.tiers if t.name == "small").roles
    assert (small_status.replicas, small_status.ready) == (1, 1)
    cold = small_status.cold_start
    assert cold is not None
    assert (cold.count, cold.start.max_seconds) == (1, 12)
    assert cold.pod is not None
    assert cold.pod.max_seconds == 12
    small.launched_at = launched + timedelta(minutes=5)
    fleet._mark_serving(small, launched + timedelta(minutes=5, seconds=30))
    again = fleet.status().tiers[0].roles[0].cold_start
    assert again is not None
    assert (again.count, again.start.max_seconds, again.start.p50_seconds) == (2, 30, 12)
    pd = next(t for t in status.tiers if t.name == "pd").roles
    assert [r.role for r in pd] == ["prefill", "decode"]
    assert all(r.cold_start is None for r in pd)  # never joined: no start
    # The router's config carries it: its hold for a tier at zero lasts the observed start.
    held = {t.name: t.cold_start_observed for t in fleet.router_config().tiers}
    assert held == {"small": timedelta(seconds=30), "pd": None}
