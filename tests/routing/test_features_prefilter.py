"""The code / maths / reasoning markers, found through literal prefilters, are exactly what the
three original case-insensitive regexes find: on the load generator's workloads, on each cue's
examples and near misses, in any case, with Unicode's case-insensitive look-alikes, and on
hypothesis-drawn text rich in the cues' characters."""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetpilot.loadgen.workloads import WORKLOADS
from fleetpilot.routing import features
from fleetpilot.routing.features import MARKER_SCAN_CHARS, extract_features

# The oracle: the markers as they were, one regex each (fleetpilot/routing/features.py before the
# prefilter), verbatim.
ORACLE_CODE = re.compile(
    r"```|\bdef \w+\s*\(|\bclass \w+\s*[:({]|\bfunction\s*\w*\s*\(|#include\s*<|\bimport \w+|"
    r"\bSELECT\b[^;]{0,200}\bFROM\b|\bpublic static\b|=>|\bfn \w+\s*\(|\bconsole\.log\b|"
    r"\b(?:refactor|debug|stack trace|traceback|compile error|segfault|unit tests?)\b",
    re.IGNORECASE,
)
ORACLE_MATH = re.compile(
    r"\\(?:frac|int|sum|sqrt|prod|lim|begin\{(?:equation|align))|\$[^$\n]{1,200}\$|[∫∑√∏∞≤≥≠±]|"
    r"\b(?:prove|proof|theorem|lemma|integral|derivative|differentiate|equation|eigen\w*|"
    r"matrix|polynomial|probability|combinatori\w*|modulo)\b|\b\d+\s*[\^*/]\s*\d+",
    re.IGNORECASE,
)
ORACLE_REASONING = re.compile(
    r"\b(?:step[- ]by[- ]step|think (?:carefully|through)|explain why|reason(?:ing)? about|"
    r"analy[sz]e|compare and contrast|trade-?offs?|justify|pros and cons|root cause|"
    r"design (?:a|an|the)|plan (?:a|an|the)|evaluate|critique|derive)\b",
    re.IGNORECASE,
)

# Capital I with dot above, dotless i, long s, Kelvin sign.
DOTTED_I, DOTLESS_I, LONG_S, KELVIN = "\u0130", "\u0131", "\u017f", "\u212a"


def wide(text: str) -> str:
    """``text`` in full-width forms (which re.IGNORECASE does not equate with ASCII)."""
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


def oracle(text: str) -> tuple[bool, bool, bool]:
    recent = text[-MARKER_SCAN_CHARS:]
    return (
        ORACLE_CODE.search(recent) is not None,
        ORACLE_MATH.search(recent) is not None,
        ORACLE_REASONING.search(recent) is not None,
    )


def ours(text: str) -> tuple[bool, bool, bool]:
    f = extract_features({"prompt": text}, "completions")
    return f.has_code, f.has_math, f.has_reasoning


def assert_same(text: str) -> tuple[bool, bool, bool]:
    expected = oracle(text)
    assert ours(text) == expected, text
    return expected


