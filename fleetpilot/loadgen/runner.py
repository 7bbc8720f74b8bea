"""Drives load at an OpenAI-compatible server and records what every request saw.

Open loop (``--rate`` / ``--schedule``): arrivals follow a Poisson process whatever the server
does, so a slow server meets a queue, as in production. Closed loop (``--concurrency``): N
clients each send the next request when their last one ends. Every run is bounded: by duration
and/or request count, a per-request timeout, and a cap on requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from fleetpilot.loadgen.workloads import ModelMix, RequestSpec, Workload
from fleetpilot.text import one_line

ROUTE_HEADER = "x-fleetpilot-route"


# ---- arrivals ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """From ``at_s`` on the rate is ``rate``; with ``ramp`` it rises (or falls) linearly to
    ``rate`` from the previous step's rate, reaching it at ``at_s``."""

    at_s: float
    rate: float
    ramp: bool = False


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]

    @classmethod
    def constant(cls, rate: float) -> Schedule:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
        return cls((Step(0.0, rate),))

    def rate_at(self, t: float) -> float:
        prev = self.steps[0]
        for step in self.steps[1:]:
            if t < step.at_s:
                if step.ramp:
                    frac = (t - prev.at_s) / (step.at_s - prev.at_s)
                    return prev.rate + frac * (step.rate - prev.rate)
                return prev.rate
            prev = step
        return prev.rate

    @property
    def peak(self) -> float:
        return max(s.rate for s in self.steps)


def parse_schedule(text: str) -> Schedule:
    """``"0:2,30:8,60:2"``: 2 req/s from t=0 s, 8 from 30 s, 2 from 60 s. ``"0:2,60:~8"``: a
    ramp from 2 req/s at 0 s to 8 req/s at 60 s. Times must start at 0 and increase."""
    steps: list[Step] = []
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"schedule {text!r}: expected 't_seconds:rate' steps separated by ','")
    for part in parts:
        at_text, sep, rate_text = part.partition(":")
        if not sep:
            raise ValueError(f"schedule step {part!r}: expected 't_seconds:rate', e.g. '30:8'")
        ramp = rate_text.strip().startswith("~")
        try:
            at = float(at_text)
            rate = float(rate_text.strip().removeprefix("~"))
        except ValueError:
            raise ValueError(f"schedule step {part!r}: time and rate must be numbers") from None
        if not (math.isfinite(at) and math.isfinite(rate)) or at < 0 or rate < 0:
            raise ValueError(f"schedule step {part!r}: time and rate must be finite and >= 0")
        if steps and at <= steps[-1].at_s:
            raise ValueError(f"schedule step {part!r}: times must increase")
        if not steps and (at != 0 or ramp):
            raise ValueError(f"schedule {text!r}: the first step must be '0:rate'")
        steps.append(Step(at, rate, ramp))
    if max(s.rate for s in steps) <= 0:
        raise ValueError(f"schedule {text!r}: every rate is 0, no request would be sent")
    return Schedule(tuple(steps))


def arrival_times(schedule: Schedule, duration_s: float, rng: random.Random) -> Iterator[float]:
    """Arrival offsets (s) of a Poisson process whose rate follows ``schedule``.

    Thinning (Lewis & Shedler): candidates at the peak rate, each kept with probability
    rate(t)/peak. Exact for steps and ramps alike, and a constant rate keeps every candidate.
    """
    peak = schedule.peak
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return
        if rng.random() * peak < schedule.rate_at(t):
            yield t


# ---- records -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    tier: str | None = None
    replica: str | None = None
    prefix_match: float | None = None
    reason: str | None = None
    # The prompt's KV blocks by where the replica gets them (device, host, computed), when
    # the engines' KV events judged the request (``kv-blocks=device:12,host:4,computed:8``).
    kv_blocks: tuple[int, int, int] | None = None


def kv_blocks_of(value: str | None) -> tuple[int, int, int] | None:
    """``device:12,host:4,computed:8`` as (12, 4, 8); None for a missing or malformed one."""
    if not value:
        return None
    counts = dict(part.partition(":")[::2] for part in value.split(","))
    try:
        return int(counts["device"]), int(counts["host"]), int(counts["computed"])
    except (KeyError, ValueError):
        return None


