"""The exact `vllm serve` command lines the planner puts into engine pods."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fleetpilot.api import load_services, parse_service
from fleetpilot.engine.vllm_args import (
    EngineLaunch,
    kv_event_ports,
    kv_events_json,
    launch_for,
    offload_gib,
    vllm_serve_args,
)
from fleetpilot.kv_events import kv_events_config
from tests.factories import make_manifest, make_tier

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _args(name: str, tier: int = 0, role: str = "unified") -> list[str]:
    (service,) = load_services(EXAMPLES / name)
    resolved = service.spec.tiers[tier].role(role)
    assert resolved is not None
    return vllm_serve_args(launch_for(resolved))


def test_two_tier_small_command_line() -> None:
    """The small tier of two-tier.yaml gives exactly this argv: every flag in order, quantization,
    the ngram speculative config and the KV-event publisher as compact JSON."""
    assert _args("two-tier.yaml", 0) == [
        "/models/qwen2.5-7b-instruct-awq",
        "--served-model-name", "qwen-7b",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
        "--dtype", "auto",
        "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256",
        "--max-num-batched-tokens", "8192",
        "--block-size", "16",
        "--enable-prefix-caching",
        "--kv-cache-dtype", "auto",
        "--quantization", "awq",
        "--speculative-config",
        '{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":4}',
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq",'
        '"replay_endpoint":"tcp://*:5558","topic":""}',
    ]  # fmt: skip


def test_single_tier_downloads_from_the_hub() -> None:
    """A Hub model id is passed as it is (vLLM downloads it), and settings the spec leaves out
    (quantization, speculation) add no flag."""
    args = _args("single-tier.yaml")
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert "--quantization" not in args
    assert "--speculative-config" not in args


def test_tp8_speculative_fp8_kv() -> None:
    """tp8-speculative.yaml's tensor parallelism, bfloat16 weights, fp8 KV cache and EAGLE-3 draft
    all reach the command line."""
    args = _args("tp8-speculative.yaml")
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--dtype") + 1] == "bfloat16"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {
        "method": "eagle3",
        "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
        "num_speculative_tokens": 4,
    }


@pytest.mark.parametrize(("role", "tensor"), [("prefill", "8"), ("decode", "4")])
def test_disaggregated_roles_get_kv_transfer_and_their_own_parallelism(
    role: str, tensor: str
) -> None:
    """Prefill and decode each get their own tensor parallelism, and both the NIXL connector with
    kv_role kv_both."""
    args = _args("disaggregated.yaml", role=role)
    assert args[args.index("--tensor-parallel-size") + 1] == tensor
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def test_nccl_connector_is_told_its_side() -> None:
    """P2pNcclConnector needs each side told: prefill is kv_producer and decode kv_consumer."""
    tier = make_tier("main", mode="disaggregated")
    tier["serving"]["kvTransfer"] = {"connector": "P2pNcclConnector"}
    service = parse_service(make_manifest(tiers=[tier]))
    roles = {
        role.name: json.loads(
            (a := vllm_serve_args(launch_for(role)))[a.index("--kv-transfer-config") + 1]
        )["kv_role"]
        for role in service.spec.tiers[0].roles()
    }
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}


def test_unified_has_no_kv_transfer() -> None:
    """A unified engine gets no --kv-transfer-config."""
    assert "--kv-transfer-config" not in _args("two-tier.yaml", 1)


def test_data_parallel_ranks_stay_in_the_pod() -> None:
    """Data-parallel ranks all run in the one pod: --data-parallel-size-local equals
    --data-parallel-size."""
    args = vllm_serve_args(EngineLaunch(model="m", served_name="m", data=4))
    assert args[args.index("--data-parallel-size") + 1] == "4"
    assert args[args.index("--data-parallel-size-local") + 1] == "4"


def test_prefix_caching_off_is_explicit() -> None:
    """vLLM turns prefix caching on by default; off must be said, not implied."""
    args = vllm_serve_args(EngineLaunch(model="m", served_name="m", prefix_caching=False))
    assert "--no-enable-prefix-caching" in args
    assert "--enable-prefix-caching" not in args


def test_extra_args_come_last() -> None:
    """The spec's extra args come last, so one of them can override a flag we set (argparse keeps
    the last)."""
    launch = EngineLaunch(model="m", served_name="m", extra_args=("--enforce-eager",))
    assert vllm_serve_args(launch)[-1] == "--enforce-eager"


@pytest.mark.parametrize(
    ("example", "role"),
    [
        ("two-tier.yaml", "unified"),
        ("disaggregated.yaml", "prefill"),
        ("disaggregated.yaml", "decode"),
    ],
)
def test_every_engine_publishes_kv_events_for_the_router(example: str, role: str) -> None:
    """Unified, prefill and decode engines all publish KV events on every interface (PUB 5557,
    replay 5558): the router's KV index subscribes to each of them."""
    args = _args(example, role=role)
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config == kv_events_config("tcp://*:5557", "tcp://*:5558")


