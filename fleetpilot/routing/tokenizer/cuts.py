"""Where a text may be cut so that encoding its parts apart gives the ids of encoding it whole:
the rule the prefix cache rests on.

``tokenizers`` splits its input at added tokens before normalizing and pre-tokenizing, and
encodes the pieces between them independently, so for a text ``a + b`` where ``a`` ends with an
added token ``T`` that no other added token can overlap, the ids of ``a + b`` are the ids of
``a`` followed by the ids of ``T + b`` without ``T``'s (encoding ``T + b`` rather than ``b``
keeps ``b`` off offset 0, which a Metaspace ``prepend_scheme=first`` pre-tokenizer treats
differently). For a tokenizer whose model is character by character (BPE without merges, no
normalizer, ByteLevel without a prefix space: the reference engine's byte tokenizer) any point
outside an added token's text is such a cut. A tokenizer offering no safe cut is encoded whole
every time. The property is tested on the shipped byte tokenizer and on trained BPE tokenizers
(ByteLevel and Metaspace) in ``tests/routing/test_tokenizer_cuts.py``. Pure: reads the
tokenizer's spec and added tokens, encodes nothing.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenizers import Tokenizer

# Completions prompts of a character-wise tokenizer have no turns to cut at: cut every this many
# characters, so a shared prefix is found to within this many re-tokenized characters.
_PLAIN_STRIDE_CHARS = 512


def _trie_regex(words: Sequence[str]) -> str:
    """An alternation of ``words`` as a trie, longest match first: Python's ``re`` tries an
    alternation branch by branch at every position, a trie rejects most positions at once."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        end = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "(?:" + body + ")?" if end else body

    return build(trie)


def _overlaps(tokens: Sequence[str]) -> set[str]:
    """The tokens an occurrence of which another token's occurrence (or another of its own) can
    overlap: one contains another, or a proper suffix of one is a proper prefix of another."""
    contents = set(tokens)
    prefixes: dict[str, set[str]] = {}
    for t in contents:
        for k in range(1, len(t)):
            prefixes.setdefault(t[:k], set()).add(t)
    bad: set[str] = set()
    for t in contents:
        for i in range(len(t)):
            for j in range(i + 1, len(t) + 1):
                if (i, j) != (0, len(t)) and t[i:j] in contents:
                    bad |= {t, t[i:j]}
        for k in range(1, len(t)):
            others = prefixes.get(t[-k:], set())
            if others:  # a proper suffix of t starts another token (t itself: a border)
                bad |= {t, *others}
    return bad


@dataclass(frozen=True)
class CutRule:
    """Where a text this tokenizer encodes may be cut so that encoding the parts apart gives the
    ids of encoding it whole (this module's docstring says why).

    ``chars``: anywhere outside an added token's text (the model maps each character alone);
    ``added``: just after an isolated added token, encoding the rest with that token in front;
    ``none``: nowhere."""

    mode: Literal["chars", "added", "none"]
    pattern: re.Pattern[str] | None
    lead_ids: Mapping[str, int] = field(default_factory=dict)

    def scan(self, text: str) -> Cuts:
        if self.mode == "none":
            return NoCuts()
        if self.mode == "added":
            assert self.pattern is not None
            matches = list(self.pattern.finditer(text))
            return AddedCuts([m.end() for m in matches], [m.end() - m.start() for m in matches])
        starts: list[int] = []
        stops: list[int] = []
        for m in self.pattern.finditer(text) if self.pattern is not None else ():
            start, stop = m.start(), m.start() + len(m.group(1))
            if starts and start < stops[-1]:
                stops[-1] = max(stops[-1], stop)
            else:
                starts.append(start)
                stops.append(stop)
        return CharCuts(starts, stops)


