"""The reference engine's HTTP server: vLLM's OpenAI-compatible API on aiohttp.

Endpoints (as vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE
streaming, sse.py), ``GET /v1/models``, ``GET /health`` (200 ready, 503
starting/draining/failed), ``GET /metrics`` (vLLM's metric names, see metrics.py),
``POST /tokenize``, ``POST /detokenize``, ``GET /version``; with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (lora_serving.py); and the P/D hand-off's internal
endpoints ``POST /internal/kv/{request_id}`` (export a pinned prompt's KV, optionally releasing
it) and ``DELETE /internal/kv/{request_id}`` (release it). The hand-off itself, and why those
endpoints answer only listed peers, is pd.py; the flags are settings.py.

Chat template: messages become ``<|role|>\\ncontent\\n`` each, followed by ``<|assistant|>\\n``
(``ByteTokenizer.apply_chat_template``), so chats sharing history share a token prefix and hit
the prefix cache. Content may be a string or a list of ``{"type": "text"}`` parts.

LoRA (``--enable-lora``): a request's ``model`` names the base model or an adapter, which the
engine applies to that request alone; adapters come from ``--lora-modules`` at start and from
the load endpoint, and ``/v1/models`` lists them with their ``parent``. Reading an adapter's
files happens off the event loop and off the engine thread.

KV events (``--kv-events-config``): the engine's prefix-cache changes go out in vLLM's format
on a ZMQ PUB socket with a replay socket (kv_publisher.py), bound before the HTTP port so a
port conflict fails the start.

Threading: the engine runs on its own thread (runner.py); the event loop only parses, waits on
per-request queues and writes responses, so a long step never stalls other connections.

Start: the port listens at once, answering 503 (``/health`` included) while the engine builds
the model and its KV pool, then for ``--cold-start-seconds`` more (a GPU engine's start, for a
local fleet's autoscaler to reckon with); only then ``/health`` answers 200.

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
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import zmq
from aiohttp import web
from pydantic import BaseModel, ValidationError

from fleetpilot import __version__
from fleetpilot.engine.reference.checkpoint import CheckpointError
from fleetpilot.engine.reference.engine import LLMEngine, RequestRejectedError
from fleetpilot.engine.reference.kv_publisher import KVEventPublisher
from fleetpilot.engine.reference.kv_wire import KV_ROUTE, serialize_kv
from fleetpilot.engine.reference.lora import (
    LoRAError,
    LoRANotFoundError,
    LoRARequest,
    read_adapter,
    write_seeded_adapter,
)
from fleetpilot.engine.reference.lora_serving import (
    LOAD_ROUTE,
    UNLOAD_ROUTE,
    LoRARegistry,
    LoRAServingError,
    not_found,
)
from fleetpilot.engine.reference.metrics import CONTENT_TYPE, ServerMetrics
from fleetpilot.engine.reference.pd import (
    KVPuller,
    check_kv_caller,
    export_pinned,
    local_address,
    max_kv_payload,
    remote_prefill_params,
)
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
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PreparedRequest,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    Usage,
    check_template_switches,
    error_body,
    to_json,
    validation_error,
)
from fleetpilot.engine.reference.request import RequestOutput
from fleetpilot.engine.reference.runner import (
    EngineDeadError,
    EngineRunner,
    RequestStream,
    StreamItem,
)
from fleetpilot.engine.reference.settings import (
    ConfigError,
    ServerSettings,
    add_arguments,
    settings_from_args,
)
from fleetpilot.engine.reference.sse import stream_events
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.httpserver import (
    content_type_refusal,
    is_json_content_type,
    make_runner,
    start_site,
)
from fleetpilot.listening import ListenError
from fleetpilot.logs import configure_logging

# The command line: ``fleetpilot engine --backend reference`` calls add_arguments, then run.
__all__ = ["EngineServer", "add_arguments", "build_server", "main", "run", "serve"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

State = Literal["starting", "ready", "draining", "failed", "stopped"]

# Bodies above this are refused with a 413; prompts are bounded by max_model_len anyway (a
# byte-level token is at most one byte of text, plus JSON escaping and chat framing).
MAX_BODY_BYTES = 16 * 1024 * 1024


class EngineServer:
    """One engine behind one HTTP listener. ``start``, then ``drain`` and ``close``."""

    def __init__(self, settings: ServerSettings, engine_factory: Callable[[], LLMEngine]) -> None:
        self.settings = settings
        self.engine_factory = engine_factory
        self.metrics = ServerMetrics(
            settings.model_name,
            max_model_len=settings.max_model_len,
            max_lora=settings.lora.max_loras if settings.lora is not None else None,
        )
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
        self._kv_puller = KVPuller(settings.kv, self.metrics)
        self.kv_publisher: KVEventPublisher | None = None
        self._boot: asyncio.Task[None] | None = None
        self.loras = LoRARegistry(settings.served_model_names)
        # Loads and unloads one at a time: a name's check, read and commit must not interleave.
        self._lora_lock = asyncio.Lock()
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
        if self.settings.allow_runtime_lora_updating:
            app.router.add_post(LOAD_ROUTE, self.load_lora_adapter)
            app.router.add_post(UNLOAD_ROUTE, self.unload_lora_adapter)
        app.router.add_post(KV_ROUTE + "{request_id}", self.kv_export)
        app.router.add_delete(KV_ROUTE + "{request_id}", self.kv_release)
        return app

    async def start(self) -> None:
        """Listen (answering 503 while starting), then build the engine in the background."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopped = asyncio.Event()
        if self.settings.kv_events.active:
            try:
                self.kv_publisher = KVEventPublisher(self.settings.kv_events)
            except zmq.ZMQError as e:
                raise ConfigError(f"--kv-events-config: cannot bind: {e}") from e
        # handler_cancellation: a client that disconnects cancels its handler, whose cleanup
        # aborts the engine request (non-streaming requests have no write to fail on).
        self._app_runner = make_runner(
            self.app,
            self.settings.limits,
            handler_cancellation=True,
            shutdown_timeout=2.0,
            access_log=None,
        )
        try:
            await start_site(self._app_runner, self.settings.host, self.settings.port)
        except BaseException:
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            raise
        for address in self._app_runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break
        self._kv_puller.open()
        self._boot = asyncio.create_task(self._build_engine())

    async def _build_engine(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(None, self.engine_factory)
        except Exception:
            log.exception("building the engine failed")
            self._fail()
            return
        try:
            for module in self.settings.lora_modules:
                if self.settings.seed_missing_lora_modules:
                    await loop.run_in_executor(
                        None,
                        write_seeded_adapter,
                        engine.model.config,
                        module.name,
                        engine.config.lora.files_at(module.path)
                        if engine.config.lora
                        else module.path,
                        engine.config.lora.max_lora_rank if engine.config.lora else 16,
                    )
                lora = self.loras.prepare_load(
                    module.name, module.path, base_model_name=module.base_model_name
                )
                await loop.run_in_executor(None, engine.add_lora, lora)
                self.loras.commit(lora)
        except (LoRAError, LoRAServingError) as e:
            log.error("--lora-modules: cannot load adapter %r: %s", module.name, e)
            self._fail()
            return
        if self.settings.cold_start_s > 0:
            # A GPU engine's weight load and KV allocation: /health stays 503 meanwhile, so a
            # fleet's readiness check (and the router behind it) sees a realistic start.
            log.info("cold start: ready in %.1f s", self.settings.cold_start_s)
            await asyncio.sleep(self.settings.cold_start_s)
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
            kv_publisher=self.kv_publisher,
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
        if self.kv_publisher is not None:  # after the runner: nothing publishes any more
            await asyncio.get_running_loop().run_in_executor(None, self.kv_publisher.close)
        await self._kv_puller.close()

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
        content_type = request.headers.get("Content-Type")
        if not is_json_content_type(content_type):
            # Before the body is read: a cross-site "simple" request starts nothing.
            raise APIError(415, content_type_refusal(content_type))
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

    def _check_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The served name a request's ``model`` names, and its adapter (None: the base)."""
        if name is None or name == "":
            return self.settings.model_name, None
        if name in self.settings.served_model_names:
            return name, None
        lora = self.loras.get(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")
        return name, lora

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
        cards += [
            ModelCard(id=lora.name, root=lora.path, parent=self.loras.parent(lora))
            for lora in self.loras.adapters.values()
        ]
        return _json(ModelList(data=cards))

    # ---- LoRA adapters (lora_serving.py) ---------------------------------------------------

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        self._require("ready")
        engine, runner = self._running()
        req = await self._parse(request, LoadLoRAAdapterRequest)
        async with self._lora_lock:
            try:
                lora = self.loras.prepare_load(
                    req.lora_name, req.lora_path, load_inplace=req.load_inplace
                )
            except LoRAServingError as e:
                return _lora_error(e)
            lora_config = engine.config.lora
            if lora_config is None:
                return _error_response(400, "LoRA is not enabled on this engine (--enable-lora)")
            if self.settings.seed_missing_lora_modules:
                await asyncio.get_running_loop().run_in_executor(
                    None,
                    write_seeded_adapter,
                    engine.model.config,
                    lora.name,
                    lora_config.files_at(lora.path),
                    lora_config.max_lora_rank,
                )
            try:
                weights = await asyncio.get_running_loop().run_in_executor(
                    None,
                    lambda: read_adapter(
                        lora_config.files_at(lora.path),
                        engine.model.config,
                        max_lora_rank=lora_config.max_lora_rank,
                    ),
                )
            except LoRANotFoundError as e:
                return _lora_error(not_found(lora.name, lora.path), detail=str(e))
            except LoRAError as e:
                return _error_response(400, f"Loading lora {lora.name} failed: {e}")
            await runner.call(lambda engine: engine.add_lora(lora, weights))
            return web.Response(text=self.loras.commit(lora))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        self._require("ready")
        _, runner = self._running()
        req = await self._parse(request, UnloadLoRAAdapterRequest)
        async with self._lora_lock:
            try:
                lora, message = self.loras.unload(req.lora_name)
            except LoRAServingError as e:
                return _lora_error(e)
            await runner.call(lambda engine: engine.remove_lora(lora.lora_int_id))
            return web.Response(text=message)

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self._parse(request, TokenizeRequest)
        self._check_model(req.model)  # an adapter shares the base model's tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            check_template_switches(req.add_generation_prompt, req.continue_final_message)
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
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
        model, lora = self._check_model(req.model)
        req.check()
        prompt = req.single_prompt()
        ids = self._encode(prompt, param="prompt") if isinstance(prompt, str) else list(prompt)
        prepared = PreparedRequest(
            "completion", req, ids, req.sampling_params(req.max_tokens), model
        )
        return await self._generate(request, prepared, lora)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._require("ready")
        req = await self._parse(request, ChatCompletionRequest)
        model, lora = self._check_model(req.model)
        req.check()
        text = self.tokenizer.apply_chat_template(
            req.chat_messages(),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        ids = self._encode(text, param="messages")
        params = req.sampling_params(req.effective_max_tokens)
        prepared = PreparedRequest("chat", req, ids, params, model)
        return await self._generate(request, prepared, lora)

    async def _generate(
        self, request: web.Request, p: PreparedRequest, lora: LoRARequest | None = None
    ) -> web.StreamResponse:
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
        reached_at = local_address(request) or (self.settings.host, self.port)
        assert self._idle is not None
        self._active += 1
        self._idle.clear()
        self._inflight.add(rid)
        stream: RequestStream | None = None
        try:
            kv_import = None
            if ktp is not None and ktp.do_remote_prefill and self.settings.kv.consumes:
                limit = max_kv_payload(engine, self.settings.max_model_len)
                kv_import = await self._kv_puller.pull(ktp, limit)
            try:
                stream = await runner.add_request(
                    rid,
                    p.prompt_ids,
                    p.params,
                    arrival_time=arrival,
                    pin_kv=pin,
                    kv_import=kv_import,
                    lora=lora,
                )
            except RequestRejectedError as e:
                raise APIError(400, str(e)) from e
            if p.request.stream:
                return await stream_events(request, p, rid, stream)
            item = await _final(stream)
            kv = self.settings.kv
            kv_params = remote_prefill_params(kv, rid, item.pin, reached_at) if pin else None
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
        p: PreparedRequest,
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

    # ---- P/D: the prefill side's endpoints (the hand-off is pd.py) -------------------------

    async def kv_export(self, request: web.Request) -> web.Response:
        check_kv_caller(request, self.settings.kv.allowed_remote_hosts)
        # Served while draining too: a decoder may still come for KV pinned just before.
        self._require("ready", "draining")
        _, runner = self._running()
        rid = request.match_info["request_id"]
        req = (
            await self._parse(request, KVPullRequest) if request.can_read_body else KVPullRequest()
        )
        if req.engine_id not in (None, self.settings.kv.engine_id):
            raise APIError(404, f"engine {req.engine_id!r} is not this engine")
        blocks = await runner.call(lambda engine: export_pinned(engine, rid, req))
        if blocks is None:
            raise APIError(404, f"no pinned KV for request {rid!r}: unknown, expired or released")
        payload = await asyncio.get_running_loop().run_in_executor(None, serialize_kv, blocks)
        return web.Response(body=payload, content_type="application/octet-stream")

    async def kv_release(self, request: web.Request) -> web.Response:
        check_kv_caller(request, self.settings.kv.allowed_remote_hosts)
        self._require("ready", "draining")
        _, runner = self._running()
        rid = request.match_info["request_id"]
        released = await runner.call(lambda engine: engine.release_kv(rid))
        if not released:
            raise APIError(404, f"no pinned KV for request {rid!r}")
        return web.json_response({"released": True})


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


def _lora_error(e: LoRAServingError, *, detail: str | None = None) -> web.Response:
    """vLLM's body for a refused load or unload: its own ``type`` names (``InvalidUserInput``)."""
    message = f"{e.message} ({detail})" if detail else e.message
    body = {"error": {"message": message, "type": e.type, "param": None, "code": e.status}}
    return web.json_response(body, status=e.status)


def _allow_header(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None


def _post_fail(loop: asyncio.AbstractEventLoop, fail: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop already closed: nothing to tell
        loop.call_soon_threadsafe(fail)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def build_server(args: argparse.Namespace) -> EngineServer:
    """A server from parsed flags (settings.py); ConfigError for a bad combination."""
    settings, engine_factory = settings_from_args(args)
    return EngineServer(settings, engine_factory)


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
    configure_logging(args.log_level, args.log_format)
    try:
        server = build_server(args)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(server))
    except ConfigError as e:  # found at start: a KV-event endpoint that cannot be bound
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ListenError as e:  # the port is taken, or the address is not this machine's
        print(f"error: {e}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetpilot.engine.reference.server",
        description="The fleetpilot CPU reference engine (vLLM's OpenAI-compatible API).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
