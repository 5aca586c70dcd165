"""Every read of a managed parameter waits for its pending update, whatever module reads it.

A module's forward pre-hook can only wait for that module's *own* parameters, but parameters are read
elsewhere too: `nn.MultiheadAttention` passes `out_proj.weight` straight to
`F.multi_head_attention_forward` (so `out_proj` never runs), tied embeddings are read by two modules,
user code calls `F.linear(x, self.other.weight)`, a loss adds `sum(p.square().sum() for p in
model.parameters())`, an EMA or a checkpoint reads parameters after `step()`.

Every such read goes through the owning module's `_parameters` dict: `Module.__getattr__` looks the
name up there, `parameters()`/`named_parameters()`/`state_dict()` iterate it. The tracker replaces
each managed module's dict by a `TrackedParameters` (a dict subclass) whose lookups and iteration
first call back into the tracker: it records the first-use order (priority) during the first forward
pass, marks the parameter as read in this step, and waits for its update if one is still in flight.
The module forward pre-hooks stay as well (modules such as nn.LSTM read parameters through lists
built once). `close()` puts plain dicts back. `Module.zero_grad()` iterates parameters only to reach
`.grad` (None for managed parameters), so its iteration does not wait.

Reads that bypass both (a tensor reference kept elsewhere and read later) cannot be seen; the
scheduler refuses them at the backward pass that reveals them (a gradient for a parameter that was
never read through its module in that step).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

_ZERO_GRAD_CODES = tuple(
    inspect.unwrap(fn).__code__ for fn in (nn.Module.zero_grad, torch.optim.Optimizer.zero_grad)
)


def called_from_zero_grad(depth: int = 10) -> bool:
    """Whether `Module.zero_grad()` or `Optimizer.zero_grad()` is among the callers (they read
    parameters and their `.grad` only to clear them)."""
    frame = sys._getframe(2)
    codes = _ZERO_GRAD_CODES
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


class TrackedParameters(dict):
    """A module's `_parameters` whose reads of managed parameters call `read(indices)` first."""

    __slots__ = ("_all", "_index", "_read")

    def __init__(
        self,
        items: Iterable[tuple[str, Any]],
        index: dict[str, int],
        read: Callable[[tuple[int, ...], bool], None],
    ) -> None:
        super().__init__(items)
        self._index = index
        self._all = tuple(dict.fromkeys(index.values()))
        self._read = read

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        i = self._index.get(name)
        if i is not None:
            self._read((i,), False)
        return value

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if dict.__contains__(self, name) else default

    def items(self):  # type: ignore[override]
        if self._all:
            self._read(self._all, True)
        return dict.items(self)

    def values(self):  # type: ignore[override]
        if self._all:
            self._read(self._all, True)
        return dict.values(self)

    def copy(self) -> dict:
        return dict(self.items())

    def __reduce_ex__(self, protocol: int) -> tuple:
        # copy.deepcopy / pickle of a model (an EMA copy, torch.save(model)) gets a plain dict of
        # up-to-date parameters, never this tracker.
        return (dict, (dict(self.items()),))


def _noop_hook(*args: Any, **kwargs: Any) -> None:
    return None


def _make_noop_hook() -> Callable[..., None]:
    return _noop_hook


class CopySafeHook:
    """A module hook of the scheduler that a copy of the model does not carry: `copy.deepcopy(model)`
    (an EMA model) or pickling it gets a no-op instead of a second reference to the scheduler."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _noop_hook

    def __reduce__(self) -> tuple:
        return (_make_noop_hook, ())


def install(
    model: nn.Module, index_of: dict[Any, int], read: Callable[[tuple[int, ...], bool], None]
) -> list[tuple[nn.Module, dict]]:
    """Replace the `_parameters` of every module holding a managed parameter; returns what to
    restore. `read(indices, iterating)` is called before every read."""
    installed = []
    for module in model.modules():
        params = module.__dict__.get("_parameters")
        if not isinstance(params, dict) or isinstance(params, TrackedParameters):
            continue
        index = {name: index_of[p] for name, p in params.items() if p is not None and p in index_of}
        if not index:
            continue
        module.__dict__["_parameters"] = TrackedParameters(params.items(), index, read)
        installed.append((module, params))
    return installed


def uninstall(installed: list[tuple[nn.Module, dict]]) -> None:
    """Put plain dicts back (with whatever the tracked ones hold now)."""
    for module, _ in installed:
        tracked = module.__dict__.get("_parameters")
        if isinstance(tracked, TrackedParameters):
            module.__dict__["_parameters"] = dict(dict.items(tracked))


__all__ = ["CopySafeHook", "TrackedParameters", "install", "uninstall"]
