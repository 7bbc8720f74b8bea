"""Every ``vllm serve`` line the planner writes, judged by the pinned vLLM's own parser.

The golden strings in ``tests/engine/test_vllm_args.py`` pin what fleetpilot writes; these
tests pin that vLLM reads it as meant: the line parses with the parser ``vllm serve`` builds
(``vllm/entrypoints/cli/serve.py``, ``EngineArgs.add_cli_args``) and the ``EngineArgs`` it
yields carry the values the InferenceService asked for. A renamed or retyped flag fails here
with vLLM's own message.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetpilot.api import RoleName, load_services, parse_service
from fleetpilot.api.capacity import GIB, kv_offload_bytes, role_capacity
from fleetpilot.api.layout import LayoutError, role_layout
from fleetpilot.api.spec import (
    DEFAULT_VLLM_IMAGE,
    VLLM_VERSION,
    KvCacheDtype,
    KvConnector,
    ModelDtype,
    Quantization,
    ResolvedRole,
)
from fleetpilot.engine.launcher import expand_group_env
from fleetpilot.engine.vllm_args import (
    DATA_PARALLEL_RPC_PORT,
    KV_EVENTS_PORT,
    MASTER_PORT,
    adapter_location,
    kv_role,
    launch_for,
    model_location,
    vllm_serve_args,
)
from fleetpilot.kube.names import spans_nodes
from fleetpilot.runtime.engines import VllmBackend
from fleetpilot.runtime.local import LocalFleet
from tests.contract.conftest import VllmJudge
from tests.factories import make_manifest, make_tier

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# A multi-node replica's pods get the leader's address from the LeaderWorkerSet controller
# (``$(LWS_LEADER_ADDRESS)`` in their args, expanded by the kubelet): any name will do here.
LEADER_ADDRESS = "svc-main-0.svc-main.ns"


def group_env(role: ResolvedRole, index: int) -> dict[str, str]:
    """The variables the LWS controller sets on pod ``index`` of a group (0: the leader)."""
    return {
        "LWS_LEADER_ADDRESS": LEADER_ADDRESS,
        "LWS_WORKER_INDEX": str(index),
        "LWS_GROUP_SIZE": str(role_layout(role).nodes),
    }


def expected_engine_args(role: ResolvedRole, index: int = 0) -> dict[str, Any]:
    """What vLLM's EngineArgs must hold for this role's pod ``index`` (0: the leader, or the
    only pod of a one-node replica), read off the spec and its layout (not off our argv)."""
    tier, engine, parallelism = role.tier, role.engine, role.parallelism
    layout = role_layout(role)
    hf = tier.model.source.huggingface
    expected: dict[str, Any] = {
        "model": model_location(tier),
        "served_model_name": [tier.model.alias],
        "tensor_parallel_size": parallelism.tensor,
        "pipeline_parallel_size": parallelism.pipeline,
        "data_parallel_size": parallelism.data,
        "dtype": tier.model.dtype.value,
        "revision": hf.revision if hf is not None else None,
        "max_model_len": tier.model.max_model_len,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "block_size": engine.kv_cache.block_size,
        "enable_prefix_caching": engine.kv_cache.prefix_caching,
        "kv_cache_dtype": engine.kv_cache.dtype.value,
        "quantization": tier.model.quantization.value if tier.model.quantization else None,
    }
    if parallelism.data > 1:
        # The ranks on this pod's node: all of them unless the replica spans nodes.
        expected["data_parallel_size_local"] = layout.data_local
        if layout.multi_node:
            expected["data_parallel_rpc_port"] = DATA_PARALLEL_RPC_PORT
    # A replica over several nodes: every pod names the group's size, its index and the
    # leader it meets at; workers serve no API.
    expected |= {"nnodes": layout.nodes, "node_rank": index}
    if layout.multi_node:
        expected |= {"master_addr": LEADER_ADDRESS, "master_port": MASTER_PORT}
    else:
        expected["data_parallel_rpc_port"] = None  # only remote engines hand-shake over TCP
    eplb = parallelism.eplb
    expected |= {"enable_expert_parallel": parallelism.expert, "enable_eplb": eplb is not None}
    eplb_config: dict[str, Any] = {
        "num_redundant_experts": eplb.redundant_experts if eplb is not None else 0
    }
    if eplb is not None and eplb.window_size is not None:
        eplb_config["window_size"] = eplb.window_size
    if eplb is not None and eplb.step_interval is not None:
        eplb_config["step_interval"] = eplb.step_interval
    expected["eplb_config"] = eplb_config  # the fields the spec sets: vLLM's defaults elsewhere
    offload = kv_offload_bytes(engine)
    expected["kv_offloading_size"] = offload / GIB if offload is not None else None
    if engine.kv_offload is not None:
        expected["kv_offloading_backend"] = engine.kv_offload.backend.value
    lora = tier.lora_settings
    if lora is not None:
        expected |= {
            "enable_lora": True,
            "max_loras": lora.max_loras,
            "max_lora_rank": lora.max_lora_rank,
            "max_cpu_loras": lora.max_cpu_loras,
        }
    spec = engine.speculative
    if spec is None:
        expected["speculative_config"] = None
    else:
        speculative: dict[str, Any] = {
            "method": spec.method.value,
            "num_speculative_tokens": spec.num_tokens,
        }
        if spec.model is not None:
            speculative["model"] = spec.model
        if spec.prompt_lookup_max is not None:
            speculative["prompt_lookup_max"] = spec.prompt_lookup_max
        expected["speculative_config"] = speculative
    return expected


def assert_vllm_reads_the_spec(
    judge: VllmJudge, role: ResolvedRole, index: int = 0
) -> dict[str, Any]:
    """vLLM parses the line of the role's pod ``index`` (a worker's past 0, of a replica that
    spans nodes; ``$(LWS_...)`` expanded as the kubelet does), and its EngineArgs hold what the
    spec asked for."""
    argv = expand_group_env(
        vllm_serve_args(launch_for(role), worker=index > 0), group_env(role, index)
    )
    verdict = judge.serve(argv)
    assert verdict["ok"], f"vLLM refused {argv}: {verdict['error']}"
    parsed: dict[str, Any] = verdict["engine_args"]
    expected = expected_engine_args(role, index)
    eplb_config = expected.pop("eplb_config")
    assert {k: parsed[k] for k in expected} == expected
    assert {k: parsed["eplb_config"][k] for k in eplb_config} == eplb_config
    assert verdict["headless"] is (index > 0)  # workers serve no API
    if role.tier.lora_settings is None:
        assert not parsed["enable_lora"]
    # The adapters vLLM registers at start: each by its name, from where the pod holds it -
    # none with lora.dynamic (the operator loads them into the running engine).
    modules = [(m["name"], m["path"]) for m in verdict["lora_modules"]]
    settings = role.tier.lora_settings
    assert modules == (
        []
        if settings is not None and settings.dynamic
        else [(a.name, adapter_location(i, a)) for i, a in enumerate(role.tier.adapters)]
    )
    transfer = parsed["kv_transfer_config"]
    if role.disaggregated:
        kv = role.tier.serving.kv_transfer
        connector = (kv.connector if kv is not None else KvConnector.NIXL).value
        assert transfer["kv_connector"] == connector
        assert transfer["kv_role"] == kv_role(connector, role.name)
    elif role.engine.kv_offload is not None:
        # Only the host tier's self-describing KV events: the connector and its role are
        # vLLM's to set from --kv-offloading-* (test_the_host_kv_tier_... below).
        assert transfer["kv_connector"] is None
        assert transfer["kv_role"] is None
        assert transfer["kv_connector_extra_config"] == {"self_describing_kv_events": True}
    else:
        assert transfer is None
    events = parsed["kv_events_config"]
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{KV_EVENTS_PORT}"
    assert events["replay_endpoint"] == f"tcp://*:{KV_EVENTS_PORT + max(1, role.parallelism.data)}"
    return parsed


def test_the_judge_is_the_release_the_images_and_the_extra_pin(vllm_judge: VllmJudge) -> None:
    """One version everywhere: the installed vLLM, the pyproject extra and the engine image."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == [f"vllm=={VLLM_VERSION}"]
    assert DEFAULT_VLLM_IMAGE.endswith(f":v{VLLM_VERSION}")
    assert vllm_judge.version == VLLM_VERSION


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_role_parses_as_the_spec_says(vllm_judge: VllmJudge, example: Path) -> None:
    """Every role of every tier of every example: the line vLLM would run reads back as the
    spec's parallelism, lengths, batch limits, KV cache, quantization, speculation, P/D
    connector and KV-event publisher."""
    roles = [role for service in load_services(example) for tier in service.spec.tiers
             for role in tier.roles()]  # fmt: skip
    assert roles
    for role in roles:
        assert_vllm_reads_the_spec(vllm_judge, role)


