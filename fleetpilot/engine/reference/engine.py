"""The step-driven engine: ``add_request`` / ``step`` / ``RequestOutput``.

One ``step()`` = schedule (scheduler.py), copy-on-write and KV imports, draft proposals when
speculating, one target forward pass over every scheduled token (model.py), then sampling or
speculative verification, stop checks, prefix-cache publication and outputs. The HTTP server
drives it from one thread: the engine is not thread-safe, and it never blocks or does I/O
(but for re-reading an evicted LoRA adapter, below).

KV events: with ``enable_kv_cache_events`` the block manager records every prefix-cache change
(blocks.py) and ``take_kv_events`` hands them over as one vLLM ``EventBatch``; whoever drives
the engine (the runner, once per step) takes them and gives them to a publisher. Nobody taking
them lets them pile up, so leave them off when driving the engine by hand.

LoRA: with ``EngineConfig.lora`` a request may name an adapter (``add_request(lora=...)``);
each scheduled sequence runs under its own, several adapters in one forward pass (model.py).
``add_lora`` loads one ahead (the server's load endpoint and ``--lora-modules``); the loaded
and active sets are lora_manager.py's LRUs. An adapter evicted from the loaded set is read
again when a request that uses it is scheduled, as vLLM's worker does: the one file read the
engine itself may do, through the ``lora_loader`` it is given.

Host tier (vLLM's ``--kv-offloading-size``, offload.py): with ``EngineConfig.kv_offload`` every
step offers the prompt blocks its requests completed to a second, larger cache in host memory
(a real copy out of the device pool), and admission loads the host blocks that extend a
request's device prefix hit back into fresh device blocks (a real copy in). Copies are paced by
the link's bandwidth on the engine's clock: a load's request waits for it while the others keep
stepping, and a store's block is servable once its copy completed. ``next_transfer_done_at``
tells whoever drives the engine when to step again while only copies are in flight.

P/D hooks: a request added with ``pin_kv=True`` keeps its prompt's KV blocks pinned after it
finishes (``pinned_kv``/``export_kv`` read them, ``release_kv`` or the TTL frees them); a
request added with ``kv_import`` starts from those blocks instead of prefilling.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from fleetpilot.engine.reference.blocks import (
    DEFAULT_BLOCK_SIZE,
    BlockManager,
    KVPool,
    extend_block_hashes,
)
from fleetpilot.engine.reference.lora import LoRAConfig, LoRAError, LoRARequest, read_adapter
from fleetpilot.engine.reference.lora_manager import Loader, LoRAManager
from fleetpilot.engine.reference.model import (
    AttentionMetadata,
    LlamaModel,
    LoRABatch,
    LoRAWeights,
    ModelConfig,
    SeqSlice,
    build_attention_metadata,
    make_kv_pool,
)
from fleetpilot.engine.reference.offload import (
    TRANSFER_SIZE_BUCKETS,
    BlockMeta,
    HostKVStore,
    HostTier,
    OffloadConfig,
    SizeHistogram,
    Transfer,
    TransferLink,
)
from fleetpilot.engine.reference.request import (
    FinishReason,
    KVBlocks,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from fleetpilot.engine.reference.sampling import (
    SamplingParams,
    probs_from_logits,
    restrict,
    sample,
    sample_from_probs,
)
from fleetpilot.engine.reference.scheduler import (
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from fleetpilot.engine.reference.speculative import (
    SpeculativeConfig,
    rejection_sample,
    verify_greedy,
)
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.kv_events import EventBatch

# 64 MiB holds 32k tokens of the default model (4 layers x 2 KV heads x 32 dims x fp32 x K,V =
# 2 KiB a token): room for 64 sequences of 512 tokens, the default max_num_seqs.
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, named after the vLLM flags they mirror."""

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes when set
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speculative: SpeculativeConfig | None = None
    seed: int = 0  # for requests without their own seed
    # How long a P/D prefill's pinned KV waits for the decoder to pull it.
    kv_pin_ttl_s: float = 60.0
    # "contiguous" reserves max_model_len per request up front: the pre-PagedAttention
    # baseline, for benchmarks only.
    kv_reservation: Literal["paged", "contiguous"] = "paged"
    # Record prefix-cache changes as vLLM KV events (take_kv_events); off as in vLLM.
    enable_kv_cache_events: bool = False
    # torch intra-op threads, process-wide. One: the matrices are small, several engines share
    # a machine in the local fleet, and OpenMP threads spinning on a busy core were measured
    # 10-30x slower than one thread. None leaves torch's setting alone.
    num_threads: int | None = 1
    # LoRA adapters (vLLM's --enable-lora and its limits); None: requests cannot name one.
    lora: LoRAConfig | None = None
    # A host tier for KV blocks (vLLM's --kv-offloading-size); None: the device pool only.
    kv_offload: OffloadConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_offload is not None and not self.enable_prefix_caching:
            raise ValueError(
                "KV offloading needs prefix caching: the host tier keeps blocks by their "
                "prefix hashes"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len}) so any prompt fits a step"
            )


