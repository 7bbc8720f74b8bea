"""A request's state inside the engine, and what the engine hands back for it each step."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch

from fleetpilot.engine.reference.lora import LoRARequest
from fleetpilot.engine.reference.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued to recompute
    # Admitted with a host-tier hit: its blocks are allocated and its KV is being copied in
    # from host memory; it keeps its place in the queue until the copy completes.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, eq=False)
class KVBlocks:
    """KV contents of a prefix, as one engine exports them and another imports them (P/D).

    ``data`` is ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]`` in the pool's
    storage dtype; ``scales`` the matching int8 scales (``[layers, 2, n, block_size, kv_heads]``)
    or None. Slots past ``len(token_ids)`` in the last block are meaningless.
    """

    token_ids: tuple[int, ...]
    block_size: int
    block_ids: tuple[int, ...]  # ids in the exporting pool (what kv_transfer_params carries)
    data: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class Request:
    """Mutable per-request state; owned by the engine and its scheduler, never shared."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int  # effective: the request's, capped by the model length
    eos_token_id: int | None
    generator: torch.Generator | None = None
    kv_import: KVBlocks | None = None
    pin_kv: bool = False
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, committed only
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of token_ids
    num_cached_tokens: int | None = None  # prefix hit (or import) at first scheduling
    num_preemptions: int = 0
    # Host tier (offload.py): the prompt blocks from here on are still to be offered for storing,
    # and the load this request waits for (tokens it brings, whether it completed).
    next_stored_block: int = 0
    host_load_tokens: int = 0
    host_load_done: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    stop_text: str | None = None  # output text cut at a stop string
    stop_search_from: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def hash_extra(self) -> bytes:
        """What its KV block hashes include besides the tokens (blocks.hash_block)."""
        return self.lora.hash_key if self.lora is not None else b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps (engine clock, seconds) from which the server derives vLLM's latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: tuple[float, ...]  # one per output token; a speculative step's share one time
    num_preemptions: int

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def inter_token_latencies_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: everything generated so far, and whether it is done.

    ``text`` never ends inside a UTF-8 character while the request runs, so a streaming server
    can send ``text[len(previous_text):]``. ``num_cached_tokens`` is what OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` reports.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    num_new_tokens: int
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_cached_tokens: int
    metrics: RequestMetrics
