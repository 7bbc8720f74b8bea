"""Drives one ``LLMEngine`` from one dedicated thread, for an asyncio server.

The engine is not thread-safe and its ``step()`` is torch work that takes milliseconds to
seconds, so it must neither be shared between threads nor run on the event loop. Everything
that touches the engine therefore runs on the runner's thread: the event loop submits commands
(add, abort, any ``call``) through a thread-safe queue, and the thread hands outputs back with
``loop.call_soon_threadsafe`` into a per-request asyncio queue. Between commands the thread runs
``step()`` while there is work and sleeps on the queue while idle.

Per-request latency metrics are observed here, on the engine thread, as outputs appear: TTFT at
the first token and one inter-token latency per step that produced tokens, as vLLM does, so
they do not depend on whether (or how fast) a client reads its stream.

KV events: with a publisher, the thread takes the engine's prefix-cache changes after every
step (and after commands that changed the cache between steps, such as a reset) and hands them
to the publisher as one batch; publishing only queues, so it never slows the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fleetpilot.engine.reference.engine import LLMEngine
from fleetpilot.engine.reference.kv_publisher import KVEventPublisher
from fleetpilot.engine.reference.lora import LoRARequest
from fleetpilot.engine.reference.metrics import ServerMetrics
from fleetpilot.engine.reference.request import KVBlocks, RequestOutput
from fleetpilot.engine.reference.sampling import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); nothing more will be produced."""


@dataclass(frozen=True)
class PinInfo:
    """Where a finished P/D prefill's prompt KV is held for a decoder to pull."""

    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float  # unix seconds, so another host can read it


@dataclass(frozen=True)
class StreamItem:
    output: RequestOutput
    pin: PinInfo | None = None  # only on the final output of a pin_kv request


