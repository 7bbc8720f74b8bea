"""Every pod of every multi-node replica the examples plan, as the pinned vLLM would start it.

A replica larger than a node runs as a LeaderWorkerSet group: the leader and the workers run
``vllm serve`` lines that differ only in ``--node-rank $(LWS_WORKER_INDEX)`` and
``--headless``, and vLLM cuts the replica from them itself (``create_engine_config``: nnodes,
node rank, data-parallel rank and size per node). These tests give each pod's line - with
``$(LWS_...)`` expanded as the kubelet expands it for pod ``i`` of a group - to vLLM's own
dispatch and config code (the judge's ``parallel`` op, on a tiny local checkpoint shaped like
the example's model) and check that the pods add up to the replica the spec asked for: one
master everyone meets at, the data-parallel ranks or the model's workers each started exactly
once, expert parallelism and EPLB where the spec turns them on.

Besides the examples' replicas, a few spec-built ones cover the layout's other cuts (one rank
per node, a model over four nodes, expert parallelism over tensor-parallel ranks).

Each check is also run against a broken group (a wrong ``--node-rank``, ranks per node that
are the replica's, a worker without ``--headless``...): it must fail, and say why, so no check
passes for a line vLLM would cut into a different replica.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.api import InferenceService, ResolvedRole, load_services, parse_service
from fleetpilot.api.layout import ReplicaLayout, Span, role_layout
from fleetpilot.engine.launcher import expand_group_env
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.engine.vllm_args import DATA_PARALLEL_RPC_PORT, MASTER_PORT
from fleetpilot.kube.names import leader_worker_set_name, spans_nodes
from fleetpilot.operator.engine_objects import engine_command
from tests.contract.conftest import VllmJudge
from tests.factories import make_manifest, make_tier

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# Tiny checkpoints with the shape of the examples' models (config only: vLLM builds the engine
# config from config.json and the tokenizer, no weights are read). Head counts divide the
# examples' tensor-parallel sizes, positions cover their maxModelLen.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 16,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
# DeepSeek-V3's layout at a fraction of the width: MLA attention, 256 routed experts (8 per
# token in 8 groups) and a shared one, the first layer dense; fp8 block-quantized as shipped.
TINY_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 258,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    },
}


def write_config_checkpoint(directory: Path, config: dict[str, Any]) -> Path:
    """A checkpoint folder ``vllm serve`` configures an engine from: ``config`` and the
    reference engine's tokenizer (as the ``tiny_checkpoint`` fixture has it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in REFERENCE_TOKENIZER.glob("*.json"):
        shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A dense and a mixture-of-experts checkpoint, by kind."""
    root = tmp_path_factory.mktemp("multi-node-checkpoints")
    return {
        "dense": write_config_checkpoint(root / "tiny-llama", TINY_LLAMA),
        "moe": write_config_checkpoint(root / "tiny-deepseek-v3", TINY_DEEPSEEK_V3),
    }


@dataclass(frozen=True)
class Case:
    """One multi-node role of one example."""

    example: str
    service: InferenceService
    role: ResolvedRole

    @property
    def id(self) -> str:
        return f"{self.example}:{self.service.name}/{self.role.tier.name}/{self.role.name}"

    @property
    def layout(self) -> ReplicaLayout:
        return role_layout(self.role)

    @property
    def checkpoint_kind(self) -> str:
        # Expert parallelism is for a mixture-of-experts model (vLLM checks is_moe).
        return "moe" if self.role.parallelism.expert else "dense"

    @property
    def leader_address(self) -> str:
        """``LWS_LEADER_ADDRESS`` of the group's leader pod: its DNS name under the group's
        headless Service (``<set>-<group>.<set>.<namespace>``), group 0."""
        lws = leader_worker_set_name(self.service.name, self.role.tier.name, self.role.name)
        return f"{lws}-0.{lws}.{self.service.namespace}"


CASES = [
    Case(example.name, service, role)
    for example in EXAMPLES
    for service in load_services(example)
    for tier in service.spec.tiers
    for role in tier.roles()
    if spans_nodes(role)
]


def spec_case(name: str, parallelism: dict[str, Any], **tier_extra: Any) -> Case:
    """A one-tier service whose replica spans nodes of 8 GPUs, beyond the examples' shapes."""
    tier = make_tier("main", parallelism=parallelism, **tier_extra)
    service = parse_service(make_manifest(name=name, tiers=[tier]))
    (role,) = service.spec.tiers[0].roles()
    assert spans_nodes(role), name
    return Case("spec", service, role)


