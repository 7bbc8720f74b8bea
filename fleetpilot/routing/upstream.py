"""Upstream attempts: one request sent to one replica, and what the router learns from it.

:class:`Attempt` is the only writer of a replica's ``in_flight`` and ``pending_prefill``: an
attempt counts in the replica's ``in_flight`` from its start to its end, and the prompt blocks
it makes the replica prefill are pending there until its first chunk (or its end).
:class:`Upstream` sends an attempt under the first-byte watch (``liveness.LivenessWatch``, with
the replica's record of the requests waiting there), asks a replica that kept a request
waiting whether it is alive, records each attempt's outcome with the router (success, failure
and its cause, an adapter the replica lacks), and makes the P/D prefill hop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from fleetpilot.routing.errors import model_not_found
from fleetpilot.routing.health import answers_health
from fleetpilot.routing.liveness import LivenessWatch, SilentReplicaError
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.pd import kv_params_of, prefill_request
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.route import Route
from fleetpilot.routing.router import Router

# The cause of an attempt that got no first byte within its budget from a replica that then
# failed its liveness probe: frozen (SIGSTOP), wedged, or its node gone without a RST.
FIRST_BYTE_TIMEOUT = "first-byte-timeout"
# The cause of an attempt given up before its budget because its replica turned suspect
# (policies.suspicion) while another could take the request: retried, counted as no failure
# (the replica's own missed scrapes count towards its ejection).
SUSPECT = "suspect"
# The /health question asked of a replica where a request has waited ``suspect_after_s``:
# a live engine's API server answers it in milliseconds (vLLM's does not wait on the engine
# core); a quarter second covers a busy event loop, and a wrong "silent" costs little - the
# replica is passed over only until its next scrape or answer.
SUSPICION_PROBE_S = 0.25
# Causes that are waits which ran out (the replica said nothing), not quick refusals: an
# ejection they led to is not worth a try in panic mode (``picker.HealthFilter``).
HUNG_CAUSES = frozenset({"timeout", FIRST_BYTE_TIMEOUT, "stall"})
# The cause of an attempt answered 404 for its LoRA adapter by a healthy replica that has not
# loaded it yet (dynamic LoRA): retried like a failure, counted as none.
ADAPTER_MISSING = "adapter-missing"


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class Attempt:
    """One request's stay on one replica: counted in its ``in_flight`` from ``begin`` to
    ``end``, and ``prefill_blocks`` pending there until ``prefilled`` (its first chunk) or
    ``end``. Both ends are idempotent; ``with`` begins and ends it."""

    def __init__(self, replica: ReplicaState, prefill_blocks: float = 0.0) -> None:
        self.replica = replica
        self._blocks = prefill_blocks
        self._counted = False
        self._pending = False

    def begin(self) -> Attempt:
        if not self._counted:
            self._counted = True
            self.replica.in_flight += 1
            if self._blocks:
                self._pending = True
                self.replica.pending_prefill += self._blocks
        return self

    def prefilled(self) -> None:
        """The prompt is computed (its first chunk came): its blocks are no longer pending."""
        if self._pending:
            self._pending = False
            self.replica.pending_prefill -= self._blocks

    def end(self) -> None:
        self.prefilled()
        if self._counted:
            self._counted = False
            self.replica.in_flight -= 1

    def __enter__(self) -> Attempt:
        return self.begin()

    def __exit__(self, *exc: object) -> None:
        self.end()


@dataclass
class Answer:
    """How an attempt went: the replica's response (None when it gave none), and the cause
    when it failed (a response with a cause is a 5xx or a missing adapter)."""

    response: aiohttp.ClientResponse | None
    cause: str | None = None
    error: Exception | None = None


class ReplicaWatch(LivenessWatch):
    """A first-byte watch that keeps the replica's record of the requests waiting for a first
    byte there (``ReplicaState.waits``, which suspicion reads): every upstream attempt's wait
    goes through one, so this is that record's one writer. An attempt that got its answer
    means the replica was heard from."""

    def __init__(
        self,
        replica: ReplicaState,
        clock: Callable[[], float],
        probe: Callable[[float], Awaitable[bool]],
        budget_s: float,
        *,
        keep_while_alive: bool,
        give_up: Callable[[], bool] | None,
        on_due: Callable[[], None] | None,
    ) -> None:
        super().__init__(
            probe,
            budget_s,
            keep_while_alive=keep_while_alive,
            give_up=give_up,
            give_up_after_s=replica.suspect_after_s,
            on_due=on_due,
        )
        self.replica = replica
        self.clock = clock
        self._token: int | None = None

    async def __aenter__(self) -> ReplicaWatch:
        await super().__aenter__()
        self._token = self.replica.waits.begin(self.clock())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            # Ended by the watch (its budget, or suspicion): the replica never answered.
            self.replica.waits.end(self._token, given_up=self.verdict in ("dead", SUSPECT))
        if exc_type is None:
            self.replica.heard_from()
        await super().__aexit__(exc_type, exc, tb)


class Upstream:
    """Sends attempts to replicas and records what they show."""

    def __init__(
        self, router: Router, metrics: RouterMetrics, session: aiohttp.ClientSession
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.session = session
        self._client_timeout: aiohttp.ClientTimeout | None = None
        # The /health questions in flight (``_question``), one per replica at most.
        self._questions: dict[str, asyncio.Task[None]] = {}

    def close(self) -> None:
        for task in self._questions.values():
            task.cancel()

    def timeout(self) -> aiohttp.ClientTimeout:
        connect = self.router.config.connect_timeout.total_seconds()
        if self._client_timeout is None or self._client_timeout.connect != connect:
            # No total or read limit here: the request-wide asyncio.timeout bounds the whole
            # exchange, and a long generation legitimately streams for minutes.
            self._client_timeout = aiohttp.ClientTimeout(
                total=None, connect=connect, sock_connect=connect
            )
        return self._client_timeout

    # -- one attempt -------------------------------------------------------------------------
    async def post(
        self,
        route: Route,
        replica: ReplicaState,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        give_up: Callable[[], bool],
    ) -> Answer:
        """Send ``payload`` to ``replica`` until its first byte, under the tier's first-byte
        budget (given up sooner when ``give_up`` says so), and record the outcome: a failure
        and its cause, a 404 for the route's adapter (no failure: the replica answered), or a
        success."""
        budget_s = self.router.first_byte_timeout_s(route.tier)
        answer = Answer(None)
        try:
            async with self.watch(replica, budget_s, keep_while_alive=True, give_up=give_up):
                answer.response = await self.session.post(
                    replica.url(path), data=payload, headers=headers, timeout=self.timeout()
                )
            answer.cause = "5xx" if answer.response.status >= 500 else None
        except SilentReplicaError as exc:
            answer.cause = SUSPECT if exc.verdict == SUSPECT else FIRST_BYTE_TIMEOUT
        except aiohttp.ClientError as exc:
            answer.cause, answer.error = cause_of(exc), exc
        adapter = route.adapter
        if answer.cause is None and adapter is not None and await lacks_model(answer.response):
            answer.cause = ADAPTER_MISSING
            self.router.record_success(replica)  # it answered: no failure
            self.adapter_missing(route, replica)
            return answer
        if answer.cause is not None:
            self.failed(route, replica, answer.cause)
            return answer
        self.router.record_success(replica)
        assert answer.response is not None
        if route.adapter is not None and answer.response.status < 400:
            self.router.record_adapter_served(replica, route.adapter)
        return answer

    def watch(
        self,
        replica: ReplicaState,
        budget_s: float,
        *,
        keep_while_alive: bool,
        give_up: Callable[[], bool] | None = None,
    ) -> ReplicaWatch:
        """The first-byte watch of one attempt on ``replica``; ``give_up`` is asked once the
        attempt has waited as long as makes a silent replica suspect."""
        return ReplicaWatch(
            replica,
            self.router.clock,
            self.probe(replica),
            budget_s,
            keep_while_alive=keep_while_alive,
            give_up=give_up,
            on_due=(lambda: self._question(replica)) if give_up is not None else None,
        )

    def probe(self, replica: ReplicaState) -> Callable[[float], Awaitable[bool]]:
        """The liveness probe of ``replica`` (its /health), noting what it shows."""

        async def probe(timeout_s: float) -> bool:
            alive = await answers_health(self.session, replica, timeout_s)
            if alive:
                replica.heard_from()
            else:
                replica.went_silent(self.router.clock())
            return alive

        return probe

    def _question(self, replica: ReplicaState) -> None:
        """A request has waited long enough on ``replica`` to ask whether it is alive: its
        /health, within ``SUSPICION_PROBE_S``, unless it is known silent already or asked now.
        No answer makes it silent, so suspect (``policies.suspicion``) a scrape period sooner
        than a missed scrape would."""
        if replica.silent_since is not None or replica.id in self._questions:
            return
        probe = self.probe(replica)

        async def ask() -> None:
            try:
                await probe(SUSPICION_PROBE_S)
            finally:
                self._questions.pop(replica.id, None)

        self._questions[replica.id] = asyncio.get_running_loop().create_task(ask())

    # -- records -----------------------------------------------------------------------------
    def failed(self, route: Route, replica: ReplicaState, cause: str) -> None:
        self.metrics.upstream_errors.labels(route.tier.name, replica.id, cause).inc()
        if cause != SUSPECT:
            # The router's on_eject counts an ejection.
            self.router.record_failure(replica, hung=cause in HUNG_CAUSES)

    def adapter_missing(self, route: Route, replica: ReplicaState) -> None:
        assert route.adapter is not None
        self.metrics.adapter_missing.labels(route.tier.name, replica.id).inc()
        self.router.record_adapter_missing(replica, route.adapter)

    # -- the P/D prefill hop -----------------------------------------------------------------
    async def prefill_hop(
        self, route: Route, body: dict[str, Any], path: str, headers: dict[str, str]
    ) -> tuple[dict[str, Any] | None, str]:
        """Hop 1 of a disaggregated request: the KV handle, or ``None`` and why not.

        The hop has the tier's first-byte budget: a prefill is one forward pass, and past the
        budget the decode replica computing the prompt itself is the quicker answer. It counts
        as a failure of the prefill replica only if its liveness probe failed too. It is given
        up sooner, counting no failure, once the replica turns suspect (a frozen prefill
        engine costs each hop in flight about a second, not the budget)."""
        replica = route.prefill
        if replica is None:
            return None, "no-prefill-replica"
        payload = json_bytes(prefill_request(body, route.served_model))
        budget_s = self.router.first_byte_timeout_s(route.tier)
        now = self.router.clock
        try:
            # The hop is the prefill: its blocks are pending on the replica until it answers.
            # Given up as soon as the replica turns suspect: decode-only is always there.
            with Attempt(replica, route.prefill_blocks):
                async with self.watch(
                    replica,
                    budget_s,
                    keep_while_alive=False,
                    give_up=lambda: replica.suspect(now()),
                ):
                    status, data = await self._prefill_exchange(replica, path, payload, headers)
        except SilentReplicaError as exc:
            if exc.verdict == "dead":
                self.failed(route, replica, FIRST_BYTE_TIMEOUT)
                return None, "prefill-" + FIRST_BYTE_TIMEOUT
            return None, "prefill-" + (SUSPECT if exc.verdict == SUSPECT else "slow")
        except aiohttp.ClientError as exc:
            self.failed(route, replica, cause_of(exc))
            return None, "prefill-" + cause_of(exc)
        except ValueError:
            return None, "prefill-invalid-json"
        if status >= 500:
            self.failed(route, replica, "5xx")
            return None, "prefill-5xx"
        if status != 200:
            return None, f"prefill-{status}"
        params = kv_params_of(data)
        if params is None:
            return None, "prefill-no-kv-params"
        self.router.record_success(replica)
        return params, "ok"

    async def _prefill_exchange(
        self, replica: ReplicaState, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, Any]:
        async with self.session.post(
            replica.url(path), data=payload, headers=headers, timeout=self.timeout()
        ) as response:
            if response.status != 200:
                return response.status, None
            return 200, await response.json(content_type=None)


async def lacks_model(response: aiohttp.ClientResponse | None) -> bool:
    """Whether an engine answered that it does not serve the model the request names (vLLM's
    404 ``NotFoundError``, ``errors.model_not_found``). Reads a 404's body, a few bytes of
    JSON that relaying it takes from aiohttp's copy; a body that breaks off says nothing."""
    if response is None or response.status != 404:
        return False
    if response.content_type == "text/event-stream":
        return False
    try:
        raw = await response.read()
    except aiohttp.ClientError:
        return False
    return model_not_found(raw)


def cause_of(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    return "disconnect"
