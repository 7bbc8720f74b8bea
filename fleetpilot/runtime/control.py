"""The local fleet's control API: how ``fleetpilot autoscaler`` reads and moves replicas.

A small JSON API on loopback (the routes are listed in :mod:`fleetpilot.autoscaler.remote`,
whose client speaks it). It is a thin shell over :class:`~fleetpilot.runtime.autoscale.
LocalActuator`: requests are parsed and checked here, and the actuator does the work under the
fleet's lock. Bad requests get a 4xx with an OpenAI-style error body naming what is wrong.

The standard library's threading HTTP server is enough: one autoscaler calls it a few times a
second, and it must not share an event loop with anything.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from fleetpilot.api import InferenceService
from fleetpilot.api.status import Condition
from fleetpilot.autoscaler.remote import decision_from_wire
from fleetpilot.listening import listening_on
from fleetpilot.runtime.autoscale import LocalActuator

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_BODY_BYTES = 1 << 20
_ROLE_PATH = re.compile(r"^/fleet/tiers/([^/]+)/roles/([^/]+)$")


class RequestError(Exception):
    """A request the API refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class ControlServer:
    """Serves one fleet's control API on ``HOST:port`` (0: a free port) from a thread.

    ``service`` is the service as the autoscaler must see it (replica bounds capped to what
    this machine runs); ``max_replicas`` refuses larger scale requests.
    """

    def __init__(
        self,
        actuator: LocalActuator,
        service: InferenceService,
        *,
        max_replicas: int,
        prometheus_url: str | None = None,
        router_address: str | None = None,
        port: int = 0,
    ) -> None:
        self.router_address = router_address  # its metrics listener: what the autoscaler reads
        self.actuator = actuator
        self.service = service
        self.max_replicas = max_replicas
        self.prometheus_url = prometheus_url
        with listening_on(HOST, port):
            self._server = ThreadingHTTPServer((HOST, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fleet-control", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    # -- routes (called from the handler; raise RequestError to refuse) --------------------
    def get(self, path: str) -> dict[str, Any]:
        if path == "/fleet":
            return {
                # With a status, as an InferenceService under the operator has one: the
                # autoscaler reads each role's observed cold start from it.
                "service": self.service.model_copy(
                    update={"status": self.actuator.fleet_status()}
                ).to_wire(),
                "roles": [s.to_wire() for s in self.actuator.role_states()],
                "prometheusUrl": self.prometheus_url,
                "router": self.router_address,
            }
        tier, role = self._role(path)
        state = self.actuator.role_state(tier, role)
        if state is None:
            raise RequestError(HTTPStatus.NOT_FOUND, f"no role {role!r} in tier {tier!r}")
        return state.to_wire()

    def put(self, path: str, body: Any) -> dict[str, Any]:
        tier, role = self._role(path)
        replicas = body.get("replicas") if isinstance(body, dict) else None
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise RequestError(
                HTTPStatus.BAD_REQUEST, "replicas: expected an integer", param="replicas"
            )
        if not 0 <= replicas <= self.max_replicas:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"replicas: {replicas} is outside 0..{self.max_replicas} (--max-replicas-per-role)",
                param="replicas",
            )
        if self.actuator.role_state(tier, role) is None:
            raise RequestError(HTTPStatus.NOT_FOUND, f"no role {role!r} in tier {tier!r}")
        self.actuator.scale(tier, role, replicas)
        state = self.actuator.role_state(tier, role)
        assert state is not None
        return state.to_wire()

    def post(self, path: str, body: Any) -> dict[str, Any]:
        if path != "/fleet/decisions":
            raise RequestError(HTTPStatus.NOT_FOUND, f"no route POST {path}")
        if not isinstance(body, dict) or not isinstance(body.get("decisions"), list):
            raise RequestError(
                HTTPStatus.BAD_REQUEST, "decisions: expected a list", param="decisions"
            )
        try:
            decisions = [decision_from_wire(d) for d in body["decisions"]]
            raw_condition = body.get("condition")
            condition = Condition.model_validate(raw_condition) if raw_condition else None
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f"decisions: malformed ({exc})", param="decisions"
            ) from None
        self.actuator.note(decisions, condition)
        return {"recorded": len(decisions)}

    @staticmethod
    def _role(path: str) -> tuple[str, str]:
        match = _ROLE_PATH.match(path)
        if match is None:
            raise RequestError(HTTPStatus.NOT_FOUND, f"no route {path}")
        return unquote(match.group(1)), unquote(match.group(2))


def _handler_for(control: ControlServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fleetpilot-control"

        def do_GET(self) -> None:
            self._answer(lambda: control.get(self._path()))

        def do_PUT(self) -> None:
            self._answer(lambda: control.put(self._path(), self._body()))

        def do_POST(self) -> None:
            self._answer(lambda: control.post(self._path(), self._body()))

        def _path(self) -> str:
            return self.path.split("?", 1)[0]

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
            raw = self.rfile.read(length) if length else b""
            try:
                return json.loads(raw) if raw else None
            except ValueError as exc:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None

        def _answer(self, route: Any) -> None:
            try:
                status, body = HTTPStatus.OK, route()
            except RequestError as exc:
                status = exc.status
                body = {
                    "error": {
                        "message": str(exc),
                        "type": "invalid_request_error",
                        "param": exc.param,
                        "code": status.value,
                    }
                }
            except Exception as exc:  # a bug must answer 500, not kill the API thread
                log.exception("control API request %s %s failed", self.command, self.path)
                status = HTTPStatus.INTERNAL_SERVER_ERROR
                body = {"error": {"message": str(exc), "type": "server_error", "code": 500}}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("control API: " + format, *args)

    return Handler


__all__ = ["ControlServer", "RequestError"]
