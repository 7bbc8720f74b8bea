"""A KV-event replay client for tests: what a router asks an engine's ROUTER socket."""

from __future__ import annotations

import time

import zmq

from fleetpilot.kv_events import END_SEQ, seq_bytes, seq_of

DEADLINE_S = 20.0


def connectable(endpoint: str) -> str:
    """A bound endpoint as a client reaches it (``tcp://0.0.0.0:P`` -> loopback)."""
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int
) -> list[tuple[bytes, int, bytes]]:
    """Ask the ROUTER socket for every batch from ``start_seq``: (topic, seq, payload) each,
    up to (not including) the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(connectable(endpoint))
    dealer.send_multipart([b"", seq_bytes(start_seq)])
    out: list[tuple[bytes, int, bytes]] = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the replay never ended"
            if not dealer.poll(int(min(left, 0.2) * 1000)):
                continue
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, seq_of(seq), payload))
    finally:
        dealer.close()
