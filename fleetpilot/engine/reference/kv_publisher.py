"""The reference engine's KV-event publisher: vLLM's ZMQ PUB socket and ROUTER replay socket.

What goes on the wire is :mod:`fleetpilot.kv_events` (vLLM 0.33's format): every batch is sent
on the PUB socket as ``[topic, seq, payload]`` with sequence numbers from 0, and kept in a
replay buffer of the last ``buffer_steps`` batches; a subscriber that missed some (it connected
late, or saw a gap in the sequence) asks the ROUTER socket with ``[b"", start_seq]`` and gets
every buffered batch from ``start_seq`` on, then the end marker.

Threading: the engine thread only calls :meth:`KVEventPublisher.publish`, which puts the batch
on a bounded queue and never blocks (a full queue drops the batch and counts it in
``dropped``: a slow publisher must not stall the engine step). One publisher thread owns both
sockets from creation to close (ZMQ sockets are not thread-safe); it sleeps in a poll on the
replay socket and a wake-up pipe, so it costs nothing while idle and answers a replay at once.
Sends never block either: the PUB socket drops messages beyond ``hwm`` for a slow subscriber,
and the replay socket's high-water mark fits a full replay plus its marker, as vLLM's does.

Endpoints: ``tcp://*:PORT`` binds every interface, ``tcp://HOST:PORT`` binds that address
(vLLM *connects* to such an endpoint, for a relay; the reference engine has none, and on
loopback it binds ``tcp://127.0.0.1:PORT``), ``ipc://`` and ``inproc://`` bind too. Port 0 picks
a free port; ``endpoint`` and ``replay_endpoint`` report what was bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import deque
from typing import Literal

import msgspec
import zmq

from fleetpilot.kv_events import END_SEQ, EventBatch, encode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)

# vLLM's defaults (vllm/config/kv_events.py).
DEFAULT_ENDPOINT = "tcp://*:5557"
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's ``--kv-events-config`` JSON, with vLLM's defaults; unknown keys are refused.

    ``publisher`` defaults as vLLM's does: "zmq" when events are enabled, else "null". Events
    are recorded and sent only when enabled with the "zmq" publisher (``active``).
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    topic: str = ""

    @property
    def active(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"

    @classmethod
    def from_json_dict(cls, data: dict[str, object]) -> KVEventsConfig:
        """Parse and check; ``ValueError`` naming the bad key."""
        try:
            config = msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ValueError(str(e)) from e
        for name, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            if getattr(config, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(config, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(config, name)
            if value is not None and "://" not in value:
                raise ValueError(f"{name} must be a ZMQ endpoint like tcp://*:5557, got {value!r}")
        return config


class KVEventPublisher:
    """Publishes ``EventBatch``es on a PUB socket with a ROUTER replay socket (module docstring).

    The constructor binds both sockets (raising ``zmq.ZMQError`` if it cannot) and starts the
    publisher thread; :meth:`close` stops it and closes the sockets with linger 0.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.published = 0  # batches sent on the PUB socket (the next sequence number)
        self.dropped = 0  # batches refused because the queue was full
        self.encode_errors = 0  # batches the thread could not encode (a bug), not sent
        self.replays = 0  # replay requests answered
        self.bad_replay_requests = 0
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self._queue: queue.Queue[EventBatch] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._close_pipe()
            raise self._error

    # ---- engine side ---------------------------------------------------------------------

    def publish(self, batch: EventBatch) -> bool:
        """Queue ``batch`` for sending; never blocks. False (and counted) if it was dropped."""
        if self._stopping:
            return False
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV event queue full: %d batches dropped so far", self.dropped)
            return False
        self._wake()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread and close the sockets (linger 0).

        Call it once the engine thread has stopped publishing.
        """
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the KV event publisher did not stop within %.1fs", timeout)
            return  # it still uses the pipe; a daemon thread, it dies with the process
        self._close_pipe()

    def _wake(self) -> None:
        # A full pipe already holds a wake-up; a closed one means the thread is gone.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- publisher thread ----------------------------------------------------------------

    def _main(self) -> None:
        ctx = zmq.Context()
        pub: zmq.Socket[bytes] | None = None
        replay: zmq.Socket[bytes] | None = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.setsockopt(zmq.SNDHWM, self.config.hwm)
                self.endpoint = _bind(pub, self.config.endpoint)
                if self.config.replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    # ZMQ credits reads every HWM/2 messages, so a full replay plus the marker
                    # needs twice the buffer to always fit (as vLLM sizes it).
                    replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                    self.replay_endpoint = _bind(replay, self.config.replay_endpoint)
            except BaseException as e:
                self._error = e
                return
            finally:
                self._ready.set()
            log.info("publishing KV events on %s (replay: %s)", self.endpoint, self.replay_endpoint)
            self._loop(pub, replay)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()

    def _loop(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            self._send_queued(pub)  # before replays: a replay then includes them
            if replay is not None and replay in events:
                self._serve_replays(replay)
            if self._stopping:
                self._send_queued(pub)
                return

    def _send_queued(self, pub: zmq.Socket[bytes]) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                payload = encode_batch(batch)
            except Exception:  # a bug in what the engine built; lose the batch, not the thread
                log.exception("could not encode a KV event batch; dropped")
                self.encode_errors += 1
                continue
            seq = self.published
            with contextlib.suppress(zmq.Again):  # at the HWM: dropped, as PUB does anyway
                pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
            self._buffer.append((seq, payload))
            self.published = seq + 1

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                self.bad_replay_requests += 1
                log.warning("ignoring a malformed KV replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            try:
                start_seq = seq_of(start)
            except ValueError as e:
                self.bad_replay_requests += 1
                log.warning("ignoring a KV replay request: %s", e)
                continue
            self.replays += 1
            try:
                for seq, payload in self._buffer:
                    if seq >= start_seq:
                        replay.send_multipart(
                            (client, b"", self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK
                        )
                replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:  # the client's queue is full (it stopped reading): give up on it
                log.warning("a KV replay client is not reading; replay cut short")


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``endpoint`` (module docstring); the bound endpoint, with the port port 0 picked."""
    if endpoint.startswith("tcp://[") or (
        endpoint.startswith("tcp://") and endpoint.count(":") > 2
    ):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


__all__ = [
    "DEFAULT_BUFFER_STEPS",
    "DEFAULT_ENDPOINT",
    "DEFAULT_HWM",
    "DEFAULT_MAX_QUEUE_SIZE",
    "KVEventPublisher",
    "KVEventsConfig",
]
