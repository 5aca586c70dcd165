"""The scheduler: priority + partition + credit gradient synchronisation for torch.distributed.

`ScheduledOptimizer` replaces DistributedDataParallel's gradient sync (DESIGN §3). It wraps a model
and a per-parameter ("element-wise") `torch.optim` optimizer:

* Construction broadcasts every parameter and buffer from rank 0 (as DDP does) and checks the setup;
  unsupported setups (sparse gradients, LBFGS/SparseAdam, mixed dtypes or devices, an optimizer
  holding tensors the model does not own, DDP-wrapped models) raise `ValueError` here.
* Forward pre-hooks record the order in which parameters are first used (the first forward decides;
  rank 0's order is broadcast once so every rank shares one gradient layout). Later forward passes
  wait only for the module's *own* parameters, so layer 1 computes while the last layers' gradients
  are still on the wire (cross-iteration overlap).
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
  local gradients become ready. One thread per rank issues every collective of the data group.
* An update thread waits for a parameter's partitions, then applies that parameter's optimizer update
  with the hyper-parameters captured at the `step()` call of that step (so an LR scheduler that runs
  right after `step()` does not leak into the step still in flight). The user's optimizer object keeps
  the state, so `state_dict()` / `load_state_dict()` and LR schedulers keep working.

Collective-order guarantee (why no configuration of jitter can deadlock or mix up data)
----------------------------------------------------------------------------------------
1. Data-group collectives are issued by exactly one thread per rank (the scheduler thread); the
   layout broadcast happens once, before that thread starts, on a separate decision group.
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
* `step()` returns before the updates land. Use `synchronize()` before reading parameters for a
  checkpoint or an evaluation outside a forward pass (forward passes wait by themselves), and use
  `ScheduledOptimizer.state_dict()` (it synchronises). `param.grad` of managed parameters is None.
* A parameter that no rank used in a step keeps its value and optimizer state (DDP with
  `find_unused_parameters=True` does the same); one used by some ranks gets the average over all.
* One backward per step: gradient accumulation over several backward passes raises.
* Global-norm gradient clipping needs every gradient: pass `clip_grad_norm=max_norm` (and
  `clip_norm_type`). The update thread then waits for all of a step's all-reduces, clips exactly like
  `torch.nn.utils.clip_grad_norm_` on the averaged gradients, and then updates. Overlap with the
  next forward is lost only for that tail; calling `clip_grad_norm_` yourself is not possible
  (gradients are in flight, `param.grad` is None).
* Buffers (e.g. BatchNorm statistics) are broadcast once at construction, not every forward
  (DDP's `broadcast_buffers=False`).
* Construction is collective over the whole default group (it creates one gloo group), so every rank
  must construct its ScheduledOptimizers in the same order; `close()` is collective too.

Untested here (CPU + gloo only): NCCL/CUDA. Nothing assumes CPU: buffers live on the parameters'
device, all-reduces are async work handles, the update thread calls `work.wait()` before using the
result, and the decision channel is always a gloo group on CPU tensors. But CUDA credit accounting
relies on the work future's callback, which NCCL may fire at enqueue time rather than completion; a
CUDA build should poll `work.is_completed()` instead. Untested: several ScheduledOptimizers at once,
process subgroups, `torch.compile`d models.

Where each concern lives: `optimizer` (the public API, setup checks, training-thread hooks), `layout`
(the flat buffer and partition plans), `decisions` (rank 0's decision channel), `dispatch` (the
leader/follower threads that issue collectives), `update` (the optimizer-update thread), `metrics`
(per-step measurements), `progress` (per-parameter step counters shared by the threads), `events`
(the named records that cross threads).
"""

from autobyte.scheduler.optimizer import ScheduledOptimizer
from autobyte.scheduler.progress import SchedulerError

__all__ = ["ScheduledOptimizer", "SchedulerError"]
