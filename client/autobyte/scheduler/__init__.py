"""The scheduler: priority + partition + credit gradient synchronisation for torch.distributed.

`ScheduledOptimizer` replaces DistributedDataParallel's gradient sync (docs/architecture.md, "The
scheduler"). It wraps a model and per-parameter ("element-wise") `torch.optim` optimizers (one, or
a list):

* Construction broadcasts every parameter and buffer from rank 0 (as DDP does) and checks the setup;
  unsupported setups (sparse gradients, LBFGS/SparseAdam, mixed dtypes or devices, an optimizer
  holding tensors the model does not own, DDP-wrapped models) raise `ValueError` here.
* Every read of a parameter is seen (`tracking`: each module's `_parameters` dict becomes a tracking
  dict, plus a forward pre-hook per module for its own parameters): reads record the order of first
  use during the first forward (rank 0's order is broadcast once so every rank shares one gradient
  layout), and every later read — by any module, functional code, `parameters()` iteration,
  `state_dict()`, a deep copy — waits for that parameter's pending update only. So layer 1 computes
  while the last layers' gradients are still on the wire (cross-iteration overlap), and nothing ever
  reads a parameter that is still being reduced or updated.
* A post-accumulate-grad hook copies each gradient (divided by the world size, any strides, e.g.
  channels-last) into one flat buffer laid out in reverse forward order, plus one "used" flag element
  per parameter, and drops `param.grad`. Gradients are owned by the scheduler from then on, so
  `zero_grad()` (ours, the optimizer's or the model's) can never touch a gradient in flight.
* Partitions are zero-copy slices of that buffer: `partition_bytes` slices that fuse small tensors
  and split big ones, or one partition per parameter when `partition_bytes is None` (no partitioning,
  ByteScheduler's baseline).
* Rank 0's scheduler thread pops the highest-priority ready partition (earliest forward use; older
  steps first) while in-flight bytes < `credit_bytes` (`None` = unlimited), publishes the decision and
  issues an async all-reduce. Other ranks' scheduler threads issue exactly rank 0's sequence as their
  local gradients become ready. One thread per rank issues every collective of the data group, a
  communicator of the scheduler's own (`groups`): nothing the user does on any group interleaves.
* An update thread waits for a parameter's partitions, then applies that parameter's optimizer update
  with the hyper-parameters captured at the `step()` call of that step (so an LR scheduler that runs
  right after `step()` does not leak into the step still in flight). The user's optimizer object keeps
  the state, so `state_dict()` / `load_state_dict()` and LR schedulers keep working.

Collective-order guarantee (why no configuration of jitter can deadlock or mix up data)
----------------------------------------------------------------------------------------
1. Data-group collectives are issued by exactly one thread per rank (the scheduler thread) on a
   group nobody else uses (created by the data-parallel group's members only, in construction order);
   the layout broadcast happens once, before that thread starts, on a separate decision group.
2. Rank 0 issues its all-reduces in the order of its decision log and sends each decision batch, as
   (step, offset, length) triples, over a FIFO point-to-point channel (a TCP socket per follower,
   set up once through a dedicated gloo group; gloo isend/irecv on that group if a socket cannot be
   opened) *before* issuing them. A follower issues the triples strictly in log order, so the k-th collective
   of every rank is the same slice of the same layout: same size, same data, on every rank.
3. A follower issues a triple of step s only when every parameter overlapping the slice has produced
   its step-s gradient locally; a step-s gradient is only written after that parameter's step-(s-1)
   update (per-parameter step counters: forward pre-hooks, the gradient hook and `step()` all check
   them), so a decision for step s+1 that arrives early simply waits.
4. Every partition plan covers each element of the buffer exactly once, and a parameter is updated
   when the reduced element count of its slice (data + flag) reaches its size. Because the log
   carries the boundaries, followers never need the configuration: a `reconfigure()` only has to
   take effect on rank 0, at a step boundary (the `step()` call that ends step s fixes the plan of
   step s+1), so a change can neither drop nor duplicate a gradient. Rank 0 also publishes every
   configuration change with the step it starts at, so `last_step_metrics().config` of a step is the
   same on every rank, and `config` on other ranks follows rank 0's (it may lag rank 0 by the
   channel's latency within a step). `reconfigure()` on other ranks is validated but rank 0's word wins.

Semantics that differ from a plain optimizer, on purpose
--------------------------------------------------------
* `step()` returns before the updates land; reads wait for them (above). `synchronize()`, `close()`
  and the end of a `with` block wait for every update; `state_dict()` synchronises. A read of
  `param.grad` after `backward()` waits for the reduced gradients and sees DDP's (`grad_reads`).
* Trainable parameters that no wrapped optimizer holds are reduced first and get their averaged
  gradient in `.grad` by the time `backward()` returns (an autograd end-of-backward callback), as DDP
  gives them, for an optimizer the user steps; with them, unused parameters are flushed at the end of
  backward rather than at `step()`.
* A parameter that no rank used in a step keeps its value and optimizer state (DDP with
  `find_unused_parameters=True` does the same); one used by some ranks gets the average over all. A
  parameter frozen during training is such a parameter. One frozen at construction and unfrozen later
  raises at that step: build a new ScheduledOptimizer, as DDP must be re-wrapped.
* Gradient accumulation goes through `with opt.no_sync():`, as with DDP's `model.no_sync()`
  (`accumulation`, decided at the forward as DDP decides it): micro-batch gradients stay in
  `param.grad`, the last backward (outside it) sends their sum by priority as it appears. Without
  it every backward synchronises, as DDP's does: a second synchronising backward in one step ends
  the step without an update and its gradients are added to the reduced ones before they are
  sent; so are a step's to the last step's where the loop did not clear them (`zero_grad()`), as
  DDP's `.grad` accumulates. The user scales each micro-batch's loss, as with DDP.
* Global-norm gradient clipping (`clip_grad_norm=`) and loss scaling (`grad_scaler=`, see `amp`) need
  every gradient: the update thread waits for all of a step's all-reduces, unscales (skipping the
  step on inf/NaN, the same verdict on every rank), clips exactly like `clip_grad_norm_` (the norm
  summed in `model.parameters()` order, `clipping`, so DDP's bits on every rank) and then updates. Overlap with the next forward is lost for that tail.
* Buffers (e.g. BatchNorm statistics) as DDP's (`buffers`): with `broadcast_buffers=True` (the
  default) rank 0's reach every rank at construction and at the start of each forward pass DDP
  would send them at, from the root forward pre-hook; `broadcast_buffers=False` leaves them alone.
* Construction is collective over the data-parallel group (it creates two groups), so its members
  construct their ScheduledOptimizers in the same order; `close()` is collective too.

CUDA (`device`): credit returns when a polled `work.is_completed()` says the collective finished (NCCL
completes futures at enqueue), the update thread runs on a stream of its own, gradient copies and
parameter reads are ordered with events — no host synchronisation per update batch (the "used" flag
is read back only for parameters this rank did not use). Written for NCCL/CUDA but untested here (no
GPU): tests/test_scheduler_cuda.py runs where one is. `torch.compile`d models compile once
(`compiled`: the compiled forward waits for every update at its start).

Where each concern lives: `optimizer` (the public API, training-thread hooks), `checks` (setup validation),
`tracking` (parameter reads), `buffers` (module buffers), `layout` (the flat buffer and partition plans), `groups` (the scheduler's
communicators), `order_channel` (rank 0's collective-order channel), `dispatch` (the leader/follower threads that
issue collectives), `update` (the optimizer-update thread), `amp` (GradScaler), `device` (CUDA
ordering), `metrics` (per-step measurements), `progress` (per-parameter step counters shared by the
threads), `events` (the named records that cross threads).
"""

from autobyte.scheduler.optimizer import ScheduledOptimizer
from autobyte.scheduler.progress import SchedulerError

__all__ = ["ScheduledOptimizer", "SchedulerError"]
