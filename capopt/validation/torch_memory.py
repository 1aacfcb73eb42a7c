"""Live tensor bytes of a PyTorch step, op by op: the torch tier's meter.

`LiveBytes` is a `TorchDispatchMode`: every tensor an aten op returns is registered by its
storage (a view shares its base's storage and costs nothing), and a weak reference to the
storage frees its bytes when the last tensor using it dies, as the caching allocator sees a
block come back. It keeps the running total, its peak, the phase the step was in at the
peak (set by the step: ``forward``, ``loss``, ``backward:blockN``, ``update``...) and the
whole allocation sequence (``events``: ``(+1, id, bytes)`` an allocation, ``(-1, id, bytes)`` a
free, ``(0, id, bytes)`` a storage resized in place to ``bytes``), from which `breakdown`
reads what was live at the peak by category:

``params``       parameters and buffers (registered before the step);
``optimizer``    optimizer state (registered before the step);
``inputs``       the batch;
``grads``        storages that end the backward pass as a parameter's ``.grad``;
``weight_casts`` a parameter cast to another dtype (autocast's weight copies);
``activations``  any other storage created in the forward pass or the loss;
``temporaries``  any other storage created in the backward pass or the update;
``gathered``     storages FSDP2 grows and shrinks in place (``UntypedStorage.resize_``: the
                 unsharded parameters of a sharded module while it runs).

Under `FakeTensorMode` nothing is allocated: the sizes are those the real step would ask the
allocator for (``nbytes`` of each storage, before the allocator's rounding). A DTensor (FSDP2's
sharded parameters, their gradients and optimizer state) is counted by its local shard.
"""

from __future__ import annotations

import sys
import weakref

CATEGORIES = ("params", "optimizer", "inputs", "grads", "weight_casts", "activations",
              "temporaries", "gathered")
FORWARD_PHASES = ("forward", "loss")