class RequestRejectedError(ValueError):
    """A request the engine can never serve; the message says why (an HTTP 400)."""


@dataclass
class EngineStats:
    """Counters and gauges, named after the vLLM metrics they feed (``vllm:<name>``)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_preemptions_total: int = 0
    request_success_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    kv_exported_blocks_total: int = 0
    kv_imported_tokens_total: int = 0
    kv_import_fallbacks_total: int = 0  # imports that could not be used: prefilled locally
    kv_pins_evicted_total: int = 0  # pins dropped early because the pool was full
    steps_total: int = 0
    forward_passes_total: int = 0  # target passes (drafts not included)
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0  # 0..1
    num_kv_blocks: int = 0
    block_size: int = 0
    lora_loads_total: int = 0  # adapters read from their folders (loads and reloads)
    lora_activations_total: int = 0  # adapters swapped into an active slot
    # Requests per adapter name, in order of first appearance (vllm:lora_requests_info).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # The host tier (vllm:external_prefix_cache_*, vllm:prompt_tokens_cached_by_source and the
    # offloading connector's vllm:kv_offload_*); kv_offload_num_blocks 0: there is none.
    external_prefix_cache_queries_total: int = 0
    external_prefix_cache_hits_total: int = 0  # all from the host tier
    kv_offload_num_blocks: int = 0
    kv_offload_bytes_per_block: int = 0  # host memory a block takes (page-aligned)
    kv_offload_blocks_used: int = 0
    kv_offload_cpu_cache_usage_perc: float = 0.0  # pinned by transfers in flight, as vLLM's
    kv_offload_cpu_cache_write_usage_perc: float = 0.0
    kv_offload_cpu_cache_read_usage_perc: float = 0.0
    kv_offload_load_bytes_total: int = 0
    kv_offload_load_time_seconds_total: float = 0.0
    kv_offload_store_bytes_total: int = 0
    kv_offload_store_time_seconds_total: float = 0.0
    kv_offload_allocation_failures_total: int = 0
    kv_offload_evictions_total: int = 0
    kv_offload_load_size: SizeHistogram = field(
        default_factory=lambda: SizeHistogram(TRANSFER_SIZE_BUCKETS)
    )
    kv_offload_store_size: SizeHistogram = field(
        default_factory=lambda: SizeHistogram(TRANSFER_SIZE_BUCKETS)
    )
    kv_offload_allocation_size: SizeHistogram | None = None  # the tier's, when there is one


@dataclass(frozen=True)
class PinnedKV:
    """A finished P/D prefill's prompt blocks, held for a decoder to pull."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    expires_at: float