MULTI_NODE_ROLES = [
    pytest.param(role, id=f"{example.name}:{tier.name}/{role.name}")
    for example in EXAMPLES
    for service in load_services(example)
    for tier in service.spec.tiers
    for role in tier.roles()
    if spans_nodes(role)
]


def test_some_example_role_spans_nodes() -> None:
    """The worker-line test below has cases."""
    assert MULTI_NODE_ROLES


@pytest.mark.parametrize("role", MULTI_NODE_ROLES)
def test_every_multi_node_worker_line_parses_as_the_spec_says(
    vllm_judge: VllmJudge, role: ResolvedRole
) -> None:
    """The workers of a replica that spans nodes run their own line (``--headless``, their
    index as ``--node-rank``): each worker's, as the kubelet expands it on pod 1 .. N-1,
    reads back as the spec's parallelism with that index."""
    for index in range(1, role_layout(role).nodes):
        assert_vllm_reads_the_spec(vllm_judge, role, index)


# A spread of what the API accepts, built as manifests so the API's own validation decides.
_speculative = st.one_of(
    st.none(),
    st.builds(
        lambda n, lookup: {"method": "ngram", "numTokens": n, "promptLookupMax": lookup},
        st.integers(1, 16),
        st.integers(1, 16),
    ),
    st.builds(
        lambda method, n: {"method": method, "numTokens": n, "model": "org/draft-model"},
        st.sampled_from(["eagle", "eagle3", "draft_model"]),
        st.integers(1, 16),
    ),
    st.builds(
        lambda method, n: {"method": method, "numTokens": n},
        st.sampled_from(["mtp", "suffix"]),
        st.integers(1, 16),
    ),
)


