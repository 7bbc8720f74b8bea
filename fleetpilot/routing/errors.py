"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}``. Purely
computational."""

from __future__ import annotations

import json
from typing import Any


class RouterError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI-shaped body."""

    status = 400
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


class InvalidRequestError(RouterError):
    status = 400
    type = "invalid_request_error"


class UnknownModelError(RouterError):
    status = 404
    type = "invalid_request_error"


class BodyTooLargeError(RouterError):
    status = 413
    type = "invalid_request_error"


class OverloadedError(RouterError):
    status = 429
    type = "rate_limit_error"


class UnavailableError(RouterError):
    status = 503
    type = "service_unavailable"


class NoReplicaError(UnavailableError):
    """No tier in reach has a replica at all: the request's own tier may be at zero.

    ``tier`` and ``roles`` name the tier the request wanted, so a router configured with a
    cold-start wait can hold the request and report the demand (scale from zero).
    """

    def __init__(self, message: str, *, tier: str, roles: tuple[str, ...]) -> None:
        super().__init__(message, code="no_ready_replicas")
        self.tier = tier
        self.roles = roles


class UpstreamFailedError(RouterError):
    status = 502
    type = "upstream_error"


class UpstreamTimeoutError(RouterError):
    status = 504
    type = "timeout_error"


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def error_bytes(error: RouterError) -> bytes:
    return json.dumps(error.body()).encode()
