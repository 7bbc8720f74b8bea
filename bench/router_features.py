"""What reading a request's code / maths / reasoning markers costs the router: the three
case-insensitive regexes searched over the prompt's last ``MARKER_SCAN_CHARS`` characters
(``before``, the patterns as they were, copied here) against the literal prefilter that runs a
cue's regex only where one of its literals occurs (``after``: ``features._markers``, as shipped).
Both give the same flags (tests/routing/test_features_prefilter.py); this checks it again on
every prompt measured.

Prompts, each rendered as the router renders a chat (``role: content`` lines):

- the load generator's four workloads (``fleetpilot.loadgen.workloads``): ``shared-prefix``
  (12 tenants), ``multi-turn``, ``mixed`` (its easy and its hard requests apart: the hard ones
  carry code, maths and reasoning cues) and ``long-context``;
- ``cues at the end``: 32k characters of filler with a code, a maths and a reasoning cue at the
  end (the regexes find each only after trying every position before it);
- ``near misses``: 32k characters dense with the literals, no cue ("steps", "classic",
  "functional", "selected", "1/x", ...): the prefilter's worst case, every cue's literal
  present, so every cue's regex runs (at its literal's first places, then over the whole text);
- ``one literal everywhere``: "steps" 6,500 times, no cue: one cue tried at its literal's
  places until that costs about a search, then searching the rest;
- ``non-ASCII``: 32k characters of accented filler, no cue (the fold's slower path).

Each prompt is timed both ways in turn, one call at a time, ``--repeats`` times (the best kept,
this VM's speed drifts); reported per workload: the p50 and mean per request, in microseconds.

Run: .venv/bin/python bench/router_features.py [--requests 200] [--repeats 5] [--save]
"""

from __future__ import annotations

import argparse
import random
import re
import time
from collections.abc import Callable
from typing import Any

from router_support import machine, percentile, save

from fleetpilot.loadgen.workloads import WORKLOADS, words
from fleetpilot.routing import features
from fleetpilot.routing.features import MARKER_SCAN_CHARS

BEFORE = (
    re.compile(
        r"```|\bdef \w+\s*\(|\bclass \w+\s*[:({]|\bfunction\s*\w*\s*\(|#include\s*<|"
        r"\bimport \w+|\bSELECT\b[^;]{0,200}\bFROM\b|\bpublic static\b|=>|\bfn \w+\s*\(|"
        r"\bconsole\.log\b|"
        r"\b(?:refactor|debug|stack trace|traceback|compile error|segfault|unit tests?)\b",
        re.IGNORECASE,
    ),
    re.compile(
        r"\\(?:frac|int|sum|sqrt|prod|lim|begin\{(?:equation|align))|\$[^$\n]{1,200}\$|"
        r"[∫∑√∏∞≤≥≠±]|"
        r"\b(?:prove|proof|theorem|lemma|integral|derivative|differentiate|equation|eigen\w*|"
        r"matrix|polynomial|probability|combinatori\w*|modulo)\b|\b\d+\s*[\^*/]\s*\d+",
        re.IGNORECASE,
    ),
    re.compile(
        r"\b(?:step[- ]by[- ]step|think (?:carefully|through)|explain why|reason(?:ing)? about|"
        r"analy[sz]e|compare and contrast|trade-?offs?|justify|pros and cons|root cause|"
        r"design (?:a|an|the)|plan (?:a|an|the)|evaluate|critique|derive)\b",
        re.IGNORECASE,
    ),
)
NEAR_MISSES = (
    "steps classic functional selected debugger reasonable trader designs planet evaluated "
    "derived 1/x a*b proven matrices plans: $ \\sigma {} = > design alpha think about\n"
)


def before(text: str) -> tuple[bool, bool, bool]:
    code, math, reasoning = BEFORE
    return (
        code.search(text) is not None,
        math.search(text) is not None,
        reasoning.search(text) is not None,
    )


def after(text: str) -> tuple[bool, bool, bool]:
    return features._markers(text)


def chat(messages: list[dict[str, str]]) -> str:
    return "".join(features._chat_text(messages)[0])[-MARKER_SCAN_CHARS:]


def prompts(n: int, seed: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, factory in WORKLOADS.items():
        workload = factory(seed, tenants=12) if name == "shared-prefix" else factory(seed)
        for _ in range(n):
            spec = workload.next()
            key = f"{name} ({spec.kind})" if name == "mixed" else name
            out.setdefault(key, []).append(chat(spec.messages))
    rng = random.Random(seed)
    tail = "\nuser: Fix the traceback, prove the integral converges, and think step by step.\n"
    filler = [words(rng, MARKER_SCAN_CHARS) for _ in range(4)]
    out["cues at the end (32k)"] = [(f + tail)[-MARKER_SCAN_CHARS:] for f in filler]
    near = (NEAR_MISSES * (MARKER_SCAN_CHARS // len(NEAR_MISSES) + 1))[:MARKER_SCAN_CHARS]
    out["near misses (32k)"] = [near] * 4
    out["one literal everywhere (32k)"] = [("steps " * 6000)[-MARKER_SCAN_CHARS:]] * 4
    accented = str.maketrans("aeiou", "áéíóú")
    out["non-ASCII (32k)"] = [f.translate(accented) for f in filler]
    return out


def timed_us(fn: Callable[[str], object], text: str) -> float:
    start = time.perf_counter_ns()
    fn(text)
    return (time.perf_counter_ns() - start) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200, help="requests a workload")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--save", action="store_true", help="write bench/results/ too")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name, texts in prompts(args.requests, args.seed).items():
        times: dict[str, list[float]] = {"before": [], "after": []}
        flagged = 0
        for text in texts:
            expected = before(text)
            if after(text) != expected:
                raise SystemExit(f"{name}: flags differ: {after(text)} != {expected}")
            flagged += any(expected)
            # Taking turns, one prompt at a time: drift falls on both alike.
            best = {"before": float("inf"), "after": float("inf")}
            for _ in range(args.repeats):
                best["before"] = min(best["before"], timed_us(before, text))
                best["after"] = min(best["after"], timed_us(after, text))
            for way, us in best.items():
                times[way].append(us)
        b50, a50 = percentile(times["before"], 0.5), percentile(times["after"], 0.5)
        rows.append(
            {
                "workload": name,
                "requests": len(texts),
                "chars_p50": int(percentile([len(t) for t in texts], 0.5)),
                "flagged": flagged,
                "before_p50_us": round(b50, 1),
                "after_p50_us": round(a50, 1),
                "before_mean_us": round(sum(times["before"]) / len(texts), 1),
                "after_mean_us": round(sum(times["after"]) / len(texts), 1),
                "speedup_p50": round(b50 / a50, 1),
            }
        )
    header = ("workload", "reqs", "chars", "flagged", "before p50", "after p50", "before mean",
              "after mean", "speedup")  # fmt: skip
    print("{:<30} {:>5} {:>6} {:>7} {:>11} {:>10} {:>12} {:>11} {:>8}".format(*header))
    for r in rows:
        print(
            f"{r['workload']:<30} {r['requests']:>5} {r['chars_p50']:>6} {r['flagged']:>7}"
            f" {r['before_p50_us']:>11.1f} {r['after_p50_us']:>10.1f}"
            f" {r['before_mean_us']:>12.1f} {r['after_mean_us']:>11.1f} {r['speedup_p50']:>7.1f}x"
        )
    print("(microseconds a request; flags identical on every prompt)")
    if args.save:
        path = save(
            "router_features",
            {"benchmark": "router_features", "machine": machine(), "repeats": args.repeats,
             "rows": rows},
        )  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
