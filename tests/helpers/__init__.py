"""Helpers the tests import as a package (`from tests.helpers.dist import run_ranks`).

    dist       spawned torch.distributed (gloo) ranks: run_ranks, run_ranks_on
    equiv      DDP vs ScheduledOptimizer training in the same ranks, and their comparison
    rpc        a raw gRPC client of a real daemon, metric samples and batches, SyntheticJob
    tuner      a scripted job and a small real predictor for the tuner's tests
    daemon     a real autobyted in a thread (ThreadDaemon) or as a process, and stopping processes
    cli        the `autobyte` CLI run as a process (run_cli)
    wait       wait_for: poll a condition until it holds
    trainer    a 2-rank torchrun of devtools/mlp_job.py streaming to a daemon
    databases  the DATABASES a storage test runs on (SQLite, PostgreSQL) and their URLs
    paths      ROOT (the checkout) and BIN (the interpreter's scripts folder)
    kinds      what a test needs beyond its process -> the markers tests/conftest.py applies

Free ports and the throwaway PostgreSQL cluster are in `devtools/` (the benchmarks use them too).
"""
