"""The simulated fleet: the real router and autoscaler policies over simulated engines.

One event loop in simulated time. What runs here is fleetpilot's own code wherever a decision
is made: each of the service's router replicas is a :class:`~fleetpilot.routing.router.Router`
built from the planner's ``RouterConfig`` (the request features, complexity tiers, spill-over,
prefix scoring over the KV index or the guessed index, load from in-flight counts and scraped
gauges); each role's replica count comes from
:func:`fleetpilot.autoscaler.policy.decide` with the role's ``RolePolicy``. Simulated are the
engines (:mod:`~fleetpilot.simulate.engine`), the network (free), Prometheus (the autoscaler
reads exact windowed percentiles of what the engines did) and Kubernetes (a replica serves
``cold_start_s`` after it was asked for; one scaled in stops taking requests at once and
finishes what it holds).

Requests come from the load generator's workloads (``fleetpilot bench``'s), open loop, Poisson
at a rate or a schedule, every request decoding its ``max_tokens`` (as ``bench --ignore-eos``);
or from a recorded bench run (:mod:`~fleetpilot.simulate.trace`): its requests at their send
times, each decoding as many tokens as its answer had.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from fleetpilot.api import InferenceService, ResolvedRole, RoleName, Tier
from fleetpilot.api.router_config import RouterConfig
from fleetpilot.autoscaler.model import History, Metrics, Observation, RolePolicy
from fleetpilot.autoscaler.policy import decide as autoscale
from fleetpilot.loadgen.runner import Schedule, arrival_times
from fleetpilot.loadgen.workloads import RequestSpec, Workload
from fleetpilot.operator.router_objects import router_config
from fleetpilot.routing.endpoints import Endpoint, KVPorts, kv_stream_id
from fleetpilot.routing.errors import NoReplicaError, RouterError
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.policies.candidates import FULL_SCAN_MAX
from fleetpilot.routing.policies.kv_index import KVIndex
from fleetpilot.routing.policies.load import EngineMetrics
from fleetpilot.routing.route import Route
from fleetpilot.routing.router import Router
from fleetpilot.simulate.baselines import FLEETPILOT, ROUTING_POLICIES, use_routing
from fleetpilot.simulate.engine import Engine, Seq
from fleetpilot.simulate.profile import MeasuredProfile, Profile, RoleModel, role_model
from fleetpilot.simulate.tokens import Prompt, SimPromptKeys, SimTokenizer
from fleetpilot.simulate.trace import Trace

PREFIX_SOURCES = ("events", "guessed")


@dataclass(frozen=True)
class SimSettings:
    """What to simulate besides the service: the load, the time, the knobs of a what-if."""

    # The load: Poisson arrivals at a rate schedule, or a recorded run replayed (its requests
    # at their send times, each answer as long as it was; ``simulate.trace``).
    load: Schedule | Trace
    duration_s: float
    seed: int = 0
    # "events": engines publish KV events and the router matches them (what the planner sets
    # up); "guessed": the router scores on what it sent where.
    prefix_source: str = "events"
    autoscale: bool = True
    # Replicas every role starts with (None: the spec's initial, else max(min, 1)), and a
    # ceiling over the spec's max (None: the spec's).
    start_replicas: int | None = None
    max_replicas: int | None = None
    # How often the replicas of each role are sampled for the report, in simulated seconds.
    sample_every_s: float = 10.0
    model: str | None = None  # the request's model field (default: the service's name)
    # The routers' replica choice: fleetpilot's, or a baseline (``baselines.ROUTING_POLICIES``).
    routing: str = FLEETPILOT
    # The largest group a router scores every replica of (``Router.full_scan_max``); a
    # what-if sets it high to compare the candidate-bounded pick with a scan of every replica.
    full_scan_max: int = FULL_SCAN_MAX
    # Whether several router replicas share their counts (``routing.peers``, what the planner
    # sets up): every ``peers.interval`` each router's replicas get the others' in-flight,
    # pending-prefill and recent-send counts. False: each router alone (a what-if).
    peers: bool = True

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}")
        if self.prefix_source not in PREFIX_SOURCES:
            raise ValueError(f"prefix source must be one of {', '.join(PREFIX_SOURCES)}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError("duration must be a positive number of seconds")


class _Source:
    """The simulated replicas as the routers discover them (``discovery.EndpointSource``)."""

    def __init__(self) -> None:
        self.version = 0
        self._endpoints: dict[str, Endpoint] = {}

    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(self._endpoints.values())

    def configure(self, config: RouterConfig) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def add(self, endpoint: Endpoint) -> None:
        self._endpoints[endpoint.id] = endpoint
        self.version += 1

    def remove(self, endpoint: Endpoint) -> None:
        if self._endpoints.pop(endpoint.id, None) is not None:
            self.version += 1


@dataclass(eq=False)
class Replica:
    """One engine replica of one role."""

    endpoint: Endpoint
    engine: Engine
    ready_at: float
    ready: bool = False
    retired: bool = False  # scaled in: takes no new requests, finishes what it holds

    @property
    def stream(self) -> str:
        return kv_stream_id(self.endpoint.id, 0)


@dataclass(eq=False)
class Request:
    """One request's life and outcome, in simulated seconds."""

    index: int
    kind: str
    arrival_s: float
    max_tokens: int
    # Until the request ends (its engines read it); then only its length is kept.
    prompt: Prompt | None
    prompt_tokens: int = 0
    tier: str = ""
    # Where it went (replica ids): the answering replica, and a P/D tier's prefill one.
    replica: str | None = None
    prefill_replica: str | None = None
    route: Route | None = None  # the router's decision, until the request ends
    decode: Replica | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, those copied back from the host tier
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first, once the request has ended."""
        if self.first_token_s is None or self.end_s is None or self.max_tokens <= 1:
            return None
        return (self.end_s - self.first_token_s) / (self.max_tokens - 1)


@dataclass(frozen=True, slots=True)
class _Job:
    """A request on one engine: the whole request, or (``hop``) a P/D tier's prefill."""

    request: Request
    hop: bool


