"""OpenAI-shaped error bodies as vLLM's OpenAI server writes them, for every HTTP server of ours
that speaks the engine contract (the reference engine, the router). Purely computational.

The shape is ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the integer HTTP
status and ``type`` vLLM's class-style name for it (``BadRequestError``, ``NotFoundError``, ...).
Clients of the fleet parse what vLLM answers; the router answers the same way, so one parser
covers a request refused by the router and one refused by an engine behind it.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's names where it has one; for the statuses only a gateway answers (429, 502, 504), the
# name the OpenAI client library raises for that status, or the status phrase in the same style.
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """vLLM's ``type`` for an HTTP status (a 4xx it does not name is a ``BadRequestError``)."""
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
    """The error object for ``status``."""
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


def normalize_error(status: int, raw: bytes) -> bytes | None:
    """An upstream error body in the shape above, or ``None`` when it already has it.

    Engines behind a gateway answer in other shapes too: older vLLM's flat
    ``{"object": "error", "message", "type", "code"}``, a body missing ``code`` or ``param``,
    or plain text from a proxy in between. The message (and param, where given) are
    kept; ``type`` and ``code`` become those of the HTTP status the client receives (a body
    that needed fixing did not come from a vLLM-compatible server, so its type names are not
    vLLM's either).
    """
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    error: Any = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) and isinstance(data, dict) and "message" in data:
        error = data  # the flat shape
    if isinstance(error, dict):
        if (
            isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str)
            and "param" in error
            and error.get("code") == status
            and data is not error
        ):
            return None
        message = error.get("message")
        if message is None:
            message = f"upstream answered HTTP {status}"
        param = error.get("param")
        body = error_body(
            status,
            message if isinstance(message, str) else json.dumps(message),
            param=param if isinstance(param, str) else None,
        )
    else:
        text = raw.decode("utf-8", "replace").strip()
        body = error_body(status, text or f"upstream answered HTTP {status}")
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
