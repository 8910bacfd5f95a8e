"""The round loop's one host sync: token ids that stay on the device, non-blocking uploads, the
round's single readback, and a clock that does not wait.

On CUDA every ``.item()`` / ``.tolist()`` / ``int(tensor)`` waits for all queued kernels, and so
does ``torch.tensor(ids, device="cuda")`` (a pageable copy, then a stream synchronisation). The
torch round loop therefore keeps drafted tokens on the device (:class:`DeviceTokens`: the length
is known, the values are not), uploads host ids with :func:`upload` (never waits), and reads
everything the host needs (drafted tokens, the target's argmaxes, row entropies) in one copy,
:func:`read_back`. ``shared_core.bench.system.gpu_syncs`` counts what is left, per round, on a CPU too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast, overload

import numpy as np
import torch


def upload(ids: Sequence[int], device: torch.device | str | None) -> torch.Tensor:
    """``[n]`` int64 ids on ``device`` without waiting for the device (a pageable copy is staged
    before the call returns, so the host list may be freed at once)."""
    host = torch.from_numpy(np.asarray(ids, dtype=np.int64).reshape(-1))
    if device is None or torch.device(device).type == "cpu":
        return host
    return host.to(device, non_blocking=True)


def read_back(*tensors: torch.Tensor) -> list[list[Any]]:
    """Every tensor's values as Python numbers (flattened), in ONE copy to the host.

    Integer and bool tensors come back as ints, floating ones as the floats of their float32
    values (carried bit for bit through an int32 view, so no float64 is needed: MPS has none).
    Host tensors among device ones are uploaded without waiting first.
    """
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    flat: list[torch.Tensor] = []
    floats: list[bool] = []
    for t in tensors:
        t = t.reshape(-1)
        if t.device != device:
            t = t.to(device, non_blocking=True)
        floats.append(t.is_floating_point())
        if floats[-1]:
            t = t.float().view(torch.int32)
        flat.append(t.to(torch.int64))
    joined = flat[0] if len(flat) == 1 else torch.cat(flat)
    values = joined.tolist()  # the one copy
    out: list[list[Any]] = []
    start = 0
    for t, is_float in zip(flat, floats, strict=True):
        part = values[start : start + t.shape[0]]
        start += t.shape[0]
        if is_float:
            part = np.asarray(part, dtype=np.int64).astype(np.int32).view(np.float32).tolist()
        out.append(part)
    return out


class DeviceTokens(Sequence[int]):
    """``n`` token ids held on the device until the round's readback.

    ``len()`` never syncs. The values are set by :meth:`resolve` (the engine's combined readback)
    or, read before that (``tokens[i]``, iteration, a grammar mask), by one copy of their own.
    Listeners (:meth:`on_resolve`, e.g. a KV session's token list) get the values once known.
    A :meth:`part` is a slice that resolves with its parent.
    """

    def __init__(self, ids: torch.Tensor, *, head: Sequence[int] = (),
                 tail: DeviceTokens | None = None):
        self.ids = ids.reshape(-1)
        self._values: tuple[int, ...] | None = None
        self._listeners: list[Callable[[tuple[int, ...]], None]] = []
        self._head = tuple(int(t) for t in head)
        self._tail = tail  # chain(): head ids on the host, then ``tail``
        if tail is not None:
            tail.on_resolve(lambda values: self.resolve((*self._head, *values)))

    @classmethod
    def chain(cls, head: Sequence[int], tail: Sequence[int]) -> Sequence[int]:
        """``[*head, *tail]``: a list when ``tail`` is on the host (or already read), else
        DeviceTokens whose ids are uploaded ``head`` followed by ``tail``'s (no wait)."""
        if not isinstance(tail, DeviceTokens) or tail.resolved:
            return [*head, *tail]
        ids = torch.cat([upload(list(head), tail.ids.device), tail.ids]) if head else tail.ids
        return cls(ids, head=head, tail=tail)

    def part(self, start: int, stop: int) -> DeviceTokens:
        """Tokens ``[start, stop)`` (a view of the same device ids), resolved with this one."""
        child = DeviceTokens(self.ids[start:stop])
        self.on_resolve(lambda values: child.resolve(values[start:stop]))
        return child

    @property
    def resolved(self) -> bool:
        return self._values is not None

    def resolve(self, values: Sequence[int]) -> None:
        """Set the values (once; later calls are ignored) and tell the listeners."""
        if self._values is not None:
            return
        self._values = tuple(int(v) for v in values)
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(self._values)

    def on_resolve(self, listener: Callable[[tuple[int, ...]], None]) -> None:
        if self._values is not None:
            listener(self._values)
        else:
            self._listeners.append(listener)

    def values(self) -> tuple[int, ...]:
        """The ids on the host (one copy if nobody read them yet)."""
        if self._values is None:
            if self._tail is not None:
                self._tail.values()  # the chain resolves with its tail
            else:  # a part reads only its own slice: later places of its parent may be unwritten
                self.resolve(read_back(self.ids)[0])
        assert self._values is not None
        return self._values

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        return self.values()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (DeviceTokens, tuple, list)):
            return self.values() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a list

    def __repr__(self) -> str:
        shown = self._values if self._values is not None else f"<{len(self)} on {self.ids.device}>"
        return f"DeviceTokens({shown})"


def host_tokens(tokens: Sequence[int] | torch.Tensor) -> list[int] | None:
    """``tokens`` as a host list when that costs no device copy, else None (device ids)."""
    if isinstance(tokens, DeviceTokens):
        return list(tokens.values()) if tokens.resolved else None
    if isinstance(tokens, torch.Tensor):
        return None
    return [int(t) for t in tokens]


def read_with(tokens: Sequence[int] | torch.Tensor, *tensors: torch.Tensor
              ) -> tuple[list[int], list[list[Any]]]:
    """``tokens`` on the host and ``tensors``' values, in one copy (none for host tokens beyond
    the tensors' own): resolves :class:`DeviceTokens` on the way."""
    host = host_tokens(tokens)
    if host is not None:
        return host, read_back(*tensors)
    # host ids returned above: what is left is on the device
    ids = tokens.ids if isinstance(tokens, DeviceTokens) else cast(torch.Tensor, tokens)
    first, *rest = read_back(ids, *tensors)
    if isinstance(tokens, DeviceTokens):
        tokens.resolve(first)
    return [int(t) for t in first], rest


class RoundClock:
    """Marks in a round (``mark(name)``) read as seconds between marks after the round's
    readback, without a sync of their own: CUDA events on a GPU, ``perf_counter`` elsewhere.

    On a GPU the spans are device time between the marks (kernels, not host launch time).
    """

    def __init__(self, device: torch.device | str | None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        """Seconds from mark ``start`` to mark ``end`` (CUDA: waits for ``end``'s event only,
        already done once the round's readback returned)."""
        a, b = self.marks[start], self.marks[end]
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b)) / 1000.0
        return float(b - a)