def route_fields(value: str | None) -> dict[str, str]:
    """Every ``key=value`` of an ``x-fleetpilot-route`` header (none for a missing one)."""
    fields: dict[str, str] = {}
    for part in (value or "").split(";"):
        key, sep, val = part.partition("=")
        if sep:
            fields[key.strip()] = val.strip()
    return fields


def parse_route(value: str | None) -> Route:
    """``tier=small; replica=...; prefix-match=0.50; kv-blocks=...; reason=...`` (unknown keys
    ignored)."""
    if not value:
        return Route()
    fields = route_fields(value)
    match: float | None
    try:
        match = float(fields["prefix-match"])
    except (KeyError, ValueError):
        match = None
    return Route(
        fields.get("tier"),
        fields.get("replica"),
        match,
        fields.get("reason"),
        kv_blocks_of(fields.get("kv-blocks")),
    )


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the run started."""

    index: int
    kind: str
    start_s: float
    timestamp: float  # wall clock (epoch s) at the start, to line up with server metrics
    end_s: float | None = None
    status: int | None = None
    error: str | None = None  # None: success; else "HTTP 503", "connect", "timeout", ...
    detail: str | None = None  # the error's message, cut short
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    route: Route = field(default_factory=Route)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def dropped(index: int, kind: str, start_s: float, t0_wall: float) -> RequestRecord:
    """An open-loop arrival not sent: the in-flight cap was reached (the client is saturated)."""
    return RequestRecord(index, kind, start_s, t0_wall + start_s, end_s=start_s, error="dropped")


# ---- the run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    model: str
    schedule: Schedule | None = None  # open loop; None: closed loop at ``concurrency``
    concurrency: int = 1
    duration_s: float | None = None
    max_requests: int | None = None
    timeout_s: float = 60.0
    max_in_flight: int = 256
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = False
    # Each request's model from a mix (LoRA adapters by popularity) instead of ``model``.
    model_mix: ModelMix | None = None
    # More base URLs of the same service (router replicas): requests alternate over
    # ``base_url`` and these, as a Service spreads connections.
    more_urls: tuple[str, ...] = ()

    def model_for(self, index: int) -> str:
        return self.model_mix.model(index) if self.model_mix is not None else self.model

    def __post_init__(self) -> None:
        if self.duration_s is None and self.max_requests is None:
            raise ValueError("a run needs a --duration and/or a number of --requests")
        if self.schedule is not None and self.duration_s is None:
            raise ValueError("an open-loop run (--rate/--schedule) needs a --duration")
        if self.concurrency < 1 or self.max_in_flight < 1:
            raise ValueError("concurrency and max in-flight must be at least 1")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def url_for(self, index: int) -> str:
        """Where request ``index`` goes: the base URLs in turn."""
        if not self.more_urls:
            return self.url
        bases = (self.base_url, *self.more_urls)
        return bases[index % len(bases)].rstrip("/") + "/chat/completions"


@dataclass
class Progress:
    """Live counters, read by the progress line."""

    sent: int = 0
    done: int = 0
    errors: int = 0
    in_flight: int = 0


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_at: float  # epoch s
    elapsed_s: float
    config: RunConfig


class Runner:
    def __init__(
        self,
        config: RunConfig,
        workload: Workload,
        *,
        on_progress: Callable[[Progress, float], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the run's seconds. It must be the clock the event loop's timers keep
        (``asyncio.sleep`` paces arrivals, ``asyncio.timeout`` bounds a request): the default
        loop's is ``time.monotonic``; a test on a virtual-time loop passes that loop's ``time``."""
        self.config = config
        self.workload = workload
        self.progress = Progress()
        self._on_progress = on_progress
        self._transport = transport
        self._clock = clock
        self._records: list[RequestRecord] = []
        self._t0 = 0.0
        self._t0_wall = 0.0

    def _now(self) -> float:
        return self._clock() - self._t0

    async def run(self) -> RunResult:
        cfg = self.config
        width = cfg.max_in_flight if cfg.schedule is not None else cfg.concurrency
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # One pooled client for the run: connection reuse, so TTFT is the server's, not TCP's.
        client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=width, max_keepalive_connections=width),
            transport=self._transport,
        )
        self._t0 = self._clock()
        self._t0_wall = time.time()
        ticker = asyncio.create_task(self._tick()) if self._on_progress else None
        try:
            async with client:
                if cfg.schedule is not None:
                    await self._open_loop(client, cfg.schedule)
                else:
                    await self._closed_loop(client)
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
                self._report_progress()
        records = sorted(self._records, key=lambda r: r.index)
        return RunResult(records, self._t0_wall, self._now(), cfg)

    def _report_progress(self) -> None:
        if self._on_progress is not None:
            self._on_progress(self.progress, self._now())

    async def _tick(self) -> None:
        while True:
            self._report_progress()
            await asyncio.sleep(0.5)

    def _take(self) -> tuple[int, RequestSpec] | None:
        """The next request to send, or None once the run's bounds are reached."""
        cfg = self.config
        if cfg.max_requests is not None and self.progress.sent >= cfg.max_requests:
            return None
        if cfg.duration_s is not None and self._now() >= cfg.duration_s:
            return None
        index = self.progress.sent
        self.progress.sent += 1
        return index, self.workload.next()

    async def _closed_loop(self, client: httpx.AsyncClient) -> None:
        async def worker() -> None:
            while (item := self._take()) is not None:
                await self._send(client, *item)

        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def _open_loop(self, client: httpx.AsyncClient, schedule: Schedule) -> None:
        assert self.config.duration_s is not None  # checked by RunConfig
        rng = random.Random(self.config.seed)
        tasks: set[asyncio.Task[None]] = set()
        for at in arrival_times(schedule, self.config.duration_s, rng):
            delay = at - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
            item = self._take()
            if item is None:
                break
            if self.progress.in_flight >= self.config.max_in_flight:
                # Waiting for a slot would quietly turn the open loop closed; count it instead.
                index, spec = item
                self._records.append(dropped(index, spec.kind, self._now(), self._t0_wall))
                self.progress.done += 1
                self.progress.errors += 1
                continue
            task = asyncio.create_task(self._send(client, *item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _send(self, client: httpx.AsyncClient, index: int, spec: RequestSpec) -> None:
        start = self._now()
        rec = RequestRecord(index, spec.kind, start, self._t0_wall + start)
        self.progress.in_flight += 1
        try:
            # The overall bound: httpx's timeout is per read, a trickling stream could outlive it.
            async with asyncio.timeout(self.config.timeout_s):
                await self._stream(client, spec, rec, start)
        except (TimeoutError, httpx.TimeoutException):
            rec.error = "timeout"
            rec.detail = f"no complete answer within {self.config.timeout_s:g} s"
        except httpx.ConnectError as e:
            rec.error = "connect"
            rec.detail = one_line(str(e) or type(e).__name__)
        except httpx.HTTPError as e:
            rec.error = type(e).__name__  # RemoteProtocolError, ReadError, ...
            rec.detail = one_line(str(e))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            rec.error = "bad response"  # not OpenAI's streaming format
            rec.detail = one_line(f"{type(e).__name__}: {e}")
        finally:
            self.progress.in_flight -= 1
        rec.end_s = self._now()
        if rec.ok:
            rec.e2e_s = rec.end_s - start
        self._records.append(rec)
        self.progress.done += 1
        if not rec.ok:
            self.progress.errors += 1

    async def _stream(
        self, client: httpx.AsyncClient, spec: RequestSpec, rec: RequestRecord, start: float
    ) -> None:
        body = spec.body(self.config.model_for(rec.index), ignore_eos=self.config.ignore_eos)
        first: float | None = None
        last: float | None = None
        async with client.stream("POST", self.config.url_for(rec.index), json=body) as resp:
            rec.status = resp.status_code
            rec.route = parse_route(resp.headers.get(ROUTE_HEADER))
            if resp.status_code >= 400:
                body_text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}"
                rec.detail = one_line(body_text)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    rec.error = "stream error"  # the server failed after the 200
                    rec.detail = one_line(json.dumps(chunk["error"]))
                    return
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = self._now()
                        first = now if first is None else first
                        last = now
                        rec.chunks += 1
        if first is None or last is None:
            return  # an empty answer: no TTFT to speak of
        rec.ttft_s = first - start
        # Tokens from usage when the server tells; else one per chunk (vLLM's default stream).
        tokens = rec.completion_tokens if rec.completion_tokens else rec.chunks
        if rec.chunks >= 2 and tokens >= 2:
            rec.tpot_s = (last - first) / (tokens - 1)
