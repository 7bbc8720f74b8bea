"""`fleetpilot engine --backend vllm`: the exact command for every example, checks before launch."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.api import load_services
from fleetpilot.api.spec import EngineBackend
from fleetpilot.cli import main
from fleetpilot.engine.launcher import (
    LaunchError,
    check_launch,
    expand_group_env,
    launch_from_file,
    launch_from_json,
    launch_to_json,
    run,
    visible_gpus,
)
from fleetpilot.engine.vllm_args import EngineLaunch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COMMON = "--host 0.0.0.0 --port 8000"
# Every engine publishes its KV events for the router's index (PUB 5557, replay 5558).
KV_EVENTS = (
    """ --kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","""
    """"publisher":"zmq","replay_endpoint":"tcp://*:5558","topic":""}'"""
)

# The command each example's engines run, written out in full: a change to any flag must be a
# deliberate edit here, checked against `vllm serve --help`.
GOLDEN = {
    ("single-tier.yaml", "main", "unified"): (
        f"vllm serve meta-llama/Llama-3.1-8B-Instruct --served-model-name llama-8b {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 8192 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 256 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto" + KV_EVENTS
    ),
    ("host-kv-offload.yaml", "main", "unified"): (
        f"vllm serve meta-llama/Llama-3.1-8B-Instruct --served-model-name llama-8b {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 32768 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 256 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto "
        "--kv-offloading-size 128 --kv-offloading-backend native "
        """--kv-transfer-config '{"kv_connector_extra_config":{"self_describing_kv_events":"""
        """true}}'""" + KV_EVENTS
    ),
    ("two-tier.yaml", "small", "unified"): (
        f"vllm serve /models/qwen2.5-7b-instruct-awq --served-model-name qwen-7b {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 8192 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 256 --max-num-batched-tokens 8192 "
        "--block-size 16 --enable-prefix-caching --kv-cache-dtype auto --quantization awq "
        """--speculative-config '{"method":"ngram","num_speculative_tokens":5,"""
        """"prompt_lookup_max":4}'""" + KV_EVENTS
    ),
    ("two-tier.yaml", "large", "unified"): (
        f"vllm serve /models/qwen2.5-72b-instruct --served-model-name qwen-72b {COMMON} "
        "--tensor-parallel-size 4 --pipeline-parallel-size 1 --dtype auto "
        "--max-model-len 32768 --gpu-memory-utilization 0.9 --max-num-seqs 256 "
        "--block-size 16 --enable-prefix-caching --kv-cache-dtype auto" + KV_EVENTS
    ),
    ("lora.yaml", "main", "unified"): (
        f"vllm serve meta-llama/Llama-3.1-8B-Instruct --served-model-name llama-3.1-8b {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 16384 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 256 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto --enable-lora --max-loras 2 "
        "--max-lora-rank 32 --max-cpu-loras 4 --lora-modules sql=/adapters/0-sql "
        "support=/adapter-volumes/adapters/support/v3" + KV_EVENTS
    ),
    ("lora-dynamic.yaml", "main", "unified"): (
        f"vllm serve Qwen/Qwen2.5-7B-Instruct --served-model-name qwen-7b {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 8192 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 256 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto --enable-lora --max-loras 2 "
        "--max-lora-rank 16" + KV_EVENTS
    ),
    ("local-two-tier.yaml", "small", "unified"): (
        f"vllm serve Qwen/Qwen2.5-0.5B-Instruct --served-model-name small-model {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 2048 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 16 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto" + KV_EVENTS
    ),
    ("local-two-tier.yaml", "large", "unified"): (
        f"vllm serve Qwen/Qwen2.5-1.5B-Instruct --served-model-name large-model {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 2048 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 16 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto" + KV_EVENTS
    ),
    ("disaggregated.yaml", "main", "prefill"): (
        f"vllm serve /models/llama-3.1-70b-instruct --served-model-name llama-70b {COMMON} "
        "--tensor-parallel-size 8 --pipeline-parallel-size 1 --dtype auto "
        "--max-model-len 65536 --gpu-memory-utilization 0.9 --max-num-seqs 128 "
        "--max-num-batched-tokens 16384 --block-size 16 --enable-prefix-caching "
        "--kv-cache-dtype auto "
        """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'"""
        + KV_EVENTS
    ),
    ("disaggregated.yaml", "main", "decode"): (
        f"vllm serve /models/llama-3.1-70b-instruct --served-model-name llama-70b {COMMON} "
        "--tensor-parallel-size 4 --pipeline-parallel-size 1 --dtype auto "
        "--max-model-len 65536 --gpu-memory-utilization 0.9 --max-num-seqs 128 "
        "--max-num-batched-tokens 16384 --block-size 16 --enable-prefix-caching "
        "--kv-cache-dtype auto "
        """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'"""
        + KV_EVENTS
    ),
    ("tp8-speculative.yaml", "main", "unified"): (
        "vllm serve meta-llama/Llama-3.3-70B-Instruct --served-model-name llama-70b-spec "
        f"{COMMON} --tensor-parallel-size 8 --pipeline-parallel-size 1 --dtype bfloat16 "
        "--max-model-len 32768 --gpu-memory-utilization 0.92 --max-num-seqs 128 "
        "--block-size 16 --enable-prefix-caching --kv-cache-dtype fp8 "
        """--speculative-config '{"method":"eagle3","model":"""
        """"yuhuili/EAGLE3-LLaMA3.3-Instruct-70B","num_speculative_tokens":4}'""" + KV_EVENTS
    ),
    ("tenants.yaml", "small", "unified"): (
        f"vllm serve Qwen/Qwen2.5-7B-Instruct --served-model-name qwen-7b {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --dtype auto --max-model-len 8192 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 256 --block-size 16 "
        "--enable-prefix-caching --kv-cache-dtype auto" + KV_EVENTS
    ),
    ("tenants.yaml", "large", "unified"): (
        f"vllm serve Qwen/Qwen2.5-72B-Instruct --served-model-name qwen-72b {COMMON} "
        "--tensor-parallel-size 4 --pipeline-parallel-size 1 --dtype auto "
        "--max-model-len 32768 --gpu-memory-utilization 0.9 --max-num-seqs 256 "
        "--block-size 16 --enable-prefix-caching --kv-cache-dtype auto" + KV_EVENTS
    ),
    ("deepseek-wide-ep.yaml", "main", "prefill"): (
        f"vllm serve /models/deepseek-v3 --served-model-name deepseek-v3 {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --data-parallel-size 8 "
        "--data-parallel-size-local 8 --enable-expert-parallel --dtype auto "
        "--max-model-len 32768 --gpu-memory-utilization 0.9 --max-num-seqs 256 "
        "--max-num-batched-tokens 16384 --block-size 16 --enable-prefix-caching "
        "--kv-cache-dtype auto --quantization fp8 "
        """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'"""
        # Eight ranks publish on 5557..5564, so replay starts after them.
        + KV_EVENTS.replace("5558", "5565")
    ),
    # The leader of a 2-node group: 8 of the 16 data-parallel ranks, the API, the coordinator.
    ("deepseek-wide-ep.yaml", "main", "decode"): (
        f"vllm serve /models/deepseek-v3 --served-model-name deepseek-v3 {COMMON} "
        "--tensor-parallel-size 1 --pipeline-parallel-size 1 --data-parallel-size 16 "
        "--data-parallel-size-local 8 --nnodes 2 --node-rank 0 "
        "--master-addr '$(LWS_LEADER_ADDRESS)' --master-port 29501 "
        "--data-parallel-rpc-port 29550 --enable-expert-parallel --enable-eplb "
        """--eplb-config '{"num_redundant_experts":32}' --dtype auto """
        "--max-model-len 32768 --gpu-memory-utilization 0.9 --max-num-seqs 256 "
        "--max-num-batched-tokens 16384 --block-size 16 --enable-prefix-caching "
        "--kv-cache-dtype auto --quantization fp8 "
        """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'"""
        + KV_EVENTS.replace("5558", "5573")
    ),
    ("llama-405b-multinode.yaml", "main", "unified"): (
        "vllm serve /models/llama-3.1-405b-instruct --served-model-name llama-405b "
        f"{COMMON} --tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2 "
        "--node-rank 0 --master-addr '$(LWS_LEADER_ADDRESS)' --master-port 29501 "
        "--dtype bfloat16 --max-model-len 32768 --gpu-memory-utilization 0.9 "
        "--max-num-seqs 64 --block-size 16 --enable-prefix-caching --kv-cache-dtype fp8" + KV_EVENTS
    ),
}
# The workers of the multi-node replicas: headless, each told its index by the LWS controller.
WORKER_GOLDEN = {
    ("deepseek-wide-ep.yaml", "main", "decode"): GOLDEN[("deepseek-wide-ep.yaml", "main", "decode")]
    .replace("--node-rank 0", "--node-rank '$(LWS_WORKER_INDEX)'")
    .replace("--data-parallel-rpc-port 29550", "--data-parallel-rpc-port 29550 --headless"),
    ("llama-405b-multinode.yaml", "main", "unified"): GOLDEN[
        ("llama-405b-multinode.yaml", "main", "unified")
    ]
    .replace("--node-rank 0", "--node-rank '$(LWS_WORKER_INDEX)'")
    .replace("--master-port 29501", "--master-port 29501 --headless"),
}