# Each alternative of the three regexes (0 code, 1 maths, 2 reasoning) and text it matches.
POSITIVES: list[tuple[int, str]] = [
    (0, "```python\nx\n```"), (0, "def fib(n): return n"), (0, "def x ()"),
    (0, "class Foo:"), (0, "class Foo (Base):"), (0, "class A{"), (0, "function (x)"),
    (0, "function foo(a)"), (0, "function\n("), (0, "#include <stdio.h>"), (0, "#include<x>"),
    (0, "import os"), (0, "import numpy as np"), (0, "SELECT a, b FROM t"),
    (0, "select *\nfrom users where x"), (0, "select\n*\nfrom t"), (0, "SELECT(a)FROM t"),
    (0, "public static void main"), (0, "x => x + 1"),
    (0, "fn main() {}"), (0, "fn add (a: u8)"), (0, "console.log(1)"), (0, "please refactor it"),
    (0, "debug this"), (0, "a stack trace:"), (0, "Traceback (most recent call last):"),
    (0, "a compile error"), (0, "a segfault."), (0, "segfault!"), (0, "unit test"),
    (0, "unit tests."), (1, r"\frac{1}{2}"), (1, r"\int_0^1"), (1, r"\sum_i"), (1, r"\sqrt{2}"),
    (1, r"\prod x"), (1, r"\lim_{x}"), (1, r"\begin{equation}"), (1, r"\begin{align*}"),
    (1, "$x^2 + 1$"), (1, "cost $5 and $6"), (1, "∫ f"), (1, "∑"), (1, "√2"), (1, "∏"), (1, "∞"),
    (1, "a ≤ b"), (1, "a ≥ b"), (1, "a ≠ b"), (1, "±1"), (1, "prove it"), (1, "a proof"),
    (1, "the theorem"), (1, "lemma 3"), (1, "an integral"), (1, "the derivative"),
    (1, "differentiate f"), (1, "this equation"), (1, "eigenvalues"), (1, "eigen"),
    (1, "a matrix"), (1, "polynomial"), (1, "probability"), (1, "combinatorics"),
    (1, "combinatorial"), (1, "7 modulo 3"), (1, "2^10"), (1, "3 * 4"), (1, "1/2"),
    (1, "12 /\n 5"), (1, "x = (2*3)"), (2, "step by step"), (2, "step-by-step"),
    (2, "step by-step"), (2, "think carefully"), (2, "think through it"), (2, "explain why"),
    (2, "reason about"), (2, "reasoning about"), (2, "analyze"), (2, "analyse"),
    (2, "compare and contrast"), (2, "trade-off"), (2, "tradeoffs"), (2, "trade-offs"),
    (2, "tradeoff"), (2, "justify"), (2, "pros and cons"), (2, "root cause"), (2, "design a"),
    (2, "design an API"), (2, "design the"), (2, "plan a trip"), (2, "plan an"),
    (2, "plan the"), (2, "evaluate"), (2, "critique"), (2, "derive it"),
]  # fmt: skip

NEAR_MISSES = [
    "``", "` ``", "undef x(", "def(x)", "default f(", "define x", "classic car", "class  Foo:",
    "class Foo", "subclass Foo:", "functional", "dysfunction", "#includes", "#include \"x.h\"",
    "# include <x>", "important", "reimport x", "import  x", "selected items from",
    "SELECT a; FROM",
    "select" + "x" * 210 + " from", "public  static", "publicstatic", "= >", "=<", "fn(x)",
    "fn  x(", "fnx(", "console .log", "console.logs", "consolelog", "refactoring", "debugger",
    "debugging", "stack  trace", "stacktrace", "tracebacks", "compile errors", "segfaulted",
    "unit testing", "units test", r"\fra", r"\ frac", "frac", r"\begin{eq}", r"\begin {equation}",
    "$", "$$", "$\n$", "$" + "x" * 201 + "$", "proven", "proofs", "theorems", "lemmas",
    "integrals", "derivatives", "equations", "noneigen", "matrices", "polynomials", "modular",
    "x2^3", "a1/2", "2 ^ x", "^3", "3^", "_2*3", "step by step_", "stepbystep", "steps by steps",
    "step  by step", "step--by-step", "think carefully_", "think  through", "thinks through",
    "explain  why", "reasonable about", "reasoned about", "analyzes", "analysed", "analyxe",
    "compare & contrast", "trade--off", "trade offs", "tradeoffsx", "justifying", "pro and cons",
    "root causes", "design alpha", "design x", "designs a", "plan another", "planet the",
    "evaluated", "critiques", "derived", "deriver",
]  # fmt: skip

