"""The reference engine's command line for a planned launch: what the local fleet starts.

Protects the one translation of the planner's EngineLaunch into reference-engine flags: the
exact argv for a unified and a P/D role, the CPU caps (batch, context length, tiny model,
short drain), the planner's kv_role reaching the engine, and every flag being one the
reference engine accepts (parsed by its own settings code into the role the planner meant).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from fleetpilot.api import InferenceService, ResolvedRole, RoleName, parse_service
from fleetpilot.api.spec import ReferenceModel
from fleetpilot.engine.reference import settings
from fleetpilot.engine.reference_launch import (
    CPU_MAX_KV_OFFLOAD_BYTES,
    CPU_MAX_NUM_SEQS,
    POD_DRAIN_GRACE_S,
    REFERENCE_DEFAULT_MAX_MODEL_LEN,
    REFERENCE_MAX_MODEL_LEN,
    REFERENCE_TOKENIZER,
    reference_argv,
    reference_pod_command,
)
from fleetpilot.engine.vllm_args import EngineLaunch, launch_for
from fleetpilot.runtime.engines import ReferenceBackend
from tests.factories import make_manifest, make_tier

HOST = "127.0.0.1"
PREAMBLE = ["py", "-m", "fleetpilot", "engine", "--backend", "reference"]
# The planner's KV-event ports (vLLM's defaults), on the local host.
EVENTS = [
    "--kv-events-config",
    '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:5557","publisher":"zmq",'
    '"replay_endpoint":"tcp://127.0.0.1:5558","topic":""}',
]


def service_of(*tiers: dict[str, object]) -> InferenceService:
    return parse_service(make_manifest(tiers=list(tiers)))


def role_of(service: InferenceService, role: RoleName) -> ResolvedRole:
    resolved = service.spec.tiers[0].role(role)
    assert resolved is not None
    return resolved


def argv_of(role: ResolvedRole, port: int = 9001) -> list[str]:
    return reference_argv(replace(launch_for(role), port=port), HOST, "py")


def parsed(argv: list[str]) -> settings.ServerSettings:
    """What the reference engine makes of ``argv``'s flags (its own parser and checks)."""
    assert argv[: len(PREAMBLE)] == PREAMBLE
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    server_settings, _ = settings.settings_from_args(parser.parse_args(argv[len(PREAMBLE) :]))
    return server_settings


def test_a_unified_launch_within_the_cpu_caps_keeps_its_own_settings() -> None:
    """A launch within the CPU caps reaches the engine as planned (served name, port, batch
    limit, context length), with the tiny model and the short drain added."""
    tier = make_tier("small", model="Qwen/Qwen2.5-0.5B-Instruct", engine={"maxNumSeqs": 8})
    tier["model"].update(servedName="small-model", maxModelLen=512)
    role = role_of(service_of(tier), RoleName.UNIFIED)
    assert argv_of(role) == [
        *PREAMBLE,
        "--host", HOST,
        "--port", "9001",
        "--model-config", "tiny",
        "--served-model-name", "small-model",
        "--max-num-seqs", "8",
        "--max-model-len", "512",
        "--drain-grace-seconds", "2",
        "--log-format", "plain",
        *EVENTS,
    ]  # fmt: skip


def test_gpu_sized_settings_are_capped_for_a_cpu() -> None:
    """A 65k context and 256 sequences (the planner's defaults for a GPU) would not run on a
    CPU: the engine gets at most 2048 tokens and 16 sequences, and no GPU-only flag."""
    tier = make_tier(
        "large",
        model="meta-llama/Llama-3.1-70B-Instruct",
        engine={"maxNumSeqs": 256, "maxNumBatchedTokens": 16384, "kvCache": {"dtype": "fp8"}},
        tensor=4,
    )
    tier["model"]["maxModelLen"] = 65536
    argv = argv_of(role_of(service_of(tier), RoleName.UNIFIED))
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[argv.index("--served-model-name") + 1] == "meta-llama/Llama-3.1-70B-Instruct"
    for gpu_only in ("--max-num-batched-tokens", "--kv-cache-dtype", "--tensor-parallel-size"):
        assert gpu_only not in argv
    assert parsed(argv).max_model_len == 2048


