"""The reference engine's HTTP server: vLLM's OpenAI-compatible API on aiohttp.

Endpoints (as vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE
streaming), ``GET /v1/models``, ``GET /health`` (200 ready, 503 starting/draining/failed),
``GET /metrics`` (vLLM's metric names, see metrics.py), ``POST /tokenize``,
``POST /detokenize``, ``GET /version``; and the P/D hand-off's internal endpoints
``POST /internal/kv/{request_id}`` (export a pinned prompt's KV, optionally releasing it) and
``DELETE /internal/kv/{request_id}`` (release it).

Chat template: messages become ``<|role|>\\ncontent\\n`` each, followed by ``<|assistant|>\\n``
(``ByteTokenizer.apply_chat_template``), so chats sharing history share a token prefix and hit
the prefix cache. Content may be a string or a list of ``{"type": "text"}`` parts.

Threading: the engine runs on its own thread (runner.py); the event loop only parses, waits on
per-request queues and writes responses, so a long step never stalls other connections.

P/D hand-off, following vLLM's NIXL proxy protocol (DESIGN.md section 4):

* prefill side (role ``prefill``/``both``): a request with ``kv_transfer_params.do_remote_decode``
  runs with ``pin_kv``; the response's ``kv_transfer_params`` says where the prompt's KV waits
  (``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``expires_at``). ``remote_host``/``remote_port`` are this server's address as
  the caller reached it, unless ``kv_ip`` is set in ``--kv-transfer-config``.
* decode side (role ``decode``/``both``): a request with ``do_remote_prefill`` first pulls the KV
  (``POST http://remote_host:remote_port/internal/kv/remote_request_id``, which also releases
  it), then runs with ``kv_import`` and so skips the prefill. A missing or expired pin, a failed
  pull or an unusable payload falls back to a local prefill, counted in
  ``fleetpilot:kv_transfer_fallbacks_total{reason}``: the output is the same, only slower.

Trust assumption: like vLLM's NIXL side channel, the hand-off is unauthenticated: a decode
server would connect to whatever host and port a request's ``kv_transfer_params`` name, and a
prefill server would hand pinned KV (and the prompt's token ids) to whoever knows the request
id. ``--allowed-remote-hosts`` (peers.py; default: loopback only) bounds both: a decode request
naming a host outside the list is refused with a 400 before any connection is made, and
``/internal/kv/`` answers 403 to callers whose address is not listed. In a cluster the engine's
port must also be reachable only from the router and its peers (the planner's NetworkPolicy).
Pulls go only to the ``/internal/kv/`` path, with a timeout and a size bound, and the payload
is safetensors (no pickle), validated before use.

Shutdown: SIGTERM (or SIGINT) starts a drain: ``/health`` and new requests get 503, running
requests finish (up to ``--drain-grace-seconds``, then they are aborted), then the process
exits 0. Pinned KV can still be pulled while draining.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import aiohttp
import torch
from aiohttp import web
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from yarl import URL

from fleetpilot import __version__
from fleetpilot.argtypes import port_number
from fleetpilot.engine.reference.checkpoint import CheckpointError, load_checkpoint
from fleetpilot.engine.reference.engine import (
    DEFAULT_KV_CACHE_BYTES,
    EngineConfig,
    LLMEngine,
    RequestRejectedError,
)
from fleetpilot.engine.reference.metrics import CONTENT_TYPE, ServerMetrics
from fleetpilot.engine.reference.model import LlamaModel, ModelConfig
from fleetpilot.engine.reference.peers import LOOPBACK, AllowedPeers
from fleetpilot.engine.reference.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    KVPullRequest,
    KVTransferParams,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    error_body,
    to_json,
    validation_error,
)
from fleetpilot.engine.reference.request import KVBlocks, RequestOutput
from fleetpilot.engine.reference.runner import (
    EngineDeadError,
    EngineRunner,
    PinInfo,
    RequestStream,
    StreamItem,
)
from fleetpilot.engine.reference.sampling import SamplingParams
from fleetpilot.engine.reference.speculative import SpeculativeConfig
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.httpserver import ServerLimits, make_runner, start_site

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

State = Literal["starting", "ready", "draining", "failed", "stopped"]
Role = Literal["unified", "prefill", "decode", "both"]

# Model presets that run on a CPU. "tiny" answers in milliseconds (tests, the local fleet);
# "small" is the engine's default architecture.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
    "small": ModelConfig(),
}
DEFAULT_MAX_MODEL_LEN = 2048
# Bodies above this are refused with a 413; prompts are bounded by max_model_len anyway (a
# byte-level token is at most one byte of text, plus JSON escaping and chat framing).
MAX_BODY_BYTES = 16 * 1024 * 1024
KV_FORMAT = "fleetpilot-kv-v1"
KV_ROUTE = "/internal/kv/"


# ---- settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVTransferSettings:
    """What ``--kv-transfer-config`` (vLLM's JSON) means for this engine."""

    role: Role = "unified"
    engine_id: str = ""
    advertise_host: str | None = None  # kv_ip: the host decoders should pull from
    allowed_remote_hosts: AllowedPeers = LOOPBACK  # KV sources and callers (the trust note)
    pull_timeout_s: float = 10.0
    pin_ttl_s: float = 60.0

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    host: str = "127.0.0.1"
    port: int = 8000
    kv: KVTransferSettings = KVTransferSettings()
    drain_grace_s: float = 25.0
    step_delay_s: float = 0.0
    limits: ServerLimits = field(default_factory=ServerLimits)  # header timeout, connections

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ConfigError(ValueError):
    """Bad command-line settings; the message says which flag."""


# ---- KV payloads ---------------------------------------------------------------------------


def serialize_kv(kv: KVBlocks) -> bytes:
    """``KVBlocks`` as safetensors bytes: tensors plus string metadata, no pickle."""
    tensors = {
        "data": kv.data.contiguous(),
        "token_ids": torch.tensor(kv.token_ids, dtype=torch.int64),
    }
    if kv.scales is not None:
        tensors["scales"] = kv.scales.contiguous()
    metadata = {
        "format": KV_FORMAT,
        "block_size": str(kv.block_size),
        "block_ids": json.dumps(list(kv.block_ids)),
    }
    return st_save(tensors, metadata=metadata)


def deserialize_kv(payload: bytes) -> KVBlocks:
    """Parse and shape-check a payload from ``serialize_kv``; ValueError if malformed.

    The engine checks the payload against the prompt and its own pool before using it; this
    checks what the engine assumes (consistent shapes), so a bad peer cannot crash a step.
    """
    try:
        tensors = st_load(payload)
        with_meta = _safetensors_metadata(payload)
    except (SafetensorError, ValueError, KeyError) as e:
        raise ValueError(f"not a KV payload: {e}") from e
    if with_meta.get("format") != KV_FORMAT:
        raise ValueError(f"unknown KV payload format {with_meta.get('format')!r}")
    try:
        block_size = int(with_meta["block_size"])
        block_ids = tuple(int(b) for b in json.loads(with_meta["block_ids"]))
        data = tensors["data"]
        token_ids = tensors["token_ids"]
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"incomplete KV payload: {e}") from e
    scales = tensors.get("scales")
    if data.dim() != 6 or data.shape[2] != len(block_ids) or data.shape[3] != block_size:
        raise ValueError(f"KV data of shape {tuple(data.shape)} does not match its metadata")
    if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
        raise ValueError("token_ids must be a 1-d int64 tensor")
    if not 0 < token_ids.numel() <= len(block_ids) * block_size:
        raise ValueError("token_ids do not fit the blocks")
    if scales is not None and (
        tuple(scales.shape) != tuple(data.shape[:-1]) or scales.dtype != torch.float32
    ):
        raise ValueError("int8 scales do not match the KV data")
    return KVBlocks(
        token_ids=tuple(int(t) for t in token_ids.tolist()),
        block_size=block_size,
        block_ids=block_ids,
        data=data,
        scales=scales,
    )


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    # The header is an 8-byte little-endian length and a JSON object; its "__metadata__" holds
    # the string metadata (safetensors.torch.load drops it).
    if len(payload) < 8:
        raise ValueError("payload too short")
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("bad metadata")
    return {str(k): str(v) for k, v in meta.items()}