# Other cuts the layout makes: one rank per node, a model over four nodes, expert parallelism
# over tensor-parallel ranks with EPLB tuned.
SPEC_CASES = [
    spec_case("rank-per-node", {"tensor": 2, "pipeline": 4, "data": 4}),
    spec_case("model-four-nodes", {"tensor": 8, "pipeline": 4}),
    spec_case(
        "moe-tp2",
        {
            "tensor": 2,
            "data": 8,
            "dataLocal": 2,
            "expert": True,
            "eplb": {"redundantExperts": 16, "windowSize": 500, "stepInterval": 1000},
        },
    ),
]


def pod_argvs(case: Case, checkpoint: Path) -> list[list[str]]:
    """The ``vllm serve`` arguments of pods 0 (the leader) .. nodes-1 of one group, as the
    kubelet expands the planned container args with the variables the LWS controller sets,
    the model path replaced by a local checkpoint."""
    nodes = case.layout.nodes
    leader = engine_command(case.service, case.role)
    worker = engine_command(case.service, case.role, worker=True)
    argvs = []
    for index in range(nodes):
        environ = {
            "LWS_LEADER_ADDRESS": case.leader_address,
            "LWS_WORKER_INDEX": str(index),
            "LWS_GROUP_SIZE": str(nodes),
        }
        command = expand_group_env(leader if index == 0 else worker, environ)
        assert command[:2] == ["vllm", "serve"]
        assert not command[2].startswith("-"), command  # the model, positional
        argvs.append([str(checkpoint), *command[3:]])
    return argvs


def judge_pods(judge: VllmJudge, argvs: list[list[str]]) -> list[dict[str, Any]]:
    return [judge.ask({"op": "parallel", "argv": argv}) for argv in argvs]


def engines_of(answer: dict[str, Any]) -> list[int]:
    """The data-parallel ranks (engine cores) a pod starts."""
    launch = answer["launch"]
    if launch["kind"] == "api_server":
        return list(launch["local_engines"])
    if launch["kind"] == "engine_proc_manager":
        start = launch["start_index"]
        return list(range(start, start + launch["local_engine_count"]))
    return []  # a multiproc executor's workers serve an engine that runs elsewhere


def expect(where: str, name: str, got: Any, want: Any) -> None:
    """One value vLLM derived, with what it is and whose in the message."""
    assert got == want, f"{where}: {name} {got!r}, not {want!r}"


def check_group(case: Case, answers: list[dict[str, Any]]) -> None:
    """What vLLM derived for every pod of one group adds up to the replica the spec asks for."""
    for index, answer in enumerate(answers):
        assert answer["ok"], f"pod {index}: vLLM refused its line: {answer['error']}"
    # What vLLM derived first (each pod's ranks, what it starts), then what it read.
    if case.layout.span is Span.DATA:
        check_data_span(case, answers)
    else:
        assert case.layout.span is Span.MODEL
        check_model_span(case, answers)
    check_agreement(case, answers)
    check_experts(case, answers)