# Unicode equivalences of re.IGNORECASE, and look-alikes it does not equate.
UNICODE = [
    f"{LONG_S}tep by {LONG_S}tep", f"ANALY{LONG_S}E", f"trade{LONG_S}", "tradeoff\u017f",
    f"tracebac{KELVIN}", f"STAC{KELVIN} TRACE", f"{DOTTED_I}MPORT os", f"{DOTLESS_I}mport os",
    f"{DOTTED_I}ntegral", f"d{DOTLESS_I}fferent{DOTLESS_I}ate", f"D{DOTTED_I}FFERENT{DOTTED_I}ATE",
    f"\\{DOTTED_I}NT", f"\\{DOTLESS_I}nt", "\\SUM", f"\\begin{{equat{DOTTED_I}on}}",
    f"{DOTTED_I}{DOTTED_I}{DOTTED_I} def f(", f"{DOTTED_I}" * 40 + " step by step",
    f"{DOTTED_I}" * 40 + " steps", f"just{DOTTED_I}fy", f"crit{DOTLESS_I}que", f"{LONG_S}egfault",
    f"con{LONG_S}ole.log", f"publ{DOTTED_I}c {LONG_S}tat{DOTLESS_I}c", "ΣSTEP BY STEPΣ",
    "ΑΣ step by step Σ", "ὈΔΥΣΣΕΎΣ proof", "Σ derive ς", "ﬅep by ﬅep", "ﬆep by step",
    wide("def f("), wide("DEF") + " f(", wide("step by step"), "def\u00a0f(", "step\u00a0by step",
    "i\u0307mport os", "I\u0307MPORT os", "STRASSE proof", "stra\u00dfe", "ß derive",
    "\u0660/\u0661", "x \u0663*\u0664", "\u00b2*3", "é1/2", "é debug", "debugé", "debug\u0301",
    "µ proof", "\u1e9b step", "Ǆ ǅ ǆ evaluate", "ΐ ΰ plan the",
]  # fmt: skip


def variants(text: str) -> list[str]:
    return [
        text,
        text.upper(),
        text.title(),
        text.swapcase(),
        "".join(c.upper() if i % 2 else c for i, c in enumerate(text)),
        text.replace("i", DOTLESS_I).replace("s", LONG_S).replace("k", KELVIN),
        text.upper().replace("I", DOTTED_I).replace("K", KELVIN),
    ]


@pytest.mark.parametrize(("feature", "text"), POSITIVES)
def test_each_alternative_is_found_in_any_case(feature: int, text: str) -> None:
    """Each alternative of the three regexes, in several cases and with Unicode's case
    look-alikes: the same flags as the original regexes, which find the example itself."""
    assert oracle(text)[feature], text
    for variant in variants(text):
        assert_same(variant)
        assert_same(f"say: {variant}, please")
        assert_same(f"x{variant}x")


@pytest.mark.parametrize("text", NEAR_MISSES)
def test_near_misses_are_what_the_regexes_say(text: str) -> None:
    """Near misses, in several cases: the original regexes' flags (mostly none)."""
    for variant in variants(text):
        assert_same(variant)
        assert_same(f"({variant})")


@pytest.mark.parametrize("text", UNICODE)
def test_unicode_case_equivalences(text: str) -> None:
    """Long s, the Kelvin sign, dotted and dotless i, Greek sigmas, ligatures, full-width
    letters, other scripts' digits: the same flags as the original regexes."""
    for variant in variants(text):
        assert_same(variant)
        assert_same(f"{variant} {variant.lower()}")


def test_unicode_look_alikes_the_regexes_equate_are_found() -> None:
    """The equivalences str.lower() and str.casefold() miss are found (the regexes find them)."""
    for text in (f"{DOTLESS_I}mport os", f"{DOTTED_I}MPORT os", f"{LONG_S}tep by {LONG_S}tep"):
        assert oracle(text) != (False, False, False)
        assert ours(text) == oracle(text)


def test_many_near_misses_before_a_match() -> None:
    """A needle at more places than are tried one by one: a search of the rest decides."""
    for n in (1, 7, 8, 9, 50, 200, 6000):
        assert_same("steps " * n)
        assert ours("steps " * n + "step by step") == (False, False, True)
        assert ours(f"{DOTTED_I}steps " * n + "step by step")[2]
        assert ours("classic " * n + "class A:") == (True, False, False)
        assert not any(ours("classic " * n))
    # The match at each count of places before it: at the last place tried one by one, at the
    # first one searched from, and past it.
    for n in range(80):
        assert ours("steps " * n + "step by step") == (False, False, True)
        assert ours(f"{DOTTED_I}steps " * n + "Step-By-Step.")[2]


