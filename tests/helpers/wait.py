"""Polling a condition in a test until it holds, or failing the test with what it waited for."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s=20.0, what="condition", show=lambda: ""):
    """predicate()'s first truthy value; after timeout_s an AssertionError naming `what` and, if
    given, what `show()` says about the state at that moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    shown = show()
    raise AssertionError(
        f"timed out after {timeout_s:.0f} s waiting for {what}" + (f": {shown}" if shown else "")
    )