def check_data_span(case: Case, answers: list[dict[str, Any]]) -> None:
    """Data-parallel ranks spread over nodes: pod ``i`` runs ranks ``i x dataLocal ...`` (the
    leader through its API server, workers through a headless engine manager handshaking with
    the leader), each rank within its node, one internal load balancer at the leader."""
    spec, layout = case.role.parallelism, case.layout
    local = layout.data_local
    if spec.data_local is not None:
        assert local == spec.data_local
    leader = answers[0]["parallel"]
    expect("pod 0", "data_parallel_external_lb", leader["data_parallel_external_lb"], False)
    expect("pod 0", "data_parallel_hybrid_lb", leader["data_parallel_hybrid_lb"], False)
    expect("pod 0", "local_engines_only", leader["local_engines_only"], False)
    handshakes = answers[0]["launch"].get("handshake_engines")
    expect("pod 0", "handshake_engines", handshakes, list(range(spec.data)))
    for index, answer in enumerate(answers):
        pod, where = answer["parallel"], f"pod {index}"
        expect(where, "data_parallel_size_local", pod["data_parallel_size_local"], local)
        expect(where, "data_parallel_rank", pod["data_parallel_rank"], index * local)
        expect(where, "data_parallel_external_lb", pod["data_parallel_external_lb"], False)
        # One data-parallel rank's world within a node.
        expect(where, "nnodes_within_dp", pod["nnodes_within_dp"], 1)
        expect(where, "node_rank_within_dp", pod["node_rank_within_dp"], 0)
        expect(where, "world_size", pod["world_size"], spec.tensor * spec.pipeline)
        expect(where, "local_world_size", pod["local_world_size"], spec.tensor * spec.pipeline)
        launch = answer["launch"]
        if index > 0:
            expect(where, "launch", launch["kind"], "engine_proc_manager")
            expect(where, "start_index", launch["start_index"], index * local)
            expect(where, "local_engine_count", launch["local_engine_count"], local)
            address = f"tcp://{case.leader_address}:{DATA_PARALLEL_RPC_PORT}"
            expect(where, "handshake_address", launch["handshake_address"], address)
    started = sorted(rank for answer in answers for rank in engines_of(answer))
    expect("group", "ranks started", started, list(range(spec.data)))


def check_model_span(case: Case, answers: list[dict[str, Any]]) -> None:
    """One model copy over the nodes: one engine (the leader's) whose executor has workers on
    every node, ``gpusPerNode`` each; the workers' pods run a multiproc executor that joins
    the leader's torch.distributed group."""
    spec, layout = case.role.parallelism, case.layout
    gpus_per_node = case.role.tier.resources.gpus_per_node
    assert layout.gpus_per_pod == gpus_per_node
    world = spec.tensor * spec.pipeline
    for index, answer in enumerate(answers):
        pod, where = answer["parallel"], f"pod {index}"
        expect(where, "world_size", pod["world_size"], world)
        expect(where, "local_world_size", pod["local_world_size"], gpus_per_node)
        expect(where, "nnodes_within_dp", pod["nnodes_within_dp"], layout.nodes)
        expect(where, "node_rank_within_dp", pod["node_rank_within_dp"], index)
        expect(where, "data_parallel_size_local", pod["data_parallel_size_local"], 1)
        expect(where, "data_parallel_rank", pod["data_parallel_rank"], 0)
        launch = answer["launch"]
        if index == 0:
            expect(where, "local_engines", launch.get("local_engines"), [0])
        else:
            expect(where, "launch", launch["kind"], "multiproc_executor")
            head = f"{case.leader_address}:{MASTER_PORT}"
            expect(where, "head_node_address", launch["head_node_address"], head)
    workers = sorted(r for answer in answers for r in answer["launch"]["executor_worker_ranks"])
    expect("group", "worker ranks started", workers, list(range(world)))


def check_agreement(case: Case, answers: list[dict[str, Any]]) -> None:
    """Every pod: the group's size, its own index, one rendezvous at the leader; the leader
    serves the API, every worker runs headless."""
    spec, layout = case.role.parallelism, case.layout
    leader = answers[0]["parallel"]
    expect("pod 0", "launch", answers[0]["launch"]["kind"], "api_server")
    for index, answer in enumerate(answers):
        pod, where = answer["parallel"], f"pod {index}"
        expect(where, "headless", answer["headless"], index > 0)
        expect(where, "nnodes", pod["nnodes"], layout.nodes)
        expect(where, "node_rank", pod["node_rank"], index)
        expect(where, "master_addr", pod["master_addr"], case.leader_address)
        expect(where, "master_port", pod["master_port"], MASTER_PORT)
        for name in ("data_parallel_master_ip", "data_parallel_rpc_port"):
            expect(where, name, pod[name], leader[name])
        expect(where, "tensor_parallel_size", pod["tensor_parallel_size"], spec.tensor)
        expect(where, "pipeline_parallel_size", pod["pipeline_parallel_size"], spec.pipeline)
        expect(where, "data_parallel_size", pod["data_parallel_size"], spec.data)
        expect(where, "data_parallel_backend", pod["data_parallel_backend"], "mp")
    if spec.data > 1:
        # Remote engines hand-shake with the leader's data-parallel coordinator.
        ip, port = leader["data_parallel_master_ip"], leader["data_parallel_rpc_port"]
        expect("pod 0", "data_parallel_master_ip", ip, case.leader_address)
        expect("pod 0", "data_parallel_rpc_port", port, DATA_PARALLEL_RPC_PORT)


