"""A real wheel: built, installed into a fresh virtual environment with nothing of the checkout on
any path, first without the [daemon] extra (autobyted says which extra it needs), then with it
(autobyted starts, migrates an empty database, and `autobyte status` talks to it).

The wheel is built the way a machine without a C++ compiler builds it (CXX names no compiler), so it
has no native hot path: it must install, say why in `autobyte check-build`, and train on the Python
path."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from devtools.ports import free_port
from tests.helpers.daemon import stop_process, wait_until_serving
from tests.helpers.paths import ROOT
from tests.helpers.wheel_job import TWO_RANK_JOB


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build_dir = tmp_path_factory.mktemp("src")
    # Build from a copy so the checkout gets no build/ or egg-info litter.
    shutil.copytree(
        ROOT,
        build_dir / "src",
        ignore=shutil.ignore_patterns(
            ".venv",
            ".git",
            "build",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
            "out",
            "results",
        ),
    )
    # No C++ compiler: the build must still succeed, without autobyte._native.
    env = dict(os.environ, CXX=str(build_dir / "no-such-compiler"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(build_dir / "src"),
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    (path,) = out.glob("autobyte-*.whl")
    return path


def source_packages() -> set[str]:
    """Every package of the three source roots, by the name it is imported as."""
    roots = {
        "client/autobyte": "autobyte",
        "autobyted": "autobyted",
        "migrations": "autobyted.migrations",
    }
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
    assert {
        "autobyted/storage/sql.py",
        "autobyted/tuner/search.py",
        "autobyted/tuner/prior.model",
    } <= names
    assert not any(
        n.startswith(("tests/", "benchmarks/", "simulator/", "devtools/", "client/", "native/"))
        for n in names
    )
    assert not any("_native" in n for n in names), "built without a compiler: no native extension"
    assert "autobyte/native_status.py" in names and "autobyte/scheduler/native.py" in names
    assert (
        "autobyte/csrc/engine.cpp" in names
    )  # compiled on first use where a compiler is (native_build)
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    base = [
        line
        for line in text.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert not any(dep in " ".join(base) for dep in ("torch", "sqlalchemy", "xgboost"))
    requires = text.splitlines()
    assert any("xgboost-cpu" in line and 'extra == "daemon"' in line for line in requires)
    assert any(
        "grpcio-health-checking" in line and 'extra == "daemon"' in line for line in requires
    )
    # torch warns "Failed to initialize NumPy" without numpy: the [torch] extra brings it
    assert any(
        line.startswith("Requires-Dist: numpy") and 'extra == "torch"' in line for line in requires
    )
    assert not any("torch" in line and 'extra == "daemon"' in line for line in requires)
    # PostgreSQL is optional: psycopg 3 (with its bundled libpq) comes with the [postgres] extra only
    assert any(
        line.startswith("Requires-Dist: psycopg[binary]") and 'extra == "postgres"' in line
        for line in requires
    )
    assert not any("psycopg" in line for line in base)
    assert any(n.startswith("autobyted/migrations/versions/0004") for n in names)


def test_fresh_venv_base_install_then_daemon_extra(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    # Nothing of the checkout on any path: a temp cwd, no PYTHONPATH, no user site.
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(PYTHONNOUSERSITE="1", PATH=f"{bin_dir}:{env.get('PATH', '')}")
    work = tmp_path / "work"
    work.mkdir()

    def pip_install(requirement: str) -> None:
        # The test environment's pip installs into the fresh venv (it has no pip of its own); the
        # dependencies come from the package index or pip's cache, the package from the built wheel.
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "-q",
                "--disable-pip-version-check",
                requirement,
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    def run(*args, timeout=60):
        return subprocess.run(
            [str(a) for a in args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    pip_install(str(wheel))
    where = run(
        python,
        "-c",
        "import autobyte, autobyted, sys; print(autobyte.__file__); "
        "print(autobyted.__file__); print([p for p in sys.path if p])",
    )
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
    prior = run(
        python,
        "-c",
        "from autobyted.tuner.predictor import load_prior; import autobyted.tuner; "
        "print(autobyted.tuner.__file__, load_prior().meta['kind'])",
    )
    assert prior.stdout.startswith(str(venv)) and prior.stdout.split()[-1] == "prior", prior.stderr
    port = free_port()
    db = tmp_path / "fresh.db"
    proc = subprocess.Popen(
        [
            str(bin_dir / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            f"sqlite:///{db}",
            "--log-format",
            "text",
        ],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
        tables = {
            row[0] for row in conn.execute("select name from sqlite_master where type='table'")
        }
    heads = sorted(p.name.split("_")[0] for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert revision == heads[-1]
    assert {"jobs", "ranks", "step_metrics", "decisions", "configurations"} <= tables


def test_wheel_without_native_runs_the_python_path(wheel, tmp_path):
    """The wheel built without a compiler, in a fresh venv that sees torch (this environment's
    site-packages through a .pth line: its .pth files, e.g. the checkout's editable finder, are not
    processed) but nothing of the checkout: check-build says why there is no native path, and a
    2-rank job trains on the Python path with DDP's parameters."""
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "borrowed-torch.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "AUTOBYTE_NATIVE")
    }
    # no compiler at run time either: nothing is compiled on first use, and the reason says why
    env.update(
        PYTHONNOUSERSITE="1",
        PATH=f"{bin_dir}:{env.get('PATH', '')}",
        CXX=str(tmp_path / "no-such-compiler"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),
    )
    work = tmp_path / "work"
    work.mkdir()
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            str(wheel),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]

    check = subprocess.run(
        [str(bin_dir / "autobyte"), "check-build", "--format", "json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["torch"]["installed"] is True
    assert report["native"]["built"] is False and report["native"]["active"] is False
    assert "not in this installation" in report["native"]["reason"]
    text = subprocess.run(
        [str(bin_dir / "autobyte"), "check-build"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    assert "built no, active no" in text and "why not" in text

    script = work / "train.py"
    script.write_text(TWO_RANK_JOB)
    out = work / "result"
    trained = subprocess.run(
        [str(python), str(script), str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    for rank in range(2):
        result = json.loads((work / f"result.{rank}.json").read_text())
        assert result["hot_path"] == "python", result
        assert (
            "not in this installation" in result["reason"] and "no C++ compiler" in result["reason"]
        )
        assert result["diff"] == 0.0, result
        log = (work / f"result.{rank}.log").read_text()
        lines = [line for line in log.splitlines() if "hot path" in line]
        assert len(lines) == 1 and "Python hot path" in lines[0], log
        assert str(ROOT) not in log
