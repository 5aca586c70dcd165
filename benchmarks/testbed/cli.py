"""`python -m benchmarks.testbed`: list testbed namespaces, remove those of dead runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks.testbed.namespaces import NAME_PREFIX, cleanup_stale, list_namespaces


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.testbed", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="delete testbed namespaces and cgroups of runs whose process no longer exists",
    )
    parser.add_argument("--list", action="store_true", help="list testbed namespaces")
    args = parser.parse_args(argv)
    if args.cleanup_stale:
        for item in cleanup_stale():
            print(f"removed {item}")
    if args.list or not args.cleanup_stale:
        for ns in list_namespaces():
            if ns.startswith(NAME_PREFIX + "-"):
                print(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
