"""Compiles the scheduler's native hot path (native/engine.cpp) on first use, against the torch that
is imported, into the torch extensions cache: once per host and torch version, in the background.

Why compile on first use rather than ship prebuilt wheels: the extension links torch's C++ ABI, which
changes with every torch release and build (CPU, cu12x, cu13x, ROCm, nightly), so a prebuilt
extension fits exactly one torch; the one that fits is the torch the training process imports, and
compiling against it where a C++ compiler exists always matches (DeepSpeed builds its ops the same
way). A plain `pip install 'autobyte[torch]'` (build isolation: torch is not in the build
environment, so setup.py cannot compile it) ships the source inside the wheel (autobyte/csrc/), and
the first ScheduledOptimizer on a host compiles it.

What happens on first use, and why a training step never waits for it:
* The first process on a host that finds no build for its torch takes an exclusive file lock in the
  cache entry (flock: released by the kernel when its holder dies, so it is never stale) and starts a
  detached, niced builder process that inherits the lock. It says so in the scheduler's one INFO line
  about its hot path and, like every other process on the host that finds the lock taken, runs the
  Python path (same parameters, more CPU per
  partition): the path is chosen collectively at the first backward pass and never switched during a
  job, and waiting a minute for a compile there would stall every rank of the job.
* Processes started after the build completed load it from the cache: the native path is active.
* A failed build is recorded with its log; it is not retried on every start (`autobyte check-build
  --build` retries in the foreground and shows the compiler's output).
AUTOBYTE_NATIVE_BUILD=0 turns the compile on first use off; TORCH_EXTENSIONS_DIR moves the cache.

Nothing here imports torch at module level: `autobyte check-build` runs on a base install too.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCE_NAME = "engine.cpp"
BUILD_SWITCH = "AUTOBYTE_NATIVE_BUILD"  # "0": never compile on first use
LIBRARY_NAME = "_native"  # PYBIND11_MODULE(_native, ...) in native/engine.cpp
COMPLETE = "complete.json"
FAILED = "failed.json"
LOG = "build.log"
LOCK = "autobyte-build.lock"  # not "lock": torch.utils.cpp_extension's own baton file there


def source_path() -> Path | None:
    """native/engine.cpp as shipped in the wheel (autobyte/csrc/) or in a checkout (native/)."""
    package = Path(__file__).resolve().parent
    for candidate in (
        package / "csrc" / SOURCE_NAME,
        package.parent.parent / "native" / SOURCE_NAME,
    ):
        if candidate.is_file():
            return candidate
    return None


def cache_root() -> Path:
    """The torch extensions cache (torch.utils.cpp_extension's default place), autobyte's folder."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    return Path(base) / "autobyte_native"


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """Where the build for this source, torch and Python lives, and what is there."""

    folder: Path
    torch_version: str
    source: Path

    @property
    def library(self) -> Path:
        return self.folder / f"{LIBRARY_NAME}.so"  # torch.utils.cpp_extension.load's file name

    def complete(self) -> bool:
        return (self.folder / COMPLETE).is_file() and self.library.is_file()

    def failure(self) -> str:
        """The recorded failure of an earlier build ("" if none)."""
        try:
            return json.loads((self.folder / FAILED).read_text())["error"]
        except (OSError, ValueError, KeyError):
            return ""


def cache_entry() -> CacheEntry | None:
    """The cache entry for the imported torch (imports torch), or None without a source or torch."""
    source = source_path()
    if source is None:
        return None
    try:
        import torch
    except ImportError:
        return None
    from autobyte.native_status import INTERFACE_VERSION

    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    digest.update(
        f"{torch.__version__}|{sys.implementation.cache_tag}|{INTERFACE_VERSION}".encode()
    )
    folder = (
        cache_root()
        / f"torch{torch.__version__}-{sys.implementation.cache_tag}-{digest.hexdigest()[:12]}"
    )
    return CacheEntry(folder, torch.__version__, source)


def compiler_missing() -> str:
    """Why nothing can be compiled here ("" if a C++ compiler and ninja are found)."""
    compiler = (os.environ.get("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        return (
            f"no C++ compiler ({compiler!r} not found on PATH): install one (apt-get install g++) "
            "and run `autobyte check-build --build`"
        )
    if _ninja_dir() is None:
        return "ninja is not installed (torch compiles extensions with it): pip install ninja"
    return ""


def _ninja_dir() -> str | None:
    found = shutil.which("ninja")
    if found:
        return os.path.dirname(found)
    try:
        import ninja  # the PyPI package ships the binary; its bin/ is not on PATH outside a venv shell
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", "")
    return folder if folder and os.path.exists(os.path.join(folder, "ninja")) else None


def _build_environment() -> dict[str, str]:
    env = dict(os.environ)
    folders = [d for d in (_ninja_dir(), os.path.dirname(sys.executable)) if d]
    env["PATH"] = os.pathsep.join([*folders, env.get("PATH", "")])
    env.pop("AUTOBYTE_NATIVE", None)
    return env


def build(entry: CacheEntry) -> None:
    """Compile into the entry's folder (the caller holds its lock); raise on failure, after
    recording it. Runs torch.utils.cpp_extension.load, then loads the result to check it."""
    import torch
    from torch.utils import cpp_extension

    from autobyte.native_status import INTERFACE_VERSION

    entry.folder.mkdir(parents=True, exist_ok=True)
    (entry.folder / COMPLETE).unlink(missing_ok=True)
    (entry.folder / FAILED).unlink(missing_ok=True)
    started = time.monotonic()
    try:
        module = cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(entry.source)],
            build_directory=str(entry.folder),
            extra_cflags=["-O2", f"'-DAUTOBYTE_TORCH_VERSION=\"{torch.__version__}\"'"],
            verbose=True,
        )
        version = getattr(module, "INTERFACE_VERSION", None)
        built_for = str(getattr(module, "TORCH_VERSION", ""))
        if version != INTERFACE_VERSION or built_for != torch.__version__:
            raise RuntimeError(
                f"the compiled extension reports interface {version} for torch "
                f"{built_for!r}; expected {INTERFACE_VERSION} for {torch.__version__}"
            )
    except BaseException as error:
        (entry.folder / FAILED).write_text(
            json.dumps(
                {"error": f"{type(error).__name__}: {error}"[-2000:], "torch": torch.__version__}
            )
        )
        raise
    (entry.folder / COMPLETE).write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "source": str(entry.source),
                "seconds": round(time.monotonic() - started, 1),
                "python": sys.version.split()[0],
            }
        )
    )


