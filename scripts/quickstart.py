"""The quick start: autobyted tunes a 2-rank job on the namespace testbed, before and after a drop.

As root (the testbed needs network namespaces): autobyted runs in the testbed's hub namespace; two
gloo ranks train an MLP in their own namespaces over 2 Gbit/s links, streaming to it. The job starts
with a poor configuration (64 KiB partitions: hundreds of small all-reduces); the tuner measures it,
tries better ones and holds the best. At 72 s the links drop to 300 Mbit/s: the tuner notices and
re-tunes. Every 10 s `autobyte status` shows what it is doing; at the end `autobyte history` lists
its decisions with the predicted and the measured step time. About two and a half minutes.

Without root it falls back to two ranks on loopback (no bandwidth drop): the tuner still moves the
job off its poor starting configuration.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
sys.path.insert(0, str(ROOT))  # benchmarks/ (the testbed) lives in the checkout, not in the package

JOB = "quickstart"
TRAIN_S = float(os.environ.get("QUICKSTART_SECONDS", "120"))
DROP_AT_S = TRAIN_S * 0.6  # after the first search has settled
START = "sched:64KiB,64KiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(text: str) -> None:
    print(text, flush=True)


def testbed_demo(work: pathlib.Path) -> int:
    from benchmarks.autobyte_policy import HubDaemon
    from benchmarks.testbed import Testbed, Trace

    trace = Trace.from_times([(0, "2gbit"), (DROP_AT_S, "300mbit")])
    with Testbed(world_size=2, rate="2gbit") as bed:
        hub = HubDaemon(bed, work, job=JOB).start()
        say(f"autobyted runs in the testbed's hub namespace at {hub.address} ({hub.db_url}); "
            f"log: {hub.log_path}")
        say(f"training 2 gloo ranks for {TRAIN_S:.0f} s, starting with {START} (a poor configuration); "
            f"the links drop from 2 Gbit/s to 300 Mbit/s at {DROP_AT_S:.0f} s\n")

        def cli(*args: str) -> str:
            out = subprocess.run(["ip", "netns", "exec", bed.hub_ns, str(BIN / "autobyte"), *args,
                                  "--daemon", hub.address, "--token", hub.token],
                                 capture_output=True, text=True)
            return out.stdout + out.stderr

        progress = {"steps": 0, "t0": None}

        def on_event(rank: int, event: dict) -> None:
            if rank == 0 and event.get("event") == "step":
                progress["steps"] = event["step"]

        stop = threading.Event()

        def watch() -> None:
            started = time.monotonic()
            while not stop.wait(10.0):
                lines = [line for line in cli("status").splitlines()[1:] if line.strip()]
                say(f"[{time.monotonic() - started:5.0f} s] step {progress['steps']:5d}  "
                    + ("\n" + " " * 20).join(lines))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        command = [sys.executable, "-m", "benchmarks.train_worker", "--model", "mlp", "--model-args",
                   json.dumps({"in_features": 512, "hidden": 1024, "depth": 3}), "--batch-size", "128",
                   "--configs", START, "--steps", "1000000", "--warmup", "0", "--rounds", "1",
                   "--steps-events", "--max-seconds", str(TRAIN_S)]
        try:
            bed.run(command, trace=trace, on_event=on_event, env=hub.env, timeout_s=TRAIN_S + 120,
                    cwd=str(ROOT))
        finally:
            stop.set()
        say("\n$ autobyte status")
        say(cli("status"))
        say(f"$ autobyte history {JOB} --rank 0 --limit 3   (the tuner's decisions: predicted vs measured)")
        say(cli("history", JOB, "--rank", "0", "--limit", "3"))
        say(f"$ autobyte best {JOB}")
        say(cli("best", JOB))
        hub.stop()
    return 0


def loopback_demo(work: pathlib.Path) -> int:
    port = free_port()
    address = f"127.0.0.1:{port}"
    os.environ.update(AUTOBYTE_DAEMON=address, AUTOBYTE_JOB=JOB)
    log = open(work / "autobyted.log", "w")
    say(f"(not root: no namespace testbed, so no bandwidth drop) starting autobyted on {address}")
    daemon = subprocess.Popen([str(BIN / "autobyted"), "start", "--listen", address, "--db",
                               f"sqlite:///{work}/autobyte.db", "--tuner", "auto"], stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        time.sleep(1.5)
        say("training a 2-rank gloo job starting with 4 KiB partitions (a poor configuration)")
        trainer = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-port", str(free_port()), str(ROOT / "examples" / "train_mlp.py"),
                                  "--steps", "1500", "--width", "128", "--depth", "2", "--partition", "4KiB",
                                  "--credit", "none"])
        if trainer.returncode != 0:
            say("training failed")
            return 1
        for args in (("status",), ("history", JOB, "--rank", "0", "--limit", "3"), ("best", JOB)):
            say(f"\n$ autobyte {' '.join(args)}")
            subprocess.run([str(BIN / "autobyte"), *args], check=False)
        return 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-quickstart-"))
    try:
        if os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0:
            return testbed_demo(work)
        return loopback_demo(work)
    finally:
        say(f"\nthe daemon's log and database are in {work}")


if __name__ == "__main__":
    sys.exit(main())
