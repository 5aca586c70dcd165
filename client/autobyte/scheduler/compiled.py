"""`torch.compile`d models under the scheduler: compile once, with no guard on per-step state.

Dynamo traces the scheduler's parameter-read hooks (the tracking dicts, module pre-hooks) like any
Python code, so a hook reading the step counter made every step recompile (the recompile limit hit
after 8 steps, then eager). Inside a trace the read hooks therefore do nothing
(`torch.compiler.is_compiling()`), and the model's root forward pre-hook runs eagerly — a graph
break at the top of the forward (`run_eagerly`) — where, when called from compiled code, it waits
for *every* parameter's pending update before the graph runs. The compiled forward thus overlaps
the previous step's communication only until it starts (the eager path waits per parameter, at its
first use); the backward's gradient hooks run in the autograd engine as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

_EVAL_FRAME_SUFFIX = ("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py")


def run_eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as torch.compile sees it: never traced (a graph break), always run in Python."""
    return torch.compiler.disable(fn, recursive=True)


def called_from_compiled_code(depth: int = 40) -> bool:
    """Whether a torch.compile'd frame is on the stack: a frame of Dynamo's wrappers other than the
    `_fn` of `run_eagerly`'s own wrapper (the eager call has only that one)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_filename.endswith(_EVAL_FRAME_SUFFIX) and code.co_name != "_fn":
            return True
        frame = frame.f_back
    return False
