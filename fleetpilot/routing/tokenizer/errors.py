"""The one error of the request tokenizer: every module of the package raises it, so it sits
below them all. No I/O."""

from __future__ import annotations

from typing import NoReturn


class TokenizerError(Exception):
    """The request cannot be tokenized as the engine would (bad shape, unsupported feature, a
    template that raised, too large) or the tokenizer files are unusable; the router falls back
    to its guessed index, it never fails the request for this."""


def bad(message: str) -> NoReturn:
    raise TokenizerError(message)
