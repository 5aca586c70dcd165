"""The examples are what a new user copies: they must keep working. The README's own pattern, as
shipped in examples/train_mlp.py, trains under torchrun and streams every step to a daemon;
examples/train_accelerate.py runs as written and as the stock accelerate script it is one import
away from (DDP), and both end with the same parameters."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.helpers.daemon import ThreadDaemon
from tests.helpers.dist import run_launch, torchrun_argv
from tests.helpers.hf import hf_env
from tests.helpers.paths import ROOT


@pytest.mark.timeout(240)
def test_train_mlp_example_trains_and_streams_to_the_daemon(db_url, tmp_path):
    daemon = ThreadDaemon(db_url).start()
    try:
        env = dict(
            os.environ,
            AUTOBYTE_DAEMON=daemon.address,
            AUTOBYTE_JOB="example",
            TMPDIR=str(tmp_path),
            PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT)]),
        )
        job = run_launch(
            torchrun_argv(str(ROOT / "examples" / "train_mlp.py")), env=env, cwd=ROOT, timeout_s=200
        )
        assert job.returncode == 0, job.stderr[-3000:]
        assert "autobyte job example: follow it with `autobyte history example`" in job.stdout, (
            job.stdout
        )
        assert (
            f"model saved to {tmp_path / 'mlp.pt'}" in job.stdout
        )  # TMPDIR, not the working directory
        state = torch.load(tmp_path / "mlp.pt")
        assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
        assert daemon.storage().sample_count("example") == 2 * 200  # every step of both ranks
    finally:
        daemon.stop()


AUTOBYTE_IMPORT = (
    "from autobyte.accelerate import Accelerator  # was: from accelerate import Accelerator"
)


def _run_accelerate_example(script, out, steps=8):
    env = hf_env(out)
    return run_launch(
        torchrun_argv(str(script), "--steps", str(steps), "--output-dir", str(out / "model")),
        env=env,
        cwd=out,
        timeout_s=200,
    )


def _saved_parameters(out):
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def stock_accelerate_run(tmp_path_factory):
    """The example as the stock accelerate script (its one import changed back), under DDP."""
    pytest.importorskip("accelerate", reason="the hf extra: pip install '.[hf]'")
    pytest.importorskip("transformers", reason="the hf extra: pip install '.[hf]'")
    out = tmp_path_factory.mktemp("stock-accelerate")
    source = (ROOT / "examples" / "train_accelerate.py").read_text()
    assert source.count(AUTOBYTE_IMPORT) == 1
    stock = out / "train_accelerate_stock.py"
    stock.write_text(source.replace(AUTOBYTE_IMPORT, "from accelerate import Accelerator"))
    return out, _run_accelerate_example(stock, out)


def _logged_steps(stdout):
    return [
        (int(step), float(loss), float(norm))
        for step, loss, norm in re.findall(
            r"^step (\d+) loss (\S+) grad_norm (\S+)$", stdout, re.MULTILINE
        )
    ]


@pytest.mark.timeout(240)
def test_the_accelerate_example_as_stock_accelerate_trains_under_ddp(stock_accelerate_run):
    out, job = stock_accelerate_run
    assert job.returncode == 0, job.stderr[-3000:]
    logged = _logged_steps(job.stdout)
    assert [step for step, _, _ in logged] == list(range(1, 9)), job.stdout  # rank 0 logs each step
    assert all(norm > 0 for _, _, norm in logged)
    assert len(_saved_parameters(out)) > 10


@pytest.mark.timeout(480)
def test_the_accelerate_example_on_autobyte_ends_with_ddps_parameters(
    stock_accelerate_run, tmp_path
):
    stock_out, stock = stock_accelerate_run
    assert stock.returncode == 0, stock.stderr[-3000:]
    job = _run_accelerate_example(ROOT / "examples" / "train_accelerate.py", tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    # the same norms logged (DDP's, to the bit) and the same parameters
    assert _logged_steps(job.stdout) == _logged_steps(stock.stdout)
    ours, ddps = _saved_parameters(tmp_path), _saved_parameters(stock_out)
    assert ours.keys() == ddps.keys()
    different = [name for name in ours if not torch.equal(ours[name], ddps[name])]
    assert not different, f"differ from DDP's: {different}"
