"""A real wheel: built, installed outside the checkout, gives both commands and finds its migrations."""

import os
import shutil
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


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
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
    assert any("xgboost-cpu" in line and 'extra == "daemon"' in line for line in text.splitlines())


def test_installed_wheel_migrates_an_empty_database_and_serves(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    assert (target / "bin" / "autobyted").exists() and (target / "bin" / "autobyte").exists()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import autobyte, autobyted; print(autobyte.__file__); "
                            "print(autobyted.__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert all(line.startswith(str(target)) for line in where.stdout.split()), where.stdout
    prior = subprocess.run([sys.executable, "-c", "from autobyted.tuner.predictor import load_prior; "
                            "import autobyted.tuner; print(autobyted.tuner.__file__, load_prior().meta['kind'])"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert prior.stdout.startswith(str(target)) and prior.stdout.split()[-1] == "prior", prior.stderr
    port = free_port()
    db = tmp_path / "fresh.db"
    proc = subprocess.Popen([sys.executable, str(target / "bin" / "autobyted"), "start", "--listen",
                             f"127.0.0.1:{port}", "--db", f"sqlite:///{db}", "--log-format", "text"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(f"127.0.0.1:{port}", proc)
        status = subprocess.run([sys.executable, str(target / "bin" / "autobyte"), "status", "--daemon",
                                 f"127.0.0.1:{port}"], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert status.returncode == 0 and "no jobs yet" in status.stdout, status.stderr
    finally:
        assert stop_process(proc) == 0
    import sqlite3

    with sqlite3.connect(db) as conn:
        (revision,) = conn.execute("select version_num from alembic_version").fetchone()
    from autobyted.storage.db import head_revision

    assert revision == head_revision()