_adapter = st.builds(
    lambda name, source: {"name": name, "source": source},
    # Capitalised: no served name (lowercase first) or model name here can equal one.
    st.from_regex(r"L([A-Za-z0-9._:/-]{0,20}[A-Za-z0-9])?", fullmatch=True),
    st.one_of(
        st.builds(
            lambda revision: {"huggingface": {"repo": "acme/adapter", **revision}},
            st.sampled_from([{}, {"revision": "0123abcd"}]),
        ),
        st.builds(
            lambda claim, path: {"pvc": {"claimName": claim, "path": path}},
            st.sampled_from(["loras", "team-adapters"]),
            st.sampled_from(["sql", "v2/legal", ".cache/x"]),
        ),
    ),
)
_lora = st.one_of(
    st.none(),
    st.builds(
        lambda loras, rank, extra: {
            "maxLoras": loras,
            "maxLoraRank": rank,
            **({"maxCpuLoras": loras + extra} if extra is not None else {}),
        },
        st.integers(1, 256),
        st.sampled_from([1, 8, 16, 32, 64, 128, 256, 320, 512]),
        st.one_of(st.none(), st.integers(0, 64)),
    ),
)


# Host KV tiers: binary and decimal suffixes, fractions of a GiB, a plain byte count.
_offload_size = st.one_of(
    st.builds(lambda n: f"{n}Gi", st.integers(1, 4096)),
    st.builds(lambda n: f"{n}Mi", st.integers(1, 1 << 20)),
    st.builds(lambda n: f"{n}G", st.integers(1, 4096)),
    st.sampled_from(["0.5Gi", "1.5Ti", "100M"]),
    st.integers(1 << 20, 1 << 40),
)