@dataclass
class RoleState:
    """One role of one tier: its replicas, its autoscaling and its observed latencies."""

    role: ResolvedRole
    model: RoleModel
    policy: RolePolicy
    replicas: list[Replica] = field(default_factory=list)
    history: History = field(default_factory=History)
    # (time, value) in arrival order, kept for the autoscaling window.
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    tpots: deque[tuple[float, float]] = field(default_factory=deque)
    completions: deque[float] = field(default_factory=deque)
    # Requests refused for want of any replica (the tier at zero), since the last decision.
    unserved: int = 0
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.role.tier.name, str(self.role.name))

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if not r.retired]


@dataclass
class Outcome:
    """What the simulation produced, for the report."""

    requests: list[Request]
    samples: list[tuple[float, dict[str, int]]]  # (time, replicas per "tier/role")
    gpu_seconds: float
    duration_s: float
    roles: list[RoleState]
    wall_s: float = 0.0


Progress = Callable[[float, int], None]  # simulated seconds so far, requests arrived


class Fleet:
    """The simulation of one service under one load."""

    def __init__(
        self,
        service: InferenceService,
        profile: Profile,
        workload: Workload,
        settings: SimSettings,
    ) -> None:
        self.service = service
        self.settings = settings
        self.workload = workload
        # The router's hop, on the client's clock only: the autoscaler reads the engines'.
        self.router_s = profile.router_s if isinstance(profile, MeasuredProfile) else 0.0
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.config = router_config(service)
        events = settings.prefix_source == "events"
        self.kv_index = KVIndex(max_blocks=1 << 62)  # sized by the engines' own caches
        self.source = _Source()
        self.routers = [
            Router(
                self.config,
                self.source,
                rng=random.Random(settings.seed * 1000 + i),
                clock=self._clock,
                kv_index=self.kv_index,
                kv_live=(lambda _stream: True) if events else None,
                full_scan_max=settings.full_scan_max,
            )
            for i in range(service.spec.routing.replicas)
        ]
        for router in self.routers:
            use_routing(router, settings.routing)
        self.prompt_keys: dict[str, SimPromptKeys] = {}
        self.roles: dict[tuple[str, str], RoleState] = {}
        scrape_s = self.config.scrape.interval.total_seconds()
        for tier in service.spec.tiers:
            for role in tier.roles():
                model = role_model(profile, role)
                policy = RolePolicy.for_role(
                    tier,
                    role.name,
                    scrape_interval_s=service.spec.monitoring.scrape_interval.total_seconds(),
                )
                if settings.max_replicas is not None:
                    policy = _with_max(policy, settings.max_replicas)
                state = RoleState(role, model, policy)
                self.roles[state.key] = state
            shape = model.shape
            tokenizer = SimTokenizer(shape.chars_per_token, shape.message_tokens)
            keys = SimPromptKeys(tokenizer, _block_size(tier))
            self.prompt_keys[tier.name] = keys
            if events:
                for router in self.routers:
                    router.tokenizers[tier.name] = keys
        self._events = events
        self._scrape_s = scrape_s
        peers = self.config.peers
        self._peer_interval_s = (
            peers.interval.total_seconds()
            if peers is not None and settings.peers and len(self.routers) > 1
            else None
        )
        self._hosts = itertools.count(1)
        self.requests: list[Request] = []
        self.by_id: dict[str, Replica] = {}
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.gpu_seconds = 0.0
        self._gpu_since = 0.0
        self._gpus_now = 0
        self._arrivals: Iterator[float] = iter(())
        self._index = 0  # arrivals so far
        self._drawn = 0  # requests drawn from the workload so far (a trace skips some)

    # -- the event loop ------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), action))

    def run(self, progress: Progress | None = None, progress_every_s: float = 60.0) -> Outcome:
        settings = self.settings
        for state in self.roles.values():
            bounds = state.role.replicas
            start = settings.start_replicas
            if start is None:
                start = bounds.initial if bounds.initial is not None else max(bounds.min, 1)
            for _ in range(start):
                self._add_replica(state, ready_at=0.0)
            if settings.autoscale:
                self.at(state.policy.interval_s, self._autoscaler(state))
        load = settings.load
        if isinstance(load, Trace):
            # A recorded run longer than the simulation is cut where it ends.
            end = settings.duration_s
            self._arrivals = iter([r.start_s for r in load.requests if r.start_s <= end])
        else:
            self._arrivals = arrival_times(load, settings.duration_s, random.Random(settings.seed))
        self._next_arrival()
        self.at(0.0, self._scrape)
        self.at(0.0, self._sample)
        if self._peer_interval_s is not None:
            self.at(0.0, self._exchange)
        next_progress = 0.0
        heap = self._heap
        pop = heapq.heappop
        end = settings.duration_s
        while heap:
            when, _, action = pop(heap)
            if when > end and not self._busy():
                break
            self.now = when
            action(when)
            if progress is not None and when >= next_progress:
                progress(when, self._index)
                next_progress = when + progress_every_s
        # GPU-hours over the load's duration (the last requests' drain is not billed).
        self._account_gpus(end)
        roles = list(self.roles.values())
        return Outcome(self.requests, self.samples, self.gpu_seconds, end, roles)

    def _busy(self) -> bool:
        """Whether requests are still in flight past the load's end (they finish)."""
        return any(not r.engine.idle for state in self.roles.values() for r in state.replicas)

    # -- requests ------------------------------------------------------------------------------
    def _next_arrival(self) -> None:
        when = next(self._arrivals, None)
        if when is not None:
            self.at(when, self._arrive)

    def _arrive(self, now: float) -> None:
        self._next_arrival()
        index = self._index
        self._index += 1
        spec, output_tokens = self._request_spec(index)
        model = self.settings.model or self.service.name
        body = spec.body(model, ignore_eos=True)
        router = self.routers[index % len(self.routers)]
        features = extract_features(body, "chat")
        request = Request(index, spec.kind, now, output_tokens, None)
        self.requests.append(request)
        for keys in self.prompt_keys.values():
            keys.begin(spec.messages)
        try:
            route = router.decide(features)
        except RouterError as e:
            request.error = f"HTTP {e.status}"
            request.end_s = now
            if isinstance(e, NoReplicaError):
                # The demand a tier at zero replicas shows the autoscaler (the router's
                # pending-requests gauge), so it scales from zero.
                for role in e.roles:
                    self.roles[(e.tier, role)].unserved += 1
            return
        request.prompt = self.prompt_keys[route.tier.name].prompt()
        request.prompt_tokens = len(request.prompt.token_ids)
        request.route = route
        request.tier = route.tier.name
        request.replica = route.replica.id
        request.prefill_replica = route.prefill.id if route.prefill is not None else None
        route.replica.in_flight += 1
        prefilling = route.prefill or route.replica
        prefilling.pending_prefill += route.prefill_blocks
        decode = self.by_id[route.replica.id]
        request.decode = decode
        if route.prefill is None:
            self._submit(decode, request, prefill=True, output=request.max_tokens)
            return
        first = self.by_id[route.prefill.id]
        self._submit(first, request, prefill=True, output=1, hop=True)

    def _request_spec(self, index: int) -> tuple[RequestSpec, int]:
        """The ``index``-th arrival's request and how many tokens it decodes: the workload's
        next, or a trace's recorded request (the workload drawn up to its place in the
        sequence) with the length its answer had."""
        load = self.settings.load
        if not isinstance(load, Trace):
            spec = self.workload.next()
            return spec, spec.max_tokens
        traced = load.requests[index]
        while self._drawn < traced.index:  # the ones its client never sent
            self.workload.next()
            self._drawn += 1
        spec = self.workload.next()
        self._drawn += 1
        return spec, traced.output_tokens or spec.max_tokens

    def _submit(
        self, replica: Replica, request: Request, *, prefill: bool, output: int, hop: bool = False
    ) -> None:
        prompt = request.prompt
        assert prompt is not None
        seq = Seq(
            request=_Job(request, hop),
            prompt_tokens=request.prompt_tokens,
            keys=prompt.keys,
            token_ids=prompt.token_ids,
            output_tokens=output,
            prefill=prefill,
        )
        self._wake_at(replica, replica.engine.submit(seq, self.now))

    def _wake_at(self, replica: Replica, when: float | None) -> None:
        if when is None:
            return
        version = replica.engine.version

        def wake(now: float) -> None:
            if replica.engine.version == version:
                self._wake_at(replica, replica.engine.wake(now))

        self.at(when, wake)

    def _first_token(self, seq: Seq, when: float) -> None:
        job: _Job = seq.request
        request, hop = job.request, job.hop
        route = request.route
        if route is None:
            return
        if hop or route.prefill is None:
            (route.prefill or route.replica).pending_prefill -= route.prefill_blocks
            request.cached_tokens = seq.cached_tokens
            request.host_cached_tokens = seq.host_tokens
        if hop:
            return
        request.first_token_s = when + self.router_s

    def _done(self, seq: Seq, when: float) -> None:
        job: _Job = seq.request
        request, hop = job.request, job.hop
        route = request.route
        decode = request.decode
        assert route is not None
        assert decode is not None
        if hop:
            # The prefill hop answered: the decode replica pulls the prompt's KV, then decodes.
            costs = decode.engine.costs
            pulled = request.prompt_tokens
            arrive = when + costs.transfer_per_token_s * pulled

            def handoff(now: float) -> None:
                self._submit(decode, request, prefill=False, output=request.max_tokens)

            self.at(arrive, handoff)
            return
        request.end_s = when + self.router_s
        request.prompt = None
        route.replica.in_flight -= 1
        state = self.roles[(request.tier, decode.endpoint.role)]
        if request.first_token_s is not None:
            ttft = request.first_token_s - request.arrival_s - self.router_s
            self._observe(request, ttft, when)
        state.completions.append(when)
        request.route = None
        request.decode = None

    def _observe(self, request: Request, ttft: float, when: float) -> None:
        """Feed the autoscaler's windows: TTFT to the role that made the first token (prefill
        in a P/D tier), TPOT to the one that decoded."""
        route = request.route
        decode = request.decode
        assert route is not None
        assert decode is not None
        first_role = RoleName.PREFILL if route.prefill is not None else decode.endpoint.role
        self.roles[(request.tier, first_role)].ttfts.append((when, ttft))
        tpot = request.tpot_s
        if tpot is not None:
            self.roles[(request.tier, decode.endpoint.role)].tpots.append((when, tpot))

    # -- replicas ------------------------------------------------------------------------------
    def _add_replica(self, state: RoleState, ready_at: float) -> Replica:
        n = next(self._hosts)
        tier = state.role.tier.name
        role = str(state.role.name)
        kv = KVPorts(5557, None, 1) if self._events else None
        host = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        endpoint = Endpoint(tier, role, host, 8000, "", kv)
        stream = kv_stream_id(endpoint.id, 0)
        publish = None
        if self._events:
            index = self.kv_index

            def publish(events: list[Any], stream: str = stream) -> None:
                index.apply(stream, events)

        engine = Engine(
            endpoint.id,
            state.model.costs,
            state.model.shape,
            on_first_token=self._first_token,
            on_done=self._done,
            publish=publish,
            now=self.now,
        )
        replica = Replica(endpoint, engine, ready_at)
        state.replicas.append(replica)
        self.by_id[endpoint.id] = replica
        self._account_gpus(self.now)
        self._gpus_now += state.model.gpus
        if ready_at <= self.now:
            self._ready(replica)
        else:
            self.at(ready_at, lambda _now: self._ready(replica))
        return replica

    def _ready(self, replica: Replica) -> None:
        if replica.retired:
            return
        replica.ready = True
        self.source.add(replica.endpoint)

    def _retire(self, state: RoleState, replica: Replica) -> None:
        replica.retired = True
        self.source.remove(replica.endpoint)
        if self._events:
            self.kv_index.drop(replica.stream)
        self._account_gpus(self.now)
        self._gpus_now -= state.model.gpus
        # Its engine finishes what it holds; the GPU is accounted free from now (the pod is
        # terminating; its grace period is short next to the run).

    def _account_gpus(self, now: float) -> None:
        now = min(now, self.settings.duration_s)
        self.gpu_seconds += self._gpus_now * max(0.0, now - self._gpu_since)
        self._gpu_since = max(self._gpu_since, now)

    # -- periodic: scrape, autoscale, sample ---------------------------------------------------
    def _scrape(self, now: float) -> None:
        """Every router reads every replica's gauges (``vllm:num_requests_*``, KV usage)."""
        metrics: dict[str, EngineMetrics] = {}
        for state in self.roles.values():
            for r in state.replicas:
                if r.ready and not r.retired:
                    e = r.engine
                    metrics[r.endpoint.id] = EngineMetrics(
                        float(e.num_waiting), float(e.num_running), e.kv_usage
                    )
        for router in self.routers:
            for replica in router.replicas():
                m = metrics.get(replica.id)
                if m is not None:
                    replica.metrics = m
                    replica.scraped_at = now
        if now < self.settings.duration_s:
            self.at(now + self._scrape_s, self._scrape)

    def _exchange(self, now: float) -> None:
        """The routers' peer exchange (``routing.peers``): each router's view of a replica
        gets what the other routers had there at this instant (in a cluster, what each peer
        answered within the last interval)."""
        states = [router.replicas() for router in self.routers]
        own: list[dict[str, tuple[int, float, float]]] = [
            {r.id: (r.in_flight, r.pending_prefill, r.recent_sends(now, own=True)) for r in rs}
            for rs in states
        ]
        totals: dict[str, tuple[int, float, float]] = {}
        for counts in own:
            for rid, (n, pending, recent) in counts.items():
                had = totals.get(rid, (0, 0.0, 0.0))
                totals[rid] = (had[0] + n, had[1] + pending, had[2] + recent)
        for replicas, counts in zip(states, own, strict=True):
            for replica in replicas:
                n, pending, recent = counts[replica.id]
                total = totals[replica.id]
                replica.peer_in_flight = total[0] - n
                replica.peer_pending = max(0.0, total[1] - pending)
                replica.peer_recent = max(0.0, total[2] - recent)
        assert self._peer_interval_s is not None
        if now < self.settings.duration_s:
            self.at(now + self._peer_interval_s, self._exchange)

    def _sample(self, now: float) -> None:
        counts = {f"{k[0]}/{k[1]}": len(s.live) for k, s in self.roles.items()}
        self.samples.append((now, counts))
        if now < self.settings.duration_s:
            self.at(now + self.settings.sample_every_s, self._sample)

    def _autoscaler(self, state: RoleState) -> Callable[[float], None]:
        def tick(now: float) -> None:
            self._autoscale(state, now)
            if now < self.settings.duration_s:
                self.at(now + state.policy.interval_s, tick)

        return tick

    def _autoscale(self, state: RoleState, now: float) -> None:
        window = state.role.tier.autoscaling.window.total_seconds()
        since = now - window
        for values in (state.ttfts, state.tpots):
            while values and values[0][0] < since:
                values.popleft()
        while state.completions and state.completions[0] < since:
            state.completions.popleft()
        live = state.live
        ready = [r for r in live if r.ready]
        metrics = _metrics(state, ready, window)
        observation = Observation(len(live), len(ready), metrics)
        state.unserved = 0
        decision = autoscale(observation, state.policy, state.history, now)
        state.history = decision.history
        if decision.dry_run or decision.replicas == len(live):
            return
        state.decisions.append((now, len(live), decision.replicas, decision.reason))
        if decision.replicas > len(live):
            for _ in range(decision.replicas - len(live)):
                self._add_replica(state, now + state.model.costs.cold_start_s)
            return
        # Scale in the newest first (Kubernetes prefers not-ready and younger pods).
        for replica in sorted(live, key=lambda r: (r.ready, -r.ready_at))[
            : len(live) - decision.replicas
        ]:
            self._retire(state, replica)