def test_a_launch_without_a_context_length_gets_the_cpu_one() -> None:
    """A model without maxModelLen (vLLM would take the checkpoint's) runs with the CPU's."""
    argv = argv_of(role_of(service_of(make_tier()), RoleName.UNIFIED))
    assert argv[argv.index("--max-model-len") + 1] == "2048"


@pytest.mark.parametrize("role", [RoleName.PREFILL, RoleName.DECODE])
def test_a_nixl_role_takes_both_sides_as_the_planner_says(role: RoleName) -> None:
    """The planner gives vLLM kv_both for NIXL; the local fleet used to say producer/consumer."""
    tier = make_tier("main", mode="disaggregated")
    tier["model"]["servedName"] = "llama"
    argv = argv_of(role_of(service_of(tier), role), port=9002)
    assert argv == [
        *PREAMBLE,
        "--host", HOST,
        "--port", "9002",
        "--model-config", "tiny",
        "--served-model-name", "llama",
        "--max-num-seqs", "16",
        "--max-model-len", "2048",
        "--drain-grace-seconds", "2",
        "--log-format", "plain",
        "--kv-transfer-config",
        '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_ip":"127.0.0.1"}',
        "--allowed-remote-hosts", HOST,
        *EVENTS,
    ]  # fmt: skip
    kv = parsed(argv).kv
    assert kv.role == settings.BOTH
    assert kv.produces
    assert kv.consumes
    assert kv.advertise_host == HOST
    assert kv.allowed_remote_hosts.allows_pull(HOST, 9003)  # a peer engine of the fleet


@pytest.mark.parametrize(
    ("role", "kv_role"), [(RoleName.PREFILL, "kv_producer"), (RoleName.DECODE, "kv_consumer")]
)
def test_a_connector_told_its_side_reaches_the_engine_as_that_side(
    role: RoleName, kv_role: str
) -> None:
    """A connector told its side (NCCL) gives the prefill kv_producer and the decode
    kv_consumer, as in a pod, and the reference engine takes that side."""
    tier = make_tier("main", mode="disaggregated")
    tier["serving"]["kvTransfer"] = {"connector": "P2pNcclConnector"}
    argv = argv_of(role_of(service_of(tier), role))
    config = argv[argv.index("--kv-transfer-config") + 1]
    assert config == f'{{"kv_connector":"P2pNcclConnector","kv_role":"{kv_role}","kv_ip":"{HOST}"}}'
    assert parsed(argv).kv.role == role


def test_a_unified_launch_parses_as_a_unified_engine() -> None:
    """A unified launch is accepted by the reference engine as a unified engine on the
    planned port and drain, with no KV transfer."""
    server_settings = parsed(argv_of(role_of(service_of(make_tier()), RoleName.UNIFIED)))
    assert server_settings.kv.role == RoleName.UNIFIED
    assert server_settings.port == 9001
    assert server_settings.drain_grace_s == 2.0
    assert "--kv-transfer-config" not in argv_of(role_of(service_of(make_tier()), RoleName.UNIFIED))


def test_the_engine_publishes_kv_events_where_the_launch_says() -> None:
    """The planner's KV-event ports reach the reference engine as a publisher and a replay
    socket on the local host; a launch without them publishes nothing."""
    role = role_of(service_of(make_tier()), RoleName.UNIFIED)
    launch = replace(launch_for(role), port=9001, kv_events_port=7001, kv_replay_port=7002)
    events = parsed(reference_argv(launch, HOST, "py")).kv_events
    assert (events.active, events.endpoint, events.replay_endpoint) == (
        True, "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002")  # fmt: skip
    quiet = replace(launch, kv_events_port=None, kv_replay_port=None)
    assert "--kv-events-config" not in reference_argv(quiet, HOST, "py")
    assert not parsed(reference_argv(quiet, HOST, "py")).kv_events.active


def test_the_local_router_finds_the_engines_shipped_tokenizer() -> None:
    """The runtime locates the reference engine's tokenizer files without importing the
    engine: the path is the one the engine ships."""
    from fleetpilot.engine.reference.hf_tokenizer import SHIPPED

    assert REFERENCE_TOKENIZER == SHIPPED
    assert (REFERENCE_TOKENIZER / "tokenizer.json").is_file()