# ---- the server ----------------------------------------------------------------------------


@dataclass
class _Prepared:
    """A validated generation request, before it reaches the engine."""

    kind: Literal["completion", "chat"]
    request: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    model: str


class EngineServer:
    """One engine behind one HTTP listener. ``start``, then ``drain`` and ``close``."""

    def __init__(self, settings: ServerSettings, engine_factory: Callable[[], LLMEngine]) -> None:
        self.settings = settings
        self.engine_factory = engine_factory
        self.metrics = ServerMetrics(settings.model_name, max_model_len=settings.max_model_len)
        self.tokenizer = ByteTokenizer()
        self.state: State = "starting"
        self.exit_code = 0
        self.engine: LLMEngine | None = None
        self.runner: EngineRunner | None = None
        self.port = settings.port
        self._inflight: set[str] = set()
        self._active = 0  # generation handlers in progress (including KV pulls)
        self._idle: asyncio.Event | None = None
        self.stopped: asyncio.Event | None = None
        self._app_runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self._boot: asyncio.Task[None] | None = None
        self.app = self._build_app()

    # ---- lifecycle -----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post(KV_ROUTE + "{request_id}", self.kv_export)
        app.router.add_delete(KV_ROUTE + "{request_id}", self.kv_release)
        return app

    async def start(self) -> None:
        """Listen (answering 503 while starting), then build the engine in the background."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopped = asyncio.Event()
        # handler_cancellation: a client that disconnects cancels its handler, whose cleanup
        # aborts the engine request (non-streaming requests have no write to fail on).
        self._app_runner = make_runner(
            self.app,
            self.settings.limits,
            handler_cancellation=True,
            shutdown_timeout=2.0,
            access_log=None,
        )
        await start_site(self._app_runner, self.settings.host, self.settings.port)
        for address in self._app_runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.kv.pull_timeout_s)
        )
        self._boot = asyncio.create_task(self._build_engine())

    async def _build_engine(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(None, self.engine_factory)
        except Exception:
            log.exception("building the engine failed")
            self._fail()
            return
        self.engine = engine
        self.metrics.set_cache_config(
            {
                "block_size": engine.config.block_size,
                "cache_dtype": engine.config.kv_cache_dtype,
                "enable_prefix_caching": engine.config.enable_prefix_caching,
                "num_gpu_blocks": engine.kv.num_blocks,
                "num_cpu_blocks": None,
                "kv_cache_memory_bytes": engine.kv.nbytes,
            }
        )
        self.metrics.set_stats(engine.stats())
        self.runner = EngineRunner(
            engine,
            self.metrics,
            step_delay_s=self.settings.step_delay_s,
            on_failure=lambda _exc: _post_fail(loop, self._fail),
        )
        self.runner.start()
        if self.state == "starting":
            self.state = "ready"
        log.info(
            "engine ready: model %s, %d KV blocks of %d tokens, role %s",
            self.settings.model_name,
            engine.kv.num_blocks,
            engine.config.block_size,
            self.settings.kv.role,
        )

    def _fail(self) -> None:
        self.state = "failed"
        self.exit_code = 1
        if self.stopped is not None:
            self.stopped.set()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        assert self._boot is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._boot), timeout)
        if self.state != "ready":
            raise RuntimeError(f"the engine did not start (state {self.state})")

    async def drain(self, grace_s: float | None = None) -> None:
        """Refuse new work (503) and wait for running requests, aborting them after the grace."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        if self.state in ("starting", "ready"):
            self.state = "draining"
        log.info("draining: %d requests in flight, grace %.1fs", self._active, grace)
        assert self._idle is not None
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            log.warning("drain grace expired: aborting %d requests", len(self._inflight))
            if self.runner is not None:
                for rid in list(self._inflight):
                    self.runner.abort(rid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)

    async def close(self) -> None:
        if self._boot is not None and not self._boot.done():
            self._boot.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._boot
        if self.state != "failed":
            self.state = "stopped"
        if self._app_runner is not None:
            await self._app_runner.cleanup()
        if self.runner is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.runner.stop)
        if self._client is not None:
            await self._client.close()

    @property
    def in_flight(self) -> int:
        """Generation requests being handled (a drain waits for these)."""
        return self._active

    @property
    def url(self) -> str:
        host = self.settings.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        return f"http://{_url_host(host)}:{self.port}"

    # ---- plumbing ------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return _error_response(e.status, e.message, param=e.param)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            messages = {
                404: f"route {request.method} {request.path} not found",
                405: f"method {request.method} not allowed on {request.path}",
                413: f"request body too large (limit {MAX_BODY_BYTES} bytes)",
            }
            message = messages.get(e.status, e.reason)
            return _error_response(e.status, message, headers=_allow_header(e))
        except EngineDeadError as e:
            return _error_response(503, str(e))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            # A bug, not bad input: log it and answer 500 without taking the server down.
            log.exception("unhandled error in %s %s", request.method, request.path)
            return _error_response(500, "internal server error")

    def _require(self, *states: State) -> None:
        if self.state in states:
            return
        reasons = {
            "starting": "the engine is starting",
            "draining": "the server is shutting down",
            "failed": "the engine has failed",
            "stopped": "the server is stopped",
        }
        raise APIError(503, reasons.get(self.state, f"the server is {self.state}"))

    async def _parse(self, request: web.Request, model: type[M]) -> M:
        raw = await request.read()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from e
        except RecursionError:
            # The client's fault, like the router's answer to the same body: not a 500.
            raise APIError(400, "the request body is nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from e
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None

    def _check_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")
        return name

    def _encode(self, text: str, *, param: str, add_bos: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_bos=add_bos)
        except UnicodeEncodeError as e:  # JSON can carry lone surrogates; UTF-8 cannot
            raise APIError(400, f"the text is not valid Unicode: {e.reason}", param=param) from e

    def _running(self) -> tuple[LLMEngine, EngineRunner]:
        if self.engine is None or self.runner is None:
            raise APIError(503, "the engine is starting")
        return self.engine, self.runner

    # ---- simple endpoints ----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        self._require("ready")
        if self.runner is None or not self.runner.alive:
            raise APIError(503, "the engine is not running")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__, "engine": "fleetpilot-reference"})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        # Rendering reads snapshots only; it never waits for the engine thread.
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        cards = [
            ModelCard(
                id=name, root=self.settings.model_root, max_model_len=self.settings.max_model_len
            )
            for name in self.settings.served_model_names
        ]
        return _json(ModelList(data=cards))

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self._parse(request, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
            tokens = self._encode(text, param="messages")
        else:
            assert req.prompt is not None
            tokens = self._encode(req.prompt, param="prompt", add_bos=req.add_special_tokens)
        return _json(
            TokenizeResponse(
                count=len(tokens), max_model_len=self.settings.max_model_len, tokens=tokens
            )
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await self._parse(request, DetokenizeRequest)
        self._check_model(req.model)
        return web.json_response({"prompt": self.tokenizer.decode(req.tokens)})

    # ---- generation ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._require("ready")
        req = await self._parse(request, CompletionRequest)
        model = self._check_model(req.model)
        req.check()
        prompt = req.single_prompt()
        ids = self._encode(prompt, param="prompt") if isinstance(prompt, str) else list(prompt)
        prepared = _Prepared("completion", req, ids, req.sampling_params(req.max_tokens), model)
        return await self._generate(request, prepared)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._require("ready")
        req = await self._parse(request, ChatCompletionRequest)
        model = self._check_model(req.model)
        req.check()
        text = self.tokenizer.apply_chat_template(req.chat_messages())
        ids = self._encode(text, param="messages")
        params = req.sampling_params(req.effective_max_tokens)
        return await self._generate(request, _Prepared("chat", req, ids, params, model))

    async def _generate(self, request: web.Request, p: _Prepared) -> web.StreamResponse:
        engine, runner = self._running()
        if len(p.prompt_ids) >= self.settings.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.settings.max_model_len} tokens. "
                f"However, your prompt has {len(p.prompt_ids)} tokens (and at least one "
                "output token is needed).",
                param="messages" if p.kind == "chat" else "prompt",
            )
        ktp = p.request.kv_transfer_params
        pin = bool(ktp is not None and ktp.do_remote_decode and self.settings.kv.produces)
        if pin and p.request.stream:
            raise APIError(
                400, "kv_transfer_params.do_remote_decode needs stream=false", "kv_transfer_params"
            )
        prefix = "chatcmpl" if p.kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        arrival = engine.clock()  # before any KV pull: the pull is part of the TTFT
        sockname = _local_address(request)
        assert self._idle is not None
        self._active += 1
        self._idle.clear()
        self._inflight.add(rid)
        stream: RequestStream | None = None
        try:
            kv_import = None
            if ktp is not None and ktp.do_remote_prefill and self.settings.kv.consumes:
                kv_import = await self._pull_kv(ktp)
            try:
                stream = await runner.add_request(
                    rid,
                    p.prompt_ids,
                    p.params,
                    arrival_time=arrival,
                    pin_kv=pin,
                    kv_import=kv_import,
                )
            except RequestRejectedError as e:
                raise APIError(400, str(e)) from e
            if p.request.stream:
                return await self._stream(request, p, rid, stream)
            item = await _final(stream)
            kv_params = self._kv_params(rid, item.pin, sockname) if pin else None
            return _json(self._response(p, rid, item.output, kv_params))
        finally:
            if stream is not None and not stream.finished:
                runner.abort(rid)  # the client left (or we failed): free the engine's work
            self._inflight.discard(rid)
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    def _response(
        self,
        p: _Prepared,
        rid: str,
        out: RequestOutput,
        kv_params: dict[str, Any] | None,
    ) -> BaseModel:
        usage = Usage.of(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)
        ids = p.request.return_token_ids
        if p.kind == "completion":
            choice = CompletionChoice(
                text=out.text,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                token_ids=list(out.token_ids) if ids else None,
            )
            return CompletionResponse(
                id=rid, model=p.model, choices=[choice], usage=usage, kv_transfer_params=kv_params
            )
        chat_choice = ChatChoice(
            message=ChatResponseMessage(content=out.text),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            token_ids=list(out.token_ids) if ids else None,
        )
        return ChatCompletionResponse(
            id=rid,
            model=p.model,
            choices=[chat_choice],
            usage=usage,
            prompt_token_ids=list(out.prompt_token_ids) if ids else None,
            kv_transfer_params=kv_params,
        )

    async def _stream(
        self, request: web.Request, p: _Prepared, rid: str, stream: RequestStream
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        writer = _SSEWriter(resp, p, rid)
        try:
            if p.kind == "chat":
                await writer.send_role()
            while True:
                try:
                    item = await stream.next()
                except EngineDeadError as e:
                    await writer.send_error(503, str(e))
                    break
                await writer.send_output(item.output)
                if item.output.finished:
                    await writer.send_usage(item.output)
                    break
            await writer.send_done()
            await resp.write_eof()
        except ConnectionResetError:
            log.debug("client disconnected from %s", rid)  # the caller's finally aborts
        return resp

    def _kv_params(
        self, rid: str, pin: PinInfo | None, sockname: tuple[str, int] | None
    ) -> dict[str, Any] | None:
        if pin is None:
            return None  # nothing pinned (aborted, or evicted at once): decode prefills
        kv = self.settings.kv
        host = kv.advertise_host or (sockname[0] if sockname else self.settings.host)
        port = sockname[1] if sockname else self.port
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": kv.engine_id,
            "remote_block_ids": list(pin.block_ids),
            "remote_request_id": rid,
            "remote_host": host,
            "remote_port": port,
            "remote_num_tokens": pin.num_tokens,
            "tp_size": 1,
            "expires_at": pin.expires_at,
        }

    # ---- P/D: decode side ----------------------------------------------------------------

    async def _pull_kv(self, ktp: KVTransferParams) -> KVBlocks | None:
        """Fetch (and release) the prompt KV a prefill server pinned; None means prefill here."""
        kv = self.settings.kv
        host, port, remote_id = ktp.remote_host, ktp.remote_port, ktp.remote_request_id
        if not host or port is None or not remote_id:
            log.warning("kv_transfer_params without remote host/port/request id: prefilling")
            self.metrics.count_kv_fallback("not_found")
            return None
        if ktp.expires_at is not None and ktp.expires_at <= time.time():
            log.info("remote KV of %s expired before the pull: prefilling", remote_id)
            self.metrics.count_kv_fallback("not_found")
            return None
        # Refused before any connection: a body must not make this server a proxy into the
        # network it sits in. A 400 rather than a silent local prefill, so a misconfigured list
        # shows at once; still counted as "refused" so the series flags hostile hand-offs.
        if not kv.allowed_remote_hosts.allows_pull(host, port):
            log.warning("refusing to pull KV from %r:%r (not an allowed remote host)", host, port)
            self.metrics.count_kv_fallback("refused")
            raise APIError(
                400,
                f"kv_transfer_params.remote_host {host!r} port {port} is not an allowed KV "
                f"source (--allowed-remote-hosts {kv.allowed_remote_hosts})",
                param="kv_transfer_params.remote_host",
            )
        try:
            url = URL.build(
                scheme="http",
                host=host,
                port=port,
                path=KV_ROUTE + quote(remote_id, safe=""),
                encoded=True,
            )
        except (ValueError, TypeError) as e:
            log.warning("refusing to pull KV from an invalid address %r:%r", host, port)
            self.metrics.count_kv_fallback("refused")
            raise APIError(
                400,
                f"kv_transfer_params.remote_host {host!r} is not a valid address",
                param="kv_transfer_params.remote_host",
            ) from e
        body = KVPullRequest(
            engine_id=ktp.remote_engine_id, block_ids=ktp.block_ids(), release=True
        )
        limit = self._max_kv_payload()
        assert self._client is not None
        try:
            async with self._client.post(url, json=body.model_dump()) as resp:
                if resp.status == 404:
                    log.info("remote KV of %s not found (expired or released)", remote_id)
                    self.metrics.count_kv_fallback("not_found")
                    return None
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > limit:
                    raise ValueError(f"payload of {resp.content_length} bytes exceeds {limit}")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > limit:
                        raise ValueError(f"payload exceeds {limit} bytes")
                    chunks.append(chunk)
                payload = b"".join(chunks)
            loop = asyncio.get_running_loop()
            blocks = await loop.run_in_executor(None, deserialize_kv, payload)
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
            log.warning("pulling KV of %s from %s:%s failed: %s", remote_id, host, port, e)
            self.metrics.count_kv_fallback("pull_failed")
            return None
        self.metrics.count_kv_pull()
        return blocks

    def _max_kv_payload(self) -> int:
        # Never more than this engine's whole pool (a compatible payload is smaller), plus
        # room for the header and token ids.
        nbytes = self.engine.kv.nbytes if self.engine is not None else 0
        return nbytes + 8 * self.settings.max_model_len + 1024 * 1024

    # ---- P/D: prefill side ---------------------------------------------------------------

    def _check_peer(self, request: web.Request) -> None:
        """Only listed peers may fetch or release pinned KV (it holds the prompt's tokens)."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        address = peer[0] if isinstance(peer, tuple) and peer else ""
        allowed = self.settings.kv.allowed_remote_hosts
        if not allowed.allows_caller(address):
            log.warning("refusing %s %s from %s (not in --allowed-remote-hosts)",
                        request.method, request.path, address or "an unknown peer")  # fmt: skip
            raise APIError(403, f"peer {address or '(unknown)'} may not access pinned KV")

    async def kv_export(self, request: web.Request) -> web.Response:
        self._check_peer(request)
        # Served while draining too: a decoder may still come for KV pinned just before.
        self._require("ready", "draining")
        _, runner = self._running()
        rid = request.match_info["request_id"]
        req = (
            await self._parse(request, KVPullRequest) if request.can_read_body else KVPullRequest()
        )
        if req.engine_id not in (None, self.settings.kv.engine_id):
            raise APIError(404, f"engine {req.engine_id!r} is not this engine")

        def export(engine: LLMEngine) -> KVBlocks | None:
            pinned = engine.pinned_kv(rid)
            # Expired pins are dropped at the next step; until then they must not be served.
            if pinned is None or pinned.expires_at <= engine.clock():
                return None
            if req.block_ids is not None and tuple(req.block_ids) != pinned.block_ids:
                return None
            blocks = engine.export_kv(rid)  # a copy: releasing below cannot change it
            if req.release:
                engine.release_kv(rid)
            return blocks

        blocks = await runner.call(export)
        if blocks is None:
            raise APIError(404, f"no pinned KV for request {rid!r}: unknown, expired or released")
        payload = await asyncio.get_running_loop().run_in_executor(None, serialize_kv, blocks)
        return web.Response(body=payload, content_type="application/octet-stream")

    async def kv_release(self, request: web.Request) -> web.Response:
        self._check_peer(request)
        self._require("ready", "draining")
        _, runner = self._running()
        rid = request.match_info["request_id"]
        released = await runner.call(lambda engine: engine.release_kv(rid))
        if not released:
            raise APIError(404, f"no pinned KV for request {rid!r}")
        return web.json_response({"released": True})


class _SSEWriter:
    """OpenAI's streaming format: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]``.

    While a request runs, text that could be the start of a stop string is held back (as vLLM
    does), so the streamed text is always a prefix of the final text, which is cut at the stop.
    """

    def __init__(self, resp: web.StreamResponse, p: _Prepared, rid: str) -> None:
        self.resp = resp
        self.p = p
        self.rid = rid
        self.created = int(time.time())
        stops = p.params.stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent_text = 0
        self.sent_tokens = 0

    async def _send(self, data: dict[str, Any]) -> None:
        line = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        await self.resp.write(f"data: {line}\n\n".encode())

    def _base(self, object_: str) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.rid,
            "object": object_,
            "created": self.created,
            "model": self.p.model,
        }
        if self.p.request.include_usage:
            data["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return data

    def _object(self) -> str:
        return "chat.completion.chunk" if self.p.kind == "chat" else "text_completion"

    async def send_role(self) -> None:
        data = self._base(self._object())
        data["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        await self._send(data)

    async def send_output(self, out: RequestOutput) -> None:
        text = out.text
        visible = len(text) if out.finished else max(len(text) - self.hold, 0)
        delta = text[self.sent_text : visible] if visible > self.sent_text else ""
        if not delta and not out.finished:
            return
        self.sent_text = max(self.sent_text, visible)
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.p.kind == "chat":
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        choice["finish_reason"] = out.finish_reason if out.finished else None
        choice["stop_reason"] = out.stop_reason if out.finished else None
        if self.p.request.return_token_ids:
            choice["token_ids"] = list(out.token_ids[self.sent_tokens :])
            self.sent_tokens = len(out.token_ids)
        data = self._base(self._object())
        data["choices"] = [choice]
        if self.p.request.continuous_usage:
            data["usage"] = _usage(out)
        await self._send(data)

    async def send_usage(self, out: RequestOutput) -> None:
        if not self.p.request.include_usage:
            return
        data = self._base(self._object())
        data["choices"] = []
        data["usage"] = _usage(out)
        await self._send(data)

    async def send_error(self, status: int, message: str) -> None:
        await self._send(error_body(status, message))

    async def send_done(self) -> None:
        await self.resp.write(b"data: [DONE]\n\n")


def _usage(out: RequestOutput) -> dict[str, Any]:
    usage = Usage.of(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)
    return usage.model_dump(mode="json")


async def _final(stream: RequestStream) -> StreamItem:
    while True:
        item = await stream.next()
        if item.output.finished:
            return item


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(text=to_json(model), status=status, content_type="application/json")


def _error_response(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        error_body(status, message, param=param), status=status, headers=headers
    )


def _allow_header(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None


def _local_address(request: web.Request) -> tuple[str, int] | None:
    """The address the client connected to: where a decoder can reach this server too."""
    transport = request.transport
    if transport is None:
        return None
    sockname = transport.get_extra_info("sockname")
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    return str(sockname[0]), int(sockname[1])


def _post_fail(loop: asyncio.AbstractEventLoop, fail: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop already closed: nothing to tell
        loop.call_soon_threadsafe(fail)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ---- command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The reference engine's flags; names mirror ``vllm serve``'s where one exists."""
    a = parser.add_argument
    a("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    a("--port", type=port_number, default=8000, help="port to listen on; 0 picks a free one")
    a(
        "--model",
        default=None,
        help="checkpoint directory (config.json + model.safetensors); omitted: a seeded "
        "random model of --model-config",
    )
    a(
        "--model-config",
        default="small",
        help="architecture of the random model: a preset (tiny, small), a JSON object of "
        "ModelConfig fields, or a JSON file (ignored with --model)",
    )
    a(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float64"],
        help="weight and activation dtype (auto: the model config's)",
    )
    a(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is the metrics' model_name "
        "(default: --model, or reference-<preset>)",
    )
    a("--max-model-len", type=int, default=None, help="context length (default: 2048 or less)")
    a("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    a("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    a("--block-size", type=int, default=16, help="tokens per KV block")
    a(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks of identical prompt prefixes",
    )
    a(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prefills across steps, mixed with decodes",
    )
    a("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="KV storage dtype")
    a(
        "--kv-cache-memory-bytes",
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        help="KV pool budget in bytes",
    )
    a(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV pool size in blocks (overrides --kv-cache-memory-bytes)",
    )
    a(
        "--speculative-config",
        default=None,
        help='JSON: {"method": "draft_layers", "num_speculative_tokens": k, '
        '"draft_num_layers": n} (the draft is the target\'s first n layers)',
    )
    a(
        "--kv-transfer-config",
        default=None,
        help='vLLM\'s JSON, e.g. {"kv_connector": "NixlConnector", "kv_role": "kv_both"}; '
        "kv_role kv_producer/kv_consumer/kv_both enables the P/D prefill/decode/both sides; "
        "also engine_id, kv_ip (host decoders pull from) and kv_connector_extra_config "
        "{allowed_remote_hosts, pull_timeout_s}",
    )
    a(
        "--allowed-remote-hosts",
        default=None,
        help="comma-separated P/D peers: the hosts (IP, CIDR or name, optionally :port) a "
        "decode request may pull KV from, and the addresses /internal/kv answers; '*' for any "
        "(only behind a network policy). Default: loopback only (127.0.0.0/8, ::1)",
    )
    a(
        "--role",
        choices=["auto", "unified", "prefill", "decode", "both"],
        default="auto",
        help="P/D role (auto: from kv_role, unified without --kv-transfer-config)",
    )
    a(
        "--kv-pin-ttl-seconds",
        type=float,
        default=60.0,
        help="how long a prefill keeps a prompt's KV for its decoder",
    )
    a("--seed", type=int, default=0, help="sampling seed for requests without their own")
    a(
        "--num-threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: best for the small matrices of CPU models)",
    )
    a(
        "--drain-grace-seconds",
        type=float,
        default=25.0,
        help="on SIGTERM, how long running requests may finish before they are aborted "
        "(keep below the pod's terminationGracePeriodSeconds)",
    )
    a(
        "--step-delay-seconds",
        type=float,
        default=0.0,
        help="sleep after each busy engine step, to simulate a slower accelerator",
    )
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _load_json_option(flag: str, value: str) -> dict[str, Any]:
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"{flag}: not a JSON object or a file: {value!r}")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{flag}: must be a JSON object")
    return data


def _model_config(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    if args.model_config in MODEL_PRESETS:
        config, name = MODEL_PRESETS[args.model_config], f"reference-{args.model_config}"
    else:
        data = _load_json_option("--model-config", args.model_config)
        try:
            config = ModelConfig.from_json_dict(data)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--model-config: {e}") from e
        name = "reference-custom"
    if args.dtype != "auto":
        config = replace(config, torch_dtype=args.dtype)
    return config, name


def _speculative(args: argparse.Namespace) -> SpeculativeConfig | None:
    if not args.speculative_config:
        return None
    data = _load_json_option("--speculative-config", args.speculative_config)
    method = data.pop("method", None)
    if method not in (None, "draft_layers"):
        raise ConfigError(
            f"--speculative-config: method {method!r} is not supported by the reference "
            "engine; use draft_layers (the target's first layers draft)"
        )
    allowed = {"num_speculative_tokens", "draft_num_layers"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"--speculative-config: unknown keys {unknown}; allowed {sorted(allowed)}"
        )
    if "num_speculative_tokens" not in data:
        raise ConfigError("--speculative-config: num_speculative_tokens is required")
    try:
        return SpeculativeConfig(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--speculative-config: {e}") from e


_KV_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def _kv_settings(args: argparse.Namespace) -> KVTransferSettings:
    data = (
        _load_json_option("--kv-transfer-config", args.kv_transfer_config)
        if (args.kv_transfer_config)
        else {}
    )
    role: Role
    if args.role != "auto":
        role = args.role
    elif data:
        kv_role = data.get("kv_role")
        if kv_role not in _KV_ROLES:
            raise ConfigError(
                f"--kv-transfer-config: kv_role must be one of {sorted(_KV_ROLES)}, got {kv_role!r}"
            )
        role = _KV_ROLES[kv_role]
    else:
        role = "unified"
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    allowed = extra.get("allowed_remote_hosts")
    if allowed is not None and (
        not isinstance(allowed, list) or not all(isinstance(h, str) for h in allowed)
    ):
        raise ConfigError("--kv-transfer-config: allowed_remote_hosts must be a list of hosts")
    if args.allowed_remote_hosts is not None and allowed is not None:
        raise ConfigError(
            "--allowed-remote-hosts and kv_connector_extra_config.allowed_remote_hosts are "
            "both set; set one"
        )
    if args.allowed_remote_hosts is not None:
        allowed = args.allowed_remote_hosts.split(",")
    try:
        peers = LOOPBACK if allowed is None else AllowedPeers.parse(allowed)
    except ValueError as e:
        raise ConfigError(f"--allowed-remote-hosts: {e}") from e
    try:
        timeout = float(extra.get("pull_timeout_s", 10.0))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--kv-transfer-config: pull_timeout_s: {e}") from e
    if args.kv_pin_ttl_seconds <= 0:
        raise ConfigError("--kv-pin-ttl-seconds must be positive")
    engine_id = data.get("engine_id") or uuid.uuid4().hex
    kv_ip = data.get("kv_ip")
    return KVTransferSettings(
        role=role,
        engine_id=str(engine_id),
        advertise_host=str(kv_ip) if kv_ip else None,
        allowed_remote_hosts=peers,
        pull_timeout_s=timeout,
        pin_ttl_s=args.kv_pin_ttl_seconds,
    )


def build_server(args: argparse.Namespace) -> EngineServer:
    """Settings and an engine factory from parsed flags; ConfigError for a bad combination.

    The model itself is built later, by the server, so the port answers 503 meanwhile.
    """
    kv = _kv_settings(args)
    spec = _speculative(args)
    model_config: ModelConfig | None = None
    if args.model is not None:
        checkpoint = Path(args.model)
        if not checkpoint.is_dir():
            raise ConfigError(f"--model: {checkpoint} is not a directory")
        try:
            config_data = json.loads((checkpoint / "config.json").read_text())
            max_positions = int(config_data.get("max_position_embeddings", 4096))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"--model: cannot read {checkpoint / 'config.json'}: {e}") from e
        default_name = args.model
    else:
        model_config, default_name = _model_config(args)
        max_positions = model_config.max_position_embeddings
    max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, max_positions)
    if max_model_len > max_positions:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"({max_positions})"
        )
    for flag, value in (
        ("--port", args.port),
        ("--drain-grace-seconds", args.drain_grace_seconds),
        ("--step-delay-seconds", args.step_delay_seconds),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must not be negative")
    try:
        engine_config = EngineConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_kv_blocks=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            speculative=spec,
            seed=args.seed,
            kv_pin_ttl_s=kv.pin_ttl_s,
            num_threads=args.num_threads,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    names = tuple(args.served_model_name or (default_name,))
    settings = ServerSettings(
        served_model_names=names,
        model_root=args.model or default_name,
        max_model_len=max_model_len,
        host=args.host,
        port=args.port,
        kv=kv,
        drain_grace_s=args.drain_grace_seconds,
        step_delay_s=args.step_delay_seconds,
    )
    checkpoint_dir = Path(args.model) if args.model is not None else None
    dtype = None if args.dtype == "auto" else args.dtype

    def factory() -> LLMEngine:
        if checkpoint_dir is not None:
            model = load_checkpoint(checkpoint_dir, torch_dtype=dtype)
        else:
            assert model_config is not None
            model = LlamaModel(model_config)
        return LLMEngine(engine_config, model)

    return EngineServer(settings, factory)


async def serve(server: EngineServer, *, install_signal_handlers: bool = True) -> int:
    """Run until SIGTERM/SIGINT (then drain) or an engine failure; the exit code."""
    await server.start()
    log.info("fleetpilot reference engine listening on %s", server.url)
    assert server.stopped is not None
    stopped = server.stopped
    loop = asyncio.get_running_loop()
    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopped.set)
    try:
        await stopped.wait()
        if server.state != "failed":
            log.info("shutdown requested: draining")
            await server.drain()
    finally:
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        await server.close()
    log.info("stopped (exit code %d)", server.exit_code)
    return server.exit_code


def run(args: argparse.Namespace) -> int:
    """Entry point for ``fleetpilot engine --backend reference``."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=getattr(logging, str(args.log_level).upper()),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        server = build_server(args)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(server))


class BackgroundServer:
    """A server on its own event loop in a thread: for tests and in-process fleets.

    ``start()`` returns once the engine is ready; ``stop()`` drains and closes it.
    """

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-server")
        self._thread.daemon = True

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> BackgroundServer:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return cls(build_server(parser.parse_args(list(argv))))

    @property
    def url(self) -> str:
        return self.server.url

    def _run(self, coro: Awaitable[Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self._loop)
        return future.result(timeout)

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self._thread.start()
        self._run(self.server.start(), timeout)
        self._run(self.server.wait_ready(timeout), timeout)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self._shutdown(grace_s), grace_s + 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._loop.close()

    async def _shutdown(self, grace_s: float) -> None:
        await self.server.drain(grace_s)
        await self.server.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _as_coroutine(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetpilot.engine.reference.server",
        description="The fleetpilot CPU reference engine (vLLM's OpenAI-compatible API).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
