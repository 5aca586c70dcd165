"""A real wheel: built, installed into a fresh virtual environment with nothing of the checkout on
any path, first without the [daemon] extra (autobyted says which extra it needs), then with it
(autobyted starts, migrates an empty database, and `autobyte status` talks to it)."""

import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT, free_port, stop_process, wait_until_serving


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build_dir = tmp_path_factory.mktemp("src")
    # Build from a copy so the checkout gets no build/ or egg-info litter.
    shutil.copytree(ROOT, build_dir / "src", ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "out", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(build_dir / "src")], check=True, capture_output=True)
    (path,) = out.glob("autobyte-*.whl")
    return path


def source_packages() -> set[str]:
    """Every package of the three source roots, by the name it is imported as."""
    roots = {"client": "autobyte", "autobyted": "autobyted", "migrations": "autobyted.migrations"}
    found = set()
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)))
    return found


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    # every package of the source tree is in the wheel: a new subpackage cannot be forgotten
    shipped = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert source_packages() <= shipped, source_packages() - shipped
    assert "autobyted/storage/sql.py" in names
    assert "autobyte/protocol/autobyte_pb2_grpc.py" in names
    assert "autobyted/migrations/env.py" in names
    assert any(n.startswith("autobyted/migrations/versions/0001") for n in names)
    assert "autobyted/migrations/script.py.mako" in names
    assert {"autobyted/storage/sql.py", "autobyted/tuner/search.py", "autobyted/tuner/prior.model"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/", "client/")) for n in names)
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    base = [line for line in text.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any(dep in " ".join(base) for dep in ("torch", "sqlalchemy", "xgboost"))
    requires = text.splitlines()
    assert any("xgboost-cpu" in line and 'extra == "daemon"' in line for line in requires)
    assert any("grpcio-health-checking" in line and 'extra == "daemon"' in line for line in requires)
    # torch warns "Failed to initialize NumPy" without numpy: the [torch] extra brings it
    assert any(line.startswith("Requires-Dist: numpy") and 'extra == "torch"' in line for line in requires)
    assert not any("torch" in line and 'extra == "daemon"' in line for line in requires)


def test_fresh_venv_base_install_then_daemon_extra(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    # Nothing of the checkout on any path: a temp cwd, no PYTHONPATH, no user site.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", PATH=f"{bin_dir}:{env.get('PATH', '')}")
    work = tmp_path / "work"
    work.mkdir()

    def pip_install(requirement: str) -> None:
        # The test environment's pip installs into the fresh venv (it has no pip of its own); the
        # dependencies come from the package index or pip's cache, the package from the built wheel.
        result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                                 "--disable-pip-version-check", requirement], cwd=work, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]

    def run(*args, timeout=60):
        return subprocess.run([str(a) for a in args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout)

    pip_install(str(wheel))
    where = run(python, "-c", "import autobyte, autobyted, sys; print(autobyte.__file__); "
                              "print(autobyted.__file__); print([p for p in sys.path if p])")
    assert where.returncode == 0, where.stderr
    assert all(str(venv) in line for line in where.stdout.splitlines()[:2]), where.stdout
    assert str(ROOT) not in where.stdout
    # base install: the CLI works, the daemon says which extra it needs
    assert run(bin_dir / "autobyte", "--help").returncode == 0
    bare = run(bin_dir / "autobyted", "start", "--listen", f"127.0.0.1:{free_port()}")
    assert bare.returncode == 6, bare.stderr
    assert "pip install 'autobyte[daemon]'" in bare.stderr and "Traceback" not in bare.stderr
    assert len(bare.stderr.strip().splitlines()) == 1

    pip_install(f"{wheel}[daemon]")
    assert run(python, "-c", "import torch").returncode != 0  # the daemon extra brings no torch
    # the simulator-trained prior ships inside the wheel and loads from the installed package
    prior = run(python, "-c", "from autobyted.tuner.predictor import load_prior; import autobyted.tuner; "
                              "print(autobyted.tuner.__file__, load_prior().meta['kind'])")
    assert prior.stdout.startswith(str(venv)) and prior.stdout.split()[-1] == "prior", prior.stderr
    port = free_port()
    db = tmp_path / "fresh.db"
    proc = subprocess.Popen([str(bin_dir / "autobyted"), "start", "--listen", f"127.0.0.1:{port}", "--db",
                             f"sqlite:///{db}", "--log-format", "text"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(f"127.0.0.1:{port}", proc)
        status = run(bin_dir / "autobyte", "status", "--daemon", f"127.0.0.1:{port}")
        assert status.returncode == 0 and "no jobs yet" in status.stdout, status.stderr
    finally:
        assert stop_process(proc) == 0, proc.stdout.read()
    log = proc.stdout.read()
    assert "ModuleNotFoundError" not in log and "autobyted stopped" in log
    with sqlite3.connect(db) as conn:
        (revision,) = conn.execute("select version_num from alembic_version").fetchone()
        tables = {row[0] for row in conn.execute("select name from sqlite_master where type='table'")}
    heads = sorted(p.name.split("_")[0] for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert revision == heads[-1]
    assert {"jobs", "ranks", "step_metrics", "decisions", "configurations"} <= tables