def test_data_parallel_ranks_keep_event_and_replay_ports_apart() -> None:
    """vLLM adds the data-parallel rank to both KV-event ports: with 4 ranks the replay ports
    start after the 4 PUB ports (5557-5560, then 5561-5564), so no two sockets collide."""
    tier = make_tier("main", parallelism={"tensor": 1, "data": 4})
    service = parse_service(make_manifest(tiers=[tier]))
    role = service.spec.tiers[0].role("unified")
    assert role is not None
    launch = launch_for(role)
    ports = kv_event_ports(launch)
    assert [p for _, p in ports] == list(range(5557, 5565))
    assert ports[0] == ("kv-events", 5557)
    assert ports[4] == ("kv-replay", 5561)
    assert len({name for name, _ in ports}) == 8
    assert all(len(name) <= 15 for name, _ in ports)  # a Kubernetes port name
    config = json.loads(kv_events_json(launch) or "")
    assert config["replay_endpoint"] == "tcp://*:5561"


def test_kv_events_json_binds_a_given_host_and_can_be_off() -> None:
    """The same config for a reference engine on loopback (tcp://127.0.0.1:PORT), and none at
    all for a launch without an events port."""
    launch = EngineLaunch(model="m", served_name="m", kv_events_port=6001, kv_replay_port=6002)
    assert json.loads(kv_events_json(launch, "127.0.0.1") or "") == kv_events_config(
        "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002"
    )
    off = EngineLaunch(model="m", served_name="m", kv_events_port=None)
    assert kv_events_json(off) is None
    assert "--kv-events-config" not in vllm_serve_args(off)
    assert kv_event_ports(off) == []


def test_a_host_binds_the_server_and_the_kv_event_sockets() -> None:
    """Given a host (a local fleet's loopback), the HTTP server and both KV-event sockets bind
    it, and nothing else of the line changes; without one (a pod) they bind every interface."""
    launch = EngineLaunch(model="m", served_name="m", kv_events_port=6001, kv_replay_port=6002)
    pod, local = vllm_serve_args(launch), vllm_serve_args(launch, "127.0.0.1")
    assert pod[pod.index("--host") + 1] == "0.0.0.0"
    assert local[local.index("--host") + 1] == "127.0.0.1"
    events = local[local.index("--kv-events-config") + 1]
    assert events == kv_events_json(launch, "127.0.0.1")
    changed = [i for i, (a, b) in enumerate(zip(pod, local, strict=True)) if a != b]
    assert changed == [pod.index("--host") + 1, pod.index("--kv-events-config") + 1]


def test_lora_example_loads_its_adapters_at_start() -> None:
    """examples/lora.yaml: LoRA on with the spec's sizes, and each adapter registered at start
    by its name, from where the pod holds it: the Hub one in the init containers' emptyDir
    (its place in the list, then a path-safe name), the PVC one under its claim's mount."""
    args = _args("lora.yaml")
    start = args.index("--enable-lora")
    assert args[start : args.index("--kv-events-config")] == [
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "32",
        "--max-cpu-loras", "4",
        "--lora-modules", "sql=/adapters/0-sql", "support=/adapter-volumes/adapters/support/v3",
    ]  # fmt: skip