def test_a_tiers_adapters_become_seeded_stand_ins_with_the_planned_sizes(tmp_path: Path) -> None:
    """The launch's LoRA sizes reach the reference engine as vLLM's flags, and each adapter by
    its name at its own folder under the fleet's adapter root (names that differ only in
    characters a path cannot hold still get folders of their own), written there by the
    engine itself; without an adapter root the engine serves the base model only."""
    tier = make_tier(
        lora={"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 3},
        adapters=[
            {"name": "team/sql", "source": {"huggingface": {"repo": "acme/sql"}}},
            {"name": "team:sql", "source": {"pvc": {"claimName": "c", "path": "sql"}}},
        ],
    )
    launch = replace(launch_for(role_of(service_of(tier), RoleName.UNIFIED)), port=9001)
    server_settings = parsed(reference_argv(launch, HOST, "py", adapter_root=tmp_path))
    assert server_settings.lora is not None
    assert (server_settings.lora.max_loras, server_settings.lora.max_lora_rank) == (2, 32)
    assert server_settings.lora.max_cpu_loras == 3
    modules = {m.name: Path(m.path) for m in server_settings.lora_modules}
    assert set(modules) == {"team/sql", "team:sql"}
    assert all(path.parent == tmp_path for path in modules.values())
    assert len(set(modules.values())) == 2
    assert server_settings.seed_missing_lora_modules
    base_only = parsed(reference_argv(launch, HOST, "py"))
    assert (base_only.lora, base_only.lora_modules) == (None, ())


def test_a_dynamic_tiers_engines_start_without_adapters_and_read_pod_paths_under_the_root(
    tmp_path: Path,
) -> None:
    """`lora.dynamic`: no adapter at start; the adapters the fleet loads later name the pod's
    paths (or a Hub repo id), read under the adapter root, with stand-ins written there at
    their first load; the engine process gets vLLM's runtime-updating switch."""
    tier = make_tier(
        lora={"maxLoras": 2, "dynamic": True},
        adapters=[{"name": "tax", "source": {"pvc": {"claimName": "c", "path": "tax"}}}],
    )
    launch = replace(launch_for(role_of(service_of(tier), RoleName.UNIFIED)), port=9001)
    server_settings = parsed(reference_argv(launch, HOST, "py", adapter_root=tmp_path))
    assert server_settings.lora is not None
    assert server_settings.lora_modules == ()
    assert (
        server_settings.lora.files_at("/adapter-volumes/c/tax")
        == tmp_path / "adapter-volumes/c/tax"
    )
    assert server_settings.lora.files_at("acme/hub-lora") == tmp_path / "acme/hub-lora"
    assert server_settings.seed_missing_lora_modules
    command = ReferenceBackend("py", adapter_root=tmp_path).command(launch, HOST, ())
    assert command.env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def test_a_cold_start_reaches_the_engine_as_its_flag() -> None:
    """``cold_start_s`` adds the engine's ``--cold-start-seconds`` (parsed by the engine into
    its wait before /health answers) and nothing else; without it the argv is as before."""
    role = role_of(service_of(make_tier("small")), RoleName.UNIFIED)
    launch = replace(launch_for(role), port=9001)
    plain = reference_argv(launch, HOST, "py")
    slow = reference_argv(launch, HOST, "py", cold_start_s=2.5)
    assert slow == [*plain, "--cold-start-seconds", "2.5"]
    assert "--cold-start-seconds" not in plain
    assert parsed(slow).cold_start_s == 2.5
    assert parsed(plain).cold_start_s == 0.0


def test_a_step_delay_reaches_the_engine_as_its_flag() -> None:
    """``step_delay_s`` adds the engine's ``--step-delay-seconds`` (its sleep after each busy
    step) and nothing else."""
    role = role_of(service_of(make_tier("small")), RoleName.UNIFIED)
    launch = replace(launch_for(role), port=9001)
    plain = reference_argv(launch, HOST, "py")
    paced = reference_argv(launch, HOST, "py", step_delay_s=0.04)
    assert paced == [*plain, "--step-delay-seconds", "0.04"]
    assert parsed(paced).step_delay_s == 0.04
    assert parsed(plain).step_delay_s == 0.0


# -- a tier with engine.backend reference: the same engine up and in a cluster ---------------


def reference_role(mode: str = "unified", **engine: object) -> ResolvedRole:
    tier = make_tier(
        "small", model="reference-tiny", mode=mode, engine={"backend": "reference", **engine}
    )
    return service_of(tier).spec.tiers[0].roles()[0]


def flags_of(args: list[str]) -> dict[str, str | None]:
    """Flag -> value (None for a switch), in order."""
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            flags[arg] = value
    return flags


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_a_reference_tier_runs_the_same_engine_up_and_in_a_pod(mode: str) -> None:
    """`fleetpilot up` and a cluster run the same flags for a reference tier: the pod's
    command and the local argv differ only in binding (host, the KV-event and hand-off
    addresses, the peers admitted) and the drain on SIGTERM - never in what the engine is
    (preset, batch, context, block size, prefix caching, P/D side)."""
    launch = launch_for(reference_role(mode, maxNumSeqs=64, referenceModel="small"))
    pod = reference_pod_command(launch)
    local = reference_argv(launch, HOST, "py")
    assert pod[:2] == ["fleetpilot", "engine"]
    assert local[:4] == ["py", "-m", "fleetpilot", "engine"]
    in_pod, up = flags_of(pod[2:]), flags_of(local[4:])
    assert list(in_pod) == list(up)
    binding = {
        "--host",
        "--kv-events-config",
        "--kv-transfer-config",
        "--allowed-remote-hosts",
        "--drain-grace-seconds",
    }
    assert {flag for flag in in_pod if in_pod[flag] != up[flag]} <= binding
    assert (in_pod["--host"], up["--host"]) == ("0.0.0.0", HOST)
    assert in_pod["--drain-grace-seconds"] == f"{POD_DRAIN_GRACE_S:g}"
    if mode == "disaggregated":
        pod_kv = json.loads(in_pod["--kv-transfer-config"] or "")
        up_kv = json.loads(up["--kv-transfer-config"] or "")
        assert (pod_kv.pop("kv_ip"), up_kv.pop("kv_ip")) == ("$(POD_IP)", HOST)
        assert pod_kv == up_kv
    assert (up["--model-config"], up["--max-num-seqs"]) == ("small", "64")


def test_a_reference_tier_is_not_capped_locally() -> None:
    """The local runtime caps a GPU spec for a CPU, not a reference tier: its user chose the
    engine and preset, and the planner refused what it cannot run. The local router expects
    the batch the engines run."""
    launch = launch_for(reference_role(maxNumSeqs=64, referenceModel="small"))
    engine = parsed(reference_argv(launch, HOST, "py"))
    assert engine.max_model_len == 2048  # the engine's default for the small preset's 4096
    assert ReferenceBackend().max_num_seqs(launch) == 64
    gpu = launch_for(role_of(service_of(make_tier("small")), RoleName.UNIFIED))
    assert ReferenceBackend().max_num_seqs(gpu) == CPU_MAX_NUM_SEQS


def test_the_planners_preset_limits_are_the_engines() -> None:
    """The API's presets and the context limits the planner refuses beyond are the engine's
    own (its MODEL_PRESETS, which the planner cannot import: they load torch)."""
    assert {p.value for p in ReferenceModel} == set(settings.MODEL_PRESETS)
    assert settings.DEFAULT_MAX_MODEL_LEN == REFERENCE_DEFAULT_MAX_MODEL_LEN
    for preset, limit in REFERENCE_MAX_MODEL_LEN.items():
        assert settings.MODEL_PRESETS[preset.value].max_position_embeddings == limit


# -- a reference tier reading a checkpoint (model.source.huggingface, through the cache) ------


def checkpoint_launch(revision: str | None = "v1") -> EngineLaunch:
    hub = {"revision": revision} if revision else {}
    tier = make_tier("small", model="acme/tiny-llm", engine={"backend": "reference"})
    tier["model"] = {"name": "acme/tiny-llm", "servedName": "tiny", "source": {"huggingface": hub}}
    return launch_for(service_of(tier).spec.tiers[0].roles()[0])


def test_a_reference_checkpoint_is_read_by_repo_and_revision_not_built_from_the_preset() -> None:
    """The mapping gives a checkpoint's launch --model <model.name> --revision <rev> (a Hub
    repo id the engine reads from the Hub cache) in place of --model-config, and keeps the
    served name and every other flag the preset's launch has."""
    launch = checkpoint_launch()
    assert launch.reference_checkpoint
    pod = flags_of(reference_pod_command(launch)[2:])
    assert (pod["--model"], pod["--revision"]) == ("acme/tiny-llm", "v1")
    assert "--model-config" not in pod
    assert pod["--served-model-name"] == "tiny"
    preset = flags_of(reference_pod_command(replace(launch, reference_checkpoint=False))[2:])
    assert preset["--model-config"] == "tiny"
    assert set(pod) - set(preset) == {"--model", "--revision"}
    assert set(preset) - set(pod) == {"--model-config"}
    # No revision in the spec: none on the line (the engine's default, main, is the Job's).
    assert "--revision" not in reference_pod_command(checkpoint_launch(None))


def test_a_reference_tier_without_a_source_is_the_preset() -> None:
    """A tier's source defaults to the Hub, but a reference tier without one has always been
    its seeded preset: only a named Hub source is a checkpoint."""
    launch = launch_for(reference_role())
    assert not launch.reference_checkpoint
    assert "--model" not in reference_pod_command(launch)


def test_the_local_fleet_refuses_a_reference_checkpoint() -> None:
    """The local fleet has no model cache: running the preset in the checkpoint's place would
    serve another model under its name, so the mapping refuses (`fleetpilot up` refuses the
    spec before, by its field)."""
    with pytest.raises(ValueError, match="cannot run a reference checkpoint"):
        reference_argv(checkpoint_launch(), HOST, "py")


# -- a host KV tier (engine.kvOffload): vLLM's flags, for the reference engine too -----------


def test_a_reference_tiers_host_kv_tier_reaches_its_pod_with_vllms_flags() -> None:
    """A reference tier's pod gets the host tier as vLLM's flags (the size in GiB, the native
    backend, self-describing host-tier KV events since the engine publishes events), the same
    up as in a pod, and its engine takes them as a unified engine with a host tier."""
    launch = launch_for(reference_role(kvOffload={"size": "256Mi"}))
    pod = reference_pod_command(launch)
    in_pod = flags_of(pod[2:])
    assert in_pod["--kv-offloading-size"] == "0.25"
    assert in_pod["--kv-offloading-backend"] == "native"
    config = json.loads(in_pod["--kv-transfer-config"] or "")
    assert config == {"kv_connector_extra_config": {"self_describing_kv_events": True}}
    assert "--allowed-remote-hosts" not in in_pod  # no P/D hand-off to admit peers to
    local = reference_argv(launch, HOST, "py")
    up = flags_of(local[4:])
    assert {f: up[f] for f in in_pod if f.startswith("--kv-offloading")} == {
        "--kv-offloading-size": "0.25",
        "--kv-offloading-backend": "native",
    }
    assert up["--kv-transfer-config"] == in_pod["--kv-transfer-config"]
    assert parsed(local).kv.role == RoleName.UNIFIED


def test_a_gpu_specs_host_kv_tier_is_capped_for_a_cpu() -> None:
    """A GPU spec's host tier (tens of GiB) runs locally at most CPU_MAX_KV_OFFLOAD_BYTES,
    like its batch and context: several engines of a local fleet share a laptop's memory. A
    smaller one is kept, and a reference tier's is never capped."""
    big = role_of(service_of(make_tier(engine={"kvOffload": {"size": "64Gi"}})), RoleName.UNIFIED)
    argv = argv_of(big)
    assert argv[argv.index("--kv-offloading-size") + 1] == f"{CPU_MAX_KV_OFFLOAD_BYTES / 2**30:g}"
    assert parsed(argv).kv.role == RoleName.UNIFIED
    small = role_of(service_of(make_tier(engine={"kvOffload": {"size": "64Mi"}})), RoleName.UNIFIED)
    argv = argv_of(small)
    assert argv[argv.index("--kv-offloading-size") + 1] == "0.0625"
    reference = launch_for(reference_role(kvOffload={"size": "2Gi"}))
    argv = reference_argv(reference, HOST, "py")
    assert argv[argv.index("--kv-offloading-size") + 1] == "2"


def test_without_kv_events_a_host_kv_tier_sends_no_transfer_config() -> None:
    """No events, nothing to describe: the offloading flags alone."""
    launch = replace(launch_for(reference_role(kvOffload={"size": "256Mi"})), kv_events_port=None)
    argv = reference_argv(launch, HOST, "py")
    assert "--kv-transfer-config" not in argv
    assert argv[argv.index("--kv-offloading-size") + 1] == "0.25"
    assert parsed(argv).kv.role == RoleName.UNIFIED
