"""The prefix cache: a text's ids from the longest cached prefix of it that ends at a safe cut
(``cuts``), so that a growing conversation re-tokenizes only its new tail, and the chained
KV-index keys of those ids (``policies.kv_index.chain_keys``) chained on from the cached keys.

The cache maps a prefix of the text that ends at a cut to its ids and chained keys; a request
encodes only what follows the longest cached prefix and chains its keys from the cached last
key. Each chat request leaves two prefixes: up to its final message (a retry or branch finds it;
from scratch it may be a shared system prompt) and the whole prompt (its next turn extends it,
the reply and the new message being new); ``RequestTokenizer.remember_reply``, given the reply
the router saw on its way back, leaves the next turn only its new message. A conversation's
newer entries replace its older ones, so it holds a few entries, not one per turn. Pure: memory
and the ``tokenizers`` pipeline only.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from tokenizers import Tokenizer

from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, ROOT, chain_keys
from fleetpilot.routing.tokenizer.cuts import CutRule, Cuts
from fleetpilot.routing.tokenizer.errors import TokenizerError, bad

# The prefix cache holds, per conversation in flight, the prefix of its latest turn until the
# next turn arrives, plus prefixes many requests share (a system prompt). 2**23 tokens are ~1,000
# conversations of 8k tokens or ~4,000 of 2k; memory is 4 bytes a token of ids plus one ~50-byte
# key per block (~3 bytes a token at 16-token blocks): ~60 MB at the bound. 4,096 entries is the
# ~4,000 short conversations; the extended entry of a conversation replaces its previous one (see
# Entry.derived), so a long conversation holds one entry, not one per turn.
DEFAULT_CACHE_ENTRIES = 4096
DEFAULT_CACHE_TOKENS = 1 << 23
# Block sizes x LoRA names x BOS variants whose keys one entry keeps (normally one).
_MAX_VARIANTS = 4
# Lookup candidates per request: the first few (shared system prompts) and the latest.
_MAX_CANDIDATES = 256
_FIRST_CANDIDATES = 16


Variant = tuple[int, str | None, tuple[int, ...]]  # block size, LoRA name, leading special ids
CacheKey = tuple[int, bytes]  # cut position, blake2b of the text before it


@dataclass
class Entry:
    ids: array[int]  # the prefix text's ids, without post-processor specials
    # Chained keys of the full blocks of (leading specials + ids), per variant.
    keys: dict[Variant, list[bytes]] = field(default_factory=dict)
    # A conversation's own prefix (the whole prompt, a remembered reply, or one that extended
    # another entry), which its next turn's entries replace; an entry encoded from scratch
    # before a request's final message may be a prefix many requests share (a system prompt),
    # and stays.
    derived: bool = False
    # The keys one turn stored (its request's entries and its remembered reply's; one list
    # object): when a later request extends one of them, the turn's derived entries go.
    family: list[CacheKey] = field(default_factory=list)


@dataclass
class CacheStats:
    """Counts since the tokenizer was made (tests and the benchmark read them)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    tokens: int = 0
    encoded_chars: int = 0  # characters handed to the tokenizer
    whole_encodes: int = 0  # texts encoded whole (no safe cut, specials not separable)


class _PrefixCache:
    """An LRU of prefix -> ids and keys, bounded in entries and in total tokens."""

    def __init__(self, max_entries: int, max_tokens: int, stats: CacheStats) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.stats = stats
        self._entries: OrderedDict[CacheKey, Entry] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: CacheKey) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: CacheKey) -> Entry | None:
        return self._entries.get(key)

    def put(self, key: CacheKey, entry: Entry) -> None:
        if len(entry.ids) > self.max_tokens or self.max_entries < 1:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.tokens -= len(old.ids)
        self._entries[key] = entry
        self.stats.tokens += len(entry.ids)
        while len(self._entries) > self.max_entries or self.stats.tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.stats.tokens -= len(evicted.ids)
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)

    def drop(self, key: CacheKey, entry: Entry) -> None:
        """Drop ``entry`` if ``key`` still holds it."""
        if self._entries.get(key) is entry:
            del self._entries[key]
            self.stats.tokens -= len(entry.ids)
            self.stats.entries = len(self._entries)


@dataclass
class Prompt:
    """A request's prompt: ``head + body + tail`` are its ids (head and tail the post-processor's
    specials); ``base`` the cached entry its body starts with, ``stored`` the entries it made."""

    head: tuple[int, ...]
    body: array[int]
    tail: tuple[int, ...]
    truncated: bool = False
    base: Entry | None = None
    stored: list[Entry] = field(default_factory=list)


