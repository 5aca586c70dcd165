"""Imported once by the fork server that tests/helpers/dist.py starts ranks from: torch, so that no
rank imports it again (seconds of CPU each), with its objects frozen out of the ranks' garbage
collections. Nothing of autobyte: a rank imports it itself, under the environment it is given."""

import gc

import torch
import torch.distributed  # noqa: F401

gc.freeze()