def test_only_the_most_recent_text_is_looked_at() -> None:
    """Markers beyond the scanned window are not seen, as before; at its edge, as before."""
    assert ours("def f(" + "x" * MARKER_SCAN_CHARS) == (False, False, False)
    for cut in range(-4, 8):
        text = "def f(" + " " * (MARKER_SCAN_CHARS - cut)
        assert_same(text)
        assert_same(f"{DOTTED_I}" * 10 + text)


def test_workload_prompts() -> None:
    """The load generator's prompts, every workload, many seeds, as chat requests."""
    seen = set()
    for name, factory in WORKLOADS.items():
        for seed in range(8):
            options = [{}, {"tenants": 12}] if name == "shared-prefix" else [{}]
            for option in options:
                workload = factory(seed, **option)
                for _ in range(20):
                    spec = workload.next()
                    f = extract_features({"messages": spec.messages}, "chat")
                    expected = oracle(f.prompt_text)
                    assert (f.has_code, f.has_math, f.has_reasoning) == expected
                    seen.add(expected)
    # The mixed workload's hard prompts carry cues, the rest none: both sides were compared.
    assert (False, False, False) in seen
    assert len(seen) > 1


NEEDLE_CHARS = sorted(
    {c for cues in features._CUES for cue in cues for n in cue.needles for c in n}
)


def test_fold_maps_what_each_needle_character_matches_to_it() -> None:
    """For every code point: what re.IGNORECASE matches to a needle's character, the fold makes
    that character; and the fold never changes a text's length (needles' indexes are matches')."""
    everything = "".join(map(chr, range(sys.maxunicode + 1)))
    folded = features._fold(everything)
    assert len(folded) == len(everything)
    # One pass for what matches any of them (a class compares lowercase as a literal does), then
    # each of those against each character.
    any_char = re.compile(f"[{re.escape(''.join(NEEDLE_CHARS))}]", re.IGNORECASE)
    matched = set()
    for m in any_char.finditer(everything):
        for char in NEEDLE_CHARS:
            if re.fullmatch(re.escape(char), m.group(), re.IGNORECASE):
                assert folded[m.start()] == char, (hex(m.start()), char)
                matched.add((m.group(), char))
    assert {(DOTTED_I, "i"), (DOTLESS_I, "i"), (LONG_S, "s"), (KELVIN, "k"), ("D", "d")} <= matched
    # Which lower() alone does not do, nor casefold() for the two i's.
    assert all(c.lower() not in ("i", "s") for c in (DOTTED_I, DOTLESS_I, LONG_S))
    assert all(c.casefold() != "i" for c in (DOTTED_I, DOTLESS_I))


def test_cues_split_the_original_alternations() -> None:
    """Every cue is anchored on a needle except the arithmetic one; needles are lowercase."""
    for cues in features._CUES:
        for cue in cues:
            assert cue.needles
            assert all(features._fold(n) == n for n in cue.needles)
            assert cue.anchored or cue.needles == ("^", "*", "/")
    assert tuple(map(len, features._CUES)) == (18, 18, 15)


# Text rich in the needles' characters, their case look-alikes and the regexes' delimiters.
FRAGMENTS = sorted(
    {n for cues in features._CUES for cue in cues for n in cue.needles}
    | {text for _, text in POSITIVES}
    | {"(", ")", "{", "}", ":", ";", "<", ">", "=", "-", "_", " ", "  ", "\n", "\t", "s", "ing"}
    | {"by", "about", "off", "offs", "tests", "from", "carefully", "through", "the", "an", "a"}
    | {"frac", "int", "begin{", "equation", "align", "log", ".", "0", "42", "\u0663", "x", "é"}
)
ALPHABET = (
    "".join(NEEDLE_CHARS).upper()
    + "".join(NEEDLE_CHARS)
    + f"{DOTTED_I}{DOTLESS_I}{LONG_S}{KELVIN}\u0307\u03a3\u03c3\u03c2ßﬅﬆ{wide('Dd')}"
    + "\u00a0\u2028é0129\u0660"
)
CASE_LOOKALIKES = {"i": DOTLESS_I, "I": DOTTED_I, "s": LONG_S, "S": LONG_S, "k": KELVIN}


