"""vLLM's error shape, and the rewriting of upstream errors into it."""

from __future__ import annotations

import json

import pytest

from fleetpilot.openai_errors import error_body, error_type, normalize_error


def test_the_shape_is_vllms() -> None:
    """Our error bodies are vLLM's: nested under error with message, type, param and an integer
    code; the type follows the status."""
    assert error_body(400, "bad", param="max_tokens") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    }
    assert (error_type(418), error_type(599)) == ("BadRequestError", "InternalServerError")


def test_a_body_already_in_the_shape_is_left_alone() -> None:
    """An upstream error already in vLLM's shape is relayed untouched (None: nothing to rewrite)."""
    assert normalize_error(404, json.dumps(error_body(404, "no such model")).encode()) is None


@pytest.mark.parametrize(
    ("status", "raw", "message", "param"),
    [
        # vLLM before the nested shape: flat, with object "error".
        (
            400,
            b'{"object":"error","message":"too long","type":"BadRequestError","param":null,'
            b'"code":400}',
            "too long",
            None,
        ),
        (400, b'{"error":{"message":"bad n","type":"x","param":"n"}}', "bad n", "n"),  # no code
        (500, b'{"error":{"message":"boom","type":"x","param":null,"code":400}}', "boom", None),
        (502, b'{"error":{"type":"x"}}', "upstream answered HTTP 502", None),  # no message
        (503, b"upstream connect error", "upstream connect error", None),  # a proxy's text
        (500, b"", "upstream answered HTTP 500", None),
    ],
)
def test_other_shapes_are_rewritten_keeping_message_and_param(
    status: int, raw: bytes, message: str, param: str | None
) -> None:
    """Other upstream error shapes (old flat vLLM, no code, a wrong code, no message, plain text,
    empty) become vLLM's shape for the status sent, keeping message and param."""
    fixed = normalize_error(status, raw)
    assert fixed is not None
    assert json.loads(fixed) == error_body(status, message, param=param)
