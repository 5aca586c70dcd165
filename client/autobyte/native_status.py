"""Whether the scheduler's native hot path (`autobyte._native`, built from native/engine.cpp) is in
this installation and can run here, and why not — without importing torch unless it is installed
(`autobyte check-build` runs on a base install too)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Any

MODULE = "autobyte._native"
INTERFACE_VERSION = 1  # must equal native/engine.cpp's kInterfaceVersion
ENV_SWITCH = "AUTOBYTE_NATIVE"  # "0": always the Python path
REBUILD = ("rebuild it: bash scripts/setup.sh in a checkout, or pip install --no-build-isolation "
           "'autobyte[torch]' with torch and a C++ compiler installed")


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """Whether the extension is in this installation (`built`), can run here (`active`), and why not."""

    built: bool
    active: bool
    reason: str
    built_for_torch: str = ""


_loaded: tuple[Any, NativeStatus] | None = None


def load() -> tuple[Any, NativeStatus]:
    """Import the extension once (torch first: it provides the libraries the extension links)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        built = importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        built = False
    module = None
    if not built:
        result = NativeStatus(False, False, f"{MODULE} is not in this installation (built without torch in "
                                            f"the build environment or without a C++ compiler); {REBUILD}")
    else:
        try:
            import torch
            import torch.distributed  # registers ProcessGroup for the extension's arguments
        except ImportError as error:
            result = NativeStatus(True, False, f"torch is not importable ({error}): pip install 'autobyte[torch]'")
        else:
            try:
                module = importlib.import_module(MODULE)
            except (ImportError, OSError) as error:
                result = NativeStatus(True, False, f"{MODULE} cannot be loaded ({error}); {REBUILD}")
            else:
                built_for = str(getattr(module, "TORCH_VERSION", ""))
                version = getattr(module, "INTERFACE_VERSION", None)
                if version != INTERFACE_VERSION:
                    result = NativeStatus(True, False, f"{MODULE} is a stale build (interface {version}, this "
                                                       f"autobyte needs {INTERFACE_VERSION}); {REBUILD}", built_for)
                    module = None
                elif built_for != torch.__version__:
                    result = NativeStatus(True, False, f"{MODULE} was built for torch {built_for}, this is "
                                                       f"torch {torch.__version__}; {REBUILD}", built_for)
                    module = None
                else:
                    result = NativeStatus(True, True, "", built_for)
    _loaded = (module, result)
    return _loaded


def status() -> NativeStatus:
    """The extension's state in this process, `AUTOBYTE_NATIVE=0` included."""
    _, result = load()
    if result.active and os.environ.get(ENV_SWITCH, "1") == "0":
        return dataclasses.replace(result, active=False, reason=f"disabled by {ENV_SWITCH}=0")
    return result


def build_report() -> dict[str, Any]:
    """What `autobyte check-build` prints: this installation's scheduler build and where it can run."""
    import platform

    from autobyte._version import __version__

    native = status()
    report: dict[str, Any] = {
        "autobyte": __version__,
        "python": platform.python_version(),
        "native": {"built": native.built, "active": native.active, "reason": native.reason,
                   "built_for_torch": native.built_for_torch},
        "torch": {"installed": False, "version": ""},
        "backends": {"gloo": False, "nccl": False, "mpi": False, "cuda": False},
    }
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return report
    report["torch"] = {"installed": True, "version": torch.__version__}
    available = dist.is_available()
    report["backends"] = {"gloo": available and dist.is_gloo_available(),
                          "nccl": available and dist.is_nccl_available(),
                          "mpi": available and dist.is_mpi_available(),
                          "cuda": torch.cuda.is_available()}
    return report
