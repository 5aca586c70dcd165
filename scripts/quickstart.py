"""The quick start's main job: autobyted + a 2-rank gloo training job streaming to it + the CLI."""

from __future__ import annotations

import os
import pathlib
import shutil
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


def wait_until_serving(address: str, daemon: subprocess.Popen, timeout_s: float = 30.0) -> bool:
    """Polls the daemon's standard health service until it says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and daemon.poll() is None:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                time.sleep(0.1)
    return False


NEXT = """
What to look at next:
  - autobyte history quickstart --format json   the same, for scripts (README "JSON output")
  - examples/train_mlp.py                       how a training script uses autobyte (20 lines)
  - README.md "Using it" and "Commands"         the client's behaviour, autobyted's settings
  - benchmarks/README.md                        what the scheduler gains over DDP, measured
To keep this run's daemon log and database, run again with QUICKSTART_KEEP=1."""


def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-quickstart-"))
    keep = os.environ.get("QUICKSTART_KEEP") == "1"
    port = free_port()
    address = f"127.0.0.1:{port}"
    os.environ.update(AUTOBYTE_DAEMON=address, AUTOBYTE_JOB="quickstart")
    env = dict(os.environ)
    log = open(work / "autobyted.log", "w")
    print(f"starting autobyted on {address} with sqlite:///{work}/autobyte.db", flush=True)
    daemon = subprocess.Popen([str(BIN / "autobyted"), "start", "--listen", address, "--db",
                               f"sqlite:///{work}/autobyte.db"], stdout=log, stderr=subprocess.STDOUT, env=env)
    ok = False
    try:
        if not wait_until_serving(address, daemon):
            print(f"autobyted did not start: {(work / 'autobyted.log').read_text()}", file=sys.stderr)
            return 1
        steps = os.environ.get("QUICKSTART_STEPS", "120")
        print(f"training a 2-rank gloo job ({steps} steps) with the scheduler, streaming to autobyted", flush=True)
        trainer = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-port", str(free_port()), str(ROOT / "examples" / "train_mlp.py"),
                                    "--steps", steps], env=env)
        # autobyted does not choose configurations by itself yet: show the control path with an
        # operator's decision in the middle of the run.
        time.sleep(float(os.environ.get("QUICKSTART_PROPOSE_AFTER_S", "8")))
        cli("propose", "quickstart", "--partition", "1MiB", "--credit", "4MiB", "--reason",
            "quick start: operator switches to 1MiB partitions, 4MiB credit")
        if trainer.wait() != 0:
            print("training failed", file=sys.stderr)
            return 1
        cli("status")
        cli("history", "quickstart", "--rank", "0", "--limit", "12")
        cli("best", "quickstart")
        ok = True
        return 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        log.close()
        if keep or not ok:
            print(f"\nautobyted stopped (exit {daemon.returncode}); its log and database are in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            print(f"\nautobyted stopped (exit {daemon.returncode}); its temporary folder is removed.")
        if ok:
            print(NEXT)


if __name__ == "__main__":
    sys.exit(main())