class LLMEngine:
    """A paged-KV LLM engine on torch. See the module docstring for the step structure."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: LlamaModel | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        lora_loader: Loader | None = None,
    ) -> None:
        """``lora_loader`` reads an adapter (default: its PEFT folder, lora.read_adapter)."""
        self.config = config = config or EngineConfig()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = model or LlamaModel(ModelConfig())
        mc = self.model.config
        if config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings})"
            )
        spec = config.speculative
        if spec is not None and spec.draft_num_layers >= mc.num_hidden_layers:
            raise ValueError(
                f"the draft ({spec.draft_num_layers} layers) must be shallower than the target "
                f"({mc.num_hidden_layers} layers)"
            )
        self.tokenizer = ByteTokenizer()
        self.clock = clock
        self.kv: KVPool = make_kv_pool(
            mc,
            block_size=config.block_size,
            num_blocks=config.num_kv_blocks,
            memory_bytes=config.kv_cache_memory_bytes,
            quantized=config.kv_cache_dtype == "int8",
        )
        if config.kv_reservation == "contiguous" and (
            math.ceil(config.max_model_len / config.block_size) > self.kv.num_blocks
        ):
            raise ValueError("contiguous reservation needs a pool of at least max_model_len")
        self.blocks = BlockManager(
            self.kv.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            reserve_tokens=config.max_model_len if config.kv_reservation == "contiguous" else None,
            enable_kv_cache_events=config.enable_kv_cache_events,
        )
        self.host: HostTier | None = None
        self.host_kv: HostKVStore | None = None
        offload = config.kv_offload
        bandwidth = offload.bandwidth_bytes_per_s if offload is not None else 1.0
        # One link each way (PCIe is full duplex): loads queue behind loads, stores behind stores.
        self._h2d = TransferLink(bandwidth)
        self._d2h = TransferLink(bandwidth)
        self._transfers: list[Transfer] = []
        self._host_generation = 0  # resets of the host tier; older transfers are void
        self._host_finished: list[str] = []  # requests finished since the last step began
        if offload is not None:
            num_host_blocks = offload.num_blocks(self.kv.spec)
            if num_host_blocks < 1:
                raise ValueError(
                    f"a KV offloading size of {offload.capacity_bytes} bytes holds no KV block "
                    f"of this model ({self.kv.spec.bytes_per_block} bytes)"
                )
            self.host = HostTier(
                num_host_blocks,
                enable_kv_cache_events=config.enable_kv_cache_events,
                self_describing_kv_events=offload.self_describing_kv_events,
            )
            self.host_kv = HostKVStore(self.kv.spec, num_host_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                max_loras=config.lora.max_loras if config.lora else None,
            ),
            self.blocks,
            self.host,
        )
        self.loras: LoRAManager | None = None
        if config.lora is not None:
            self.loras = LoRAManager(config.lora, lora_loader or self._read_adapter)
        self._stats = EngineStats(num_kv_blocks=self.kv.num_blocks, block_size=config.block_size)
        if self.host is not None:
            self._stats.kv_offload_num_blocks = self.host.num_blocks
            assert config.kv_offload is not None
            self._stats.kv_offload_bytes_per_block = config.kv_offload.block_bytes(self.kv.spec)
        # Whether the last step ran nothing (only copies in flight, or nothing at all).
        self.last_step_idle = False
        self._generator = torch.Generator().manual_seed(config.seed)
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.pins: OrderedDict[str, PinnedKV] = OrderedDict()
        # Draft distributions of the current step's sampled (non-greedy) speculative requests.
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._generate_calls = 0

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        pin_kv: bool = False,
        kv_import: KVBlocks | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises ``RequestRejectedError`` for one that can never be served.

        ``prompt``: text (encoded with BOS) or token ids. ``pin_kv``: keep the prompt's KV after
        finishing, for a remote decoder (P/D prefill side). ``kv_import``: KV of a prefix of
        the prompt computed elsewhere (P/D decode side); unusable imports fall back to prefill.
        ``lora``: the adapter it runs under (read when first scheduled, if not loaded).
        """
        params = params or SamplingParams()
        if request_id in self._requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        if lora is not None and self.loras is None:
            raise RequestRejectedError("LoRA is not enabled on this engine (--enable-lora)")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise RequestRejectedError("the prompt is empty")
        if any(not 0 <= t < vocab for t in ids):
            raise RequestRejectedError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.allowed_token_ids):
            raise RequestRejectedError("allowed_token_ids contains out-of-vocab token id!")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise RequestRejectedError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{max_len} tokens, which must also leave room for at least one output token"
            )
        room = max_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestRejectedError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the maximum context length of {max_len} tokens"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        total = len(ids) + max_tokens
        need_blocks = math.ceil(total / self.config.block_size)
        if need_blocks > self.kv.num_blocks:
            raise RequestRejectedError(
                f"the request needs up to {total} tokens of KV cache ({need_blocks} blocks of "
                f"{self.config.block_size}) but the whole KV pool holds {self.kv.num_blocks} blocks"
            )
        if kv_import is not None and not self._import_usable(kv_import, ids):
            self._stats.kv_import_fallbacks_total += 1
            kv_import = None
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_time=arrival_time if arrival_time is not None else self.clock(),
            max_tokens=max_tokens,
            eos_token_id=None if params.ignore_eos else self.tokenizer.eos_token_id,
            generator=generator,
            kv_import=kv_import,
            pin_kv=pin_kv,
            lora=lora,
        )
        self._requests[request_id] = request
        self.scheduler.add(request)

    # ---- LoRA adapters ---------------------------------------------------------------------

    def _read_adapter(self, lora: LoRARequest) -> LoRAWeights:
        assert self.config.lora is not None
        lora_config = self.config.lora
        return read_adapter(
            lora_config.files_at(lora.path),
            self.model.config,
            max_lora_rank=lora_config.max_lora_rank,
        )

    def add_lora(self, lora: LoRARequest, weights: LoRAWeights | None = None) -> None:
        """Load an adapter ahead of its requests (vLLM's ``add_lora``); ``weights`` already read
        (the server reads off the engine thread) skip the read. Raises ``LoRAError`` for an
        adapter that cannot be served; the same id again replaces it (a load in place)."""
        if self.loras is None:
            raise LoRAError("LoRA is not enabled on this engine (--enable-lora)")
        self.loras.add(lora, weights, in_use=self.scheduler.running_loras())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter unless a running request uses it; whether it was dropped.
        Queued requests naming it still run: their adapter is read again."""
        if self.loras is None:
            return False
        return self.loras.remove(lora_int_id, in_use=self.scheduler.running_loras())

    def _activate_loras(
        self, plan: SchedulerOutput
    ) -> tuple[dict[int, LoRAWeights], list[Request]]:
        """The scheduled adapters' weights, and the requests whose adapter could not be read
        (taken out of ``plan``: they finish with "abort" instead of running)."""
        if self.loras is None:
            return {}, []
        in_use = self.scheduler.running_loras()  # admitted requests are running already
        batch = {
            s.request.lora.lora_int_id: s.request.lora for s in plan.scheduled if s.request.lora
        }
        weights: dict[int, LoRAWeights] = {}
        failed: set[int] = set()
        for key, lora in batch.items():
            try:
                weights |= self.loras.activate([lora], in_use=in_use)
            except LoRAError as e:
                log.warning("cannot read LoRA adapter %r: %s", lora.name, e)
                failed.add(key)
        dropped = [
            s.request
            for s in plan.scheduled
            if s.request.lora and s.request.lora.lora_int_id in failed
        ]
        if dropped:
            plan.scheduled = [s for s in plan.scheduled if s.request not in dropped]
            plan.imports = [(r, ids) for r, ids in plan.imports if r not in dropped]
            for r in dropped:
                self.scheduler.remove(r)
                self._finish(r, "abort")
        return weights, dropped

    def _lora_batch(
        self, seqs: Sequence[tuple[Request, SeqSlice]], weights: dict[int, LoRAWeights]
    ) -> LoRABatch | None:
        """Which rows of the flattened batch use which adapter; None when none does."""
        rows: dict[int, list[int]] = {}
        for r, s in seqs:
            if r.lora is not None:
                rows.setdefault(r.lora.lora_int_id, []).extend(
                    range(s.query_start, s.query_start + s.query_len)
                )
        if not rows:
            return None
        return LoRABatch(
            tuple((weights[k], torch.tensor(v, dtype=torch.long)) for k, v in rows.items())
        )

    def _import_usable(self, kv: KVBlocks, prompt: list[int]) -> bool:
        pool = self.kv.data
        expected = (*pool.shape[:2], -(-kv.num_tokens // kv.block_size), kv.block_size)
        return (
            0 < kv.num_tokens <= len(prompt)
            and list(kv.token_ids) == prompt[: kv.num_tokens]
            and kv.block_size == self.config.block_size
            and tuple(kv.data.shape[:4]) == expected
            and tuple(kv.data.shape[4:]) == tuple(pool.shape[3:])
            and kv.data.dtype == pool.dtype
            and (kv.scales is not None) == (self.kv.scales is not None)
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes with the next step."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.scheduler.remove(request)
        self._finish(request, "abort")
        self._aborted.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def has_transfers_in_flight(self) -> bool:
        """Copies to or from the host tier not completed yet (steps complete them)."""
        return bool(self._transfers)

    def next_transfer_done_at(self) -> float | None:
        """When (engine clock) the first copy in flight completes; None if there is none."""
        return min((t.done_at for t in self._transfers), default=None)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion together (continuous batching); outputs in order."""
        self._generate_calls += 1
        ids = [f"generate-{self._generate_calls}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; outputs of requests that progressed or finished."""
        now = self.clock()
        self._expire_pins(now)
        outputs = [self._output(r, 0) for r in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule()
        while plan.starved and self.pins:
            self._release_pin(next(iter(self.pins)))
            self._stats.kv_pins_evicted_total += 1
            plan = self.scheduler.schedule()
        self._stats.steps_total += 1
        finished, self._host_finished = self._host_finished, []
        for load in plan.host_loads:
            self._start_load(load.keys, load.slots, load.device_blocks, load.request, now)
        if plan.scheduled:
            outputs += self._run(plan, now)
        if self.host is not None:
            for request_id in finished:
                self.host.finish(request_id)
        if self._transfers:
            self._complete_transfers(self.clock())
        self.last_step_idle = not plan.scheduled and not outputs
        self._stats.num_preemptions_total = self.scheduler.num_preemptions
        return outputs

    def _run(self, plan: SchedulerOutput, now: float) -> list[RequestOutput]:
        lora_weights, dropped = self._activate_loras(plan)
        outputs = [self._output(r, 0) for r in dropped]
        if not plan.scheduled:
            return outputs
        self.kv.copy_blocks(plan.block_copies)
        for request, block_ids in plan.imports:
            assert request.kv_import is not None
            n = len(block_ids)
            scales = request.kv_import.scales
            self.kv.import_blocks(
                block_ids,
                request.kv_import.data[:, :, :n],
                scales[:, :, :n] if scales is not None else None,
            )
            self._stats.kv_imported_tokens_total += request.num_computed_tokens
            request.kv_import = None  # used once; a recompute after preemption prefills
        for s in plan.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        drafts = self._propose(plan.scheduled, lora_weights)

        input_ids: list[int] = []
        seqs: list[SeqSlice] = []
        logits_rows: list[int] = []
        samplers: list[tuple[ScheduledRequest, int, int]] = []  # (s, first logits row, n rows)
        for s in plan.scheduled:
            r = s.request
            start = r.num_computed_tokens
            tokens = r.token_ids[start : start + s.num_new_tokens] + drafts.get(r.request_id, [])
            seqs.append(
                SeqSlice(len(input_ids), len(tokens), start, self.blocks.table(r.request_id))
            )
            input_ids += tokens
            if start + s.num_new_tokens == r.num_tokens:  # the chunk reaches the end: sample
                n_rows = 1 + len(drafts.get(r.request_id, []))
                samplers.append((s, len(logits_rows), n_rows))
                last = len(input_ids)
                logits_rows += range(last - n_rows, last)
        meta = build_attention_metadata(seqs, self.config.block_size)
        requests = [s.request for s in plan.scheduled]
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long),
            meta,
            self.kv,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long),
            lora=self._lora_batch(list(zip(requests, seqs, strict=True)), lora_weights),
        )
        self._stats.forward_passes_total += 1
        done = self.clock()

        sampling = {id(s): (row, n) for s, row, n in samplers}
        # Greedy rows free to pick any token: one batched argmax (the rest go through sample).
        greedy_rows = [
            row
            for s, row, n in samplers
            if n == 1 and s.request.params.greedy and not s.request.params.allowed_token_ids
        ]
        argmax = dict(zip(greedy_rows, logits[greedy_rows].argmax(-1).tolist(), strict=True))
        for s in plan.scheduled:
            r = s.request
            if id(s) not in sampling:
                r.num_computed_tokens += s.num_new_tokens  # a prefill chunk: nothing to sample
                self._publish(r)
                self._offload(r, done)
                continue
            row, n = sampling[id(s)]
            draft = drafts.get(r.request_id)
            if draft is not None:
                new = self._verify(r, draft, logits[row : row + n])
                r.num_computed_tokens += s.num_new_tokens + len(new) - 1
            else:
                new = (
                    [argmax[row]]
                    if row in argmax
                    else sample(logits[row : row + 1], r.params, r.generator or self._generator)
                )
                r.num_computed_tokens += s.num_new_tokens
            if r.first_token_time is None:
                r.first_token_time = done
                self._stats.prompt_tokens_total += r.num_prompt_tokens
            appended = self._append(r, new, done)
            self._stats.generation_tokens_total += appended
            self._publish(r)
            self._offload(r, done)
            if r.finish_reason is not None:
                if r.pin_kv:
                    self._pin(r)
                else:
                    self.scheduler.remove(r)
                self._finish(r, r.finish_reason)
            outputs.append(self._output(r, appended))
        return outputs

    def _publish(self, r: Request) -> None:
        if self.config.enable_prefix_caching:
            bs = self.config.block_size
            computed = r.token_ids[: r.num_computed_tokens]
            extend_block_hashes(r.block_hashes, computed, bs, r.hash_extra)
            lora = (r.lora.lora_int_id, r.lora.name) if r.lora is not None else None
            self.blocks.cache_full_blocks(
                r.request_id, r.block_hashes, r.num_computed_tokens, computed, lora=lora
            )

    # ---- the host tier -----------------------------------------------------------------------

    def _start_load(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        device_blocks: Sequence[int],
        request: Request,
        now: float,
    ) -> None:
        """Copy host blocks into the device blocks admission gave ``request``, and time the
        copy on the host-to-device link; the request runs once it completed."""
        assert self.host_kv is not None
        self.host_kv.load(self.kv, slots, device_blocks)
        nbytes = len(keys) * self.kv.spec.bytes_per_block
        start, done_at = self._h2d.schedule(now, nbytes)
        self._transfers.append(
            Transfer(
                "load",
                tuple(keys),
                nbytes,
                start,
                done_at,
                self._host_generation,
                request_id=request.request_id,
            )
        )

    def _offload(self, r: Request, now: float) -> None:
        """Offer ``r``'s newly completed blocks to the host tier and copy out those it lacks
        (vLLM's ``_build_store_jobs``: prompt blocks only, by default)."""
        if self.host is None or self.host_kv is None:
            return
        bs = self.config.block_size
        tokens = r.num_computed_tokens
        assert self.config.kv_offload is not None
        if self.config.kv_offload.offload_prompt_only:
            tokens = min(tokens, r.num_prompt_tokens)
        start, end = r.next_stored_block, min(tokens // bs, len(r.block_hashes))
        if end <= start:
            return
        keys = r.block_hashes[start:end]
        lora = (r.lora.lora_int_id, r.lora.name) if r.lora is not None else None
        meta = [
            BlockMeta(
                parent=r.block_hashes[i - 1] if i > 0 else None,
                token_ids=tuple(r.token_ids[i * bs : (i + 1) * bs]),
                block_size=bs,
                lora=lora,
            )
            for i in range(start, end)
        ]
        positions = [(i + 1) * bs for i in range(start, end)]
        prepared = self.host.prepare_store(r.request_id, keys, positions, meta)
        if prepared is None:
            return  # no room now: offered again next step
        r.next_stored_block = end
        to_store, slots = prepared
        if not to_store:
            return
        table = self.blocks.table(r.request_id)
        position = {key: start + i for i, key in enumerate(keys)}
        self.host_kv.store(self.kv, [table[position[k]] for k in to_store], slots)
        nbytes = len(to_store) * self.kv.spec.bytes_per_block
        begin, done_at = self._d2h.schedule(now, nbytes)
        self._transfers.append(
            Transfer("store", tuple(to_store), nbytes, begin, done_at, self._host_generation)
        )

    def _complete_transfers(self, now: float) -> None:
        """Complete the copies done by ``now``: stored blocks become servable (their events),
        loads release their host blocks and let their requests run."""
        assert self.host is not None
        pending: list[Transfer] = []
        s = self._stats
        for t in self._transfers:
            if t.done_at > now:
                pending.append(t)
                continue
            current = t.generation == self._host_generation
            if t.kind == "store":
                if current:
                    self.host.complete_store(t.keys)
                s.kv_offload_store_bytes_total += t.nbytes
                s.kv_offload_store_time_seconds_total += t.done_at - t.start
                s.kv_offload_store_size.observe(t.nbytes)
                continue
            if current:
                self.host.complete_load(t.keys)
            request = self._requests.get(t.request_id or "")
            if request is not None:
                request.host_load_done = True  # the data is in: a reset does not void it
            s.kv_offload_load_bytes_total += t.nbytes
            s.kv_offload_load_time_seconds_total += t.done_at - t.start
            s.kv_offload_load_size.observe(t.nbytes)
        self._transfers = pending

    # ---- KV events and the prefix cache ------------------------------------------------------

    def take_kv_events(self) -> EventBatch | None:
        """The prefix-cache changes since the last call as one batch (None if there were none).

        The device pool's events come first, then the host tier's, as vLLM's scheduler appends
        its connector's events to its block pool's. ``ts`` is wall-clock seconds, as vLLM's;
        this engine is data-parallel rank 0.
        """
        events = self.blocks.take_events()
        if self.host is not None:
            events += self.host.take_events()
        if not events:
            return None
        return EventBatch(ts=time.time(), events=events, data_parallel_rank=0)

    def reset_prefix_cache(self, *, reset_external: bool = False) -> None:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``); running requests keep
        their blocks, which are simply no longer shared with new ones. ``reset_external``
        (vLLM's ``reset_connector``) empties the host tier too, silently as vLLM's does;
        copies in flight complete without effect, and requests offer their blocks again."""
        self.blocks.reset_prefix_cache()
        if reset_external and self.host is not None:
            self.host.reset()
            self._host_generation += 1
            for r in self._requests.values():
                if r.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                    r.next_stored_block = 0

    # ---- speculative decoding --------------------------------------------------------------

    def _propose(
        self, scheduled: Sequence[ScheduledRequest], lora_weights: dict[int, LoRAWeights]
    ) -> dict[str, list[int]]:
        """Draft tokens for every request scheduled with speculative lookahead.

        The draft is the target's first layers: it runs on the same positions and writes the
        same K/V for those layers into the same slots, which the target's verification pass
        then overwrites with identical values; so it needs no KV cache of its own. It runs
        under each request's adapter too, or those K/V would differ.
        """
        self._draft_probs = {}
        spec = self.config.speculative
        active = [s for s in scheduled if s.num_spec_tokens > 0]
        if spec is None or not active:
            return {}
        drafts: dict[str, list[int]] = {s.request.request_id: [] for s in active}
        probs: dict[str, list[torch.Tensor]] = {s.request.request_id: [] for s in active}
        for j in range(max(s.num_spec_tokens for s in active)):
            step = [s for s in active if s.num_spec_tokens > j]
            seqs: list[SeqSlice] = []
            ids: list[int] = []
            for i, s in enumerate(step):
                r = s.request
                pos = r.num_computed_tokens + j
                ids.append(r.token_ids[pos] if j == 0 else drafts[r.request_id][-1])
                seqs.append(SeqSlice(i, 1, pos, self.blocks.table(r.request_id)))
            meta: AttentionMetadata = build_attention_metadata(seqs, self.config.block_size)
            requests = [s.request for s in step]
            logits = self.model.forward(
                torch.tensor(ids, dtype=torch.long),
                meta,
                self.kv,
                num_layers=spec.draft_num_layers,
                lora=self._lora_batch(list(zip(requests, seqs, strict=True)), lora_weights),
            )
            for i, s in enumerate(step):
                r = s.request
                if r.params.greedy:
                    drafts[r.request_id].append(int(restrict(logits[i], r.params).argmax()))
                    continue
                q = probs_from_logits(logits[i : i + 1], r.params)
                drafts[r.request_id] += sample_from_probs(q, r.generator or self._generator)
                probs[r.request_id].append(q[0])
        self._draft_probs = {k: torch.stack(v) for k, v in probs.items() if v}
        return drafts

    def _verify(self, r: Request, draft: list[int], logits: torch.Tensor) -> list[int]:
        self._stats.spec_decode_num_drafts_total += 1
        self._stats.spec_decode_num_draft_tokens_total += len(draft)
        if r.params.greedy:
            new = verify_greedy(draft, restrict(logits, r.params).argmax(-1).tolist())
        else:
            target = probs_from_logits(logits, r.params)
            new = rejection_sample(
                draft, self._draft_probs[r.request_id], target, r.generator or self._generator
            )
        self._stats.spec_decode_num_accepted_tokens_total += len(new) - 1
        return new

    # ---- stopping ------------------------------------------------------------------------

    def _append(self, r: Request, tokens: Sequence[int], now: float) -> int:
        """Append sampled tokens until one finishes the request; returns how many were kept."""
        kept = 0
        for token in tokens:
            r.token_ids.append(token)
            r.token_times.append(now)
            kept += 1
            if self._check_stop(r, token):
                break
        return kept

    def _check_stop(self, r: Request, token: int) -> bool:
        p = r.params
        if r.eos_token_id is not None and token == r.eos_token_id:
            r.finish_reason = "stop"
            return True
        if token in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", token
            return True
        if p.stop:
            text = self.tokenizer.decode(r.output_token_ids)
            longest = max(len(s) for s in p.stop)
            start = max(0, r.stop_search_from - longest + 1)
            hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
            r.stop_search_from = len(text)
            if hits:
                at, stop = min(hits)
                r.finish_reason, r.stop_reason = "stop", stop
                r.stop_text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                return True
        if r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.config.max_model_len:
            r.finish_reason = "length"
            return True
        return False

    def _finish(self, r: Request, reason: FinishReason) -> None:
        """Mark ``r`` finished; the caller has already released (or pinned) its blocks."""
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        r.finished_time = self.clock()
        if self.host is not None:
            # vLLM tells its offloading manager in the next step, after that step's stores.
            self._host_finished.append(r.request_id)
        self._requests.pop(r.request_id, None)
        self._stats.request_success_total[reason] = (
            self._stats.request_success_total.get(reason, 0) + 1
        )

    def _output(self, r: Request, num_new: int) -> RequestOutput:
        finished = r.finished
        if r.stop_text is not None:
            text = r.stop_text
        else:
            text = self.tokenizer.decode(r.output_token_ids, hold_incomplete=not finished)
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=tuple(r.prompt_token_ids),
            token_ids=tuple(r.output_token_ids),
            text=text,
            num_new_tokens=num_new,
            finished=finished,
            finish_reason=r.finish_reason if finished else None,
            stop_reason=r.stop_reason,
            num_cached_tokens=r.num_cached_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=r.arrival_time,
                first_scheduled_time=r.first_scheduled_time,
                first_token_time=r.first_token_time,
                finished_time=r.finished_time,
                token_times=tuple(r.token_times),
                num_preemptions=r.num_preemptions,
            ),
        )

    # ---- P/D: pinned prompt KV -----------------------------------------------------------

    def _pin(self, r: Request) -> None:
        """Finish ``r`` but keep the blocks holding its prompt's KV for export."""
        num_tokens = min(r.num_computed_tokens, r.num_prompt_tokens)
        if r in self.scheduler.running:
            self.scheduler.running.remove(r)
        keep = -(-num_tokens // self.config.block_size)
        block_ids = self.blocks.free_seq(r.request_id, keep_blocks=keep)
        if not block_ids:
            return
        self.pins[r.request_id] = PinnedKV(
            request_id=r.request_id,
            token_ids=tuple(r.prompt_token_ids[:num_tokens]),
            block_ids=tuple(block_ids),
            expires_at=self.clock() + self.config.kv_pin_ttl_s,
        )

    def pinned_kv(self, request_id: str) -> PinnedKV | None:
        """The pinned prompt KV of a finished ``pin_kv`` request, if not released or expired."""
        return self.pins.get(request_id)

    def export_kv(self, request_id: str) -> KVBlocks:
        """Copy out a pinned prompt's KV blocks; KeyError if unknown, released or expired."""
        pin = self.pins[request_id]
        data, scales = self.kv.export_blocks(pin.block_ids)
        self._stats.kv_exported_blocks_total += len(pin.block_ids)
        return KVBlocks(
            token_ids=pin.token_ids,
            block_size=self.config.block_size,
            block_ids=pin.block_ids,
            data=data,
            scales=scales,
        )

    def release_kv(self, request_id: str) -> bool:
        """Unpin a prompt's KV (the decoder has it); False if it was not pinned."""
        if request_id not in self.pins:
            return False
        self._release_pin(request_id)
        return True

    def _release_pin(self, request_id: str) -> None:
        pin = self.pins.pop(request_id)
        self.blocks.unref_blocks(pin.block_ids)

    def _expire_pins(self, now: float) -> None:
        for rid in [rid for rid, pin in self.pins.items() if pin.expires_at <= now]:
            self._release_pin(rid)

    # ---- metrics -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters, with the gauges filled in."""
        s = self._stats
        s.prefix_cache_queries_total = self.blocks.stats.queries
        s.prefix_cache_hits_total = self.blocks.stats.hits
        s.num_preemptions_total = self.scheduler.num_preemptions
        s.num_requests_running = len(self.scheduler.running)
        s.num_requests_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage_perc = self.blocks.usage
        if self.host is not None:
            n = self.host.num_blocks
            s.external_prefix_cache_queries_total = self.scheduler.external_stats.queries
            s.external_prefix_cache_hits_total = self.scheduler.external_stats.hits
            s.kv_offload_blocks_used = self.host.num_used
            s.kv_offload_cpu_cache_usage_perc = self.host.num_pinned / n
            s.kv_offload_cpu_cache_write_usage_perc = self.host.num_writing / n
            s.kv_offload_cpu_cache_read_usage_perc = max(
                (self.host.num_pinned - self.host.num_writing) / n, 0.0
            )
            s.kv_offload_allocation_failures_total = self.host.stats.allocation_failures
            s.kv_offload_evictions_total = self.host.stats.evictions
            s.kv_offload_allocation_size = self.host.stats.allocation_size
        if self.loras is not None:
            s.lora_loads_total = self.loras.stats.loads
            s.lora_activations_total = self.loras.stats.activations
            s.running_lora_adapters = _count_by_adapter(self.scheduler.running)
            s.waiting_lora_adapters = _count_by_adapter(self.scheduler.waiting)
        return EngineStats(
            **{
                **s.__dict__,
                "request_success_total": dict(s.request_success_total),
                "running_lora_adapters": dict(s.running_lora_adapters),
                "waiting_lora_adapters": dict(s.waiting_lora_adapters),
                "kv_offload_load_size": s.kv_offload_load_size.copy(),
                "kv_offload_store_size": s.kv_offload_store_size.copy(),
                "kv_offload_allocation_size": (
                    s.kv_offload_allocation_size.copy()
                    if s.kv_offload_allocation_size is not None
                    else None
                ),
            }
        )


def _count_by_adapter(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora is not None:
            counts[r.lora.name] = counts.get(r.lora.name, 0) + 1
    return counts
