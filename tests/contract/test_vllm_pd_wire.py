"""The P/D hand-off as the pinned vLLM reads it: the router's two request bodies and the
reference engine's prefill answer, judged by vLLM's own request models and its NIXL
connector's scheduler side (``vllm_judge.py``, ops ``pd_prefill`` and ``pd_decode``).

The router speaks vLLM's NIXL proxy protocol (``fleetpilot.routing.policies.pd``): hop 1 asks
a prefill engine for one token with ``kv_transfer_params: {do_remote_decode: true}``; the
engine's answer carries a KV handle; hop 2 sends the original request with that handle to a
decode engine, which pulls the blocks. Here vLLM plays each engine in turn: the prefill
engine answering the router's hop 1, the decode engine planning its pull from hop 2, and the
decode engine reading the reference engine's handle. The NIXL transfer itself needs GPUs
(``bench/gpu``); what is judged is every field that crosses the router.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetpilot.api import RoleName
from fleetpilot.engine.reference.protocol import KVTransferParams
from fleetpilot.engine.vllm_args import launch_for, vllm_serve_args
from fleetpilot.routing.policies.pd import (
    client_body,
    decode_request,
    kv_params_of,
    prefill_request,
)
from fleetpilot.testing.engine_server import BackgroundServer
from tests.contract.conftest import VllmJudge
from tests.factories import make_service, make_tier

MODEL = "pd-model"
BLOCK_SIZE = 16
PROMPT = "Disaggregated serving moves the prompt's KV cache from prefill to decode, " * 3
COMPLETION: dict[str, Any] = {"model": "client-alias", "prompt": PROMPT, "max_tokens": 12,
                              "temperature": 0, "stream": True}  # fmt: skip
CHAT: dict[str, Any] = {"model": "client-alias", "messages": [{"role": "user", "content": PROMPT}],
                        "max_completion_tokens": 12, "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
BODIES = {"completions": COMPLETION, "chat": CHAT}
# KV blocks the prefill engine holds the prompt in (vLLM's scheduler never reads them).
PREFILL_BLOCKS = [7, 3, 11, 12, 4, 9, 2, 8, 5, 1, 6, 10, 13, 14]
DECODE_BLOCKS = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]


def role_argv(role: RoleName, checkpoint: Path) -> list[str]:
    """The planner's ``vllm serve`` line for one role of a disaggregated NIXL tier, with the
    model at a local checkpoint (vLLM builds the engine's config from it)."""
    tier = make_tier("pd", mode="disaggregated", model=MODEL)
    resolved = make_service(tiers=[tier]).spec.tiers[0].role(role)
    assert resolved is not None
    launch = replace(launch_for(resolved), model=str(checkpoint), max_model_len=256)
    assert launch.kv_connector == "NixlConnector"
    return vllm_serve_args(launch)


def json_shape(value: Any) -> Any:
    """A JSON value's types, nested: ``[[1, 2]]`` and ``[[3]]`` alike, ``[1, 2]`` not."""
    if isinstance(value, list):
        return ["list", json_shape(value[0]) if value else None]
    return type(value).__name__


def json_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def prompt_ids(length: int) -> list[int]:
    return [(i * 7 + 3) % 250 for i in range(length)]


@pytest.fixture(scope="module")
def prefill_argv(tiny_checkpoint: Path) -> list[str]:
    return role_argv(RoleName.PREFILL, tiny_checkpoint)


@pytest.fixture(scope="module")
def decode_argv(tiny_checkpoint: Path) -> list[str]:
    return role_argv(RoleName.DECODE, tiny_checkpoint)


def vllm_prefill(
    judge: VllmJudge, argv: list[str], kind: str, prompt: list[int], blocks: list[int]
) -> dict[str, Any]:
    """What a vLLM prefill engine answers the router's hop 1 (``kv_transfer_params``)."""
    hop1 = prefill_request(BODIES[kind], MODEL)
    answer = judge.ask({"op": "pd_prefill", "argv": argv, "kind": kind, "body": hop1,
                        "prompt_token_ids": prompt, "block_ids": blocks})  # fmt: skip
    assert answer["ok"], answer["error"]
    return answer


def vllm_decode_plan(
    judge: VllmJudge, argv: list[str], kind: str, prompt: list[int], handle: dict[str, Any]
) -> dict[str, Any]:
    """The pull a vLLM decode engine plans for the router's hop 2 carrying ``handle``."""
    hop2 = decode_request(BODIES[kind], MODEL, handle)
    local = DECODE_BLOCKS[: -(-len(prompt) // BLOCK_SIZE)]
    answer = judge.ask({"op": "pd_decode", "argv": argv, "kind": kind, "body": hop2,
                        "prompt_token_ids": prompt, "local_block_ids": local})  # fmt: skip
    assert answer["ok"], answer["error"]
    return answer


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_vllm_prefills_the_routers_first_hop_and_answers_a_handle(
    vllm_judge: VllmJudge, prefill_argv: list[str], kind: str
) -> None:
    """vLLM's request model reads hop 1 as one token with do_remote_decode, and its NIXL
    prefill side keeps the blocks for a remote decoder and answers where they are."""
    prompt = prompt_ids(100)
    blocks = PREFILL_BLOCKS[:7]
    answer = vllm_prefill(vllm_judge, prefill_argv, kind, prompt, blocks)
    assert answer["max_tokens"] == 1
    assert answer["delay_free_blocks"] is True  # pinned for the decoder's read
    handle = answer["kv_transfer_params"]
    assert handle["do_remote_prefill"] is True
    assert handle["do_remote_decode"] is False
    assert handle["remote_block_ids"] == [blocks]
    assert handle["remote_num_tokens"] == len(prompt)
    assert handle["remote_engine_id"]
    assert handle["remote_request_id"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_vllm_handle_passes_through_the_router_to_a_vllm_decoder(
    vllm_judge: VllmJudge, prefill_argv: list[str], decode_argv: list[str], kind: str
) -> None:
    """The handle a vLLM prefill engine answers, carried by the router's hop 2, makes a vLLM
    decode engine plan to pull exactly those blocks from that engine: nothing the router
    drops, renames or rewrites on the way."""
    prompt = prompt_ids(100)
    blocks = PREFILL_BLOCKS[:7]
    handle = vllm_prefill(vllm_judge, prefill_argv, kind, prompt, blocks)["kv_transfer_params"]
    carried = kv_params_of({"id": "cmpl-1", "kv_transfer_params": handle})
    assert carried is not None
    plan = vllm_decode_plan(vllm_judge, decode_argv, kind, prompt, carried)
    assert plan["tokens_to_load"] == len(prompt)
    assert plan["load_async"] is True
    [pull] = plan["pulls"].values()
    remote = pull["remote"]
    assert remote["block_ids"] == [blocks]
    assert (remote["engine_id"], remote["request_id"]) == (
        handle["remote_engine_id"], handle["remote_request_id"])  # fmt: skip
    assert (remote["host"], remote["port"]) == (handle["remote_host"], handle["remote_port"])
    assert pull["tp_size"] == handle["tp_size"]


def test_a_client_cannot_hand_a_decoder_its_own_handle(
    vllm_judge: VllmJudge, decode_argv: list[str]
) -> None:
    """A client's own kv_transfer_params would make a vLLM decoder pull KV from an address the
    client chose: the router strips them, and vLLM then plans no pull at all."""
    prompt = prompt_ids(40)
    forged = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]], "tp_size": 1,
              "remote_engine_id": "x", "remote_request_id": "y",
              "remote_host": "169.254.169.254", "remote_port": 80}  # fmt: skip
    body = client_body({**COMPLETION, "kv_transfer_params": forged}, MODEL)
    answer = vllm_judge.ask({"op": "pd_decode", "argv": decode_argv, "kind": "completions",
                             "body": body, "prompt_token_ids": prompt,
                             "local_block_ids": DECODE_BLOCKS[:3]})  # fmt: skip
    assert answer["ok"], answer["error"]
    assert answer["tokens_to_load"] == 0
    assert answer["pulls"] == {}


@pytest.fixture(scope="module")
def reference_prefill() -> Iterator[BackgroundServer]:
    """A reference engine on the prefill side of NIXL, as the local fleet runs one."""
    config = '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "ref-p"}'
    server = BackgroundServer.from_argv(
        ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len",
         "256", "--served-model-name", MODEL, "--kv-transfer-config", config]
    ).start()  # fmt: skip
    yield server
    server.stop()


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_reference_prefill_answers_the_handle_vllm_answers(
    vllm_judge: VllmJudge,
    prefill_argv: list[str],
    decode_argv: list[str],
    reference_prefill: BackgroundServer,
    kind: str,
) -> None:
    """The reference engine's answer to hop 1 has every field of vLLM's prefill answer, each
    of the same JSON type, and a vLLM decoder plans to pull the reference engine's blocks
    from it: a CPU fleet's hand-off is the one a GPU fleet's router carries."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    hop1 = {**prefill_request(BODIES[kind], MODEL), "return_token_ids": True}
    response = httpx.post(reference_prefill.url + path, json=hop1, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    ours = kv_params_of(body)
    assert ours is not None
    prompt_len = body["usage"]["prompt_tokens"]
    pinned = [b for group in ours["remote_block_ids"] for b in json_list(group)]
    assert len(pinned) == -(-prompt_len // BLOCK_SIZE)
    answer = vllm_prefill(vllm_judge, prefill_argv, kind, prompt_ids(prompt_len), pinned)
    theirs = answer["kv_transfer_params"]
    for key, value in theirs.items():
        assert key in ours, f"vLLM's prefill answers {key}; the reference engine does not"
        assert json_shape(ours[key]) == json_shape(value), (key, ours[key], value)
        if not key.startswith("remote_") or key == "remote_num_tokens":
            assert ours[key] == value, key  # flags, sizes and the transfer mode agree
    [our_blocks] = ours["remote_block_ids"]
    plan = vllm_decode_plan(vllm_judge, decode_argv, kind, prompt_ids(prompt_len), ours)
    assert plan["tokens_to_load"] == prompt_len
    [pull] = plan["pulls"].values()
    assert pull["remote"]["block_ids"] == [our_blocks]
    assert pull["remote"]["engine_id"] == "ref-p"
    assert pull["remote"]["request_id"] == body["id"]
    assert (pull["remote"]["host"], pull["remote"]["port"]) == (
        "127.0.0.1", httpx.URL(reference_prefill.url).port)  # fmt: skip


def test_the_reference_decoder_reads_a_vllm_handle(
    vllm_judge: VllmJudge, prefill_argv: list[str]
) -> None:
    """A handle a vLLM prefill engine answers parses in the reference engine's request model
    with the blocks, engine, request and address vLLM named."""
    prompt = prompt_ids(60)
    blocks = PREFILL_BLOCKS[:4]
    handle = vllm_prefill(vllm_judge, prefill_argv, "completions", prompt, blocks)
    params = KVTransferParams.model_validate(handle["kv_transfer_params"])
    assert params.do_remote_prefill
    assert not params.do_remote_decode
    assert params.block_ids() == blocks
    assert params.remote_request_id == handle["kv_transfer_params"]["remote_request_id"]
    assert params.remote_host
    assert params.remote_port
