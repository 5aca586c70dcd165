"""Who wants to hear of each new ScheduledOptimizer (or FSDP2 job, autobyte.fsdp): parts of
autobyte (the transport) register a hook here, and the scheduler calls them, without importing any
of them (torch-free)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_scheduler_created_hooks: list[Callable[[Any], None]] = []


def on_scheduler_created(hook: Callable[[Any], None]) -> None:
    """Call hook(optimizer) from every ScheduledOptimizer's constructor from now on (once per hook)."""
    if hook not in _scheduler_created_hooks:
        _scheduler_created_hooks.append(hook)


def scheduler_created(optimizer: Any) -> None:
    """Called by ScheduledOptimizer's constructor, last."""
    for hook in _scheduler_created_hooks:
        hook(optimizer)
