"""Shared fixtures (real daemons in a thread or as a process, SQLite and PostgreSQL databases) and
the markers each test gets from what it needs (tests/helpers/kinds.py); helpers: tests/helpers/."""

from __future__ import annotations

import atexit
import shutil
import signal
import tempfile

import pytest

from devtools.ports import free_port
from tests.helpers.daemon import ThreadDaemon, start_daemon_process, stop_process
from tests.helpers.kinds import KINDS, Reach, kinds_of_test
from tests.helpers.turns import Turns

_REACH = Reach()


# ---------------------------------------------------------------------- two tests at a time
# Under pytest-xdist (scripts/test.sh runs `-n 2`) a test marked `alone` runs with no other test
# beside it (tests/helpers/turns.py); one at a time (`-n 0`, or no xdist) nothing changes.

_TURNS: Turns | None = None


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--turns",
        choices=("all", "shared", "alone"),
        default="all",
        help="run every test (all), only those that may run beside another (shared), or only "
        "those marked alone; scripts/test.sh runs shared two at a time, then alone",
    )


def pytest_configure(config) -> None:
    global _TURNS
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and "autobyte_turns" in workerinput:
        _TURNS = Turns(workerinput["autobyte_turns"])
    elif workerinput is None and (getattr(config.option, "numprocesses", None) or 0) > 0:
        config.autobyte_turns = tempfile.mkdtemp(prefix="autobyte-turns-")


def pytest_unconfigure(config) -> None:
    global _TURNS
    if _TURNS is not None:
        _TURNS.close()
        _TURNS = None
    folder = getattr(config, "autobyte_turns", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist's, on the controller, for each worker
    folder = getattr(node.config, "autobyte_turns", None)
    if folder is not None:
        node.workerinput["autobyte_turns"] = folder


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's whole protocol: its setup (module fixtures starting rank pools) and
    teardown count as its own."""
    if _TURNS is None:
        yield
        return
    with _TURNS.hold(alone=item.get_closest_marker("alone") is not None):
        yield


def pytest_ignore_collect(collection_path, config):
    """`--turns alone`: a test file that marks no test `alone` (its text never names the marker) is
    not imported at all. Collecting every file imports torch, Lightning and transformers for
    tests that are then deselected: 11 s of the alone part's CPU."""
    if (
        config.getoption("turns") == "alone"
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and "mark.alone" not in collection_path.read_text(errors="replace")
    ):
        return True
    return None


def pytest_collection_modifyitems(config, items) -> None:
    """Marks each test multiprocess / netns / postgres by what its code and fixtures reach, and
    slow when it has any of those: `-m "not slow"` is the fast subset a developer runs. With
    `--turns shared|alone`, keeps only the tests of that part."""
    part = config.getoption("turns")
    if part != "all":
        keep = [
            i for i in items if (i.get_closest_marker("alone") is not None) == (part == "alone")
        ]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        fixture_functions = []
        if info is not None:
            for name in item.fixturenames:
                definitions = info.name2fixturedefs.get(name) or ()
                fixture_functions += [definition.func for definition in definitions]
        kinds = set(kinds_of_test(_REACH, function, fixture_functions, item.fixturenames))
        kinds |= {kind for kind in KINDS if item.get_closest_marker(kind) is not None}
        for kind in sorted(kinds):
            if item.get_closest_marker(kind) is None:
                item.add_marker(kind)
        if kinds and item.get_closest_marker("slow") is None:
            item.add_marker("slow")
    items[:] = heaviest_files_first(items)


# A test's weight in the file order below: roughly its seconds of CPU on this host (a testbed's
# namespaces and ranks; processes, each importing torch; in-process work).
_WEIGHT = {"netns": 8.0, "multiprocess": 3.0, "postgres": 1.0}


def heaviest_files_first(items: list) -> list:
    """The tests file by file, the files in falling order of their tests' weight (_WEIGHT by the
    kinds each test is marked), each file's tests in their own order. scripts/test.sh hands whole
    files to its two workers (`--dist loadfile`: a module's fixtures start once, on one worker)
    in this order, so the last files to start are short ones and neither worker idles long while
    the other finishes a heavy file."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(tests: list) -> float:
        return sum(
            max([0.1] + [w for kind, w in _WEIGHT.items() if t.get_closest_marker(kind)])
            for t in tests
        )

    order = sorted(files, key=lambda name: (-weight(files[name]), name))
    return [item for name in order for item in files[name]]


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'autobyte.db'}"


# ---------------------------------------------------------------------- PostgreSQL
# One throwaway cluster per test session (initdb/pg_ctl of the system's server, run as `postgres`
# when the suite runs as root), one fresh database per test. Started only when a test asks.


@pytest.fixture(scope="session")
def pg_cluster():
    from devtools.pgcluster import PgCluster, PgUnavailable

    try:
        cluster = PgCluster.start()
    except PgUnavailable as error:
        pytest.fail(f"{error}; the PostgreSQL tests need it", pytrace=False)
    atexit.register(cluster.stop)  # also when the session ends abnormally
    try:
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)


@pytest.fixture
def pg_url(pg_cluster):
    url = pg_cluster.create_database()
    yield url
    pg_cluster.drop_database(url)


@pytest.fixture
def thread_daemon(db_url):
    daemon = ThreadDaemon(db_url).start()
    yield daemon
    daemon.stop()


@pytest.fixture
def daemon_process(db_url):
    port = free_port()
    proc = start_daemon_process(db_url, port)
    proc.address = f"127.0.0.1:{port}"
    yield proc
    stop_process(proc, signal.SIGKILL)
