"""The docs agree with the code: the shell blocks a page marks `<!-- runnable -->` run as written, typed
into a new shell from the clone (the README's first commands, the tutorial's steps), and every flag the
command synopses name is one the command takes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from typing import NamedTuple

import pytest

from devtools.ports import free_port
from tests.helpers.cli import newcomer_env, run_shell
from tests.helpers.paths import BIN, ROOT

MARK = re.compile(
    r"^<!-- runnable(?:: (?P<how>[a-z]+))? -->\n```sh\n(?P<text>.*?)^```$", re.MULTILINE | re.DOTALL
)
VENV_BIN = ROOT / ".venv" / "bin"
needs_the_setup_venv = pytest.mark.skipif(
    BIN != VENV_BIN,
    reason=f"the pages' commands use {VENV_BIN}, which scripts/setup.sh makes; "
    f"these tests run from {BIN}",
)


class Block(NamedTuple):
    """A shell block a page marks runnable; `how` is "background" for one that runs until stopped."""

    how: str
    text: str


def runnable_blocks(page: str) -> list[Block]:
    return [
        Block(m.group("how") or "", m.group("text"))
        for m in MARK.finditer((ROOT / page).read_text())
    ]


def test_the_runnable_marks_are_found():
    assert [b.how for b in runnable_blocks("README.md")] == [""]
    assert [b.how for b in runnable_blocks("docs/tutorial.md")] == ["background", "", ""]


@needs_the_setup_venv
def test_the_readme_leaves_a_newcomer_one_line_from_the_cli():
    (block,) = runnable_blocks("README.md")
    assert block.text.splitlines()[0].startswith(". .venv/bin/activate")
    # Without that line the tools are not found (the issue this block answers) ...
    if shutil.which("autobyte", path=newcomer_env()["PATH"]) is None:  # none installed elsewhere
        missing = run_shell("autobyte --help", cwd=ROOT)
        assert missing.returncode == 127 and "autobyte: command not found" in missing.stdout
    # ... with it, every tool the README and the tutorial name answers.
    shell = run_shell(block.text + "autobyted --help\ntorchrun --help\n", cwd=ROOT)
    assert shell.returncode == 0, shell.stdout
    assert "autobyte: what the daemon sees" in shell.stdout and "Usage: autobyted" in shell.stdout


def _wait_until_answering(address: str, daemon: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert daemon.poll() is None, daemon.stdout.read()
        status = subprocess.run(
            [str(BIN / "autobyte"), "status", "--daemon", address],
            capture_output=True,
            check=False,
        )
        if status.returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"the tutorial's daemon did not answer at {address} in {timeout_s} s")


@needs_the_setup_venv
@pytest.mark.timeout(300)
def test_the_tutorial_runs_as_written(tmp_path):
    # The clone as the tutorial's reader sees it, in a folder of the test's own: the commands are the
    # page's, verbatim; only the port is not the default 7077, which the test must not take from
    # whatever else runs on this machine (the environment variables the page's commands read).
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    address = f"127.0.0.1:{free_port()}"
    env = newcomer_env(AUTOBYTED_LISTEN=address, AUTOBYTE_DAEMON=address, TMPDIR=str(tmp_path))
    start, train, watch = runnable_blocks("docs/tutorial.md")
    assert start.how == "background"
    daemon = subprocess.Popen(
        ["bash", "-c", start.text],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_until_answering(address, daemon)
        assert (tmp_path / "tutorial.db").is_file()  # "creates tutorial.db"
        trained = run_shell(train.text, cwd=tmp_path, env=env, timeout=240)
        assert trained.returncode == 0, trained.stdout[-3000:]
        assert "autobyte job tutorial" in trained.stdout  # "Rank 0 prints the job id"
        watched = run_shell(watch.text, cwd=tmp_path, env=env, timeout=120)
        assert watched.returncode == 0, watched.stdout[-3000:]
        assert re.search(r"^tutorial\s+finished\s+2/2\s+200\s", watched.stdout, re.MULTILINE), (
            watched.stdout
        )
        assert (tmp_path / "tutorial.png").stat().st_size > 0
        # Step 4's note: a finished job refuses a proposal, exit 1
        late = run_shell(
            ".venv/bin/autobyte propose tutorial --partition 1MiB --credit 4MiB", tmp_path, env
        )
        assert late.returncode == 1 and "no process would apply the decision" in late.stdout
    finally:
        # Step 5: Ctrl-C in the daemon's terminal (SIGINT to its foreground process group)
        os.killpg(daemon.pid, signal.SIGINT)
        output, _ = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, output[-3000:]


def _synopses(page: str, heading: str) -> list[str]:
    """The command lines of the first code block after `heading` (a continuation line, indented,
    joins the line above)."""
    text = (ROOT / page).read_text()
    block = text[text.index(heading) :].split("```")[1]
    lines: list[str] = []
    for line in block.splitlines()[1:]:
        if line.startswith(" ") and lines:
            lines[-1] += line
        elif line.strip():
            lines.append(line)
    return lines


def _help(program: str, command: str) -> str:
    result = subprocess.run(
        [str(BIN / program), command, "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{program} {command}: {result.stderr}"
    return result.stdout


@pytest.mark.parametrize(
    ("page", "heading"), [("README.md", "## Commands"), ("docs/reference.md", "## Commands")]
)
def test_every_flag_the_synopses_name_is_taken(page, heading):
    checked = 0
    for line in _synopses(page, heading):
        program, *words = line.split()
        assert program in ("autobyte", "autobyted"), line
        head = []
        for word in words:
            if word.startswith(("[", "--")):
                break
            head += [w for w in word.split("|") if re.fullmatch(r"[a-z][a-z-]*", w)]
        assert head, line
        for command in head:
            helptext = _help(program, command)
            for flag in re.findall(r"--[a-z][a-z-]*", line):
                assert flag in helptext, f"{page}: `{program} {command}` has no {flag}: {line}"
                checked += 1
    assert checked > 10


PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:client|autobyted|tests|scripts|examples|benchmarks|docs|devtools|simulator"
    r"|native|protos|migrations|\.ci)/[\w./*{},-]*[\w*}])"
)


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [
        expanded
        for choice in match.group(1).split(",")
        for expanded in _expand_braces(pattern[: match.start()] + choice + pattern[match.end() :])
    ]


@pytest.mark.parametrize("page", PAGES)
def test_every_file_and_module_a_page_names_exists(page):
    import importlib.util

    text = (ROOT / page).read_text()
    missing = [
        path
        for named in sorted(set(REPO_PATH.findall(text)))
        for path in _expand_braces(named)
        if not (ROOT / path).exists() and not list(ROOT.glob(path))
    ]
    assert not missing, f"{page} names files the repository does not hold: {missing}"
    modules = sorted(set(re.findall(r"python -m ([\w.]+)", text)))
    unknown = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not unknown, f"{page} runs modules that do not exist: {unknown}"
