"""What a test needs beyond its own process, read from the code it runs: the markers it gets.

tests/conftest.py marks every collected test by what its code and its fixtures' code reach, so that
a new test file is classified without a line of its own:

    multiprocess  starts processes: spawned torch.distributed ranks (`tests.helpers.dist`),
                  torchrun, an `autobyted` process, the CLI, a wheel build, any `subprocess` or
                  `multiprocessing`
    netns         network namespaces (`benchmarks.testbed`; needs root and iproute2)
    postgres      a throwaway PostgreSQL cluster (`devtools.pgcluster`, the `pg_url`/`pg_cluster`
                  fixtures, the "postgresql" case of `tests.helpers.databases.DATABASES`)
    slow          any of the above: what the fast subset (`-m "not slow"`) leaves out

"Reach" is static: the names a test function uses, followed through the functions and classes of
its own module, tests/ (conftest fixtures included) and the helpers, and through nested functions
and lambdas. A name that resolves to one of the modules below (or to a function or class defined
in one) gives its kind; imports inside a function count too (`import subprocess`; `from
benchmarks.testbed import Testbed` by what `Testbed` is: a module of the tests or the testbed is
imported to look, nothing else is).
"""

from __future__ import annotations

import dis
import importlib
import inspect
import sys
import types
from collections.abc import Iterable

# Module name (or a prefix ending in ".") -> the kind of test that uses it.
KIND_OF_MODULE = {
    "subprocess": "multiprocess",
    "multiprocessing": "multiprocess",
    "multiprocessing.": "multiprocess",
    "torch.multiprocessing": "multiprocess",
    "torch.multiprocessing.": "multiprocess",
    "torch.distributed.run": "multiprocess",
    "concurrent.futures.process": "multiprocess",
    # The testbed itself; its pure parts (rates, traces) run anywhere.
    "benchmarks.testbed.bed": "netns",
    "benchmarks.testbed.namespaces": "netns",
    "benchmarks.testbed.lifecycle": "netns",
    "benchmarks.testbed.runner": "netns",
    "benchmarks.testbed.cli": "netns",
    "devtools.pgcluster": "postgres",
}
KIND_OF_FIXTURE = {"pg_cluster": "postgres", "pg_url": "postgres"}
KINDS = ("multiprocess", "netns", "postgres")
# Code whose own references are followed (the tests' and their helpers'); library code is not.
FOLLOWED_PREFIXES = ("tests.", "test_", "conftest")


def kind_of_module_name(name: str) -> str | None:
    for module, kind in KIND_OF_MODULE.items():
        if name == module or (module.endswith(".") and name.startswith(module)):
            return kind
    return None


def _followed(module_name: str | None) -> bool:
    if not module_name:
        return False
    return module_name == "tests" or module_name.startswith(FOLLOWED_PREFIXES)


class Reach:
    """Walks code objects once each (cached across tests) and returns the kinds they reach."""

    def __init__(self) -> None:
        self._kinds_of_code: dict[types.CodeType, frozenset[str]] = {}

    def kinds_of(self, obj: object) -> frozenset[str]:
        """The kinds reached by a function, a method, a class (its methods) or a module."""
        found: set[str] = set()
        self._visit_object(obj, found)
        return frozenset(found)

    def _visit_object(self, obj: object, found: set[str]) -> None:
        if isinstance(obj, types.ModuleType):
            kind = kind_of_module_name(obj.__name__)
            if kind:
                found.add(kind)
            return
        try:
            module_name = getattr(obj, "__module__", None)
        except Exception:  # noqa: BLE001 - a lazy proxy that fails on attribute access
            return
        if isinstance(module_name, str):
            kind = kind_of_module_name(module_name)
            if kind:
                found.add(kind)
                return
        if not _followed(module_name):
            return
        if isinstance(obj, type):
            for member in vars(obj).values():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    self._visit_object(member, found)
            return
        function = _plain_function(obj)
        if function is not None:
            self._visit_code(function.__code__, function.__globals__, found)

    def _visit_code(self, code: types.CodeType, namespace: dict, found: set[str]) -> None:
        cached = self._kinds_of_code.get(code)
        if cached is not None:
            found |= cached
            return
        own: set[str] = set()
        # In progress: a function that reaches itself adds nothing (mutual recursion between two
        # helpers leaves the inner one's cached kinds short of the outer one's).
        self._kinds_of_code[code] = frozenset()
        for name in code.co_names:
            if name in namespace:
                self._visit_object(namespace[name], own)
        for module_name, names in _imports_in(code):
            kind = kind_of_module_name(module_name)
            if kind:
                own.add(kind)
                continue
            module = _importable(module_name)
            for name in names:
                if module is not None and hasattr(module, name):
                    self._visit_object(getattr(module, name), own)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
                self._visit_code(const, namespace, own)
        self._kinds_of_code[code] = frozenset(own)
        found |= own


def _imports_in(code: types.CodeType) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for each `import m` / `from m import a, b` in a code object."""
    found: list[tuple[str, list[str]]] = []
    for instruction in dis.get_instructions(code):
        if instruction.opname == "IMPORT_NAME":
            found.append((instruction.argval, []))
        elif instruction.opname == "IMPORT_FROM" and found:
            found[-1][1].append(instruction.argval)
    return found


def _importable(module_name: str) -> types.ModuleType | None:
    """The module, when it is one whose contents decide a kind (the tests', the benchmarks');
    a library is never imported only to classify a test."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not (
        _followed(module_name)
        or module_name.startswith("benchmarks.")
        or module_name == "benchmarks"
    ):
        return None
    try:
        return importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - a module that fails to import fails its test, not collection
        return None


def _plain_function(obj: object) -> types.FunctionType | None:
    """The function under methods, functools.wraps wrappers and hypothesis' @given."""
    for _ in range(8):
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None)
        if inner is not None:
            obj = inner
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is None:
            break
        obj = wrapped
    return obj if inspect.isfunction(obj) else None


def kinds_of_test(
    reach: Reach,
    function: object,
    fixture_functions: Iterable[object],
    fixture_names: Iterable[str],
) -> frozenset[str]:
    """The kinds one test needs: from its function, the functions of the fixtures it uses (their
    whole closure) and the fixtures known by name."""
    found = set(reach.kinds_of(function))
    for fixture in fixture_functions:
        found |= reach.kinds_of(fixture)
    found |= {KIND_OF_FIXTURE[name] for name in fixture_names if name in KIND_OF_FIXTURE}
    return frozenset(found)
