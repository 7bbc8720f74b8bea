"""The router's own errors, in vLLM's OpenAI shape (``fleetpilot.openai_errors``):
``{"error": {"message", "type", "param", "code": <HTTP status>}}``. Purely computational.

Each error also carries a ``reason``: a short machine-readable word (``invalid_json``,
``no_ready_replicas``, ``overloaded``, ...) that the router sends in the ``x-fleetpilot-error``
header and counts in ``fleetpilot_router_rejected_requests_total``; vLLM's body has no field
for it, and ``code`` is the integer status its clients expect there.
"""

from __future__ import annotations

import json
from typing import Any

from fleetpilot.openai_errors import error_body, error_type

ERROR_HEADER = "x-fleetpilot-error"


class RouterError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI-shaped body."""

    status = 400

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param)

    def response_headers(self) -> dict[str, str]:
        if self.reason is None:
            return self.headers
        return {**self.headers, ERROR_HEADER: self.reason}


def model_not_found(raw: bytes) -> bool:
    """Whether an engine's error body is vLLM's answer to a request naming a model it does not
    serve: type ``NotFoundError`` ("The model `sql` does not exist."), in vLLM 0.33's
    ``{"error": {...}}`` or older vLLM's top-level ``{"object": "error", ...}``. A 404 of
    another kind (a web framework's ``{"detail": "Not Found"}``, plain text) is not one."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    if not isinstance(data, dict):
        return False
    error = data.get("error")
    if not isinstance(error, dict):
        error = data  # the flat shape
    return bool(error.get("type") == error_type(404))


class InvalidRequestError(RouterError):
    status = 400


class AuthenticationError(RouterError):
    """No API key, or one no tenant holds: 401, with the challenge RFC 6750 asks for."""

    status = 401

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(
            message, reason=reason, headers={"WWW-Authenticate": 'Bearer realm="fleetpilot"'}
        )


class PermissionDeniedError(RouterError):
    """A tenant's key asking for a tier or adapter the tenant may not use."""

    status = 403


class UnknownModelError(RouterError):
    status = 404


class BodyTooLargeError(RouterError):
    status = 413


class OverloadedError(RouterError):
    status = 429


class UnavailableError(RouterError):
    status = 503


class NoReplicaError(UnavailableError):
    """No tier in reach has a replica at all: the request's own tier may be at zero.

    ``tier`` and ``roles`` name the tier the request wanted, so a router configured with a
    cold-start wait can hold the request and report the demand (scale from zero).
    """

    def __init__(
        self,
        message: str,
        *,
        tier: str,
        roles: tuple[str, ...],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason="no_ready_replicas", headers=headers)
        self.tier = tier
        self.roles = roles


class UpstreamFailedError(RouterError):
    status = 502


class UpstreamTimeoutError(RouterError):
    status = 504