def _metrics(state: RoleState, ready: list[Replica], window_s: float) -> Metrics:
    """What Prometheus would answer for the role over the window: exact p95s of what its
    requests saw, the engines' gauges now."""
    ttfts = [v for _, v in state.ttfts]
    tpots = [v for _, v in state.tpots]
    engines = [r.engine for r in ready]
    return Metrics(
        ttft_p95_s=_p95(ttfts),
        ttft_samples=float(len(ttfts)),
        tpot_p95_s=_p95(tpots),
        tpot_samples=float(len(tpots)),
        kv_cache_usage_frac=(sum(e.kv_usage for e in engines) / len(engines)) if engines else None,
        waiting_requests=float(sum(e.num_waiting for e in engines) + state.unserved),
        running_requests=float(sum(e.num_running for e in engines)),
        reporting_engines=len(engines),
        arrival_rate_rps=len(state.completions) / window_s,
        data_age_s=0.0,
    )


def _block_size(tier: Tier) -> int:
    return tier.engine.kv_cache.block_size


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _with_max(policy: RolePolicy, ceiling: int) -> RolePolicy:
    return replace(policy, max_replicas=ceiling, min_replicas=min(policy.min_replicas, ceiling))


__all__ = ["Fleet", "Outcome", "Request", "SimSettings"]
