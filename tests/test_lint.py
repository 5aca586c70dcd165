"""Static checks: pyflakes' rules (real bugs), then ruff's linter and formatter with the settings
pyproject.toml states ([tool.ruff]: line length, target version, rules, exclusions)."""

import subprocess
import sys

from tests.helpers.paths import ROOT

PROJECT_SETTINGS = ROOT / "pyproject.toml"


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


def test_pyflakes_rules_are_clean():
    result = _ruff(
        "check",
        "--isolated",
        "--select",
        "E9,F",
        "--exclude",
        "client/autobyte/protocol/*_pb2*",
        "--output-format",
        "concise",
        str(ROOT),
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_check_is_clean_with_the_project_settings():
    result = _ruff(
        "check",
        "--config",
        str(PROJECT_SETTINGS),
        "--output-format",
        "concise",
        "--no-cache",
        str(ROOT),
    )
    assert result.returncode == 0, (
        result.stdout[-6000:] + result.stderr + "\n(`ruff check --fix .` fixes those marked [*])"
    )


def test_ruff_format_leaves_every_file_as_it_is():
    result = _ruff(
        "format",
        "--check",
        "--config",
        str(PROJECT_SETTINGS),
        "--output-format",
        "concise",
        "--no-cache",
        str(ROOT),
    )
    assert result.returncode == 0, (
        result.stdout[-6000:] + result.stderr + "\n(`ruff format .` rewrites them)"
    )
