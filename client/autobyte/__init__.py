"""autobyte: a communication scheduler for distributed PyTorch training that streams its measurements to
autobyted and applies the configurations decided there."""

from autobyte._version import __version__
from autobyte.transport.session import init, shutdown
from autobyte.types import Config, StepMetrics

__all__ = ["Config", "ScheduledOptimizer", "StepMetrics", "__version__", "init", "shutdown"]


def __getattr__(name: str):
    # torch is an extra: `import autobyte` works without it; the scheduler loads on first use.
    if name == "ScheduledOptimizer":
        from autobyte.scheduler import ScheduledOptimizer

        return ScheduledOptimizer
    if name == "fsdp":  # autobyte.fsdp.attach after a plain `import autobyte`
        import importlib

        return importlib.import_module("autobyte.fsdp")
    raise AttributeError(f"module 'autobyte' has no attribute {name!r}")