def test_every_example_role_has_a_golden_command() -> None:
    """Every role of every example's vLLM tiers has a golden command, and no golden command is
    left for a role that no longer exists."""
    roles = set()
    for path in EXAMPLES.glob("*.yaml"):
        for service in load_services(path):
            for tier in service.spec.tiers:
                if tier.engine.backend is EngineBackend.VLLM:
                    roles |= {(path.name, tier.name, role) for role in tier.role_names}
    assert roles == set(GOLDEN)


def test_a_reference_tier_is_not_launched_as_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    """The vLLM launcher refuses a tier of the CPU reference engine rather than print (or
    exec) a `vllm serve` line its pods never run."""
    argv = ["engine", "--backend", "vllm", "-f", str(EXAMPLES / "cpu-two-tier.yaml")]
    assert main([*argv, "--tier", "small", "--role", "unified", "--dry-run"]) != 0
    assert "tier 'small' runs engine.backend reference, not vLLM" in capsys.readouterr().err


@pytest.mark.parametrize(("example", "tier", "role"), sorted(GOLDEN))
def test_dry_run_prints_the_exact_command(
    example: str, tier: str, role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetpilot engine --dry-run` prints exactly the golden `vllm serve` command for each example
    role."""
    argv = ["engine", "--backend", "vllm", "-f", str(EXAMPLES / example), "--tier", tier]
    assert main([*argv, "--role", role, "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == GOLDEN[(example, tier, role)]


@pytest.mark.parametrize(("example", "tier", "role"), sorted(WORKER_GOLDEN))
def test_dry_run_prints_the_workers_command(
    example: str, tier: str, role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--worker` prints the golden line of a multi-node replica's workers: headless, their node
    rank left to the LWS controller's variable."""
    argv = ["engine", "--backend", "vllm", "-f", str(EXAMPLES / example), "--tier", tier]
    assert main([*argv, "--role", role, "--worker", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == WORKER_GOLDEN[(example, tier, role)]


def test_worker_of_a_one_node_replica_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`--worker` for a replica that fits on one node is an error, not a headless engine that
    waits for a leader that never comes."""
    argv = ["engine", "--backend", "vllm", "-f", str(EXAMPLES / "single-tier.yaml")]
    assert main([*argv, "--tier", "main", "--worker", "--dry-run"]) == 2
    assert "fits on one" in capsys.readouterr().err


def test_group_variables_are_expanded_as_the_kubelet_does() -> None:
    """The launcher fills in the LWS controller's variables itself (it execs vllm, no kubelet
    expands them), and refuses to start without them."""
    command = [
        "vllm",
        "serve",
        "--node-rank",
        "$(LWS_WORKER_INDEX)",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
        "--x",
        "$(HOME)",
    ]
    env = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "svc-0.svc.ml", "HOME": "/root"}
    assert expand_group_env(command, env) == [
        "vllm",
        "serve",
        "--node-rank",
        "1",
        "--master-addr",
        "svc-0.svc.ml",
        "--x",
        "$(HOME)",
    ]
    with pytest.raises(LaunchError, match="LWS_WORKER_INDEX is not set"):
        expand_group_env(command, {"LWS_LEADER_ADDRESS": "svc-0.svc.ml"})


def test_a_worker_pod_checks_its_own_share_of_gpus() -> None:
    """A pod of a 16-GPU replica over 2 nodes needs 8 visible GPUs, not 16."""
    launch = launch_from_file(EXAMPLES / "llama-405b-multinode.yaml", "main", "unified")
    check_launch(replace(launch, model="llama"), gpus=8)
    with pytest.raises(LaunchError, match=r"needs 8 GPUs \(.* / 2 nodes\)"):
        check_launch(replace(launch, model="llama"), gpus=4)


@pytest.mark.parametrize(
    ("example", "tier", "role"),
    [
        ("two-tier.yaml", "small", "unified"),
        ("lora.yaml", "main", "unified"),
        ("lora-dynamic.yaml", "main", "unified"),
        ("deepseek-wide-ep.yaml", "main", "decode"),
    ],
)
def test_launch_json_round_trips(example: str, tier: str, role: str) -> None:
    """What the planner writes as --launch-json reads back as the same EngineLaunch, nothing dropped
    or defaulted (speculation, LoRA sizes and adapters, nodes and EPLB included)."""
    launch = launch_from_file(EXAMPLES / example, tier, role)
    assert launch_from_json(launch_to_json(launch)) == launch


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[]", "must be a JSON object"),
        ('{"model": "m", "served_name": "m", "gpus": 4}', "unknown keys: gpus"),
        ('{"model": "m"}', "served_name"),
        ('{"model": "m", "served_name": "m", "lora": {"max_loras": 1}}', "max_lora_rank"),
        (
            '{"model": "m", "served_name": "m", "lora": {"max_loras": 1, "max_lora_rank": 8, '
            '"modules": [["only-a-name"]]}}',
            "not enough values",
        ),
    ],
)
def test_bad_launch_json_is_refused(text: str, message: str) -> None:
    """Broken --launch-json (not JSON, not an object, unknown keys, a missing field) is refused with
    what is wrong, before vLLM starts."""
    with pytest.raises(LaunchError, match=message):
        launch_from_json(text)


@pytest.mark.parametrize(
    ("tier", "role", "message"),
    [("huge", "unified", "no tier 'huge'"), ("main", "unified", "has no role 'unified'")],
)
def test_unknown_tier_or_role_is_refused(tier: str, role: str, message: str) -> None:
    """A tier not in the file, or a role the tier does not have (unified in a disaggregated tier),
    is refused by name."""
    with pytest.raises(LaunchError, match=message):
        launch_from_file(EXAMPLES / "disaggregated.yaml", tier, role)


def test_too_few_gpus_is_refused_before_loading() -> None:
    """Needing more GPUs (tensor x pipeline x data) than are visible is refused before vLLM loads
    weights; enough GPUs, or an unknown count, passes."""
    launch = EngineLaunch(model="m", served_name="m", tensor=4, data=2)
    with pytest.raises(LaunchError, match=r"needs 8 GPUs .* but 4 are visible"):
        check_launch(launch, gpus=4)
    check_launch(launch, gpus=8)
    check_launch(launch, gpus=None)  # unknown: not guessed


def test_missing_model_directory_is_refused() -> None:
    """A local model path that does not exist (the volume not mounted) is refused before vLLM
    starts."""
    launch = EngineLaunch(model="/models/absent", served_name="m")
    with pytest.raises(LaunchError, match="does not exist"):
        check_launch(launch, gpus=1, path_exists=lambda _: False)


def test_connector_only_for_disaggregated_roles() -> None:
    """A KV connector is refused on a unified engine, and a prefill or decode engine without one is
    refused too."""
    with pytest.raises(LaunchError, match="KV connector"):
        check_launch(EngineLaunch(model="m", served_name="m", kv_connector="NixlConnector"), gpus=1)
    with pytest.raises(LaunchError, match="KV connector"):
        check_launch(EngineLaunch(model="m", served_name="m", role="decode"), gpus=1)


@pytest.mark.parametrize(
    ("value", "count"), [("0,1,2,3", 4), ("", 0), ("-1", 0), ("GPU-a1b2,GPU-c3d4", 2)]
)
def test_visible_gpus_from_the_device_plugin(value: str, count: int) -> None:
    """GPUs are counted from CUDA_VISIBLE_DEVICES as the device plugin sets it (indices or UUIDs;
    empty or -1 is none); without it the count is unknown, not guessed."""
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == count
    assert visible_gpus({}) is None


def _exec_recorded(tmp_path: Path, launch: EngineLaunch) -> tuple[dict[str, Any], int]:
    """Run the launcher with a `vllm` on PATH that records its argv, pid and the runtime-LoRA
    env var; what it recorded, and the launcher's pid."""
    record = tmp_path / "argv.json"
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "lora = os.environ.get('VLLM_ALLOW_RUNTIME_LORA_UPDATING')\n"
        f"json.dump({{'argv': sys.argv[1:], 'pid': os.getpid(), 'lora': lora}}, "
        f"open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0"}
    env.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetpilot", "engine", "--backend", "vllm",
         "--launch-json", launch_to_json(launch)],
        env=env,
    )  # fmt: skip
    assert process.wait(timeout=60) == 0
    return json.loads(record.read_text()), process.pid


