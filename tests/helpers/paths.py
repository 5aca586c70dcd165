"""Where things are: the checkout the tests run from and the interpreter's scripts folder."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/paths.py -> the checkout
BIN = Path(sys.executable).parent  # console scripts (autobyted, autobyte) of this interpreter
