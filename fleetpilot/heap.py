"""The cyclic garbage collector's settings for a long-running server process.

CPython collects its oldest generation once pending promotions reach a quarter of the objects
already there, and such a full collection scans every tracked object while the event loop
stands still. Under a flood of slow request bodies a router holds ten thousand connections of
about seventy objects each, and each lives the 20 s of the body rule, long enough to be
promoted: full collections then came every few seconds and paused the router for up to 1.3 s
each (bench/router_slow_bodies.py, 10,000 connections), the bulk of its p99 under the flood.

The request path leaves no cyclic garbage (a cut body's cycle is broken where it is made,
``httpserver._release_cut_body``), so the oldest generation holds live objects, not garbage
waiting for a full collection; collecting it that often buys nothing but pauses. So a server:
- freezes what it built before serving (modules, config, compiled policies), which no
  collection need scan again (``gc.freeze``, as CPython's docs advise for long-lived
  processes);
- lets the young generations run as CPython sets them, and considers a full collection only
  after :data:`FULL_COLLECTION_AFTER` collections of the middle one instead of 10: about every
  six minutes under that flood, rarely otherwise. Cycles made elsewhere are still collected,
  later.
"""

from __future__ import annotations

import gc

# Middle-generation collections between full ones (CPython's default: 10).
FULL_COLLECTION_AFTER = 1000


def settle_heap() -> None:
    """Call once a server has built everything it serves with, before it serves."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)
