"""A KV-event replay client for tests: what a router asks an engine's ROUTER socket."""

from __future__ import annotations

import zmq

from fleetpilot.kv_events import END_SEQ, seq_bytes, seq_of
from fleetpilot.testing.polling import eventually

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

    def received() -> list[tuple[bytes, int, bytes]] | None:
        """Keep the next message (waiting up to 0.2 s for it); ``out`` once the end arrived."""
        if not dealer.poll(200):
            return None
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert (topic, payload) == (b"", b"")
            return out
        out.append((topic, seq_of(seq), payload))
        return None

    try:
        # The probe itself waits on the socket: no sleep between rounds.
        return eventually("the replay's end marker", received, DEADLINE_S, interval=0)
    finally:
        dealer.close()
