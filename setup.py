"""Packages are derived from the folders, so a new subpackage can never be left out of the wheel.

Every folder is its import name: `autobyte` is client/autobyte (client/ is its source root, as
Flower's src/py), `autobyted` is autobyted/. The one mapping is the one the design card forces:
the Alembic environment lives in the top-level migrations/ and ships as `autobyted.migrations`.
Everything below a root that is a package (has an __init__.py) is found by setuptools. Metadata,
dependencies and entry points are in setup.cfg.

The scheduler's native hot path (`autobyte._native`, native/engine.cpp) is built only where it can
be: torch importable in the build environment (so `pip install --no-build-isolation`, as
scripts/setup.sh does: build isolation would have to download torch, which is never a build
requirement) and a C++ compiler on PATH. Anywhere else, and if the compilation fails, the package
builds without it and the scheduler runs its Python path (`autobyte check-build` says why).
AUTOBYTE_BUILD_NATIVE=0 skips it on purpose.

The source itself ships in every wheel (autobyte/csrc/engine.cpp): where the extension was not built
here (pip's default build isolation has no torch), `autobyte.native_build` compiles it on first use
against the torch the training process imports.
"""

import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NATIVE_SOURCES = ["native/engine.cpp"]
# The design card keeps migrations/ at the top level; it ships inside the daemon's package.
MIGRATIONS = {"autobyted.migrations": "migrations"}


def packages() -> list[str]:
    found = find_packages("client", include=["autobyte", "autobyte.*"])
    found += find_packages(".", include=["autobyted", "autobyted.*"])
    for name, folder in MIGRATIONS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


class BuildPyWithNativeSource(build_py):
    """Copies native/engine.cpp into the built package as autobyte/csrc/, for the compile on first use."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install finds native/ in the checkout
        target = os.path.join(self.build_lib, "autobyte", "csrc")
        for source in NATIVE_SOURCES:
            if os.path.exists(source):
                self.mkpath(target)
                self.copy_file(source, os.path.join(target, os.path.basename(source)))


def _say(message: str) -> None:
    print(f"autobyte: {message}", file=sys.stderr)


def native_build() -> dict:
    """setup() arguments for the optional C++ extension, or none (with the reason printed)."""
    if os.environ.get("AUTOBYTE_BUILD_NATIVE", "1") == "0":
        _say("AUTOBYTE_BUILD_NATIVE=0: building without the native hot path")
        return {}
    if not all(os.path.exists(source) for source in NATIVE_SOURCES):
        return {}  # building from an sdist without native/
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as error:  # noqa: BLE001 - any failure to import torch means: no extension
        _say(
            f"building without the native hot path: torch is not importable here ({error}); "
            "install torch first and build with pip's --no-build-isolation to get it"
        )
        return {}
    compiler = (os.environ.get("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        _say(f"building without the native hot path: no C++ compiler ({compiler!r} not found)")
        return {}

    class OptionalBuildExtension(BuildExtension):
        """A failed compilation leaves the Python path, never a failed install."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as error:  # noqa: BLE001
                _say(f"building without the native hot path: compiling {ext.name} failed: {error}")

    extension = CppExtension(
        "autobyte._native",
        NATIVE_SOURCES,
        extra_compile_args=["-O2", f'-DAUTOBYTE_TORCH_VERSION="{torch.__version__}"'],
    )
    return {
        "ext_modules": [extension],
        "cmdclass": {
            "build_ext": OptionalBuildExtension.with_options(use_ninja=bool(shutil.which("ninja")))
        },
    }


native = native_build()
setup(
    package_dir={"autobyte": "client/autobyte", "autobyted": "autobyted", **MIGRATIONS},
    packages=packages(),
    ext_modules=native.get("ext_modules", []),
    cmdclass={"build_py": BuildPyWithNativeSource, **native.get("cmdclass", {})},
)
