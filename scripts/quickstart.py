"""The quick start's main job: autobyted + a 2-rank gloo training job streaming to it + the CLI."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> None:
    print(f"\n$ autobyte {' '.join(args)}", flush=True)
    subprocess.run([str(BIN / "autobyte"), *args], check=False, env=os.environ)


def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-quickstart-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    os.environ.update(AUTOBYTE_DAEMON=address, AUTOBYTE_JOB="quickstart")
    env = dict(os.environ)
    log = open(work / "autobyted.log", "w")
    print(f"starting autobyted on {address} with sqlite:///{work}/autobyte.db", flush=True)
    daemon = subprocess.Popen([str(BIN / "autobyted"), "start", "--listen", address, "--db",
                               f"sqlite:///{work}/autobyte.db"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        time.sleep(1.0)
        steps = os.environ.get("QUICKSTART_STEPS", "120")
        print(f"training a 2-rank gloo job ({steps} steps) with the scheduler, streaming to autobyted", flush=True)
        trainer = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-port", str(free_port()), str(ROOT / "examples" / "train_mlp.py"),
                                    "--steps", steps], env=env)
        # Until the tuner lands, show the control path with an operator decision mid-run.
        time.sleep(float(os.environ.get("QUICKSTART_PROPOSE_AFTER_S", "8")))
        cli("propose", "quickstart", "--partition", "1MiB", "--credit", "4MiB", "--reason",
            "quick start: operator switches to 1MiB partitions, 4MiB credit")
        if trainer.wait() != 0:
            print("training failed", file=sys.stderr)
            return 1
        cli("status")
        cli("history", "quickstart", "--rank", "0", "--limit", "12")
        cli("best", "quickstart")
        return 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        print(f"\nautobyted stopped (exit {daemon.returncode}); its log and database are in {work}")


if __name__ == "__main__":
    sys.exit(main())
