"""A competing TCP flow for the testbed: a sink that discards, a source that sends as fast as TCP lets.

The testbed runs these inside its namespaces (`Testbed.set_flows`), so the flow crosses a rank's
shaped link and competes with gloo's connections there the way a neighbour's job would: TCP
congestion control (the kernel's, BBR on this machine) shares the tbf rate, and the flow's
backlog sits in the same tbf queue as the ranks' all-reduces.

    python -m benchmarks.testbed.traffic sink --bind 10.217.0.254 --port 5201
    python -m benchmarks.testbed.traffic source --to 10.217.0.254 --port 5201 --flows 2

Both are deliberately light on this 2-core machine: the source calls `sendall` on one 4 MiB
memoryview (no per-call allocation), the sink splices into /dev/null (no copy to user space);
neither imports more than the standard library. The testbed reads their CPU time from /proc before stopping them and
reports it, so the flow's own CPU cost is accounted for, not hidden.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence

CHUNK_BYTES = 4 << 20


def _discard(conn: socket.socket) -> None:
    """Drop what arrives: spliced into /dev/null through a pipe (no copy to user space) where the
    kernel supports it, else recv_into one reused buffer."""
    with conn:
        try:
            if hasattr(os, "splice"):
                read_end, write_end = os.pipe()
                null = os.open(os.devnull, os.O_WRONLY)
                try:
                    while True:
                        moved = os.splice(conn.fileno(), write_end, CHUNK_BYTES)
                        if not moved:
                            return
                        while moved:
                            moved -= os.splice(read_end, null, moved)
                finally:
                    for fd in (read_end, write_end, null):
                        os.close(fd)
            view = memoryview(bytearray(CHUNK_BYTES))
            while conn.recv_into(view):
                pass
        except OSError:
            pass


def sink(bind: str, port: int) -> None:
    """Accept any number of connections and discard what they send, until killed."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((bind, port))
    server.listen(64)
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_discard, args=(conn,), daemon=True).start()


def _send_forever(address: tuple[str, int], connect_timeout_s: float) -> None:
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = socket.create_connection(address, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    conn.settimeout(None)
    view = memoryview(bytes(CHUNK_BYTES))
    try:
        while True:
            conn.sendall(view)
    except OSError:
        pass


def source(to: str, port: int, flows: int, connect_timeout_s: float = 10.0) -> None:
    """`flows` connections to the sink, each sending without pause, until killed."""
    threads = [
        threading.Thread(target=_send_forever, args=((to, port), connect_timeout_s), daemon=True)
        for _ in range(flows)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    sink_parser = sub.add_parser("sink", help="accept connections and discard their bytes")
    sink_parser.add_argument("--bind", required=True)
    sink_parser.add_argument("--port", type=int, required=True)
    source_parser = sub.add_parser("source", help="send to a sink as fast as TCP allows")
    source_parser.add_argument("--to", required=True)
    source_parser.add_argument("--port", type=int, required=True)
    source_parser.add_argument("--flows", type=int, default=1)
    args = parser.parse_args(argv)
    if args.role == "sink":
        sink(args.bind, args.port)
    else:
        if args.flows < 1:
            parser.error(f"--flows must be >= 1, got {args.flows}")
        source(args.to, args.port, args.flows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
