"""The native hot path from a plain `pip install`: the wheel built with pip's defaults (build isolation
on, so setup.py sees no torch and compiles nothing) ships native/engine.cpp; in a fresh virtual
environment with nothing of the checkout on any path, the first ScheduledOptimizer on the host starts
compiling it in the background (once per host: the other rank finds it under way; each says so in
its one INFO line about the hot path) and trains on the Python path; once the compile is done, the
next job runs the native path with DDP's parameters. `autobyte check-build` says which, and
`--build` waits for the compile.

The fresh venv sees torch (and ninja) through a .pth line to this environment's site-packages, as
tests/test_packaging.py does, so nothing is downloaded but the build backend (setuptools, wheel)
that pip's isolated build installs from the index or its cache. The compile takes a minute or more."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.wheel_job import TWO_RANK_JOB

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def isolated_wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "src"
    shutil.copytree(
        ROOT,
        src,
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
            "_native*.so",
        ),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_BUILD_ISOLATION")}
    # pip's defaults: build isolation on (torch is not in the isolated build environment)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("autobyte-*.whl")
    return path


def test_isolated_wheel_ships_the_source_not_a_build(isolated_wheel):
    names = set(zipfile.ZipFile(isolated_wheel).namelist())
    assert "autobyte/csrc/engine.cpp" in names
    assert not any(n.startswith("autobyte/_native") for n in names)
    shipped = zipfile.ZipFile(isolated_wheel).read("autobyte/csrc/engine.cpp")
    assert shipped == (ROOT / "native" / "engine.cpp").read_bytes()


@pytest.mark.timeout(1200)
def test_plain_install_compiles_on_first_use_then_runs_native(isolated_wheel, tmp_path):
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "borrowed-torch.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    cache = tmp_path / "torch_extensions"
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PYTHONPATH",
            "VIRTUAL_ENV",
            "PYTHONHOME",
            "AUTOBYTE_NATIVE",
            "AUTOBYTE_NATIVE_BUILD",
        )
    }
    # PATH without this environment's bin/: ninja must be found through its Python package
    path = [
        d
        for d in env.get("PATH", "").split(os.pathsep)
        if Path(d).resolve() != Path(sys.executable).parent
    ]
    env.update(
        PYTHONNOUSERSITE="1",
        TORCH_EXTENSIONS_DIR=str(cache),
        PATH=os.pathsep.join([str(bin_dir), *path]),
    )
    work = tmp_path / "work"
    work.mkdir()

    def run(*args, timeout=180):
        return subprocess.run(
            [str(a) for a in args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

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
            str(isolated_wheel),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]

    before = run(bin_dir / "autobyte", "check-build", "--format", "json")
    assert before.returncode == 0, before.stderr
    report = json.loads(before.stdout)
    assert report["native"]["built"] is False and report["native"]["active"] is False
    assert "not compiled for torch" in report["native"]["reason"], report
    assert report["native_build"]["source"] == "not built"
    assert report["native_build"]["compile_source"].startswith(str(venv)), report
    assert report["native_build"]["cache_dir"].startswith(str(cache)), report
    text = run(bin_dir / "autobyte", "check-build").stdout
    assert "source: not built" in text and "check-build --build" in text, text

    script = work / "train.py"
    script.write_text(TWO_RANK_JOB)
    first = run(python, script, work / "first", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    results = [json.loads((work / f"first.{rank}.json").read_text()) for rank in range(2)]
    logs = [(work / f"first.{rank}.log").read_text() for rank in range(2)]
    assert all(r["hot_path"] == "python" and r["diff"] == 0.0 for r in results), results
    # one INFO line per process about its hot path: one process on the host started the compile,
    # the other found it under way
    lines = [[line for line in log.splitlines() if "hot path" in line] for log in logs]
    assert all(len(found) == 1 and "Python hot path" in found[0] for found in lines), logs
    started = [found[0] for found in lines if "in the background" in found[0]]
    waiting = [found[0] for found in lines if "another process on this host" in found[0]]
    assert len(started) == 1 and len(waiting) == 1, logs
    assert sorted(r["reason"] for r in results) == sorted(
        line.split("Python hot path: ", 1)[1] for line in started + waiting
    ), (results, logs)
    assert str(ROOT) not in "".join(logs)

    # check-build --build waits for the compile under way rather than starting a second one
    waited = run(bin_dir / "autobyte", "check-build", "--build", "--format", "json", timeout=900)
    assert waited.returncode == 0, (
        waited.stderr[-3000:],
        (next(cache.rglob("build.log"))).read_text()[-3000:],
    )
    after = json.loads(waited.stdout)
    assert after["native"] == {
        "built": True,
        "active": True,
        "reason": "",
        "built_for_torch": torch.__version__,
    }
    assert after["native_build"]["source"] == "compiled"
    (entry,) = [p for p in cache.glob("autobyte_native/*") if p.is_dir()]
    assert (entry / "complete.json").is_file() and "done" in (entry / "build.log").read_text()

    second = run(python, script, work / "second", timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    for rank in range(2):
        result = json.loads((work / f"second.{rank}.json").read_text())
        assert result == {"hot_path": "native", "reason": "", "diff": 0.0}, result
        log = (work / f"second.{rank}.log").read_text()
        assert "compiling" not in log and "native hot path (autobyte._native" in log, log
