"""Which LoRA adapters are loaded and which are active: vLLM's two LRU adapter caches.

Purely computational: the loader it is given (``lora.read_adapter`` in the engine) does the
file I/O, and the caller says which adapters running sequences use. Two levels, as vLLM's
``LRUCacheWorkerLoRAManager``:

* loaded (vLLM's CPU cache): the weights of at most ``max_cpu_loras`` adapters, least recently
  used evicted first; an adapter asked for again after its eviction is read again through the
  loader. Every read is counted in ``stats.loads``.
* active (vLLM's GPU slots): at most ``max_loras`` adapters a forward pass may use. A batch's
  adapters are activated before it runs, taking the least recently used idle slot; every
  activation is counted in ``stats.activations``. On this CPU engine activating copies nothing
  (the forward pass reads the loaded weights); on a GPU it is the host-to-device copy, so the
  count is the swap cost a benchmark compares.

Neither level evicts an adapter a running sequence uses. The scheduler keeps those to at most
``max_loras`` (vLLM's rule), and ``max_cpu_loras >= max_loras``, so both levels always have
room for a batch's adapters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from fleetpilot.engine.reference.lora import LoRAConfig, LoRARequest
from fleetpilot.engine.reference.model import LoRAWeights

Loader = Callable[[LoRARequest], LoRAWeights]


@dataclass
class LoRAStats:
    """Cumulative counts of adapter traffic."""

    loads: int = 0  # adapters read through the loader: first loads and reloads after eviction
    activations: int = 0  # adapters put into an active slot (a host-to-device copy on a GPU)
    cpu_evictions: int = 0
    slot_evictions: int = 0


class LoRAManager:
    """The loaded and active adapters, by ``lora_int_id``. See the module docstring."""

    def __init__(self, config: LoRAConfig, loader: Loader) -> None:
        self.config = config
        self.loader = loader
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU first
        self.active: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.stats = LoRAStats()

    def add(
        self,
        request: LoRARequest,
        weights: LoRAWeights | None = None,
        *,
        in_use: Collection[int] = (),
    ) -> LoRAWeights:
        """Load an adapter (vLLM's ``add_lora``): read it through the loader unless ``weights``
        are given, and keep it loaded if an idle adapter can make room. The same id again
        replaces the weights (a load in place): its active slot, holding the old ones, is freed.
        """
        if weights is None:
            weights = self.loader(request)
            self.stats.loads += 1
        key = request.lora_int_id
        self.loaded.pop(key, None)
        self.active.pop(key, None)
        if self._make_room(set(in_use)):
            self.loaded[key] = weights
        return weights

    def remove(self, lora_int_id: int, *, in_use: Collection[int] = ()) -> bool:
        """Forget an adapter's weights unless a running sequence uses it; whether it was dropped."""
        if lora_int_id in in_use or lora_int_id not in self.loaded:
            return False
        del self.loaded[lora_int_id]
        self.active.pop(lora_int_id, None)
        return True

    def activate(
        self, requests: Iterable[LoRARequest], *, in_use: Collection[int] = ()
    ) -> dict[int, LoRAWeights]:
        """Make a batch's adapters loaded and active; their weights by id.

        ``in_use``: adapters of running sequences, besides the batch's, that must stay. Raises
        what the loader raises for an adapter it cannot read (``LoRAError``).
        """
        batch = {r.lora_int_id: r for r in requests}
        keep = set(in_use) | batch.keys()
        out: dict[int, LoRAWeights] = {}
        for key, request in batch.items():
            weights = self.loaded.get(key)
            if weights is None:
                weights = self.loader(request)
                self.stats.loads += 1
                if not self._make_room(keep):
                    raise RuntimeError(_NO_ROOM.format(n=len(keep), what="loaded"))
                self.loaded[key] = weights
            else:
                self.loaded.move_to_end(key)
            if key not in self.active:
                self._free_slot(keep)
                self.active[key] = None
                self.stats.activations += 1
            else:
                self.active.move_to_end(key)
            out[key] = weights
        return out

    def _make_room(self, keep: set[int]) -> bool:
        """Evict idle adapters until one more fits; False if only kept ones are loaded."""
        while len(self.loaded) >= self.config.cpu_capacity:
            victim = next((k for k in self.loaded if k not in keep), None)
            if victim is None:
                return False
            del self.loaded[victim]
            self.active.pop(victim, None)
            self.stats.cpu_evictions += 1
        return True

    def _free_slot(self, keep: set[int]) -> None:
        while len(self.active) >= self.config.max_loras:
            victim = next((k for k in self.active if k not in keep), None)
            if victim is None:
                raise RuntimeError(_NO_ROOM.format(n=len(keep), what="active"))
            del self.active[victim]
            self.stats.slot_evictions += 1


# The scheduler's max_loras rule makes this unreachable; a bug if it shows.
_NO_ROOM = "{n} adapters must stay {what}: more than max_loras are running"
