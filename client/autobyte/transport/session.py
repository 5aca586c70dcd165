"""A process's session with autobyted: init/shutdown, attaching each ScheduledOptimizer to the
reporter, and what a rank registers with (its place in the job, the model's fingerprint)."""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import weakref
from typing import Any

from autobyte import hooks, jobid
from autobyte.channel import daemon_address, daemon_addresses, daemon_token
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.transport.place import RankPlace
from autobyte.transport.reporter import Reporter, warn_user
from autobyte.types import MAX_WORLD_SIZE, summarize_tensor_sizes

_lock = threading.Lock()
_reporter: Reporter | None = None
_atexit_registered = False


def init(
    daemon: str | None = None,
    job: str | None = None,
    token: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    buffer_samples: int = 10_000,
    tls_ca: str | None = None,
    flush_interval_s: float = 1.0,
    tune: bool = True,
) -> Reporter | None:
    """Connect this process to autobyted. Every ScheduledOptimizer created afterwards (and any already
    created) streams its step metrics and accepts the daemon's configurations. Defaults come from
    AUTOBYTE_DAEMON, AUTOBYTE_JOB (else torchrun's --rdzv-id, else an id derived from the torchrun
    launch, the same on every rank: `autobyte.jobid`), AUTOBYTE_TOKEN, RANK and WORLD_SIZE;
    without RANK/WORLD_SIZE they come from the optimizer's process group. Never blocks on the network.
    `daemon` may list several daemons that share one database ("host1:7077,host2:7077"): a rank
    starts with the (rank mod N)-th and moves on to the next whenever the one it uses fails.
    `tune=False` keeps the daemon's tuner away from this job (it still records and shows it; an
    operator's `autobyte propose` still applies). A malformed AUTOBYTE_DAEMON warns once and returns
    None (training goes on, nothing is streamed); a malformed `daemon` argument is a ValueError."""
    global _reporter
    # torchrun's run id is "none" unless --rdzv-id is given: then one is derived from the launch
    job = jobid.job_id_for(job, os.environ)
    if rank is None and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    if (
        rank is not None
        and world_size is not None
        and (world_size < 1 or not 0 <= rank < world_size)
    ):
        raise ValueError(f"rank {rank} is not within world size {world_size}")
    if world_size is not None and world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world size {world_size} exceeds autobyted's limit of {MAX_WORLD_SIZE}")
    if buffer_samples < 1:
        raise ValueError(f"buffer_samples={buffer_samples} must be positive")
    if not 0 < flush_interval_s <= 60:
        raise ValueError(f"flush_interval_s={flush_interval_s} must be in (0, 60] seconds")
    if daemon is not None:
        daemon_addresses(
            daemon
        )  # ValueError for a malformed address in the code, before anything starts
    else:
        try:
            daemon_addresses()
        except ValueError as error:
            # A malformed AUTOBYTE_DAEMON is the environment's mistake, not the script's: training goes
            # on without a daemon, as for a wrong token, and the user is told once.
            _warn_unusable_environment(
                f"autobyte metrics go nowhere: AUTOBYTE_DAEMON={os.environ.get('AUTOBYTE_DAEMON')!r} "
                f"is not usable ({error}); training goes on without autobyted"
            )
            return None
    with _lock:
        if _reporter is not None:
            _reporter.close()
        _reporter = Reporter(
            daemon_address(daemon),
            job,
            rank,
            world_size,
            daemon_token(token),
            buffer_samples,
            tls_ca,
            flush_interval_s,
            tune,
        )
        for optimizer in list(_pending_optimizers):
            attach(_reporter, optimizer)
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(shutdown)  # a short, bounded flush when the training script ends
            _atexit_registered = True
        return _reporter


_warned_environment: set[str] = set()


def _warn_unusable_environment(message: str) -> None:
    """Once per message and process (every init() of a script would repeat it)."""
    if message not in _warned_environment:
        _warned_environment.add(message)
        warn_user(message)


def shutdown(timeout_s: float = 2.0) -> None:
    """Record the last steps, flush what can be flushed within timeout_s, tell the daemon this rank
    is finished, and stop the background threads. Runs at exit by itself; call it after the last
    `step()` (never concurrently with one). Never raises, never waits longer than timeout_s."""
    global _reporter
    with _lock:
        if _reporter is not None:
            _reporter.close(timeout_s)
            _reporter = None


_pending_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()


def on_optimizer_created(optimizer) -> None:
    """Called by ScheduledOptimizer's constructor (through `autobyte.hooks`); attaches it if init()
    was called."""
    _pending_optimizers.add(optimizer)
    reporter = _reporter
    if reporter is not None:
        attach(reporter, optimizer)


hooks.on_scheduler_created(on_optimizer_created)


def attach(reporter: Reporter, optimizer) -> None:
    """Stream `optimizer`'s steps through `reporter`: where this rank sits, what the model is."""
    reporter.attach(
        optimizer,
        _place_of(optimizer, reporter.rank, reporter.world_size),
        model_fingerprint(optimizer.model.parameters()),
        _backend_of(optimizer),
    )


def model_fingerprint(parameters) -> pb.ModelFingerprint:
    sizes, digest = [], hashlib.sha256()
    count = 0
    for p in parameters:
        sizes.append(p.numel() * p.element_size())
        count += p.numel()
        digest.update(f"{tuple(p.shape)}:{p.dtype};".encode())
    return pb.ModelFingerprint(
        parameter_count=count,
        digest=digest.hexdigest()[:32],
        **summarize_tensor_sizes(sizes)._asdict(),
    )


def _place_of(optimizer, rank: int | None, world_size: int | None) -> RankPlace:
    """The job-wide rank and world size (the default group's) unless given (or set by RANK/
    WORLD_SIZE), and the rank within the optimizer's data-parallel group."""
    dp_rank = dp_size = dp_leader = None
    try:
        import torch.distributed as dist

        group = getattr(optimizer, "process_group", None)
        if dist.is_available() and dist.is_initialized():
            from autobyte.scheduler.groups import place_in

            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
            dp_rank, dp_size, dp_leader = place_in(group)
    except Exception:  # noqa: BLE001, S110 - a transport that is not torch.distributed
        pass
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if dp_rank is None or dp_rank < 0:
        dp_rank, dp_size, dp_leader = rank, world_size, 0
    return RankPlace(rank, world_size, dp_rank, dp_size, dp_leader)


def _backend_of(optimizer) -> str:
    try:
        import torch.distributed as dist

        return str(dist.get_backend(getattr(optimizer, "process_group", None)))
    except Exception:  # noqa: BLE001 - not initialised, or a transport that is not torch.distributed
        return "unknown"
