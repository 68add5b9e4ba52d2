"""Which adapters this engine serves, and which of them hold a slot of the graphs.

An adapter is registered by name (`--lora-modules`, the load route, `LLM(lora_modules=...)`) and
read from its directory when registered, so a bad one is refused then. A request naming it takes
a slot when it is admitted: the slot that already holds it, else a free one, else the least
recently used idle one (no running request on it), written in place (worker/adapters.py). With
every slot busy the request waits, as a request waits for KV blocks (vLLM's max_loras). Read
adapters stay in memory up to `max_cpu_loras` (least recently used first out; one evicted is read
again from its directory when next needed). Each registration gets a new key, which the prefix
cache hashes blocks with, so blocks computed with one adapter are never another's, nor those of
a later adapter registered under the same name.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neffkit.errors import AdapterError, RequestError
from neffkit.runtime.lora.peft_adapter import Adapter, read_adapter
from neffkit.runtime.worker.adapters import AdapterSlots
from neffkit.runtime.worker.batch import SequenceState

if TYPE_CHECKING:
    from neffkit.runtime.worker.loader import LoadedBundle

_KEYS = itertools.count(1)


@dataclass
class Registered:
    name: str
    path: Path
    key: str  # unique per registration: the prefix cache's extra key


@dataclass
class Slot:
    key: str | None = None  # the registration it holds
    users: int = 0  # admitted requests on it
    last_used: int = 0


class AdapterManager:
    """Not thread-safe: the engine core's one caller drives it, as it drives the scheduler."""

    def __init__(self, slots: AdapterSlots, max_cpu_loras: int | None = None) -> None:
        self.slots_io = slots
        self.max_loras = slots.lora.max_loras
        self.max_cpu_loras = max(max_cpu_loras or self.max_loras, self.max_loras)
        self.registered: dict[str, Registered] = {}
        self._cache: OrderedDict[str, Adapter] = OrderedDict()  # key → its tensors
        # key → (name, directory) of every registration, unloaded ones too: a queued request
        # keeps the adapter it was queued with
        self._sources: dict[str, tuple[str, Path]] = {}
        self.slots = [Slot() for _ in range(self.max_loras)]  # slot s at index s - 1
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ registration
    def register(self, name: str, path: str | Path) -> Registered:
        """Read and check the adapter, then serve it as `name` (AdapterError: it cannot be)."""
        if name in self.registered:
            raise AdapterError(f"adapter {name!r} is already loaded", hint="unload it first")
        adapter = read_adapter(name, path, self.slots_io.lora)
        entry = Registered(name, Path(path), f"{name}#{next(_KEYS)}")
        self.registered[name] = entry
        self._sources[entry.key] = (name, entry.path)
        self._remember(entry.key, adapter)
        return entry

    def unregister(self, name: str) -> None:
        """Stop serving `name`: new requests for it are refused; running ones finish on their
        slot, which is freed when the last of them ends."""
        entry = self.registered.pop(name, None)
        if entry is None:
            raise RequestError(f"adapter {name!r} is not loaded", param="lora_name")

    def key(self, name: str) -> str:
        """The key a request for `name` is queued under (RequestError: not served here)."""
        entry = self.registered.get(name)
        if entry is None:
            raise RequestError(f"adapter {name!r} is not loaded", param="model")
        return entry.key

    # ------------------------------------------------------------------ slots
    def acquire(self, seq: SequenceState) -> bool:
        """Give an admitted request its adapter's slot (False: every slot is busy)."""
        key = seq.adapter_key
        assert key is not None
        slot = next((s for s in self.slots if s.key == key), None)
        if slot is None:
            idle = [s for s in self.slots if s.users == 0]
            if not idle:
                return False
            slot = min(idle, key=lambda s: (s.key is not None, s.last_used))
            self.slots_io.write(self.slots.index(slot) + 1, self._adapter(seq))
            slot.key = key
        slot.users += 1
        slot.last_used = next(self._clock)
        seq.lora_slot = self.slots.index(slot) + 1
        return True

    def release(self, seq: SequenceState) -> None:
        if seq.lora_slot:
            self.slots[seq.lora_slot - 1].users -= 1
            seq.lora_slot = 0

    def stats(
        self, admitted: list[SequenceState], waiting: Iterable[SequenceState]
    ) -> tuple[list[str], list[str], int]:
        """vLLM's lora_requests_info: the adapters of the admitted and of the waiting requests
        (by name, unloaded ones too while their requests run), and max_loras."""
        running = sorted({s.adapter for s in admitted if s.adapter})
        return running, sorted({s.adapter for s in waiting if s.adapter}), self.max_loras

    # ------------------------------------------------------------------ memory
    def _adapter(self, seq: SequenceState) -> Adapter:
        """The request's adapter's tensors: in memory, else read again (AdapterError: its
        directory changed since it was registered)."""
        key = seq.adapter_key or ""
        adapter = self._cache.get(key)
        if adapter is not None:
            self._cache.move_to_end(key)
            return adapter
        name, path = self._sources[key]
        adapter = read_adapter(name, path, self.slots_io.lora)
        self._remember(key, adapter)
        return adapter

    def _remember(self, key: str, adapter: Adapter) -> None:
        self._cache[key] = adapter
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)


