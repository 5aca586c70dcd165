"""The quick start: autobyted tunes a 2-rank job by itself, before and after a bandwidth drop.

As root (the testbed needs network namespaces): autobyted runs in the testbed's hub namespace; two
gloo ranks train an MLP in their own namespaces over 2 Gbit/s links, streaming to it. The job starts
with a poor configuration (64 KiB partitions: hundreds of small all-reduces); the tuner measures it,
tries better ones and holds the best. At 72 s the links drop to 300 Mbit/s: the tuner notices and
re-tunes. Every 10 s `autobyte status` shows what it is doing; at the end `autobyte history` lists
its decisions with the predicted and the measured step time. About two and a half minutes.

Without root (or with QUICKSTART_TESTBED=0) it falls back to two ranks on loopback (no bandwidth
drop): the tuner still moves the job off its poor starting configuration.

The temporary folder (daemon log and database) is removed at the end, unless the run failed or
QUICKSTART_KEEP=1.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
sys.path.insert(0, str(ROOT))  # benchmarks/ (the testbed) lives in the checkout, not in the package
from benchmarks.testbed import worker_cli
from benchmarks.testbed.host import free_port

JOB = "quickstart"
TRAIN_S = float(os.environ.get("QUICKSTART_SECONDS", "120"))
DROP_AT_S = TRAIN_S * 0.6  # after the first search has settled
START = "sched:64KiB,64KiB"

NEXT = """
What to look at next:
  {activate:<44}autobyte, autobyted and torchrun on your PATH (they live in .venv/bin)
  autobyte --help                             the CLI; it asks a running autobyted (docs/tutorial.md starts one)
  docs/tutorial.md                            your own job by hand: the daemon, a script, status, history, best
  examples/train_mlp.py                       a training script with autobyte (the README's pattern)
  docs/tuner.md, docs/reference.md            the tuner's states, operator control, autobyted's settings
  docs/results.md                             what the scheduler and the tuner gain, measured"""
KEEP_HINT = "To keep this run's daemon log and database, run again with QUICKSTART_KEEP=1."


def say(text: str) -> None:
    print(text, flush=True)


def wait_until_serving(address: str, daemon: subprocess.Popen, timeout_s: float = 30.0) -> bool:
    """Polls the daemon's standard health service until it says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and daemon.poll() is None:
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return True
            except grpc.RpcError:
                time.sleep(0.1)
    return False


def testbed_demo(work: pathlib.Path) -> bool:
    from benchmarks.harness.autobyte_policy import HubDaemon
    from benchmarks.testbed import Testbed, Trace

    trace = Trace.from_times([(0, "2gbit"), (DROP_AT_S, "300mbit")])
    with Testbed(world_size=2, rate="2gbit") as bed:
        hub = HubDaemon(bed, work, job=JOB).start()
        say(f"autobyted runs in the testbed's hub namespace at {hub.address} with {hub.db_url}")
        say(
            f"training 2 gloo ranks for {TRAIN_S:.0f} s, starting with {START} (a poor configuration); "
            f"the links drop from 2 Gbit/s to 300 Mbit/s at {DROP_AT_S:.0f} s\n"
        )

        def cli(*args: str) -> str:
            out = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    bed.hub_ns,
                    str(BIN / "autobyte"),
                    *args,
                    "--daemon",
                    hub.address,
                    "--token",
                    hub.token,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            return out.stdout + out.stderr

        progress = {"steps": 0}

        def on_event(rank: int, event: dict) -> None:
            if rank == 0 and event.get("event") == "step":
                progress["steps"] = event["step"]

        stop = threading.Event()

        def watch() -> None:
            started = time.monotonic()
            header_shown = False
            while not stop.wait(10.0):
                lines = [line for line in cli("status").splitlines() if line.strip()]
                if not lines or not lines[0].startswith("JOB"):
                    continue  # no job yet (or the daemon's answer is not a table)
                if (
                    not header_shown
                ):  # `autobyte status`'s header once; the tuner's line under each row
                    say(lines[0])
                    header_shown = True
                # The status lines as `autobyte status` prints them (within 80 columns), under the time
                say(
                    f"-- {time.monotonic() - started:.0f} s, step {progress['steps']}\n"
                    + "\n".join(lines[1:])
                )

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        command = worker_cli.command(
            model="mlp",
            model_args={"in_features": 512, "hidden": 1024, "depth": 3},
            batch_size=128,
            configs=[START],
            steps=1_000_000,
            warmup=0,
            rounds=1,
            steps_events=True,
            max_seconds=TRAIN_S,
        )
        try:
            run = bed.run(
                command,
                trace=trace,
                on_event=on_event,
                env=hub.env,
                timeout_s=TRAIN_S + 120,
                cwd=str(ROOT),
            )
        finally:
            stop.set()
            watcher.join()
        for change in run.rate_log[1:]:  # the first entry is the starting rate
            say(
                f"\nthe links dropped at {change['t_s']:.0f} s, rank 0's step {change['step']} "
                f"(unix time {change['wall_time']:.1f})"
            )
        say("\n$ autobyte status")
        say(cli("status"))
        say(f"$ autobyte history {JOB}   (the tuner's decisions: who, why, predicted vs measured)")
        say(cli("history", JOB))
        say(f"$ autobyte best {JOB}")
        say(cli("best", JOB))
        hub.stop()
    return True


def loopback_demo(work: pathlib.Path) -> bool:
    port = free_port()
    address = f"127.0.0.1:{port}"
    os.environ.update(AUTOBYTE_DAEMON=address, AUTOBYTE_JOB=JOB)
    log = open(work / "autobyted.log", "w")  # noqa: SIM115 - the daemon's output, closed in the finally below
    say(
        f"(no namespace testbed, so no bandwidth drop) starting autobyted on {address} with "
        f"sqlite:///{work}/autobyte.db"
    )
    daemon = subprocess.Popen(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            address,
            "--db",
            f"sqlite:///{work}/autobyte.db",
            "--tuner",
            "auto",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        if not wait_until_serving(address, daemon):
            say(f"autobyted did not start: {(work / 'autobyted.log').read_text()}")
            return False
        steps = os.environ.get("QUICKSTART_STEPS", "1500")
        say(
            f"training a 2-rank gloo job ({steps} steps) starting with 4 KiB partitions (a poor configuration)"
        )
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(ROOT / "devtools" / "mlp_job.py"),
                "--steps",
                steps,
                "--width",
                "128",
                "--depth",
                "2",
                "--partition",
                "4KiB",
                "--credit",
                "none",
            ],
            check=False,
        )
        if trainer.returncode != 0:
            say("training failed")
            return False
        for args in (("status",), ("history", JOB), ("best", JOB)):
            say(f"\n$ autobyte {' '.join(args)}")
            subprocess.run([str(BIN / "autobyte"), *args], check=False)
        return True
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        log.close()


def activate_path() -> str:
    """The virtual environment's activate script as the user can type it from where they are."""
    relative = os.path.relpath(BIN / "activate")
    return str(BIN / "activate") if relative.startswith("..") else relative


def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-quickstart-"))
    keep = os.environ.get("QUICKSTART_KEEP") == "1"
    ok = False
    try:
        testbed = (
            os.environ.get("QUICKSTART_TESTBED", "1") != "0"
            and os.geteuid() == 0
            and subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode
            == 0
        )
        ok = testbed_demo(work) if testbed else loopback_demo(work)
        return 0 if ok else 1
    finally:
        if keep or not ok:
            say(f"\nautobyted stopped; its log and database are in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            say("\nautobyted stopped; its temporary folder is removed.")
        if ok:
            nxt = NEXT.format(activate=f". {activate_path()}")
            say(nxt if keep else f"{nxt}\n{KEEP_HINT}")


if __name__ == "__main__":
    sys.exit(main())