@st.composite
def tier_manifests(draw: st.DrawFn) -> dict[str, Any]:
    seqs = draw(st.integers(1, 4096))
    engine: dict[str, Any] = {
        "gpuMemoryUtilization": draw(st.sampled_from([0.5, 0.8, 0.85, 0.9, 0.95, 0.99])),
        "maxNumSeqs": seqs,
        "kvCache": {
            "blockSize": draw(st.sampled_from([8, 16, 32, 64, 128])),
            "dtype": draw(st.sampled_from([d.value for d in KvCacheDtype])),
            "prefixCaching": draw(st.booleans()),
        },
    }
    if draw(st.booleans()):
        engine["maxNumBatchedTokens"] = draw(st.integers(seqs, 1_048_576))
    speculative = draw(_speculative)
    if speculative is not None:
        engine["speculative"] = speculative
    model: dict[str, Any] = {
        "name": draw(st.sampled_from(["Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B"])),
        "dtype": draw(st.sampled_from([d.value for d in ModelDtype])),
    }
    if draw(st.booleans()):
        model["maxModelLen"] = draw(st.integers(16, 4_194_304))
    if draw(st.booleans()):
        model["quantization"] = draw(st.sampled_from([q.value for q in Quantization]))
    if draw(st.booleans()):
        model["servedName"] = draw(st.from_regex(r"[a-z0-9][a-z0-9._:/-]{0,30}", fullmatch=True))
    source = draw(st.sampled_from(["hub", "hub-revision", "pvc"]))
    if source == "pvc":
        model["source"] = {"pvc": {"claimName": "models", "subPath": "weights/v1"}}
    elif source == "hub-revision":
        model["source"] = {"huggingface": {"revision": "0123abcd"}}
    tensor = draw(st.sampled_from([1, 2, 4, 8]))
    parallelism = {
        "tensor": tensor,
        "pipeline": draw(st.sampled_from([1, 2, 4])),
        "data": draw(st.sampled_from([1, 2, 4])),
    }
    mode = draw(st.sampled_from(["unified", "disaggregated"]))
    if mode == "unified" and draw(st.booleans()):
        engine["kvOffload"] = {"size": draw(_offload_size)}
    tier = make_tier("main", mode=mode, model=model["name"], engine=engine,
                     parallelism=parallelism)  # fmt: skip
    tier["model"] = model
    adapters = draw(st.lists(_adapter, max_size=3, unique_by=lambda a: a["name"]))
    if adapters:
        tier["adapters"] = adapters
    lora = draw(_lora)
    if lora is not None:
        tier["lora"] = lora
    if mode == "disaggregated":
        tier["serving"]["kvTransfer"] = {
            "connector": draw(st.sampled_from([c.value for c in KvConnector]))
        }
        tier["serving"]["decode"]["parallelism"] = {"tensor": draw(st.sampled_from([1, 2]))}
    return tier


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tier=tier_manifests())
def test_a_spread_of_specs_parses_as_asked(vllm_judge: VllmJudge, tier: dict[str, Any]) -> None:
    """Whatever the API accepts within these ranges, vLLM parses to the same values."""
    service = parse_service(make_manifest(tiers=[tier]))
    for role in service.spec.tiers[0].roles():
        try:
            nodes = role_layout(role).nodes
        except LayoutError:
            continue  # a layout the planner refuses: it writes no line for it
        for index in range(nodes):
            assert_vllm_reads_the_spec(vllm_judge, role, index)