def local_shard(t):
    """A DTensor's local shard (its wrapper's storage stands for the global shape and holds
    nothing); any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def _dtensor_type():
    """DTensor, where torch has it (the class is imported by then when any exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def _dispatch_base():
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


class LiveBytes(_dispatch_base()):
    def __init__(self):
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary
        self._ids = WeakIdKeyDictionary()        # storage -> id
        self._born: dict[int, str] = {}          # id -> phase at allocation
        self._kind: dict[int, str] = {}          # id -> category fixed at registration
        self._size: dict[int, int] = {}
        self.origin: dict[int, tuple] = {}        # id -> (op, dtype, shape) when ``explain``
        self.explain = False
        self._next = 0
        self.live = 0
        self.peak = 0
        self.peak_phase = ""
        self.peak_event = 0
        self.phase = "setup"
        self.events: list[tuple[int, int, int]] = []
        self.phase_peaks: dict[str, int] = {}
        self.step_start = 0
        self._param_storages: set[int] = set()
        self._in_dtensor = False
        self.paused = False          # (see `ShapesOnly`)

    # -- registration ---------------------------------------------------------------------
    def _storage_id(self, t) -> int | None:
        import torch
        if not isinstance(t, torch.Tensor):
            return None
        t = local_shard(t)
        if t.is_meta:                 # shapes only (DTensor's sharding propagation): no memory
            return None
        st = t.untyped_storage()
        sid = self._ids.get(st)
        if sid is not None:
            return sid
        nbytes = int(st.nbytes())
        sid = self._next
        self._next += 1
        self._ids[st] = sid
        self._size[sid] = nbytes
        self._born[sid] = self.phase
        weakref.finalize(st, self._free, sid)
        self._alloc(sid, nbytes)
        return sid

    def _alloc(self, sid: int, nbytes: int) -> None:
        self.live += nbytes
        self.events.append((1, sid, nbytes))
        self._note_peak()

    def _note_peak(self) -> None:
        if self.live > self.peak:
            self.peak, self.peak_phase, self.peak_event = self.live, self.phase, len(self.events)
        if self.live > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.live

    def _free(self, sid: int) -> None:
        nbytes = self._size.get(sid, 0)
        self.live -= nbytes
        self.events.append((-1, sid, nbytes))

    def resized(self, storage, nbytes: int) -> None:
        """A storage resized in place (FSDP2 frees and refills unsharded parameters so)."""
        sid = self._ids.get(storage)
        if sid is None:
            sid = self._next
            self._next += 1
            self._ids[storage] = sid
            self._size[sid] = 0
            self._born[sid] = self.phase
            self._kind[sid] = "gathered"
            weakref.finalize(storage, self._free, sid)
        self._kind.setdefault(sid, "gathered")
        old = self._size.get(sid, 0)
        self._size[sid] = int(nbytes)
        self.live += int(nbytes) - old
        self.events.append((0, sid, int(nbytes)))
        self._note_peak()

    def register(self, tensors, kind: str) -> None:
        """Count tensors that exist before the step (parameters, optimizer state, batch)."""
        if kind not in CATEGORIES:
            raise ValueError(f"unknown category {kind!r}")
        for t in tensors:
            sid = self._storage_id(t)
            if sid is not None:
                self._kind.setdefault(sid, kind)
                if kind == "params":
                    self._param_storages.add(sid)

    def mark(self, tensors, kind: str) -> None:
        """Name the category of storages created during the step (``.grad`` at the end of
        the backward pass)."""
        for t in tensors:
            sid = self._storage_id(t)
            if sid is not None:
                self._kind.setdefault(sid, kind)

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def reset_peak(self) -> None:
        """The step starts here: its peak, and ``step_start`` (its first event)."""
        self.step_start = len(self.events)
        self.peak, self.peak_phase, self.peak_event = self.live, self.phase, len(self.events)
        self.phase_peaks = {}

    # -- the dispatch hook ----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch
        from torch.utils._pytree import tree_leaves
        if self.paused:
            return func(*args, **(kwargs or {}))
        dtensor = _dtensor_type()
        if dtensor is not None and dtensor in types:
            # a DTensor op: its handler computes on the local shards (tensor parallelism's
            # loss_parallel cross-entropy, sharding's redistributions), below this mode. The
            # op is dispatched again with the mode on, and the mode steps aside for DTensor
            # ops (NotImplemented: the subclass handles them), so that the handler's own
            # temporaries are counted as a GPU would allocate them, not only its result.
            if self._in_dtensor:
                return NotImplemented
            self._in_dtensor = True
            try:
                with self:
                    out = func(*args, **(kwargs or {}))
            finally:
                self._in_dtensor = False
        else:
            out = func(*args, **(kwargs or {}))
        cast_of_param = False
        if (func is torch.ops.aten._to_copy.default and args
                and isinstance(args[0], torch.Tensor)):
            src = self._ids.get(local_shard(args[0]).untyped_storage())
            # a parameter's cast: of a registered parameter, or of the unsharded one FSDP2
            # gathered into a storage it resizes
            cast_of_param = src in self._param_storages or self._kind.get(src) == "gathered"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = local_shard(t).untyped_storage()
                sid = self._ids.get(st)
                known = sid is not None
                if known and int(st.nbytes()) != self._size.get(sid, 0):
                    self.resized(st, int(st.nbytes()))   # grown in place by an op (out=)
                sid = self._storage_id(t)
                if cast_of_param and not known and sid is not None:
                    self._kind[sid] = "weight_casts"
                if self.explain and not known and sid is not None:
                    self.origin[sid] = (str(func.__name__), str(t.dtype), tuple(t.shape))
        return out

    # -- reading --------------------------------------------------------------------------
    def category(self, sid: int) -> str:
        kind = self._kind.get(sid)
        if kind:
            return kind
        return "activations" if self._born.get(sid) in FORWARD_PHASES else "temporaries"

    def breakdown(self) -> dict[str, int]:
        """Bytes by category live at the peak (they add up to ``peak``)."""
        out = {c: 0 for c in CATEGORIES}
        for sid, nbytes in self.live_at_peak().items():
            out[self.category(sid)] += nbytes
        return out

    def live_at_peak(self) -> dict[int, int]:
        """Storage id -> bytes of what was live at the peak."""
        live: dict[int, int] = {}
        for sign, sid, nbytes in self.events[: self.peak_event]:
            if sign > 0 or (sign == 0 and nbytes):
                live[sid] = nbytes
            else:
                live.pop(sid, None)
        return live

    def sequence(self, start: int = 0) -> list[tuple[int, int, int]]:
        """The allocation sequence from event ``start`` (for an allocator's replay)."""
        return self.events[start:]


class ShapesOnly:
    """While the meter runs, DTensor's sharding propagation traces each new op on fake tensors
    of the global shapes to learn its output's shape (`ShardingPropagator`, "so that it
    avoids materializing memory"); it picks up the step's own fake mode, so the meter would
    see those tensors. They are paused here: a GPU allocates nothing for them."""

    def __init__(self, meter: LiveBytes):
        self.meter = meter

    def __enter__(self):
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:                      # a torch without DTensor
            self.cls = None
            return self
        self.cls = ShardingPropagator
        self.orig = orig = ShardingPropagator._propagate_tensor_meta_non_cached
        meter = self.meter

        def traced(prop, *args, **kwargs):
            was, meter.paused = meter.paused, True
            try:
                return orig(prop, *args, **kwargs)
            finally:
                meter.paused = was
        ShardingPropagator._propagate_tensor_meta_non_cached = traced
        return self

    def __exit__(self, *exc):
        if self.cls is not None:
            self.cls._propagate_tensor_meta_non_cached = self.orig
        return False


__all__ = ["CATEGORIES", "LiveBytes", "ShapesOnly", "local_shard"]
