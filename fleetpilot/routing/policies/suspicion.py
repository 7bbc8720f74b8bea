"""Suspicion before ejection: which replicas are passed over for new requests before they are
ejected. Purely computational: the proxy records the facts (``FirstByteWaits``: when each
request sent to a replica began waiting for its first byte; ``ReplicaState.silent_since``:
since when a scrape or /health probe of it has failed with no answer from it since), and
``is_suspect`` judges them.

Ejection needs ``ejection.failures`` failures in a row, and a frozen replica (SIGSTOP, a wedged
process, a node gone without a RST) fails only by timing out: three missed scrapes, or a request
that waited its whole first-byte budget - seconds in which every request sent there waits too.
A replica is suspect as soon as two facts agree: a request has waited a fraction of the
first-byte budget for its first byte there (it is not answering requests), and its last scrape
or probe got no answer (it is not answering anything, and /metrics and /health are served by
the engine's API server, never queued behind generation). A slow but live replica answers its
scrapes; a quiet one has no request waiting. Suspicion is no verdict: the first answer from the
replica (a scrape, a probe, a first byte) clears it.
"""

from __future__ import annotations

import itertools


class FirstByteWaits:
    """The requests sent to one replica that have had no first byte yet, each with when it
    began waiting; the oldest is the first (a dict keeps insertion order, and waits begin in
    time order). A wait given up on (its budget ran out, or its replica turned suspect) stays
    evidence until the replica is heard from (``heard_from``): it never answered, and without
    it suspicion would end the moment its requests moved elsewhere, and draw new ones back."""

    __slots__ = ("_given_up", "_since", "_tokens")

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self._tokens = itertools.count()
        self._given_up: float | None = None

    def begin(self, now: float) -> int:
        """A request starts waiting at ``now``; the token ``end`` takes."""
        token = next(self._tokens)
        self._since[token] = now
        return token

    def end(self, token: int, *, given_up: bool = False) -> None:
        """The request got its first byte, failed, or left; ``given_up``: the router stopped
        waiting for a replica that said nothing."""
        since = self._since.pop(token, None)
        if given_up and since is not None:
            self._given_up = since if self._given_up is None else min(self._given_up, since)

    def heard_from(self) -> None:
        """The replica answered something: the waits given up on are no evidence any more."""
        self._given_up = None

    def oldest(self) -> float | None:
        """When the longest-waiting request (or one given up on) began waiting; None when
        none waits."""
        waiting = next(iter(self._since.values()), None)
        if self._given_up is None:
            return waiting
        return self._given_up if waiting is None else min(waiting, self._given_up)

    def __len__(self) -> int:
        return len(self._since)


def is_suspect(
    now: float,
    oldest_wait_since: float | None,
    silent_since: float | None,
    suspect_after_s: float,
) -> bool:
    """Whether a replica is to be passed over for new requests: a request has waited at least
    ``suspect_after_s`` for its first byte there (``oldest_wait_since``: when the oldest still
    waiting began), and its last scrape or probe failed with nothing heard from it since
    (``silent_since`` not None)."""
    return (
        silent_since is not None
        and oldest_wait_since is not None
        and now - oldest_wait_since >= suspect_after_s
    )