class RequestStream:
    """The outputs of one request, consumed on the event loop."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: StreamItem | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> StreamItem:
        """The newest output, waiting for one if none is pending.

        Outputs are cumulative (each carries all tokens so far), so when a slow reader falls
        behind, the pending ones are collapsed into the latest instead of queueing up.
        """
        item = await self._queue.get()
        while not self._queue.empty() and not self._is_final(item):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.output.finished:
            self.finished = True
        return item

    @staticmethod
    def _is_final(item: StreamItem | BaseException) -> bool:
        return isinstance(item, BaseException) or item.output.finished


class _Command:
    """Work for the engine thread; ``cancel`` is called instead if the thread is gone."""

    def __init__(
        self,
        run: Callable[[LLMEngine], None],
        cancel: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.run = run
        self.cancel = cancel


@dataclass
class _Tracked:
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    pin: bool
    last_token_time: float | None = None
    tokens_seen: int = 0


class EngineRunner:
    """Owns the engine thread. Create on the event loop; ``start`` it; ``stop`` it once."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        *,
        step_delay_s: float = 0.0,
        idle_wait_s: float = 0.25,
        on_failure: Callable[[BaseException], None] | None = None,
        kv_publisher: KVEventPublisher | None = None,
    ) -> None:
        self.engine = engine
        self.kv_publisher = kv_publisher
        self.metrics = metrics
        self.step_delay_s = step_delay_s
        self.idle_wait_s = idle_wait_s
        self.on_failure = on_failure
        self.failed: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._stopping = False
        self._closed = False
        self._lock = threading.Lock()  # orders submit() against the thread's final drain
        self._thread = threading.Thread(target=self._main, name="engine-runner", daemon=True)

    # ---- event-loop side -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (blocking: call from a worker thread when on an event loop)."""
        self._stopping = True
        self._commands.put(None)  # wake it
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._closed or self._stopping:
                raise EngineDeadError(self._dead_message())
            self._commands.put(command)

    def _dead_message(self) -> str:
        if self.failed is not None:
            return f"the engine failed: {self.failed!r}"
        return "the engine is stopped"

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread, between steps; its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def resolve(result: T | None, exc: BaseException | None) -> None:
            if future.done():  # the caller was cancelled meanwhile
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def run(engine: LLMEngine) -> None:
            try:
                result = fn(engine)
            except Exception as e:  # the caller's error (e.g. a rejected request), not ours
                _post(loop, resolve, None, e)
            else:
                _post(loop, resolve, result, None)

        def cancel(exc: BaseException) -> None:
            _post(loop, resolve, None, exc)

        self._submit(_Command(run, cancel))
        return await future

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float,
        pin_kv: bool = False,
        kv_import: KVBlocks | None = None,
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; raises the engine's ``RequestRejectedError`` for a bad one."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id)

        def add(engine: LLMEngine) -> None:
            engine.add_request(
                request_id,
                list(prompt_token_ids),
                params,
                arrival_time=arrival_time,
                pin_kv=pin_kv,
                kv_import=kv_import,
                lora=lora,
            )
            self._tracked[request_id] = _Tracked(stream, loop, pin_kv)

        try:
            await self.call(add)
        except asyncio.CancelledError:
            # The client left while the add was queued: it may still be added, so abort it
            # (the abort is queued after the add).
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still running; safe to call from any thread, any time."""

        def abort(engine: LLMEngine) -> None:
            engine.abort_request(request_id)

        with contextlib.suppress(EngineDeadError):  # nothing runs any more
            self._submit(_Command(abort))

    # ---- engine thread -------------------------------------------------------------------

    def _main(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                woke = self._run_commands(timeout=self._wait_s())
                if self._stopping:
                    break
                if (
                    engine.has_unfinished_requests()
                    or engine.has_transfers_in_flight()
                    or (not woke and engine.pins)
                ):
                    # An idle tick still steps while prompts are pinned: step() expires them.
                    outputs = engine.step()
                    # Counters before answers: a client (or a scraper right behind it) that
                    # saw its request finish must find it in /metrics.
                    if self.metrics is not None:
                        self.metrics.set_stats(engine.stats())
                    self._publish_kv_events()
                    self._dispatch(outputs)
                    if self.step_delay_s > 0 and engine.has_unfinished_requests():
                        time.sleep(self.step_delay_s)
                self._publish_kv_events()  # changes made by commands between steps
                if self.metrics is not None:
                    self.metrics.set_stats(engine.stats())
        except Exception as e:
            log.exception("the engine failed; failing every request in flight")
            self.failed = e
        finally:
            self._close()

    def _publish_kv_events(self) -> None:
        batch = self.engine.take_kv_events()
        if batch is not None and self.kv_publisher is not None:
            self.kv_publisher.publish(batch)

    def _wait_s(self) -> float:
        """How long to wait for a command before stepping again (0: step now).

        Steps come back to back while requests can run; while the engine waits only for copies
        to or from its host tier (its last step ran nothing), until the first completes, so a
        paced load neither spins the thread nor waits longer than it takes; with nothing to do,
        up to ``idle_wait_s`` (an idle tick, which expires pinned prompts).
        """
        engine = self.engine
        done_at = engine.next_transfer_done_at()
        if done_at is not None and (engine.last_step_idle or not engine.has_unfinished_requests()):
            return min(max(done_at - engine.clock(), 0.0), self.idle_wait_s)
        return 0.0 if engine.has_unfinished_requests() else self.idle_wait_s

    def _run_commands(self, *, timeout: float) -> bool:
        """Run queued commands, waiting up to ``timeout`` seconds for the first one.

        Returns whether any command (or the stop wake-up) arrived.
        """
        block = timeout > 0
        try:
            command = self._commands.get(timeout=timeout) if block else None
        except queue.Empty:
            return False
        woke = command is not None or block
        while True:
            if command is not None:
                command.run(self.engine)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return woke
            woke = True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            self._observe(tracked, out)
            pin = None
            if out.finished:
                del self._tracked[out.request_id]
                if tracked.pin:
                    pin = self._pin_info(out.request_id)
            _post(tracked.loop, tracked.stream._put, StreamItem(out, pin))

    def _pin_info(self, request_id: str) -> PinInfo | None:
        pinned = self.engine.pinned_kv(request_id)
        if pinned is None:
            return None
        remaining = pinned.expires_at - self.engine.clock()
        return PinInfo(
            block_ids=pinned.block_ids,
            num_tokens=len(pinned.token_ids),
            expires_at=time.time() + remaining,
        )

    def _observe(self, t: _Tracked, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        m = out.metrics
        if t.last_token_time is None and m.first_token_time is not None:
            self.metrics.observe_first_token(m.first_token_time - m.arrival_time)
            t.last_token_time = m.first_token_time
        if t.last_token_time is not None:
            # Tokens of one speculative step share a timestamp: one latency per step.
            for when in m.token_times[t.tokens_seen :]:
                if when > t.last_token_time:
                    self.metrics.observe_inter_token(when - t.last_token_time)
                    t.last_token_time = when
            t.tokens_seen = len(m.token_times)
        if out.finished:
            self.metrics.observe_finished(
                m, num_prompt=len(out.prompt_token_ids), num_output=len(out.token_ids)
            )

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        error = EngineDeadError(self._dead_message())
        for tracked in self._tracked.values():
            _post(tracked.loop, tracked.stream._put, error)
        self._tracked.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None and command.cancel is not None:
                command.cancel(error)
        if self.failed is not None and self.on_failure is not None:
            self.on_failure(self.failed)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """``loop.call_soon_threadsafe`` that tolerates a loop that has already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        log.debug("event loop closed; dropping an engine result")