def test_a_renamed_flag_fails_with_vllms_own_message(vllm_judge: VllmJudge) -> None:
    """The judge is not lenient: a flag vLLM does not have, or a value it cannot take, is
    refused with vLLM's words, so a mistake in the planner cannot pass."""
    (service,) = load_services(ROOT / "examples" / "single-tier.yaml")
    (role,) = service.spec.tiers[0].roles()
    argv = vllm_serve_args(launch_for(role))
    renamed = [a if a != "--max-num-seqs" else "--max-num-sequences" for a in argv]
    verdict = vllm_judge.serve(renamed)
    assert not verdict["ok"]
    assert "unrecognized arguments" in verdict["error"]
    assert "--max-num-sequences" in verdict["error"]
    events = argv.index("--kv-events-config") + 1
    bad_events = [*argv]
    bad_events[events] = json.dumps({"enable_kv_cache_events": True, "publisherr": "zmq"})
    verdict = vllm_judge.serve(bad_events)
    assert not verdict["ok"]
    assert "publisherr" in verdict["error"]


def test_the_gpu_checks_engines_run_lines_vllm_reads(vllm_judge: VllmJudge, tmp_path: Path) -> None:
    """The GPU check (``bench/gpu/vllm_check.py``) starts each engine with the launcher's line
    on a local checkpoint, loopback and its own ports, plus the flag that makes vLLM report
    cached tokens: every one of those lines parses as ``vllm serve`` reads it, so a lent GPU
    machine's minutes are not lost to a flag this vLLM does not have."""
    from bench.gpu import vllm_check

    model = vllm_check.write_checkpoint(tmp_path / "model")
    manifest = vllm_check.check_manifest(with_pd=True)
    fleet = LocalFleet(
        parse_service(manifest), tmp_path / "fleet", 0, backend=VllmBackend("vllm", model)
    )
    assert {r.role for r in fleet.replicas} == {RoleName.UNIFIED, RoleName.PREFILL, RoleName.DECODE}
    for replica in fleet.replicas:
        assert replica.argv[:2] == ["vllm", "serve"]
        answer = vllm_judge.serve(replica.argv[2:])
        assert answer["ok"], (replica.name, answer["error"])
        engine_args = answer["engine_args"]
        assert engine_args["model"] == str(model)
        assert engine_args["block_size"] == vllm_check.BLOCK_SIZE
        assert engine_args["max_model_len"] == vllm_check.MAX_MODEL_LEN
        assert engine_args["kv_events_config"]["endpoint"].startswith("tcp://127.0.0.1:")


# The reference engine's tiny preset (tests/contract/conftest.py's checkpoint) in float32, as
# the spec's architecture, so the planner sizes what vLLM configures from that checkpoint.
TINY_ARCHITECTURE = {"layers": 3, "kvHeads": 2, "headDim": 16, "parameters": 200_000}


def _tiny_offload_tier(size: str | int, tensor: int, data: int, block_size: int) -> dict[str, Any]:
    return make_tier(
        "main",
        model="tiny",
        engine={"kvOffload": {"size": size}, "kvCache": {"blockSize": block_size}},
        parallelism={"tensor": tensor, "data": data},
        resources={"gpuMemory": "80Gi"},
    ) | {"model": {"name": "tiny", "dtype": "float32", "maxModelLen": 2048,
                   "architecture": TINY_ARCHITECTURE}}  # fmt: skip