def adapter_manager(
    loaded: LoadedBundle, modules: Mapping[str, str | Path], max_cpu_loras: int | None = None
) -> AdapterManager | None:
    """The adapters a bundle with slots serves, `modules` registered (None: it has no slots)."""
    if loaded.adapters is None:
        if modules:
            raise AdapterError(
                f"{loaded.bundle.root}: built without adapter slots; cannot serve "
                f"{', '.join(modules)}",
                hint="add a lora: section to the manifest and rebuild",
            )
        return None
    manager = AdapterManager(loaded.adapters, max_cpu_loras)
    for name, path in modules.items():
        manager.register(name, path)
    return manager


# a reply to the server: (call id, why it was refused (None: done), whether no adapter of that
# name is loaded)
Reply = tuple[int, str | None, bool]


class AdapterCalls:
    """The server's loads and unloads, for the engine core's loop, each answered with its id.
    A load's adapter is read, checked and registered between two steps, in the loop: ~20 ms for
    SmolLM2's rank-16 adapters, less than a step (bench/serve.py --adapters). On a thread it
    took 1.2 s instead of 0.07 and made the steps meanwhile up to 5x slower (the graph call
    holds the GIL, and the reader's ops compete for the step's cores)."""

    def __init__(self, manager: AdapterManager | None) -> None:
        self.manager = manager

    def handle(self, msg: tuple) -> Reply:
        """`("load", call_id, name, path)` or `("unload", call_id, name)` from the server."""
        return self.load(*msg[1:4]) if msg[0] == "load" else self.unload(*msg[1:3])

    def load(self, cid: int, name: str, path: str) -> Reply:
        if self.manager is None:
            return cid, "this bundle was built without adapter slots (lora:)", False
        try:
            self.manager.register(name, path)
        except AdapterError as exc:
            return cid, _said(exc), False
        except Exception as exc:  # noqa: BLE001 - an unreadable file: the caller's to fix
            return cid, f"adapter {name!r} ({path}): {exc}", False
        return cid, None, False

    def unload(self, cid: int, name: str) -> Reply:
        if self.manager is None or name not in self.manager.registered:
            return cid, f"adapter {name!r} is not loaded", True
        self.manager.unregister(name)  # its running requests finish on their slot
        return cid, None, False


def _said(exc: AdapterError) -> str:
    """The refusal as a client reads it: the message, and the raise site's hint if it has one."""
    return f"{exc.message} ({exc.own_hint})" if exc.own_hint else exc.message