def test_exec_hands_vllm_the_exact_arguments(tmp_path: Path) -> None:
    """The launcher replaces itself with `vllm serve`: with a `vllm` on PATH that records its
    argv, the JSON flags arrive unquoted and intact, and the launcher's pid is vLLM's."""
    weights = tmp_path / "qwen2.5-7b-instruct-awq"
    weights.mkdir()
    launch = replace(
        launch_from_file(EXAMPLES / "two-tier.yaml", "small", "unified"), model=str(weights)
    )
    recorded, pid = _exec_recorded(tmp_path, launch)
    expected = GOLDEN[("two-tier.yaml", "small", "unified")].replace(
        "/models/qwen2.5-7b-instruct-awq", str(weights)
    )
    assert ["vllm", *recorded["argv"]] == shlex.split(expected)
    assert recorded["pid"] == pid
    assert recorded["lora"] is None


def test_exec_turns_on_runtime_lora_updating_for_dynamic_adapters(tmp_path: Path) -> None:
    """A `lora.dynamic` launch: vLLM serves the load/unload endpoints the operator calls only
    with VLLM_ALLOW_RUNTIME_LORA_UPDATING set, so the launcher sets it."""
    launch = launch_from_file(EXAMPLES / "lora-dynamic.yaml", "main", "unified")
    recorded, _ = _exec_recorded(tmp_path, launch)
    assert ["vllm", *recorded["argv"]] == shlex.split(
        GOLDEN[("lora-dynamic.yaml", "main", "unified")]
    )
    assert recorded["lora"] == "True"


def test_refusal_exits_before_exec(capsys: pytest.CaptureFixture[str]) -> None:
    """Four GPUs wanted, one visible: an error and exit 2, no vLLM start."""
    launch = launch_from_file(EXAMPLES / "two-tier.yaml", "large", "unified")
    args = argparse.Namespace(
        file=None, launch_json=launch_to_json(launch), worker=False, dry_run=False
    )
    assert run(args, environ={"CUDA_VISIBLE_DEVICES": "0"}) == 2
    assert "needs 4 GPUs" in capsys.readouterr().err
