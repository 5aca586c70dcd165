"""Whether the scheduler's native hot path (`autobyte._native`, built from native/engine.cpp) is in
this installation or in the torch extensions cache and can run here, and why not — without importing
torch unless it is installed (`autobyte check-build` runs on a base install too).

Where it comes from, first found first: built into the installation by setup.py (`prebuilt`: torch
and a compiler in the build environment, as scripts/setup.sh installs), else compiled on first use
against the imported torch into the torch extensions cache (`compiled`: `autobyte.native_build`)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Any

MODULE = "autobyte._native"
INTERFACE_VERSION = 4  # must equal native/engine.cpp's kInterfaceVersion
ENV_SWITCH = "AUTOBYTE_NATIVE"  # "0": always the Python path
REBUILD = (
    "rebuild it: `autobyte check-build --build` compiles it against this torch (a C++ "
    "compiler and ninja needed), or bash scripts/setup.sh in a checkout"
)


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """Whether the extension is in this installation (`built`), can run here (`active`), and why not."""

    built: bool
    active: bool
    reason: str
    built_for_torch: str = ""
    source: str = (
        ""  # "prebuilt" (in the installation), "compiled" (the torch extensions cache) or ""
    )


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
        module, result = _load_compiled()
    else:
        try:
            import torch
            import torch.distributed  # registers ProcessGroup for the extension's arguments
        except ImportError as error:
            result = NativeStatus(
                True, False, f"torch is not importable ({error}): pip install 'autobyte[torch]'"
            )
        else:
            try:
                module = importlib.import_module(MODULE)
            except (ImportError, OSError) as error:
                result = NativeStatus(
                    True, False, f"{MODULE} cannot be loaded ({error}); {REBUILD}"
                )
            else:
                module, result = _checked(module, torch.__version__, "prebuilt")
    _loaded = (module, result)
    return _loaded


def _checked(module: Any, torch_version: str, source: str) -> tuple[Any, NativeStatus]:
    """(module or None, status) of a loaded extension: the interface and torch it was built for."""
    built_for = str(getattr(module, "TORCH_VERSION", ""))
    version = getattr(module, "INTERFACE_VERSION", None)
    if version != INTERFACE_VERSION:
        return None, NativeStatus(
            True,
            False,
            f"{MODULE} is a stale build (interface {version}, this "
            f"autobyte needs {INTERFACE_VERSION}); {REBUILD}",
            built_for,
            source,
        )
    if built_for != torch_version:
        return None, NativeStatus(
            True,
            False,
            f"{MODULE} was built for torch {built_for}, this is torch {torch_version}; {REBUILD}",
            built_for,
            source,
        )
    return module, NativeStatus(True, True, "", built_for, source)


def _load_compiled() -> tuple[Any, NativeStatus]:
    """Not in the installation: the build compiled on first use into the torch extensions cache."""
    not_here = (
        f"{MODULE} is not in this installation (built without torch in the build environment or "
        "without a C++ compiler)"
    )
    try:
        import torch
        import torch.distributed
    except ImportError:
        return None, NativeStatus(False, False, f"{not_here}; {REBUILD}")
    from autobyte import native_build

    entry = native_build.cache_entry()
    if entry is None:
        return None, NativeStatus(
            False,
            False,
            f"{not_here} and it ships no native/engine.cpp to "
            "compile; reinstall autobyte from a wheel or a checkout",
        )
    if not entry.complete():
        return None, NativeStatus(
            False,
            False,
            f"{not_here} and not compiled for torch {torch.__version__} "
            f"yet (cache: {entry.folder}); `autobyte check-build --build` "
            "compiles it now, or the first ScheduledOptimizer on this "
            "host starts compiling it in the background",
        )
    try:
        module = native_build.load_library(entry.library)
    except (ImportError, OSError) as error:
        return None, NativeStatus(
            True,
            False,
            f"the compiled {entry.library} cannot be loaded ({error}); {REBUILD}",
            source="compiled",
        )
    return _checked(module, torch.__version__, "compiled")


def status(start_build: bool = False) -> NativeStatus:
    """The extension's state in this process, `AUTOBYTE_NATIVE=0` included. `start_build`: where it
    is neither installed nor compiled, start compiling it in the background on this host (the
    scheduler's first use; never waits) and say so in the reason."""
    _, result = load()
    disabled = os.environ.get(ENV_SWITCH, "1") == "0"
    if result.active and disabled:
        return dataclasses.replace(result, active=False, reason=f"disabled by {ENV_SWITCH}=0")
    if start_build and not result.built and not disabled:
        from autobyte import native_build

        entry = native_build.cache_entry()
        if entry is not None:
            return dataclasses.replace(result, reason=native_build.start_in_background(entry))
    return result


def build_report() -> dict[str, Any]:
    """What `autobyte check-build` prints: this installation's scheduler build and where it can run."""
    import platform

    from autobyte._version import __version__

    native = status()
    report: dict[str, Any] = {
        "autobyte": __version__,
        "python": platform.python_version(),
        "native": {
            "built": native.built,
            "active": native.active,
            "reason": native.reason,
            "built_for_torch": native.built_for_torch,
        },
        "native_build": _build_source(native),
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
    report["backends"] = {
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available(),
        "mpi": available and dist.is_mpi_available(),
        "cuda": torch.cuda.is_available(),
    }
    return report


def _build_source(native: NativeStatus) -> dict[str, Any]:
    """Where the extension comes from: prebuilt in the installation, compiled into the cache, or
    not built (with the cache entry it would be compiled into and whether a compiler is there)."""
    from autobyte import native_build

    entry = native_build.cache_entry() if native.source != "prebuilt" else None
    source = native_build.source_path()
    return {
        "source": native.source or "not built",
        "cache_dir": str(entry.folder) if entry is not None else "",
        "compile_source": str(source) if source is not None else "",
        "compiler_missing": native_build.compiler_missing() if not native.built else "",
        "failed": entry.failure() if entry is not None else "",
    }