def _lock(entry: CacheEntry, blocking: bool) -> int | None:
    entry.folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(entry.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


_started: dict[Path, str] = {}


def start_in_background(entry: CacheEntry) -> str:
    """Make sure a build of `entry` is done or under way on this host without waiting for it; return
    why this process cannot use the native path (the Python path's reason). Never raises."""
    if entry.folder in _started:
        return _started[entry.folder]
    reason = _start(entry)
    _started[entry.folder] = reason
    return reason


def _start(entry: CacheEntry) -> str:
    fix = "`autobyte check-build --build` compiles it in the foreground and shows why"
    if os.environ.get(BUILD_SWITCH, "1") == "0":
        return (
            f"autobyte._native is not in this installation nor compiled for torch "
            f"{entry.torch_version}, and {BUILD_SWITCH}=0 turns its compile on first use off; {fix}"
        )
    failure = entry.failure()
    if failure:
        return (
            f"compiling the native hot path failed earlier ({failure.splitlines()[-1][:300]}; log: "
            f"{entry.folder / LOG}); {fix}"
        )
    missing = compiler_missing()
    if missing:
        return (
            f"autobyte._native is not in this installation and cannot be compiled here: {missing}"
        )
    try:
        fd = _lock(entry, blocking=False)
        if fd is None:
            return (
                "the native hot path is being compiled for this torch by another process on this "
                f"host (into {entry.folder}); processes started after it finishes use it"
            )
        try:
            if entry.complete():
                return "the native hot path was compiled meanwhile; processes started from now on use it"
            with open(entry.folder / LOG, "wb") as log:
                subprocess.Popen(
                    [sys.executable, "-m", "autobyte.native_build", "--locked-fd", str(fd)],
                    pass_fds=(fd,),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=_build_environment(),
                    cwd=entry.folder,
                )
        finally:
            os.close(fd)  # the builder holds the lock from here on
    except OSError as error:
        return f"the native hot path is not built and its compile could not be started ({error}); {fix}"
    logger.debug("started the native hot path's compile into %s", entry.folder)
    # the scheduler's one INFO line about its hot path carries this reason
    return (
        f"the native hot path is being compiled for torch {entry.torch_version} in the background "
        f"(about a minute, once per host; into {entry.folder}); processes started after it "
        "finishes use it"
    )


def build_now(timeout_s: float = 900.0) -> tuple[bool, str]:
    """Compile in the foreground (waiting for a build under way instead of starting a second one):
    (ok, what happened). What `autobyte check-build --build` runs."""
    entry = cache_entry()
    if entry is None:
        return False, (
            "nothing to compile: "
            + (
                "torch is not importable (pip install 'autobyte[torch]')"
                if source_path() is not None
                else "this installation ships no native/engine.cpp"
            )
        )
    deadline = time.monotonic() + timeout_s
    while True:
        fd = _lock(entry, blocking=False)
        if fd is not None:
            break
        if time.monotonic() > deadline:
            return (
                False,
                f"another process has been compiling into {entry.folder} for over {timeout_s:.0f} s",
            )
        time.sleep(0.5)
    try:
        if entry.complete():
            return True, f"compiled for torch {entry.torch_version} in {entry.folder}"
        missing = compiler_missing()
        if missing:
            return False, missing
        os.environ["PATH"] = _build_environment()["PATH"]
        try:
            build(entry)
        except BaseException as error:  # noqa: BLE001 - reported, with the compiler's output above it
            return False, f"compiling failed: {type(error).__name__}: {str(error)[-1500:]}"
        return True, f"compiled for torch {entry.torch_version} into {entry.folder}"
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """The detached builder: `python -m autobyte.native_build --locked-fd N` (holding the lock)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--locked-fd", type=int, required=True, help="the inherited, locked lock file"
    )
    args = parser.parse_args(argv)
    try:
        os.nice(10)  # the training processes on this host come first
    except OSError:
        pass
    entry = cache_entry()
    if entry is None:
        print("autobyte native build: no source or no torch", file=sys.stderr)
        return 2
    try:
        build(entry)
    except BaseException as error:  # noqa: BLE001 - recorded in failed.json and the log
        print(f"autobyte native build failed: {error}", file=sys.stderr)
        return 1
    finally:
        os.close(args.locked_fd)
    print(f"autobyte native build: done in {entry.folder}")
    return 0


def load_library(path: Path) -> Any:
    """Import a compiled `_native` library from the cache as `autobyte._native` (torch imported)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("autobyte._native", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["autobyte._native"] = module
    return module


if __name__ == "__main__":
    sys.exit(main())
