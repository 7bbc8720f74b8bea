"""Request features the routing policies read: the prompt text (for prefix hashing) and the
cheap complexity signals. Purely computational: a parsed JSON body and headers in, a frozen
``RequestFeatures`` out, or ``InvalidRequestError`` for a body no engine would accept.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetpilot.routing.errors import InvalidRequestError

TIER_HEADER = "x-fleetpilot-tier"
Kind = Literal["completions", "chat"]

# English text averages about four characters per token with Llama/Qwen-style BPE vocabularies;
# a tokenizer per tier would be exact but costs more than the routing decision it informs.
CHARS_PER_TOKEN = 4
# Markers are looked for in the most recent text only: the signal is what is being asked now,
# and scanning a 1 MB prompt on every request would cost more than the rest of the routing.
MARKER_SCAN_CHARS = 32_768

# The markers: three case-insensitive alternations of cues. Python's `re` tries every alternative
# at every position (~0.5 us a character for the three), so each alternative is its own regex here,
# behind the literals any match of it contains (its needles, lowercase): the text is folded once,
# a needle is a substring test (~1 ns a character), and a cue's regex runs only where one of its
# needles occurs. An alternation has a match iff one of its alternatives has, so the flags are the
# single regexes' (one alternative is rewritten to the same effect, below), which
# tests/routing/test_features_prefilter.py keeps and checks them against.


@dataclass(frozen=True, slots=True)
class _Cue:
    """One alternative of a marker regex, and the literals every match of it contains."""

    regex: re.Pattern[str]
    needles: tuple[str, ...]
    # Every match starts where one of the needles starts: the regex is tried at those places.
    anchored: bool


def _cue(pattern: str, *needles: str, anchored: bool = True) -> _Cue:
    return _Cue(re.compile(pattern, re.IGNORECASE), needles, anchored)


def _words(*words: tuple[str, str]) -> tuple[_Cue, ...]:
    r"""``\b(?:a|b|...)\b`` as a cue a word: (the word's pattern, its literal start)."""
    return tuple(_cue(rf"\b{pattern}\b", needle) for pattern, needle in words)


_CODE_CUES = (
    _cue(r"```", "```"),
    _cue(r"\bdef \w+\s*\(", "def "),
    _cue(r"\bclass \w+\s*[:({]", "class "),
    _cue(r"\bfunction\s*\w*\s*\(", "function"),
    _cue(r"#include\s*<", "#include"),
    _cue(r"\bimport \w+", "import "),
    _cue(r"\bSELECT\b[^;]{0,200}\bFROM\b", "select"),
    _cue(r"\bpublic static\b", "public static"),
    _cue(r"=>", "=>"),
    _cue(r"\bfn \w+\s*\(", "fn "),
    _cue(r"\bconsole\.log\b", "console.log"),
    *_words(
        ("refactor", "refactor"),
        ("debug", "debug"),
        ("stack trace", "stack trace"),
        ("traceback", "traceback"),
        ("compile error", "compile error"),
        ("segfault", "segfault"),
        ("unit tests?", "unit test"),
    ),
)
_MATH_CUES = (
    _cue(r"\\(?:frac|int|sum|sqrt|prod|lim|begin\{(?:equation|align))", "\\"),
    _cue(r"\$[^$\n]{1,200}\$", "$"),
    _cue(r"[∫∑√∏∞≤≥≠±]", *"∫∑√∏∞≤≥≠±"),
    *_words(
        ("prove", "prove"),
        ("proof", "proof"),
        ("theorem", "theorem"),
        ("lemma", "lemma"),
        ("integral", "integral"),
        ("derivative", "derivative"),
        ("differentiate", "differentiate"),
        ("equation", "equation"),
        (r"eigen\w*", "eigen"),
        ("matrix", "matrix"),
        ("polynomial", "polynomial"),
        ("probability", "probability"),
        (r"combinatori\w*", "combinatori"),
        ("modulo", "modulo"),
    ),
    # \b\d+\s*[\^*/]\s*\d+, led by its first digit so that `re` skips to digits: \b before a
    # digit (a \w) is "no \w before it", what the lookbehind asks once the digit is read.
    _cue(r"\d(?<!\w\d)\d*\s*[\^*/]\s*\d", "^", "*", "/", anchored=False),
)
_REASONING_CUES = _words(
    ("step[- ]by[- ]step", "step"),
    ("think (?:carefully|through)", "think "),
    ("explain why", "explain why"),
    ("reason(?:ing)? about", "reason"),
    ("analy[sz]e", "analy"),
    ("compare and contrast", "compare and contrast"),
    ("trade-?offs?", "trade"),
    ("justify", "justify"),
    ("pros and cons", "pros and cons"),
    ("root cause", "root cause"),
    ("design (?:a|an|the)", "design "),
    ("plan (?:a|an|the)", "plan "),
    ("evaluate", "evaluate"),
    ("critique", "critique"),
    ("derive", "derive"),
)
_CUES = (_CODE_CUES, _MATH_CUES, _REASONING_CUES)
# Each marker's (needle, cue) pairs, a cue's needles together; and those for ASCII text, which
# holds no non-ASCII needle.
_NEEDLES = tuple(tuple((n, cue) for cue in cues for n in cue.needles) for cues in _CUES)
_ASCII_NEEDLES = tuple(tuple((n, cue) for n, cue in pairs if n.isascii()) for pairs in _NEEDLES)
# re.IGNORECASE equates characters whose simple lowercase mappings are equal, and adds a few
# pairs (re._casefix). Of the needles' characters: 'i' matches U+0131 (dotless i) and U+0130
# (capital I with dot above), 's' matches U+017F (long s), 'k' matches U+212A (Kelvin sign).
# str.lower() leaves U+0131 and U+017F as they are and makes U+0130 'i' + U+0307 (str.casefold()
# does no better: U+0131 stays, U+0130 becomes two characters); U+212A it lowers to 'k'. So those
# three are replaced first, then the text lowered: each character that matches a needle's
# character becomes that character, and, U+0130 gone, the folded text is as long as the text (a
# needle's index is where a match would start). The tests check this for every code point.
_FOLD_FIRST = (("\u0130", "i"), ("\u0131", "i"), ("\u017f", "s"))
_MIN_TRIES = 8


def _fold(text: str) -> str:
    """``text`` in lowercase, each character as the needles spell what it matches."""
    if text.isascii():
        return text.lower()
    for char, plain in _FOLD_FIRST:
        text = text.replace(char, plain)
    return text.lower()


def _found(
    needles: tuple[tuple[str, _Cue], ...],
    text: str,
    folded: str,
    aligned: bool,
    present: Container[str],
) -> bool:
    """Whether a cue of ``needles`` matches in ``text`` (``folded`` is ``_fold(text)``;
    ``present`` holds every needle that occurs in it, or is ``folded`` itself)."""
    # Trying a regex at a place (~0.3 us) costs what its search spends on ~30 characters: past
    # this many places a cue searches the rest instead, so a literal everywhere costs at most
    # about two searches of that cue alone.
    budget = _MIN_TRIES + len(text) // 32
    searched = None
    for needle, cue in needles:
        if needle not in present or cue is searched:
            continue
        if not (cue.anchored and aligned):
            # One search looks at every place, this needle's and the cue's other needles'.
            if cue.regex.search(text) is not None:
                return True
            searched = cue
            continue
        at = folded.find(needle)
        tries = budget
        while at >= 0:
            if not tries:
                # Every match from here on (\b and lookbehinds still see what precedes).
                if cue.regex.search(text, at) is not None:
                    return True
                break
            if cue.regex.match(text, at) is not None:
                return True
            at = folded.find(needle, at + 1)
            tries -= 1
    return False


# Every needle, for the needle sets of long messages (``_NeedleSets``).
_ALL_NEEDLES = tuple(dict.fromkeys(n for pairs in _NEEDLES for n, _ in pairs))
# Only no needle holds a line break, so a needle in ``"".join(lines)`` (each a chat message's
# ``role: content\n`` line) is in one of the lines: a line's needle set can stand for its part.
assert not any("\n" in n for n in _ALL_NEEDLES)


def _needles_in(text: str) -> frozenset[str]:
    folded = _fold(text)
    return frozenset(n for n in _ALL_NEEDLES if n in folded)


class _NeedleSets:
    """Per long chat message, the needles its folded text holds: a system prompt resent with
    every request is searched for the ~50 needles once (52 substring tests of a 2,000-character
    prompt take ~60 us, most of a request's features), not per request. Thread-safe (the
    proxy extracts features on its worker threads too); bounded by the characters it keys on,
    least recently used first out.

    Exact: folding is per character, and a line ends with a line break, which no needle holds
    and which no case mapping looks across, so the needles in the folded whole are the union
    of those in the folded lines."""

    MIN_CHARS = 256  # shorter lines are searched each time: as cheap as a look-up
    MAX_CHARS = 8 << 20  # of lines kept, in all

    def __init__(self) -> None:
        self._sets: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def of(self, lines: Sequence[str]) -> set[str]:
        present: set[str] = set()
        for line in lines:
            if len(line) < self.MIN_CHARS:
                present |= _needles_in(line)
                continue
            with self._lock:
                found = self._sets.get(line)
                if found is not None:
                    self._sets.move_to_end(line)
            if found is None:
                found = _needles_in(line)
                self._keep(line, found)
            present |= found
        return present

    def _keep(self, line: str, found: frozenset[str]) -> None:
        if len(line) > self.MAX_CHARS // 8:
            return
        with self._lock:
            if line in self._sets:
                return
            self._sets[line] = found
            self._chars += len(line)
            while self._chars > self.MAX_CHARS:
                old, _ = self._sets.popitem(last=False)
                self._chars -= len(old)


_NEEDLE_SETS = _NeedleSets()


def _markers(text: str, lines: Sequence[str] | None = None) -> tuple[bool, bool, bool]:
    """``(has_code, has_math, has_reasoning)`` of ``text``; ``lines``: the parts it joins
    (chat messages), whose needle sets are kept (``_NeedleSets``)."""
    folded = _fold(text)
    aligned = len(folded) == len(text)
    code, math, reasoning = _ASCII_NEEDLES if text.isascii() else _NEEDLES
    present: Container[str] = folded if lines is None else _NEEDLE_SETS.of(lines)
    return (
        _found(code, text, folded, aligned, present),
        _found(math, text, folded, aligned, present),
        _found(reasoning, text, folded, aligned, present),
    )


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What routing needs from one OpenAI request."""

    kind: Kind
    model: str | None
    prompt_text: str
    approx_tokens: int
    max_tokens: int | None
    turns: int
    system_chars: int
    has_code: bool
    has_math: bool
    has_reasoning: bool
    stream: bool
    tier_header: str | None = None
    # What the request's tenant may use (routing.auth); None: anything.
    allowed_tiers: frozenset[str] | None = None
    allowed_adapters: frozenset[str] | None = None
    # The request body as sent, for the router's tokenizer to render and tokenize as the
    # engine will (chat template options included) and match against the engines' KV events.
    payload: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


def _bad(message: str, param: str | None, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, reason=code)


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass; true is not a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer", key, "invalid_type")
    if value < 0:
        raise _bad(f"'{key}' must not be negative", key)
    return value


def _prompt_text(prompt: Any) -> tuple[str, int]:
    """The completions ``prompt`` as text, and its approximate token count.

    Token-id prompts become their ids joined by spaces: a stable, prefix-preserving text whose
    blocks hash like any other prompt's.
    """
    if isinstance(prompt, str):
        return prompt, len(prompt) // CHARS_PER_TOKEN
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
            return text, len(text) // CHARS_PER_TOKEN
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt)), len(prompt)
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return "\n".join(" ".join(map(str, p)) for p in prompt), sum(len(p) for p in prompt)
    raise _bad("'prompt' must be a string, a list of strings, or a list of token ids", "prompt")


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise _bad(
                    f"messages[{index}].content parts must be objects",
                    f"messages[{index}].content",
                    "invalid_type",
                )
            text = part.get("text")
            if isinstance(text, str):
                parts.append(text)
        return "".join(parts)
    raise _bad(
        f"messages[{index}].content must be a string or a list of parts",
        f"messages[{index}].content",
        "invalid_type",
    )


def _chat_text(messages: Any) -> tuple[list[str], int, int]:
    """The conversation as ``role: content`` lines (the order a chat template renders it in),
    the number of user turns, and the characters of system prompts."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    lines = []
    turns = 0
    system_chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a string", f"messages[{i}].role")
        text = _content_text(message.get("content"), i)
        if role == "user":
            turns += 1
        elif role in ("system", "developer"):
            system_chars += len(text)
        lines.append(f"{role}: {text}\n")
    return lines, turns, system_chars


def extract_features(
    body: Any, kind: Kind, headers: Mapping[str, str] | None = None
) -> RequestFeatures:
    """Validate what routing relies on and read the features; the engine validates the rest."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    if kind == "completions":
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
        text, tokens = _prompt_text(body["prompt"])
        turns, system_chars = 1, 0
        max_tokens = _optional_int(body, "max_tokens")
        lines = None
    else:
        if "messages" not in body:
            raise _bad("'messages' is required", "messages", "missing_required_parameter")
        lines, turns, system_chars = _chat_text(body["messages"])
        text = "".join(lines)
        tokens = len(text) // CHARS_PER_TOKEN
        completion = _optional_int(body, "max_completion_tokens")
        max_tokens = completion if completion is not None else _optional_int(body, "max_tokens")
    # The messages' needle sets stand for the text only while all of it is looked at.
    whole = len(text) <= MARKER_SCAN_CHARS
    has_code, has_math, has_reasoning = _markers(
        text[-MARKER_SCAN_CHARS:], lines if whole else None
    )
    tier = None
    if headers is not None:
        tier = headers.get(TIER_HEADER) or None
    return RequestFeatures(
        kind=kind,
        model=model,
        prompt_text=text,
        approx_tokens=tokens,
        max_tokens=max_tokens,
        turns=turns,
        system_chars=system_chars,
        has_code=has_code,
        has_math=has_math,
        has_reasoning=has_reasoning,
        stream=stream,
        tier_header=tier.strip() if tier else None,
        payload=body,
    )