def test_lora_defaults_and_path_safe_adapter_directories() -> None:
    """Adapters without `lora` take vLLM's defaults (one in a batch, rank 16; no
    --max-cpu-loras, which vLLM then sets to max-loras); '/' and ':' in a name do not make a
    nested or odd directory. A tier with neither adapters nor `lora` gets no LoRA flag."""
    tier = make_tier(
        "main",
        adapters=[{"name": "team/sql:v2", "source": {"huggingface": {"repo": "acme/sql"}}}],
    )
    (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
    args = vllm_serve_args(launch_for(role))
    lora = args[args.index("--enable-lora") : args.index("--kv-events-config")]
    assert lora == [
        "--enable-lora",
        "--max-loras", "1",
        "--max-lora-rank", "16",
        "--lora-modules", "team/sql:v2=/adapters/0-team--sql-v2",
    ]  # fmt: skip
    (plain,) = parse_service(make_manifest(tiers=[make_tier("main")])).spec.tiers[0].roles()
    assert not any("lora" in a for a in vllm_serve_args(launch_for(plain)))


def _offload_args(size: str | int, **engine: object) -> list[str]:
    tier = make_tier("main", engine={"kvOffload": {"size": size}, **engine})
    (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
    return vllm_serve_args(launch_for(role))


def test_a_host_kv_tier_adds_vllms_offloading_flags_and_self_describing_events() -> None:
    """engine.kvOffload becomes --kv-offloading-size in GiB and the native backend, and, as
    the engine publishes KV events, a --kv-transfer-config asking only for self-describing
    host-tier events (vLLM sets the connector and its role itself), before the events."""
    args = _offload_args("64Gi")
    start = args.index("--kv-offloading-size")
    assert args[start : start + 7] == [
        "--kv-offloading-size", "64",
        "--kv-offloading-backend", "native",
        "--kv-transfer-config", '{"kv_connector_extra_config":{"self_describing_kv_events":true}}',
        "--kv-events-config",
    ]  # fmt: skip


def test_a_host_kv_tier_without_kv_events_asks_for_no_transfer_config() -> None:
    """Without KV events there is nothing to describe: no --kv-transfer-config, only the
    offloading flags."""
    tier = make_tier("main", engine={"kvOffload": {"size": "8Gi"}})
    (role,) = parse_service(make_manifest(tiers=[tier])).spec.tiers[0].roles()
    launch = replace(launch_for(role), kv_events_port=None)
    args = vllm_serve_args(launch)
    assert "--kv-transfer-config" not in args
    assert "--kv-events-config" not in args
    assert args[args.index("--kv-offloading-size") + 1] == "8"


@pytest.mark.parametrize(
    ("size", "flag", "size_bytes"),
    [
        ("64Gi", "64", 64 * 1024**3),
        ("512Mi", "0.5", 512 * 1024**2),
        ("1.5Ti", "1536", 1536 * 1024**3),
        ("100G", "93.13225746154785", 100 * 10**9),
        (123_456_789, "0.11497809458523989", 123_456_789),
        ("1.5Gi", "1.5", 3 * 512 * 1024**2),
    ],
)
def test_the_offloading_size_is_gib_that_multiply_back_to_the_specs_bytes(
    size: str | int, flag: str, size_bytes: int
) -> None:
    """vLLM reads --kv-offloading-size as GiB and multiplies by 2**30 into cpu_bytes_to_use:
    the flag is the shortest number for which that gives back exactly the spec's bytes."""
    args = _offload_args(size)
    text = args[args.index("--kv-offloading-size") + 1]
    assert text == flag
    assert float(text) * (1 << 30) == size_bytes
    assert offload_gib(size_bytes) == flag


def test_no_host_kv_tier_no_offloading_flags() -> None:
    """A tier without engine.kvOffload runs exactly as before: no offloading flag, no
    transfer config."""
    args = _args("single-tier.yaml")
    assert not {"--kv-offloading-size", "--kv-offloading-backend", "--kv-transfer-config"} & set(
        args
    )