@pytest.mark.parametrize(
    ("size", "tensor", "data", "block_size"),
    [
        ("64Gi", 1, 1, 16),
        ("0.5Gi", 2, 1, 16),
        ("512Mi", 4, 1, 32),  # more GPUs than KV heads: vLLM replicates a head on each
        ("100M", 1, 2, 16),  # decimal, not a whole number of GiB; two engines
        (123_456_789, 2, 2, 64),  # bytes, not a whole number of pages
        ("1Gi", 1, 1, 8),  # a block of 6 KiB: vLLM rounds each chunk up to a page
    ],
)
def test_the_host_kv_tier_is_the_one_vllm_builds_and_the_planner_sizes(
    vllm_judge: VllmJudge,
    tiny_checkpoint: Path,
    size: str | int,
    tensor: int,
    data: int,
    block_size: int,
) -> None:
    """engine.kvOffload's line, built into an engine config as `vllm serve` builds it: vLLM's
    own VllmConfig post-init turns --kv-offloading-size into its OffloadingConnector (kv_both)
    with exactly the spec's bytes as cpu_bytes_to_use, keeping the extra key we send so that
    blocks in host memory are published with their tokens (not placeholders); and vLLM's
    CPUOffloadingSpec, over the KV blocks a worker of that config holds, holds as many blocks
    as the planner says the host tier holds (tokens over block size, per data-parallel rank)."""
    service = parse_service(
        make_manifest(tiers=[_tiny_offload_tier(size, tensor, data, block_size)])
    )
    (role,) = service.spec.tiers[0].roles()
    argv = [str(tiny_checkpoint), *vllm_serve_args(launch_for(role))[1:]]
    answer = vllm_judge.ask({"op": "kv_offload", "argv": argv})
    assert answer["ok"], answer["error"]
    assert answer["cache_config"]["kv_offloading_backend"] == "native"
    transfer = answer["kv_transfer_config"]
    assert transfer["kv_connector"] == "OffloadingConnector"
    assert transfer["kv_role"] == "kv_both"
    assert transfer["kv_connector_extra_config"] == {
        "self_describing_kv_events": True,
        "cpu_bytes_to_use": kv_offload_bytes(role.engine),
    }
    offload = answer["offload"]
    assert offload["self_describing_kv_events"] is True
    assert offload["enable_kv_cache_events"] is True
    assert offload["world_size"] == tensor
    assert offload["blocks_per_chunk"] == 1
    capacity = role_capacity(role)
    assert capacity is not None
    assert capacity.host_kv_tokens == offload["num_chunks"] * block_size * data
    assert capacity.host_kv_tokens > 0


def test_without_our_extra_key_vllms_host_tier_publishes_placeholders(
    vllm_judge: VllmJudge, tiny_checkpoint: Path
) -> None:
    """Why the line carries --kv-transfer-config: the same engine without it gets vLLM's
    offloading connector with self_describing_kv_events off, whose host-tier BlockStored
    events carry no token ids (the router could not place them in a prefix chain)."""
    service = parse_service(make_manifest(tiers=[_tiny_offload_tier("1Gi", 1, 1, 16)]))
    (role,) = service.spec.tiers[0].roles()
    argv = [str(tiny_checkpoint), *vllm_serve_args(launch_for(role))[1:]]
    config = argv.index("--kv-transfer-config")
    del argv[config : config + 2]
    answer = vllm_judge.ask({"op": "kv_offload", "argv": argv})
    assert answer["ok"], answer["error"]
    assert answer["kv_transfer_config"]["kv_connector_extra_config"] == {"cpu_bytes_to_use": GIB}
    assert answer["offload"]["enable_kv_cache_events"] is True
    assert answer["offload"]["self_describing_kv_events"] is False


def test_vllm_would_replace_a_pd_roles_connector_with_its_offloading_one(
    vllm_judge: VllmJudge, tiny_checkpoint: Path
) -> None:
    """Why the API refuses engine.kvOffload with prefill and decode roles: a decode role's
    line with vLLM's offloading flags added ends up, after vLLM's own config post-init, with
    the OffloadingConnector instead of the NIXL connector its KV hand-off needs."""
    tier = make_tier("main", mode="disaggregated", model="tiny")
    tier["model"] = {"name": "tiny", "maxModelLen": 2048}
    service = parse_service(make_manifest(tiers=[tier]))
    decode = service.spec.tiers[0].role("decode")
    assert decode is not None
    argv = [str(tiny_checkpoint), *vllm_serve_args(launch_for(decode))[1:]]
    asked = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert asked["kv_connector"] == KvConnector.NIXL.value
    argv += ["--kv-offloading-size", "1", "--kv-offloading-backend", "native"]
    answer = vllm_judge.ask({"op": "kv_offload", "argv": argv})
    assert answer["ok"], answer["error"]
    assert answer["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
