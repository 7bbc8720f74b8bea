"""A recorded load for ``fleetpilot simulate --trace``: the JSON ``fleetpilot bench --out``
writes, replayed.

A bench run records each request's index (its place in the workload's seeded sequence), when it
was sent and how many tokens came back, and the run's workload, seed and workload options. That
is enough to send the simulated fleet the very requests the real one got, at the very times: the
workload regenerates each request's messages from its seed, so the file need not carry the
prompts. A request the client never sent (``dropped``: its in-flight cap was reached) is left
out; its place in the sequence is kept, so the ones after it are still the same requests. The
answer's length is the tokens the engine produced where the record has them (an engine without
``ignore_eos`` stops early), else what the request asked for. A closed-loop run replays open
loop: its send times are what the clients did.

Pure parsing: every problem is a :class:`TraceError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from fleetpilot.files import FileError, TooLargeError, decode_text, parse_json, read_limited
from fleetpilot.loadgen.workloads import WORKLOADS

# A record is ~600 bytes as the bench writes it (indented JSON), so this is ~1.7 million
# requests (half an hour at 1,000 req/s); decoded, such a file takes a few GB of memory.
MAX_TRACE_BYTES = 1 << 30


class TraceError(ValueError):
    """A trace file that cannot be replayed, naming the file and the field."""


@dataclass(frozen=True, slots=True)
class TracedRequest:
    index: int  # its place in the workload's sequence
    start_s: float  # when it was sent, from the run's start
    output_tokens: int | None  # the tokens it got back; None: unknown (it failed)


@dataclass(frozen=True)
class Trace:
    workload: str
    seed: int
    options: dict[str, Any]  # make_workload's options, as the run used them
    requests: tuple[TracedRequest, ...]  # in index order, sends never earlier than the last
    duration_s: float  # the run's duration, or its last send when the record has none
    dropped: int = 0  # arrivals the client never sent
    source: str = field(default="", compare=False)


def load_trace(path: Path) -> Trace:
    """The trace in ``path``; :class:`TraceError` when it is not a readable bench output."""
    try:
        raw = read_limited(path, MAX_TRACE_BYTES)
    except OSError as e:
        raise TraceError(f"trace {path}: {e.strerror or e}") from None
    except TooLargeError:
        raise TraceError(
            f"trace {path}: over {MAX_TRACE_BYTES >> 30} GiB, more than a trace this simulator "
            "replays (about 1.7 million requests): is it the right file?"
        ) from None
    try:
        # A trace may be a GiB: the decoder's own depth limit, not a second walk.
        doc = parse_json(decode_text(raw, str(path)), str(path), max_depth=None)
    except FileError as e:
        raise TraceError(f"trace {e}") from None
    return parse_trace(doc, str(path))


def parse_trace(doc: Any, source: str = "trace") -> Trace:
    def refuse(where: str, what: str) -> TraceError:
        return TraceError(f"{source}: {where}: {what}")

    if not isinstance(doc, dict):
        raise refuse("the document", "expected the JSON object fleetpilot bench --out writes")
    config = doc.get("config")
    if not isinstance(config, dict):
        raise refuse("config", "missing: not a fleetpilot bench --out file")
    workload = config.get("workload")
    if workload not in WORKLOADS:
        raise refuse("config.workload", f"{workload!r} is not one of {', '.join(WORKLOADS)}")
    seed = config.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise refuse("config.seed", f"expected an integer, got {seed!r}")
    options = config.get("workload_options", {})
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise refuse("config.workload_options", "expected an object of option names")
    records = doc.get("requests")
    if not isinstance(records, list):
        raise refuse("requests", "expected a list of request records")
    requests: list[TracedRequest] = []
    dropped, seen = 0, set[int]()
    for i, record in enumerate(records):
        where = f"requests[{i}]"
        if not isinstance(record, dict):
            raise refuse(where, "expected an object")
        index, start = record.get("index"), record.get("start_s")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise refuse(f"{where}.index", f"expected an integer >= 0, got {index!r}")
        if index in seen:
            raise refuse(f"{where}.index", f"{index} appears twice")
        seen.add(index)
        if not _number(start) or start < 0:
            raise refuse(f"{where}.start_s", f"expected a number >= 0, got {start!r}")
        if record.get("error") == "dropped":
            dropped += 1
            continue
        tokens = record.get("completion_tokens")
        if tokens is not None and (
            not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0
        ):
            raise refuse(f"{where}.completion_tokens", f"expected an integer >= 0, got {tokens!r}")
        # A failed request's count (if any) is what it got before failing, not its length.
        known = tokens if record.get("error") is None and tokens else None
        requests.append(TracedRequest(index, float(start), known))
    if not requests:
        raise refuse("requests", "no request was sent: nothing to replay")
    # The workload's sequence is drawn in index order, so requests are replayed in it; a
    # closed loop's clients may stamp two sends a hair out of that order, so a send is never
    # earlier than the one before it.
    requests.sort(key=lambda r: r.index)
    for i in range(1, len(requests)):
        if requests[i].start_s < requests[i - 1].start_s:
            r = requests[i]
            requests[i] = TracedRequest(r.index, requests[i - 1].start_s, r.output_tokens)
    duration = config.get("duration_s")
    last = requests[-1].start_s
    if duration is None:
        duration = last
    elif not _number(duration) or duration <= 0:
        raise refuse("config.duration_s", f"expected a number > 0, got {duration!r}")
    return Trace(
        workload=workload,
        seed=seed,
        options=dict(options),
        requests=tuple(requests),
        duration_s=max(float(duration), last, 1e-3),
        dropped=dropped,
        source=source,
    )


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