@dataclass
class Lookup:
    """A text prompt looked up in the prefix cache and not yet encoded: ``text`` from ``start``
    follows the cached prefix ``base``; ``stores`` (cut, conversation-specific) are the prefixes
    to cache once encoded, ``digests`` their keys'."""

    text: str
    scan: Cuts
    stores: list[tuple[int, bool]]
    digests: dict[int, bytes]
    head: tuple[int, ...]
    tail: tuple[int, ...]
    truncated: bool = False
    join: bool = False  # a remembered reply: joins the family of the prefix found
    # A post-processor whose specials depend on the text: one whole encode, nothing cached.
    whole_with_specials: bool = False
    start: int = 0
    base: Entry | None = None

    @property
    def pending_chars(self) -> int:
        return len(self.text) - self.start


def _affixes(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids the post-processor puts before and after a text (BOS, EOS, [CLS]/[SEP]), if they
    are the same for every text (template processors); None if not."""
    found: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    for probe in ("a", "Hello, world. 12"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        n = len(plain)
        at = next((i for i in range(len(full) - n + 1) if full[i : i + n] == plain), None)
        if at is None:
            return None
        pair = (tuple(full[:at]), tuple(full[at + n :]))
        if found is not None and found != pair:
            return None
        found = pair
    return found


class PrefixEncoder:
    """A ``tokenizers`` pipeline behind the prefix cache. ``max_chars`` bounds what one text
    costs: a longer one is encoded up to its last safe cut before it (``truncated``).

    Thread-safe: the cache (and the stats) are behind one lock, held only to look prefixes up,
    store them and read or extend an entry's keys, never across an encode, so a caller on an
    event loop waits at most for another thread's dictionary operations, never for its
    tokenizing. Entries' ids are never changed once stored (readers copy them outside the lock);
    two threads encoding the same new prefix both store it, the later replacing the earlier with
    the same ids. The ``tokenizers`` object is immutable once built and releases the GIL while it
    encodes."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        rule: CutRule,
        *,
        max_chars: int,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.rule = rule
        self.affixes = _affixes(tokenizer)
        self.max_chars = max_chars
        self.stats = CacheStats()
        self.cache = _PrefixCache(cache_entries, cache_tokens, self.stats)

    def look_up(
        self,
        text: str,
        scan: Cuts,
        cuts: list[int],
        stores: list[tuple[int, bool]],
        specials: bool,
        *,
        join: bool = False,
    ) -> Lookup:
        """The longest cached prefix of ``text`` ending at one of ``cuts``, nothing encoded yet:
        :meth:`finish` encodes the rest and caches the prefixes ending at ``stores`` (cut,
        conversation-specific) for later requests, as one turn's family (``join``: the family of
        the prefix found, for a remembered reply)."""
        if specials and self.affixes is None:
            # A post-processor whose specials depend on the text: encode whole, no cache.
            if len(text) > self.max_chars:
                bad(f"the prompt is longer than {self.max_chars} characters")
            return Lookup(text, scan, [], {}, (), (), join=join, whole_with_specials=True)
        head, tail = self.affixes if specials and self.affixes is not None else ((), ())
        truncated = False
        if len(text) > self.max_chars:
            cut = scan.at_or_before(self.max_chars)
            if cut is None:
                bad(f"the prompt is longer than {self.max_chars} characters and has no cut")
            text = text[: cut[0]]
            truncated = True
            cuts = [c for c in cuts if c <= cut[0]]
            stores = [(c, own) for c, own in stores if c <= cut[0]]
        if len(cuts) > _MAX_CANDIDATES:
            cuts = cuts[:_FIRST_CANDIDATES] + cuts[-(_MAX_CANDIDATES - _FIRST_CANDIDATES) :]
        digests = _prefix_digests(text, sorted({*cuts, *(c for c, _ in stores)}))
        found = Lookup(text, scan, stores, digests, head, tail, truncated, join)
        with self.cache.lock:
            for c in reversed(cuts):
                entry = self.cache.get((c, digests[c]))
                if entry is not None:
                    found.start, found.base = c, entry
                    break
            if found.base is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return found

    def finish(self, found: Lookup) -> Prompt:
        """The second half of :meth:`look_up`: encode what follows the prefix found and
        store the new prefixes. Runs on any thread; the lock is taken only to store."""
        text, scan, base, start = found.text, found.scan, found.base, found.start
        if found.whole_with_specials:
            ids = self.encode(text, scan, 0, len(text), specials=True, whole=True)
            return Prompt((), array("I", ids), ())
        body = array("I", base.ids) if base is not None else array("I")
        join = found.join
        family: list[CacheKey] = base.family if join and base is not None else []
        made: list[tuple[CacheKey, Entry]] = []
        try:
            for stop, own in sorted(set(found.stores)):
                if stop <= start:
                    continue
                body += array("I", self.encode(text, scan, start, stop))
                entry = Entry(array("I", body), derived=own or base is not None, family=family)
                made.append(((stop, found.digests[stop]), entry))
                start = stop
            if start < len(text):
                body += array("I", self.encode(text, scan, start, len(text)))
        except _CutMismatchError:  # impossible if the argument in cuts.py holds; stay exact
            body = array("I", self.encode(text, scan, 0, len(text), whole=True))
            return Prompt(found.head, body, found.tail, found.truncated)
        with self.cache.lock:
            if base is not None and made and base.derived and not join:
                # The conversation moved on: the turn it extends is replaced by this one.
                for key in base.family:
                    old = self.cache.peek(key)
                    if old is not None and old.derived and old.family is base.family:
                        self.cache.drop(key, old)
            for key, entry in made:
                family.append(key)
                self.cache.put(key, entry)
        stored = [entry for _, entry in made]
        return Prompt(found.head, body, found.tail, found.truncated, base, stored)

    def encode(
        self,
        text: str,
        scan: Cuts,
        start: int,
        stop: int,
        *,
        specials: bool = False,
        whole: bool = False,
    ) -> list[int]:
        """The ids of ``text[start:stop]`` as part of ``text`` (``start`` a cut): in ``added``
        mode encoded after the added token that ends at ``start``, whose id is dropped
        (``whole``: counted as a whole encode)."""
        lead = 0
        if start > 0:
            cut = scan.at_or_before(start)
            if cut is None or cut[0] != start:
                raise _CutMismatchError
            lead = cut[1]
        segment = text[start - lead : stop]
        with self.cache.lock:  # counters shared with other threads' requests
            self.stats.encoded_chars += len(segment)
            self.stats.whole_encodes += whole
        try:
            ids = self.tokenizer.encode_batch_fast([segment], add_special_tokens=specials)[0].ids
        except Exception as e:
            raise TokenizerError(f"the tokenizer failed: {e}") from e
        if not lead:
            return ids
        if not ids or ids[0] != self.rule.lead_ids.get(text[start - lead : start]):
            raise _CutMismatchError
        return ids[1:]

    def chain(self, prompt: Prompt, variant: Variant, tail: Sequence[int] = ()) -> list[bytes]:
        """The keys of ``head + body + tail`` for ``variant``, chained on from the keys of the
        prefix found; the keys of the prefixes it stored are left on them for later requests."""
        block_size, lora_name, head = variant
        ids = array("I", head)
        ids += prompt.body
        ids += array("I", tail)
        with self.cache.lock:
            known = list(prompt.base.keys.get(variant, ())) if prompt.base is not None else []
        if len(known) >= MAX_MATCH_BLOCKS:
            keys = known[:MAX_MATCH_BLOCKS]
        else:
            rest = chain_keys(
                ids[len(known) * block_size :],
                block_size,
                lora_name,
                parent=known[-1] if known else ROOT,
                max_blocks=MAX_MATCH_BLOCKS - len(known),
            )
            keys = known + rest
        with self.cache.lock:
            for entry in [prompt.base, *prompt.stored]:
                if entry is None or variant in entry.keys:
                    continue
                if len(entry.keys) >= _MAX_VARIANTS:
                    entry.keys.pop(next(iter(entry.keys)))
                entry.keys[variant] = keys[: (len(head) + len(entry.ids)) // block_size]
        return keys


class _CutMismatchError(Exception):
    pass


def _prefix_digests(text: str, points: Sequence[int]) -> dict[int, bytes]:
    """blake2b of ``text[:p]`` for each ascending ``p``, in one pass over the text."""
    digests: dict[int, bytes] = {}
    h = blake2b(digest_size=16)
    prev = 0
    for p in points:
        h.update(text[prev:p].encode("utf-8", "surrogatepass"))
        prev = p
        digests[p] = h.copy().digest()
    return digests
