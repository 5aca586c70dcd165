"""Static checks that catch real bugs: syntax errors, undefined names, unused imports (pyflakes rules)."""

import subprocess
import sys

from tests.helpers.paths import ROOT


def test_pyflakes_rules_are_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E9,F",
                             "--exclude", "client/autobyte/protocol/*_pb2*", "--output-format", "concise", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