def check_experts(case: Case, answers: list[dict[str, Any]]) -> None:
    """Expert parallelism over the replica's ranks and EPLB with the spec's redundant experts,
    on every pod alike."""
    spec = case.role.parallelism
    for index, answer in enumerate(answers):
        pod, where = answer["parallel"], f"pod {index}"
        expect(where, "enable_expert_parallel", pod["enable_expert_parallel"], spec.expert)
        if spec.expert:
            expect(where, "is_moe", answer["model"]["is_moe"], True)
        expect(where, "enable_eplb", pod["enable_eplb"], spec.eplb is not None)
        eplb = pod["eplb_config"]
        redundant = spec.eplb.redundant_experts if spec.eplb is not None else 0
        expect(where, "num_redundant_experts", eplb["num_redundant_experts"], redundant)
        if spec.eplb is not None and spec.eplb.window_size is not None:
            expect(where, "eplb window_size", eplb["window_size"], spec.eplb.window_size)
        if spec.eplb is not None and spec.eplb.step_interval is not None:
            expect(where, "eplb step_interval", eplb["step_interval"], spec.eplb.step_interval)
        expect(where, "eplb_config", eplb, answers[0]["parallel"]["eplb_config"])


def test_the_examples_plan_both_kinds_of_multi_node_replica() -> None:
    """The examples hold a replica of each cut (data-parallel ranks over nodes, one model over
    nodes), so the checks below are not vacuous."""
    assert {case.layout.span for case in CASES} == {Span.DATA, Span.MODEL}
    assert any(case.role.parallelism.eplb is not None for case in CASES)


@pytest.mark.parametrize("case", CASES + SPEC_CASES, ids=lambda case: case.id)
def test_every_pod_of_a_multi_node_replica_takes_its_part(
    vllm_judge: VllmJudge, checkpoints: dict[str, Path], case: Case
) -> None:
    """The leader's and each worker's planned line, as vLLM reads them on pod 0 .. N-1: they
    agree on the group and the rendezvous, the ranks (or the model's workers) are each started
    once on the right node, expert parallelism and EPLB as the spec says."""
    answers = judge_pods(vllm_judge, pod_argvs(case, checkpoints[case.checkpoint_kind]))
    check_group(case, answers)


Mutation = Callable[[Case, int, list[str]], None]


def _set(flag: str, value: str | Callable[[Case], str], pods: Callable[[int], bool]) -> Mutation:
    """``flag``'s value replaced on the pods ``pods`` selects (by index)."""

    def mutate(case: Case, index: int, argv: list[str]) -> None:
        if pods(index):
            argv[argv.index(flag) + 1] = value if isinstance(value, str) else value(case)

    return mutate


def _drop(flag: str, takes_value: bool, pods: Callable[[int], bool]) -> Mutation:
    """``flag`` (and its value) left out on the pods ``pods`` selects."""

    def mutate(case: Case, index: int, argv: list[str]) -> None:
        if pods(index):
            at = argv.index(flag)
            del argv[at : at + (2 if takes_value else 1)]

    return mutate


def _both(first: Mutation, second: Mutation) -> Mutation:
    def mutate(case: Case, index: int, argv: list[str]) -> None:
        first(case, index, argv)
        second(case, index, argv)

    return mutate


def _workers(index: int) -> bool:
    return index > 0


def _every(index: int) -> bool:
    return True


def _always(case: Case) -> bool:
    return True


@dataclass(frozen=True)
class Breakage:
    """A plausible bug in the planned lines, the replicas it applies to, and what the checks
    must say about it (a regular expression of the failure)."""

    name: str
    mutate: Mutation
    caught_as: str
    applies: Callable[[Case], bool] = _always


