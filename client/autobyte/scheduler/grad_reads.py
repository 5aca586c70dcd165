"""`param.grad` of a managed parameter reads as DDP's: a read is a synchronisation point.

The scheduler takes each gradient off `param.grad` in its hook and reduces it while the next forward
runs; DDP instead waits at the end of `backward()` and leaves the averaged gradient in `.grad`.
Whatever reads a gradient between `backward()` and `step()` — `clip_grad_norm_`, `clip_grad_value_`,
`GradScaler.unscale_`, a norm for logging, `p.grad` in the loop, another library's hook — needs the
value DDP holds there, and is the only thing that does. So `.grad` of a managed parameter is a
property (its class is swapped for a subclass that adds it, `manage()`; `release()` swaps it back)
that asks the scheduler, which answers (`ScheduledOptimizer._grad_read`):

- between `backward()` and `step()`: it sends the gradients of parameters that had none (as
  `step()` would), waits until every slice of the step is reduced — the wait DDP pays at the end of
  every backward — and returns the parameter's averaged gradient as a view of the buffer the update
  reads, so in-place changes (a clip's `mul_`, an unscale) are what the update applies; None for a
  parameter no rank used, as DDP leaves it;
- after `step()`: the same gradient once its update has landed, until a `zero_grad()` or an
  assignment of None clears it (then None, as after DDP's `zero_grad()`); `Module.zero_grad()` and
  `Optimizer.zero_grad()` read it only to clear it, so they never wait;
- inside `no_sync()`, or for parameters no wrapped optimizer holds: the tensor autograd left in
  `.grad`, as DDP's.

A loop that reads no gradient never enters any of this and keeps the whole overlap. A read inside
`backward()` of a gradient already handed to the scheduler (a hook of another parameter) cannot be
served without deadlocking the collectives it would wait on: it raises, naming the parameter.
Assigning a tensor between `backward()` and `step()` copies it into the buffer (the update uses it);
assigning None drops the parameter from that step's update, as an optimizer skips a None gradient.

Reads from C++ (autograd's accumulation) use the field itself, as do the scheduler's own
(`raw_grad`, `set_raw_grad`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

_FIELD = torch._C.TensorBase.grad  # the C++ field's own descriptor


def raw_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor in the parameter's `.grad` field, without asking the scheduler."""
    return _FIELD.__get__(param)


def set_raw_grad(param: torch.Tensor, value: torch.Tensor | None) -> None:
    _FIELD.__set__(param, value)


# id(param) -> (a weak reference to it, read(i), write(i, value), i)
_managed: dict[int, tuple[weakref.ref, Callable[[int], Any], Callable[[int, Any], None], int]] = {}
_classes: dict[type, type] = {}


def _entry(param: torch.Tensor) -> tuple | None:
    entry = _managed.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry


def _get(param: torch.Tensor) -> torch.Tensor | None:
    grad = _FIELD.__get__(param)
    if grad is not None:
        return grad
    entry = _entry(param)
    return None if entry is None else entry[1](entry[3])


def _set(param: torch.Tensor, value: torch.Tensor | None) -> None:
    entry = None if _FIELD.__get__(param) is not None else _entry(param)
    if entry is None:  # the field holds autograd's tensor (or the parameter is not managed)
        _FIELD.__set__(param, value)
    else:
        entry[2](entry[3], value)


def _deepcopy_as_base(base: type) -> Callable[[Any, dict], Any]:
    def __deepcopy__(self: Any, memo: dict) -> Any:
        # a copy (an EMA model) is the user's plain parameter, not managed
        if id(self) in memo:
            return memo[id(self)]
        result = base(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result

    return __deepcopy__


def _managed_class(cls: type) -> type:
    sub = _classes.get(cls)
    if sub is None:
        namespace: dict[str, Any] = {
            "grad": property(_get, _set, doc="The gradient DDP would hold (grad_reads)."),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        if cls is nn.Parameter:
            namespace["__deepcopy__"] = _deepcopy_as_base(cls)
        sub = _classes[cls] = type(cls.__name__, (cls,), namespace)
        sub._autobyte_base = cls  # type: ignore[attr-defined]
    return sub


def manage(
    params: Iterable[torch.Tensor],
    read: Callable[[int], Any],
    write: Callable[[int, Any], None],
) -> None:
    """Route `.grad` of params[i] to read(i) / write(i, value) while its field holds None."""
    for i, param in enumerate(params):
        base = type(param)
        if getattr(base, "_autobyte_base", None) is None:
            param.__class__ = _managed_class(base)
        _managed[id(param)] = (weakref.ref(param), read, write, i)


def release(params: Iterable[torch.Tensor]) -> None:
    """`.grad` is the plain field again."""
    for param in params:
        if _entry(param) is not None:
            del _managed[id(param)]
        base = getattr(type(param), "_autobyte_base", None)
        if base is not None:
            param.__class__ = base


__all__ = ["manage", "raw_grad", "release", "set_raw_grad"]