@st.composite
def fragment(draw: st.DrawFn) -> str:
    positive = st.sampled_from([text for _, text in POSITIVES])
    text = draw(positive | positive | st.sampled_from(FRAGMENTS) | st.text(ALPHABET, max_size=4))
    # Each character as it is, in the other case, or as a case look-alike.
    mask = draw(st.integers(0, 4 ** len(text) - 1)) if text else 0
    out = []
    for c in text:
        mask, how = divmod(mask, 4)
        out.append(c if how == 0 else c.swapcase() if how == 1 else CASE_LOOKALIKES.get(c, c))
    # Glued to the next one, or not.
    return "".join(out) + draw(st.sampled_from(["", "", " ", "\n", "(", ". ", "_", "9"]))


rich_text = st.lists(fragment(), max_size=16).map("".join)


@settings(max_examples=400, deadline=None)
@given(rich_text)
def test_same_flags_as_the_original_regexes(text: str) -> None:
    """Any text: the flags are the original regexes'."""
    assert_same(text)


@settings(max_examples=200, deadline=None)
@given(rich_text)
def test_every_match_of_a_cue_holds_a_needle(text: str) -> None:
    """The prefilter's premise, cue by cue: every match of an anchored cue starts where one of its
    needles occurs in the folded text; every match of the others contains one."""
    folded = features._fold(text)
    for cues in features._CUES:
        for cue in cues:
            for m in cue.regex.finditer(text):
                if cue.anchored:
                    assert any(folded.startswith(n, m.start()) for n in cue.needles), m
                else:
                    assert any(n in features._fold(m.group()) for n in cue.needles), m


def chat_flags(messages: list[dict[str, str]]) -> tuple[bool, bool, bool]:
    f = extract_features({"messages": messages}, "chat")
    return f.has_code, f.has_math, f.has_reasoning


# Long enough that its needle set is kept (features._NeedleSets.MIN_CHARS).
PADDING = "an ordinary sentence of a long system prompt. " * 8

message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.tuples(rich_text, st.booleans()).map(
            lambda drawn: drawn[0] + PADDING if drawn[1] else drawn[0]
        ),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(message, min_size=1, max_size=4))
def test_a_chat_has_the_flags_of_its_whole_text_first_and_again_from_kept_needle_sets(
    messages: list[dict[str, str]],
) -> None:
    """A chat's flags are the original regexes' over its ``role: content`` lines, whether its
    long messages' needle sets are computed now or were kept from an earlier request (the same
    system prompt resent), and whatever the messages around them."""
    expected = oracle(extract_features({"messages": messages}, "chat").prompt_text)
    assert chat_flags(messages) == expected
    assert chat_flags(messages) == expected  # its long messages' needle sets kept now
    # Each message again after another (a kept set beside other text).
    shifted = [{"role": "user", "content": "debug this"}, *messages]
    assert chat_flags(shifted) == oracle(
        extract_features({"messages": shifted}, "chat").prompt_text
    )


def test_a_cue_across_two_messages_is_found_as_in_their_joined_text() -> None:
    """The original regexes read the joined lines: ``SELECT`` in one message and ``FROM`` in
    the next is a code cue there, and stays one with the messages' needle sets kept."""
    messages = [
        {"role": "system", "content": PADDING + "SELECT name"},
        {"role": "user", "content": "FROM users" + PADDING},
    ]
    joined = extract_features({"messages": messages}, "chat").prompt_text
    assert oracle(joined)[0]
    assert chat_flags(messages)[0]
    assert chat_flags(messages)[0]


def test_kept_needle_sets_are_bounded_by_their_characters() -> None:
    sets = features._NeedleSets()
    lines = [f"{i:02d}: " + PADDING * 4 for i in range(50)]
    per_line = len(lines[0])
    sets.MAX_CHARS = per_line * 10
    for line in lines:
        sets.of([line])
    assert len(sets._sets) == 10
    assert list(sets._sets) == lines[-10:]  # least recently used out first