# Leaving out --data-parallel-size-local is not among them: with --nnodes, vLLM infers the
# same count (local world size / one rank's world), so the line starts the same replica.
BREAKAGES = [
    # Workers not told their index (the literal 0, or the leader's line on every pod).
    Breakage(
        "worker-node-rank-0",
        _set("--node-rank", "0", _workers),
        r"pod 1: (data_parallel_rank|node_rank_within_dp) 0, not",
    ),
    Breakage(
        "worker-not-headless",
        _drop("--headless", False, _workers),
        r"pod 1: (vLLM refused its line: .*data_parallel_rank 0|launch 'api_server', not)",
    ),
    Breakage(
        "no-nnodes",
        _drop("--nnodes", True, _every),
        r"(data_parallel_rank 0|local_world_size \d+), not",
    ),
    Breakage(
        "worker-meets-itself",
        _set("--master-addr", "10.0.0.2", _workers),
        r"pod 1: (handshake_address 'tcp://|head_node_address ')10\.0\.0\.2:",
    ),
    Breakage(
        "worker-master-port",
        _set("--master-port", "29502", _workers),
        r"pod 1: (master_port 29502|head_node_address '[^']*:29502'), not",
    ),
    # The replica's ranks per pod instead of the node's (what a one-node replica writes).
    Breakage(
        "data-local-is-data",
        _set("--data-parallel-size-local", lambda case: str(case.role.parallelism.data), _every),
        r"pod 0: data_parallel_size_local \d+, not",
        lambda case: case.layout.span is Span.DATA,
    ),
    Breakage(
        "worker-rpc-port",
        _set("--data-parallel-rpc-port", "29551", _workers),
        r"pod 1: handshake_address '[^']*:29551', not",
        lambda case: case.role.parallelism.data > 1,
    ),
    Breakage(
        "no-redundant-experts",
        _set("--eplb-config", '{"num_redundant_experts":0}', _every),
        r"pod 0: num_redundant_experts 0, not",
        lambda case: case.role.parallelism.eplb is not None,
    ),
    Breakage(
        "no-expert-parallel",
        _drop("--enable-expert-parallel", False, _every),
        r"(?s)vLLM refused its line: .*enable_expert_parallel must be True to use EPLB",
        lambda case: case.role.parallelism.eplb is not None,
    ),
    Breakage(
        "eplb-config-dropped",
        _drop("--eplb-config", True, _every),
        r"pod 0: num_redundant_experts 0, not",
        lambda case: case.role.parallelism.eplb is not None,
    ),
    Breakage(
        "no-eplb",
        _both(_drop("--enable-eplb", False, _every), _drop("--eplb-config", True, _every)),
        r"pod 0: enable_eplb False, not True",
        lambda case: case.role.parallelism.eplb is not None,
    ),
]
BROKEN = [
    pytest.param(case, breakage, id=f"{case.id}-{breakage.name}")
    for case in CASES
    for breakage in BREAKAGES
    if breakage.applies(case)
]


@pytest.mark.parametrize(("case", "breakage"), BROKEN)
def test_the_checks_catch_a_broken_group(
    vllm_judge: VllmJudge, checkpoints: dict[str, Path], case: Case, breakage: Breakage
) -> None:
    """Each plausible mistake in the lines makes vLLM cut a different replica (or refuse the
    line), and the checks above say so."""
    argvs = pod_argvs(case, checkpoints[case.checkpoint_kind])
    for index, argv in enumerate(argvs):
        breakage.mutate(case, index, argv)
    answers = judge_pods(vllm_judge, argvs)
    with pytest.raises(AssertionError, match=breakage.caught_as):
        check_group(case, answers)


def test_workers_of_a_replica_with_runtime_lora_loading_start(
    vllm_judge: VllmJudge, checkpoints: dict[str, Path]
) -> None:
    """``lora.dynamic`` with data-parallel ranks: the planner pins one API server (vLLM
    refuses runtime LoRA loading with more), which only the leader runs - a headless worker
    given ``--api-server-count`` is refused by ``vllm serve``."""
    case = spec_case(
        "lora-rank-per-node",
        {"tensor": 2, "pipeline": 4, "data": 4},
        adapters=[{"name": "sql", "source": {"huggingface": {"repo": "acme/sql-lora"}}}],
        lora={"maxLoras": 2, "maxLoraRank": 16, "dynamic": True},
    )
    answers = judge_pods(vllm_judge, pod_argvs(case, checkpoints[case.checkpoint_kind]))
    check_group(case, answers)
    # The one API server, on the leader.
    expect("pod 0", "entrypoint", answers[0]["entrypoint"], "run_server")
