"""The reducer: a compressor plus an error-feedback memory, averaging gradients in place."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .._validate import check_state_keys
from .base import Compressor, Dense
from .memory import ErrorFeedback, NoMemory
from .noise import NoiseTracker
from .transport import AllReduce, Exchange, parallel
from .wire import check_world_size

#: The keys of a state_dict, and those older ones lack.
_STATE_KEYS = frozenset({"compressor", "memory"})
_OPTIONAL_STATE_KEYS = frozenset({"dense_keys", "non_finite_steps", "noise"})


class Reducer:
    """Averages gradients over workers: the tensors ``compressor`` applies to (PowerSGD and
    top-k: those with >= 2 dimensions) through it with error feedback, the others dense.

    A tensor whose level does not pay for its shape (:meth:`Compressor.pays`: it would
    send at least as much as dense, e.g. a 3 x 64 matrix at PowerSGD rank 8) is averaged
    dense while it keeps that level, and compressed again once its level pays; what its
    memory owes goes with its first dense step. The decision is a pure function of
    ``(shape, level)``, so every rank makes the same, and it is cached.

    ``exchange(keys, grads, world_size)`` is an exchange for a transport (see
    ``transport.py``). **It changes its input**: each gradient is replaced in place by its
    averaged (compressed) estimate; the compression error goes to ``memory``.

    Non-finite gradients: when what the workers exchanged holds an inf or NaN (identically
    on every worker, since it is a collective's result; the averages are computed from it,
    so they hold one too), the result is still written back, so
    that an AMP ``GradScaler`` sees it and skips the optimizer step as it would without
    compression; but the error-feedback memory of the compressed tensors is reset to zero
    (it shares its storage with the step's input, which the step overwrote), the
    warm-start factors are redrawn from the shared seed, a ``RuntimeWarning`` is issued
    and ``non_finite_steps`` counts it. One bad step therefore never poisons later ones.

    Args:
        compressor: a :class:`Compressor` (``Dense()``, ``PowerSGD(rank)``, ``TopK(fraction)``).
        memory: the error-feedback memory; ``ErrorFeedback()`` by default, ``NoMemory()``
            to disable it.
    """

    def __init__(self, compressor: Compressor, memory: ErrorFeedback | NoMemory | None = None):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor, got {type(compressor).__name__}")
        if memory is None:
            memory = ErrorFeedback()
        if not isinstance(memory, ErrorFeedback | NoMemory):
            raise TypeError(f"memory must be ErrorFeedback, NoMemory or None, got "
                            f"{type(memory).__name__}")  # fmt: skip
        self.compressor = compressor
        self.memory = memory
        self._dense = compressor if isinstance(compressor, Dense) else Dense()
        #: Steps whose averaged result held an inf or NaN.
        self.non_finite_steps = 0
        #: Keys sent dense whatever their shape (compression would not pay for them).
        self.dense_keys: set[Hashable] = set()
        # bytes of live memory per storage, or None when it must be counted again
        self._live: dict[int, int] | None = None
        # per key, its place in the order of the parts exchanged so far (the same on
        # every rank), which is the order its memory lies in
        self._slots: dict[Hashable, int] = {}
        self._next_slot = 0
        # per (shape, level): whether the level pays for the shape (Compressor.pays)
        self._paying: dict[tuple[tuple[int, ...], Any], bool] = {}
        #: What the exchanges tell of their averages' error (:class:`NoiseTracker`).
        self.noise = NoiseTracker()

    def compresses(self, grad: torch.Tensor, key: Hashable = None) -> bool:
        """Whether ``grad`` (of ``key``) is the compressor's: it applies to the shape and
        the key is not in :attr:`dense_keys`, so the tensor has a level (which a rule may
        choose). At a level that does not pay for its shape it is still sent dense
        (:meth:`sends_compressed`)."""
        return self.compressor.applies_to(grad.shape) and (
            key is None or key not in self.dense_keys
        )

    def sends_compressed(self, grad: torch.Tensor, key: Hashable = None) -> bool:
        """Whether the next exchange sends ``grad`` (of ``key``) through the compressor:
        :meth:`compresses` it, and its level (``compressor.level(key)``) pays for its
        shape; otherwise it is averaged dense."""
        return self.compresses(grad, key) and self.pays(grad.shape, self.compressor.level(key))

    def pays(self, shape: Sequence[int], level: Any) -> bool:
        """``compressor.pays(shape, level)``, cached per ``(shape, level)``."""
        # torch.Size is a tuple: the step's lookup builds no new one
        entry = (shape if isinstance(shape, tuple) else tuple(shape), level)
        paying = self._paying.get(entry)
        if paying is None:
            paying = self._paying[entry] = self.compressor.pays(entry[0], level)
        return paying

    def set_dense(self, keys: Iterable[Hashable]) -> None:
        """Send ``keys`` dense from the next exchange on (and no others).

        What their error-feedback memory still owes is sent with their next dense
        exchange, so nothing a compressor dropped is lost.
        """
        if isinstance(keys, str | bytes):
            raise TypeError(f"keys must be an iterable of keys, not a single {type(keys).__name__}")
        self.dense_keys = set(keys)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Move ``old``'s compressor state, memory and dense flag to the key ``new``."""
        self.compressor.rename(old, new)
        self.memory.rename(old, new)
        self.noise.rename(old, new)
        if old in self._slots:
            self._slots[new] = self._slots.pop(old)
        if old in self.dense_keys:
            self.dense_keys.discard(old)
            self.dense_keys.add(new)

    def state_dict(self) -> dict[str, Any]:
        """The compressor's levels and factors, the memory, the keys sent dense, the
        count of non-finite steps and the noise tracker's history: tensors and plain values
        (``weights_only``-loadable)."""
        return {
            "compressor": self.compressor.state_dict(),
            "memory": self.memory.state_dict(),
            "dense_keys": sorted(self.dense_keys, key=repr),
            "non_finite_steps": self.non_finite_steps,
            "noise": self.noise.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Anything else (a different compressor, a missing
        or unknown key, a bad value) raises ``ValueError`` naming it, and changes nothing:
        every part is checked before any is replaced."""
        check_state_keys(state, _STATE_KEYS, "Reducer", _OPTIONAL_STATE_KEYS)
        dense = state.get("dense_keys", [])
        try:
            if isinstance(dense, str | bytes | Mapping):
                raise TypeError
            dense = set(dense)  # the keys must be hashable
        except TypeError:
            raise ValueError(f"dense_keys must be a list of keys, got {dense!r}") from None
        count = state.get("non_finite_steps", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"non_finite_steps must be an int >= 0, got {count!r}")
        memory = type(self.memory)()  # loaded apart: the compressor's load may still fail
        memory.load_state_dict(state["memory"])
        noise = NoiseTracker()
        noise.load_state_dict(state.get("noise", {"history": {}}))
        self.compressor.load_state_dict(state["compressor"])  # checks all before changing
        noise.on = self.noise.on  # whether to record is the caller's, not the file's
        self.memory, self.noise = memory, noise
        self._live, self._slots = None, {}  # every rank starts over alike
        self.dense_keys = dense
        self.non_finite_steps = count

    def check_shapes(self, shapes: Mapping[Any, Any]) -> None:  # Any keys: Mapping's invariant
        """Raise ``ValueError`` unless the compressor's state, the memories and the dense
        keys fit tensors of ``shapes`` (a loaded checkpoint's consistency)."""
        self.compressor.check_shapes(shapes)
        self.memory.check_shapes(shapes)
        unknown = [k for k in self.dense_keys if k not in shapes]
        if unknown:
            raise ValueError(f"dense_keys {unknown[:5]} belong to no tensor of shapes")

    def exchange(self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor], world_size: int,
                 local_size: int = 1) -> Exchange[bool]:  # fmt: skip
        """Average ``grads`` in place (``local_size`` workers a host); the exchange returns
        whether the result was finite."""
        _check_gradients(keys, grads, world_size)
        self.compressor.track_noise(self.noise.on)
        self.compressor.set_local_size(local_size)
        exchanges, order, owed = self._start(keys, grads, world_size)
        received: list[torch.Tensor] = []
        results = yield from _recording(parallel(*exchanges), received)
        finite, compressed = self._finish(keys, grads, order, results, received, owed)
        if self.noise.on:
            self.noise.record(keys, grads, compressed if finite else {}, world_size)
        return finite

    def _start(self, keys, grads, world_size):
        """One exchange per part of the tensors; the parts' order; the dense keys whose
        memory is sent now (and then forgotten)."""
        # One exchange per (kind, dtype, device): a collective carries a single dtype.
        parts: dict[tuple[bool, torch.dtype, torch.device], list[int]] = {}
        for i, g in enumerate(grads):
            compressed = self.sends_compressed(g, keys[i])
            parts.setdefault((compressed, g.dtype, g.device), []).append(i)
        exchanges, order = [], []
        owed: list[Hashable] = []
        for (compressed, _, _), ix in parts.items():
            if compressed:
                exchanges.append(self._compressed_part(ix, keys, grads, world_size))
            else:
                exchanges.append(self._dense_part(ix, keys, grads, world_size, owed))
            order.append((compressed, ix))
        return exchanges, order, owed

    def _compressed_part(self, ix, keys, grads, world_size) -> Exchange[Any]:
        # Tensors of one shape side by side, in the order they were laid out in (the same
        # on every rank, unlike addresses): a compressor that batches them (PowerSGD)
        # takes a view instead of copying them together, and the memories can serve as
        # the inputs (see _homes).
        slots = self._slots
        ix.sort(key=lambda i: (tuple(grads[i].shape), slots.get(keys[i], -1)))
        part_keys = [keys[i] for i in ix]
        part = [grads[i] for i in ix]
        homes = self._homes(part_keys, part)
        inputs = [self.memory.compensate(k, g, out=h) for k, g, h in zip(part_keys, part, homes)]
        # the averages are written straight into the gradients
        targets = [grads[i].detach() for i in ix]
        return self.compressor.exchange(part_keys, inputs, world_size, out=targets)

    def _dense_part(self, ix, keys, grads, world_size, owed: list[Hashable]) -> Exchange[Any]:
        # a key newly sent dense (dense_keys, or a level that does not pay) still owes its
        # memory: send it now, then forget it
        inputs = []
        for i in ix:
            if self.memory.get(keys[i]) is None:
                inputs.append(grads[i].detach())
            else:
                owed.append(keys[i])
                inputs.append(self.memory.compensate(keys[i], grads[i]))
        return self._dense.exchange([keys[i] for i in ix], inputs, world_size)

    def _finish(self, keys, grads, order, results, received, owed) -> tuple[bool, dict]:
        """Keep the residuals (unless the step was not finite) and write the averages;
        whether the step was finite, and the compressed keys' residuals."""
        outputs: list[torch.Tensor] = [None] * len(grads)  # type: ignore[list-item]
        residuals: dict[Hashable, torch.Tensor | None] = {}
        for (compressed, ix), part in zip(order, results):
            for i, (average, residual) in zip(ix, part):
                outputs[i] = average
                if compressed:
                    residuals[keys[i]] = residual
        # Every worker's average is computed from what it received; checking those (small)
        # buffers instead of the outputs costs a fraction of a pass over the gradients,
        # and gives the same answer on every worker.
        finite = not received or bool(
            torch.stack([torch.isfinite(t).all() for t in received]).all()
        )
        if finite:
            for key, residual in residuals.items():
                self._keep(key, residual)
            for key in owed:
                self.memory.update(key, None)
                self._live = None
        elif residuals:
            self._skip_non_finite(residuals)
        for g, out in zip(grads, outputs):
            if out.data_ptr() != g.data_ptr():  # compressed averages are in place already
                g.detach().copy_(out)
        return finite, residuals

    def _skip_non_finite(self, residuals: Iterable[Hashable]) -> None:
        residuals = list(residuals)
        # the memory was compensated in place, then overwritten by this step: zero it,
        # where it lives, so that the next step compensates in place again
        for key in residuals:
            memory = self.memory.get(key)
            if memory is not None:
                memory.zero_()
        self.non_finite_steps += 1
        self.compressor.reset(residuals)
        warnings.warn(
            "non-finite averaged gradient: error-feedback memory of the compressed tensors "
            "reset to zero and warm-start factors redrawn for this step",
            RuntimeWarning,
            stacklevel=3,  # as before this was a helper: the frame resuming the exchange
        )

    def _homes(self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor]) -> list[Any]:
        """Where the compensated inputs of ``keys`` go: their memories themselves (``g +
        e`` written over ``e``, so that error feedback costs one model-size buffer), or
        the views of a fresh flat buffer that the memory then lives in.

        The memories serve when every key has one, contiguous and of its gradient's
        shape, dtype and device; tensors of one shape follow each other in memory, as in
        a flat buffer; and every storage they live in holds only live memories. After
        DDP rebuilds its buckets, the rebuilt buckets thus keep using the first step's
        buffer rather than doubling the memory while they move out of it; and when a
        storage holds a memory no more (a tensor sent dense, a bucket that moved), the
        keys still in it move out too, so that it is freed.
        """
        for key in keys:  # whatever serves: so the slots stay the same on every rank
            self._slots[key] = self._next_slot
            self._next_slot += 1
        memories = [self.memory.get(k) for k in keys]
        if _can_home(memories, grads, self._live_bytes):
            return memories
        like = grads[0]
        flat = like.new_empty(sum(g.numel() for g in grads))
        homes, offset = [], 0
        for g in grads:
            homes.append(flat[offset : offset + g.numel()].view(g.shape))
            offset += g.numel()
        return homes

    def _live_bytes(self) -> dict[int, int]:
        """Bytes of live memory per storage (by its address), counted again after a
        memory moved or went."""
        if self._live is None:
            live: dict[int, int] = {}
            for key in self.memory.keys():
                m = self.memory.get(key)
                if m is None:  # keys() holds only the non-zero memories
                    continue
                address = _storage(m)[0]
                live[address] = live.get(address, 0) + m.numel() * m.element_size()
            self._live = live
        return self._live

    def _keep(self, key: Hashable, residual: torch.Tensor | None) -> None:
        """Store ``key``'s residual; the live-bytes count is stale if it changed storage."""
        old = self.memory.get(key)
        if old is None or residual is None or _storage(old)[0] != _storage(residual)[0]:
            self._live = None
        self.memory.update(key, residual)


def _can_home(
    memories: list[Any], grads: Sequence[torch.Tensor], live_bytes: Callable[[], dict[int, int]]
) -> bool:
    """Whether ``memories`` can serve as the inputs of ``grads`` (see
    :meth:`Reducer._homes`); ``live_bytes()`` counts the live memory per storage."""
    previous = None
    for m, g in zip(memories, grads):
        if m is None or not m.is_contiguous() or (m.shape, m.dtype, m.device) != (
            g.shape, g.dtype, g.device
        ):  # fmt: skip
            return False
        if previous is not None and previous.shape == m.shape:
            end = previous.data_ptr() + previous.numel() * previous.element_size()
            if m.data_ptr() != end:
                return False
        previous = m
    live = live_bytes()
    return all(live.get(address) == size for address, size in map(_storage, memories))


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """The address and size in bytes of the storage ``t`` lives in."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _recording(exchange: Exchange[Any], received: list[torch.Tensor]) -> Exchange[Any]:
    """Pass ``exchange`` through, appending every collective's result to ``received``."""
    reply: Any = None  # a generator's first send must be None, which send's type forbids
    while True:
        try:
            phase = exchange.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = yield phase
        received.extend(reply)


def _check_gradients(keys: Sequence[Hashable], grads: Sequence[torch.Tensor], world: int) -> None:
    check_world_size(world)
    if len(keys) != len(grads):
        raise ValueError(f"keys and grads differ in length: {len(keys)} != {len(grads)}")
    if len(set(keys)) != len(keys):
        raise ValueError("keys must be unique")
    for key, g in zip(keys, grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"gradient for {key!r} must be a Tensor, got {type(g).__name__}")
        if not g.is_floating_point():
            raise TypeError(f"gradient for {key!r} must be floating point, got {g.dtype}")


def average_in_place(tensors: Sequence[torch.Tensor], world: int,
                     buffer: torch.Tensor | None = None) -> Exchange[bool]:  # fmt: skip
    """An exchange averaging ``tensors`` dense in place, with no copies: the flat
    ``buffer`` they are views of in one all-reduce when given (a DDP bucket's), else each
    tensor (the transport coalesces a phase's all-reduces of one dtype)."""
    if buffer is not None:
        yield [AllReduce(buffer.div_(world))]
    elif tensors:
        yield [AllReduce(t.div_(world)) for t in tensors]
    return True
