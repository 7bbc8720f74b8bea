"""What this router just sent where, until the engines' KV events can say it. Purely
computational (the caller passes the clock).

An engine reports a prompt's blocks (``BlockStored``) only once it has computed them: after the
request waited in its queue and ran its prefill, a step later. Until then the KV index says
nothing caches the prompt, so a tenant's second request arriving in that window would be
placed as if the prefix were cold - on another replica, which then computes and caches the
same prefix again. Under load that window is hundreds of milliseconds, long enough for a hot
tenant to be smeared across the fleet (measured: bench/router_kv_events.py, the hit rate fell
from 0.84 to 0.74 when events alone decided). So the keys of each prompt the router sends are
held as "about to be cached" on the chosen replica until its engine reports them stored (from
then on its events speak, evictions included) or a short time passes; a replica's match is the
longer of what its events report and what is still held here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Queueing plus a prefill plus the event's trip, with room: beyond this the engine has either
# reported the blocks or lost them, and the events speak alone.
DEFAULT_TTL_S = 5.0
# A replica takes at most a few hundred requests in a TTL; 2**15 keys is ~250 prompts of 2,000
# tokens (16-token blocks) each, ~4 MB.
DEFAULT_MAX_KEYS = 1 << 15


class RecentSends:
    """Per replica, the KV-index keys of prompts sent there in the last ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if ttl_s <= 0 or max_keys < 1:
            raise ValueError("ttl_s must be positive and max_keys at least 1")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._sent: dict[str, OrderedDict[bytes, float]] = {}
        # key -> the replicas it is held for: which replicas to look at for a prompt
        # (``holders``) without asking every replica of a thousand-replica group.
        self._where: dict[bytes, dict[str, None]] = {}

    def record(self, replica: str, keys: Sequence[bytes], now: float) -> None:
        """The prompt with these keys was sent to ``replica`` at ``now``."""
        if not keys:
            return
        sent = self._sent.setdefault(replica, OrderedDict())
        expiry = now + self.ttl_s
        move = sent.move_to_end
        where = self._where
        for key in reversed(keys):  # the head last: the most recent, trimmed last
            if key in sent:
                move(key)
            else:
                where.setdefault(key, {})[replica] = None
            sent[key] = expiry
        self._trim(replica, sent, now)

    def matched(self, replica: str, keys: Sequence[bytes], now: float) -> int:
        """How many leading ``keys`` were sent to ``replica`` within the TTL."""
        sent = self._sent.get(replica)
        if not sent:
            return 0
        n = 0
        for key in keys:
            expiry = sent.get(key)
            if expiry is None or expiry <= now:
                break
            n += 1
        return n

    def holders(self, keys: Sequence[bytes], now: float, above: int = 0) -> dict[str, int]:
        """The replicas some of ``keys`` were sent to within the TTL, each with the depth of
        the deepest such key (1-based), looking only at depths over ``above``: where to ask
        ``matched`` in a group too large to ask every replica (``matched`` is the exact
        count; a replica sent a later key but since trimmed of an earlier one shows here
        deeper than it matches)."""
        found: dict[str, int] = {}
        where = self._where
        sent = self._sent
        for depth in range(len(keys), above, -1):
            replicas = where.get(keys[depth - 1])
            if not replicas:
                continue
            key = keys[depth - 1]
            for replica in replicas:
                if replica not in found and sent[replica][key] > now:
                    found[replica] = depth
        return found

    def confirm(self, replica: str, keys: Iterable[bytes]) -> None:
        """The replica's engine reported these blocks stored: its events speak for them now."""
        sent = self._sent.get(replica)
        if sent:
            for key in keys:
                if sent.pop(key, None) is not None:
                    self._unwhere(key, replica)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in ``replicas``."""
        keep = set(replicas)
        for replica in [r for r in self._sent if r not in keep]:
            for key in self._sent.pop(replica):
                self._unwhere(key, replica)

    def size(self, replica: str) -> int:
        sent = self._sent.get(replica)
        return len(sent) if sent else 0

    def _trim(self, replica: str, sent: OrderedDict[bytes, float], now: float) -> None:
        # Entries are in refresh order and every refresh adds the same TTL, so the oldest
        # expires first: expired ones are all at the front.
        while sent and (len(sent) > self.max_keys or next(iter(sent.values())) <= now):
            key, _ = sent.popitem(last=False)
            self._unwhere(key, replica)

    def _unwhere(self, key: bytes, replica: str) -> None:
        replicas = self._where.get(key)
        if replicas is not None:
            replicas.pop(replica, None)
            if not replicas:
                del self._where[key]


__all__ = ["DEFAULT_MAX_KEYS", "DEFAULT_TTL_S", "RecentSends"]
