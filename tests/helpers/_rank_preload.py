"""Imported once by the fork server that tests/helpers/dist.py starts ranks from: torch, so that no
rank imports it again (seconds of CPU each), and Lightning where installed (5 s of CPU a rank more,
in every rank of tests/test_lightning.py), with their objects frozen out of the ranks' garbage
collections. Nothing of autobyte: a rank imports it itself, under the environment it is given."""

import gc

import torch
import torch.distributed  # noqa: F401

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # the tests that need it skip or fail on their own
    pass

gc.freeze()
