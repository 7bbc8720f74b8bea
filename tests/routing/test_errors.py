"""Reading engines' error bodies: which 404 says the engine does not serve the model asked for
(a LoRA adapter it has not loaded yet), the one the router retries elsewhere."""

from __future__ import annotations

import json

import pytest

from fleetpilot.routing.errors import model_not_found

MESSAGE = "The model `sql` does not exist."


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # vLLM 0.33 (and the reference engine).
        ({"error": {"message": MESSAGE, "type": "NotFoundError", "param": "model", "code": 404}},
         True),
        # Older vLLM's top-level shape.
        ({"object": "error", "message": MESSAGE, "type": "NotFoundError", "param": None,
          "code": 404}, True),
        # A web framework's 404 for a path it does not route: the engine's API is elsewhere.
        ({"detail": "Not Found"}, False),
        # Another error type under the same status (a gateway in between).
        ({"error": {"message": "no route", "type": "BadRequestError", "code": 404}}, False),
        ([MESSAGE], False),
    ],
)  # fmt: skip
def test_only_vllms_not_found_error_says_the_model_is_missing(body: object, expected: bool) -> None:
    assert model_not_found(json.dumps(body).encode()) is expected


def test_a_body_that_is_not_json_says_nothing() -> None:
    assert model_not_found(b"404 page not found") is False
    assert model_not_found(b"[" * 100_000) is False  # too deep for the parser