@dataclass(frozen=True)
class AddedCuts:
    """The cuts of one text in ``added`` mode: just after each isolated added token."""

    ends: list[int]  # ascending
    widths: list[int]  # the length of the token before each

    def at_or_before(self, pos: int) -> tuple[int, int] | None:
        """The last cut at or before ``pos``, with the characters before it (the added token)
        that the rest is encoded after."""
        i = bisect_right(self.ends, pos) - 1
        return (self.ends[i], self.widths[i]) if i >= 0 else None

    def at_or_after(self, pos: int) -> tuple[int, int] | None:
        i = bisect_left(self.ends, pos)
        return (self.ends[i], self.widths[i]) if i < len(self.ends) else None

    def plain_cuts(self, length: int) -> list[int]:
        """Cuts to look a text without turns (a completions prompt) up at."""
        return list(self.ends)


@dataclass(frozen=True)
class CharCuts:
    """The cuts of one text in ``chars`` mode: anywhere outside the (merged, disjoint) spans of
    added-token text."""

    starts: list[int]  # ascending
    stops: list[int]

    def at_or_before(self, pos: int) -> tuple[int, int] | None:
        i = bisect_right(self.starts, pos - 1) - 1  # the last span starting before pos
        if i >= 0 and pos < self.stops[i]:
            pos = self.starts[i]
        return (pos, 0) if pos > 0 else None

    def at_or_after(self, pos: int) -> tuple[int, int] | None:
        i = bisect_right(self.starts, pos - 1) - 1
        if i >= 0 and pos < self.stops[i]:
            pos = self.stops[i]
        return (pos, 0) if pos > 0 else None

    def plain_cuts(self, length: int) -> list[int]:
        points = range(_PLAIN_STRIDE_CHARS, length, _PLAIN_STRIDE_CHARS)
        return sorted({c[0] for p in points if (c := self.at_or_before(p)) is not None})


@dataclass(frozen=True)
class NoCuts:
    """A tokenizer that offers no safe cut: every text is encoded whole."""

    def at_or_before(self, pos: int) -> tuple[int, int] | None:
        return None

    def at_or_after(self, pos: int) -> tuple[int, int] | None:
        return None

    def plain_cuts(self, length: int) -> list[int]:
        return []


Cuts = AddedCuts | CharCuts | NoCuts


def cut_rule(spec: Mapping[str, Any], tokenizer: Tokenizer) -> CutRule:
    added = list(tokenizer.get_added_tokens_decoder().values())
    contents = [t.content for t in added if t.content]
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    char_model = (
        model.get("type") == "BPE"
        and not model.get("merges")
        and not model.get("ignore_merges")
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
        and not model.get("fuse_unk")
    )
    char_pre = pre is None or (pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space"))
    plain_added = all(not (t.lstrip or t.rstrip or t.single_word) for t in added)
    if char_model and spec.get("normalizer") is None and char_pre and plain_added:
        if not contents:
            return CutRule("chars", None)
        longest_first = sorted(set(contents), key=len, reverse=True)
        return CutRule("chars", re.compile("(?=(" + _trie_regex(longest_first) + "))"))
    overlapping = _overlaps(contents)
    normalizer = spec.get("normalizer") is not None
    safe = {
        t.content
        for t in added
        if t.content
        and t.content not in overlapping
        and not t.single_word
        and not (normalizer and t.normalized)
        and not (t.special and tokenizer.encode_special_tokens)
    }
    if not safe:
        return CutRule("none", None)
    lead_ids = {}
    for content in safe:
        token_id = tokenizer.token_to_id(content)
        if token_id is not None:
            lead_ids[content] = token_id
    pattern = re.compile(_trie_regex(sorted(lead_ids, key=len, reverse=True)))
    return CutRule("added", pattern, lead_ids)


def span_cuts(scan: Cuts, spans: list[tuple[int, int]]) -> list[int]:
    """Where to look a chat's prefixes up: the last cut before each message's text and the
    first after it (where a remembered reply's prefix ends)."""
    cuts: set[int] = set()
    for start, end in spans:
        for cut in (scan.at_or_before(start), scan.at_or_after(end)):
            if cut is not None:
                cuts.add(cut[0])
    return sorted(cuts)
