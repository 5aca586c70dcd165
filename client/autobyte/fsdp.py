"""autobyte for FSDP2: one call after the user's own `fully_shard` calls.

    model = Transformer()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    sharded = autobyte.fsdp.attach(model, opt)        # measured every step
    sharded.propose(autobyte.fsdp.ShardConfig(forward_prefetch=2))   # rank 0's proposal

What it changes are FSDP2's own communication knobs, none of which changes the arithmetic (the same
all-gathers and reduce-scatters run on the same bytes; only when they are issued, and whether a
group's parameters are gathered again in backward, moves):

- `forward_prefetch`: how many of the next groups (in forward order) each group's all-gather
  issues ahead (`FSDPModule.set_modules_to_forward_prefetch`); 0 is FSDP2's implicit prefetch.
- `backward_prefetch`: how many of the previous groups each group prefetches in backward
  (`set_modules_to_backward_prefetch`); 1 is FSDP2's default (the previous group).
- `reshard_after_forward`: whether the non-root groups free their gathered parameters after
  forward (`set_reshard_after_forward`), trading memory for a second all-gather in backward: one
  bool for every group, or a tuple of one per group in forward order (None: that group as the
  user set it). The root keeps what FSDP2 chose for it.

On CPU (gloo) each collective holds the thread that issued it until it finishes, so FSDP2's
prefetch overlaps nothing there; `attach` issues the all-gathers asynchronously where the
parameters are on CPU (`ShardedJob.set_async_gathers`: the same collectives on the same buffers),
so that a prefetched all-gather runs while the thread computes, as on a GPU's all-gather stream.

A field left None keeps what the user set before `attach` (their own prefetch lists, their own
`reshard_after_forward` per group): `ShardConfig()` is the job exactly as the user built it.

Forward order is recorded in the first step (each group's first forward), as DDP's reducer records
its first-use order; configurations apply from the boundary after it.

Every rank applies a configuration at the same step: rank 0's proposals travel in a small
broadcast on a gloo group of the job's ranks, started at each step boundary and waited at the next
(long since done: it never stalls a step), and every rank applies what it received at that same
boundary (at the proposal's `at_step` if that is later). Other ranks' proposals are ignored, as
`ScheduledOptimizer.reconfigure`'s are.

A step boundary is the optimizer's `step()` (a post-step hook) when the optimizer is given, else
each forward of the root module (a loop that accumulates over several forwards should pass its
optimizer).

Measured per step (`ShardedJob.last_step`, `add_step_callback`): the step's wall time (boundary to
boundary), the root's forward, the rest (backward and the optimizer step), on CUDA the allocator's
peak memory, and per group (`_Traffic`): the time the training thread spent in its all-gathers
(issuing one and waiting for it) and in its reduce-scatter, how many all-gathers it ran, and the
most bytes of gathered parameters held at once (the quantity the memory budget bounds). With
`autobyte.init()` every rank streams these steps to autobyted as an FSDP2 job, and the daemon's
decisions (autobyte.types.Config's FSDP2 fields) arrive through rank 0's `propose` (`_Reported`).

FSDP2 has no hooks for its collectives: `_Traffic` wraps four methods of each of the job's
FSDPParamGroup objects (per instance, removed at `close`). On CPU (gloo) FSDP2 runs each
collective on the training thread, so these times are the waits themselves; on CUDA the
collectives run on their own streams and the times are only what the thread spent issuing and
ordering them (the waits there are on streams, and not measured yet).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autobyte import hooks
from autobyte.hostload import local_peer_pids
from autobyte.records import MemoryLimits, ShardLayout
from autobyte.scheduler.start import measure_latency
from autobyte.tcplinks import rank_addresses
from autobyte.types import Config, StepMetrics, check_depth

logger = logging.getLogger(__name__)

_NONE = -1  # a field left None, on the wire


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """FSDP2's communication knobs (the module docstring); None keeps the user's own setting."""

    forward_prefetch: int | None = None
    backward_prefetch: int | None = None
    reshard_after_forward: bool | tuple[bool | None, ...] | None = None

    def __post_init__(self) -> None:
        check_depth("forward_prefetch", self.forward_prefetch, 0)
        check_depth("backward_prefetch", self.backward_prefetch, 1)
        reshard = self.reshard_after_forward
        if isinstance(reshard, list):
            object.__setattr__(self, "reshard_after_forward", tuple(reshard))
            reshard = self.reshard_after_forward
        each = reshard if isinstance(reshard, tuple) else (reshard,)
        if not each or not all(v is None or isinstance(v, bool) for v in each):
            raise ValueError(
                "reshard_after_forward must be None, a bool or a tuple of one bool (or None) per "
                f"group, got {self.reshard_after_forward!r}"
            )

    def reshard_of(self, index: int) -> bool | None:
        """The setting of the group at `index` in forward order (None: as the user set it)."""
        reshard = self.reshard_after_forward
        return reshard[index] if isinstance(reshard, tuple) else reshard

    def describe(self) -> str:
        def part(name: str, value: Any) -> str:
            return f"{name}={'as set' if value is None else value}"

        return ", ".join(part(f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def encode(self, groups: int) -> list[int]:
        """As integers for the broadcast: the depths, then whether resharding is per group, then
        one value per group (-1: None)."""
        per_group = isinstance(self.reshard_after_forward, tuple)
        return [
            _NONE if self.forward_prefetch is None else self.forward_prefetch,
            _NONE if self.backward_prefetch is None else self.backward_prefetch,
            int(per_group),
            *(_NONE if (v := self.reshard_of(i)) is None else int(v) for i in range(groups)),
        ]

    def to_config(self) -> Config:
        """As autobyted holds it (autobyte.types.Config's FSDP2 fields): one reshard setting for
        every group, so a per-group tuple whose values differ reads as None (as the user set it)."""
        reshard = self.reshard_after_forward
        if isinstance(reshard, tuple):
            reshard = reshard[0] if len(set(reshard)) == 1 else None
        return Config(
            forward_prefetch=self.forward_prefetch,
            backward_prefetch=self.backward_prefetch,
            reshard_after_forward=reshard,
        )

    @classmethod
    def from_config(cls, config: Config) -> ShardConfig:
        """A daemon's configuration; ValueError for one of the scheduler's knobs."""
        config.for_engine("fsdp2")
        return cls(config.forward_prefetch, config.backward_prefetch, config.reshard_after_forward)

    @classmethod
    def decode(cls, values: Sequence[int]) -> ShardConfig:
        forward, backward, per_group, *each = (None if v == _NONE else int(v) for v in values)
        reshard = tuple(None if v is None else bool(v) for v in each)
        return cls(forward, backward, reshard if per_group else (reshard[0] if reshard else None))


@dataclasses.dataclass(frozen=True)
class ShardStep:
    """One step of a sharded job, as measured on this rank."""

    step: int
    step_time_s: float
    forward_s: float
    rest_s: float  # backward and the optimizer step
    peak_memory_bytes: int  # 0: not measurable here (CPU)
    config: ShardConfig
    decision_id: int = 0  # autobyted's decision that set `config` (0: none)
    # per group, by module name ("" the root), as `_Traffic` measures them on the training thread
    all_gather_s: dict[str, float] = dataclasses.field(default_factory=dict)
    all_gathers: dict[str, int] = dataclasses.field(default_factory=dict)
    reduce_scatter_s: dict[str, float] = dataclasses.field(default_factory=dict)
    gathered_peak_bytes: int = 0  # the most bytes of gathered parameters held at once

    @property
    def comm_s(self) -> float:
        """The time the training thread spent in the step's collectives."""
        return sum(self.all_gather_s.values()) + sum(self.reduce_scatter_s.values())


@dataclasses.dataclass
class _Original:
    """What the user set on one group before attach: restored where a field is None."""

    forward: list[Any]
    backward: list[Any]
    reshard: bool


def _fsdp_module_type() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _gathered_bytes(module: Any) -> int:
    """Bytes of the group's own parameters when gathered (unsharded, in the mixed-precision policy's
    parameter dtype where one is set)."""
    return sum(_gathered_bytes_of(g) for g in module._get_fsdp_state()._fsdp_param_groups)


def _gathered_bytes_of(group: Any) -> int:
    """Bytes of one FSDPParamGroup's parameters when gathered."""
    total = 0
    for param in group.fsdp_params:
        # FSDP2 sets param_dtype at its lazy init (the first forward); the policy says it before
        dtype = getattr(param, "param_dtype", None) or group.mp_policy.param_dtype
        total += param._orig_size.numel() * (dtype or param.sharded_param.dtype).itemsize
    return total


def _reshards_after_forward(module: Any) -> bool:
    # FSDP2 has no public getter: a group that reshards after forward has post-forward mesh info.
    state = module._get_fsdp_state()
    groups = state._fsdp_param_groups
    return any(g.post_forward_mesh_info is not None for g in groups)


def check_memory_budget(memory_budget_bytes: Any) -> None:
    """ValueError unless `memory_budget_bytes` is None or a positive int."""
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, int)
        or memory_budget_bytes <= 0
    ):
        raise ValueError(
            f"memory_budget_bytes must be a positive int (bytes), got {memory_budget_bytes!r}"
        )


# the last few broadcasts that completed (ShardedJob._retire): freed later, by the thread that
# appends, or at the interpreter's exit, by its main thread
_RETIRED: collections.deque = collections.deque(maxlen=8)


class _AsyncAllGather:
    """FSDP2's all-gather (the same collective on the same buffers), always issued asynchronously:
    `wait_for_unshard` then waits on the returned work (FSDP2's copy-out does so for any work it is
    given). Installed on a group whose collectives hold the training thread until they finish
    (gloo), so that an all-gather issued ahead (prefetch) runs while the thread computes, as it
    does on a GPU's all-gather stream."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Any:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        # all_gather_single where this torch has it (it deprecates all_gather_into_tensor)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=group, async_op=True)


def _holds_the_thread(group: Any) -> bool:
    """Whether a param group's all-gathers block the calling thread until they finish: on CPU
    (gloo) they do; on CUDA they run on FSDP2's all-gather stream and return at once."""
    device = getattr(group, "device", None)
    return device is not None and device.type == "cpu"


def _fsdp_default(comm: Any) -> bool:
    """Whether a param group's all-gather is FSDP2's own (not a user's `set_custom_all_gather`)."""
    return type(comm).__name__ == "DefaultAllGather"


class _Traffic:
    """Each group's communication as the training thread meets it (the module docstring): the
    time in its all-gathers (`unshard`, which issues one, and `wait_for_unshard`) and its
    reduce-scatter (`post_backward`), the all-gathers issued, and the gathered bytes held, a group
    counting from the all-gather it issues until `reshard` frees its gathered parameters."""

    def __init__(self, modules: dict[str, Any]) -> None:
        self.all_gather_s: dict[str, float] = {}
        self.all_gathers: dict[str, int] = {}
        self.reduce_scatter_s: dict[str, float] = {}
        self.held = 0
        self.peak = 0
        self._wrapped: list[Any] = []
        for name, module in modules.items():
            for group in module._get_fsdp_state()._fsdp_param_groups:
                self._wrap(name, group, _gathered_bytes_of(group))

    def _wrap(self, name: str, group: Any, size: int) -> None:
        state = {"held": False}

        def update() -> None:
            held = group._all_gather_result is not None or group.is_unsharded
            if held != state["held"]:
                state["held"] = held
                self.held += size if held else -size
                self.peak = max(self.peak, self.held)

        def timed(method: Callable[..., Any], into: str) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                issued = group._all_gather_result is None and not group.is_unsharded
                t0 = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    spent = getattr(self, into)  # this step's (take() starts a new one)
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
                    if method.__name__ == "unshard" and issued and group._all_gather_result:
                        self.all_gathers[name] = self.all_gathers.get(name, 0) + 1
                    update()

            return call

        def tracked(method: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                try:
                    return method(*args, **kwargs)
                finally:
                    update()

            return call

        group.unshard = timed(group.unshard, "all_gather_s")
        group.wait_for_unshard = timed(group.wait_for_unshard, "all_gather_s")
        group.post_backward = timed(group.post_backward, "reduce_scatter_s")
        group.reshard = tracked(group.reshard)
        update()
        self._wrapped.append(group)

    def take(self) -> tuple[dict[str, float], dict[str, int], dict[str, float], int]:
        """This step's measurements; the next step's start from what is held now."""
        taken = (self.all_gather_s, self.all_gathers, self.reduce_scatter_s, self.peak)
        self.all_gather_s, self.all_gathers, self.reduce_scatter_s = {}, {}, {}
        self.peak = self.held
        return taken

    def remove(self) -> None:
        for group in self._wrapped:
            for method in ("unshard", "wait_for_unshard", "post_backward", "reshard"):
                vars(group).pop(method, None)  # the class's own again
        self._wrapped = []


class ShardedJob:
    """What `attach` returns: the measured steps and rank 0's proposals of an FSDP2 model."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        config: ShardConfig | None = None,
        group: dist.ProcessGroup | None = None,
        memory_budget_bytes: int | None = None,
        async_gathers: bool | None = None,
    ) -> None:
        fsdp_module = _fsdp_module_type()
        if not isinstance(model, fsdp_module):
            raise ValueError(
                f"autobyte.fsdp.attach needs the root of an FSDP2 model: call fully_shard(model) "
                f"(after fully_shard on its blocks) first; got a {type(model).__name__}"
            )
        if config is not None and not isinstance(config, ShardConfig):
            raise ValueError(f"config must be an autobyte.fsdp.ShardConfig, got {config!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if not dist.is_initialized():
            raise ValueError("autobyte.fsdp.attach needs torch.distributed to be initialized")
        check_memory_budget(memory_budget_bytes)
        if async_gathers is not None and not isinstance(async_gathers, bool):
            raise ValueError(f"async_gathers must be None, True or False, got {async_gathers!r}")
        self.model = model
        self.groups = [m for m in model.modules() if isinstance(m, fsdp_module) and m is not model]
        # every param group's all-gather as FSDP2 (or the user) set it: restored at close
        self._param_groups = [
            g for m in (model, *self.groups) for g in m._get_fsdp_state()._fsdp_param_groups
        ]
        # (None: a torch whose FSDP2 has no custom all-gather hook; its groups stay as they are)
        self._own_gathers = {
            id(g): getattr(g, "_all_gather_comm", None) for g in self._param_groups
        }
        self.async_gathers = False
        self._original = {
            id(m): _Original(
                list(m._get_fsdp_state()._states_to_forward_prefetch),
                list(m._get_fsdp_state()._states_to_backward_prefetch),
                _reshards_after_forward(m),
            )
            for m in self.groups
        }
        self._order: list[Any] | None = None  # groups in first-forward order, after step 0
        self._bytes = {id(m): _gathered_bytes(m) for m in (model, *self.groups)}
        self.memory_budget_bytes = memory_budget_bytes
        self._check_budget(ShardConfig(), "the job as built")
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._leader = 0 if ranks is None else ranks[0]
        # proposals travel on gloo whatever the data backend (a few ints a step, off the data path)
        self._channel = dist.new_group(ranks, backend="gloo")
        # the job's other ranks on this host (autobyte.hostload: their CPU is not others' load)
        self.local_job_pids = local_peer_pids(self._channel)
        # each rank's address (autobyte.tcplinks: the peer of a queued link, named by its rank)
        self.rank_addresses = rank_addresses(self._channel)
        self._lock = threading.Lock()
        # rank 0's (config, at_step, decision_id): decision_id is autobyted's (0: the script's own)
        self._proposal: tuple[ShardConfig, int, int] | None = None
        self._sent = 0  # proposals rank 0 has sent (a new one is told apart by its number)
        self._received = 0
        self._incoming: tuple[Any, torch.Tensor] | None = None  # the broadcast in flight
        # received, waiting for its step: (config, at_step, decision_id)
        self._pending: tuple[ShardConfig, int, int] | None = None
        self.config = ShardConfig()
        self.decision_id = 0  # autobyted's decision that set self.config (0: none)
        self.step = 0  # steps completed
        self._seen: list[Any] = []
        self._callbacks: list[Callable[[ShardStep], Any]] = []
        self.last_step: ShardStep | None = None
        self._t_start = time.perf_counter()
        self._t_forward_end: float | None = None
        self._forward_s = 0.0
        names = {id(m): n for n, m in model.named_modules()}
        self._traffic = _Traffic({names[id(m)]: m for m in (model, *self.groups)})
        self._handles = [m.register_forward_pre_hook(self._group_forward) for m in self.groups]
        self._handles.append(model.register_forward_pre_hook(self._root_forward_begins))
        self._handles.append(model.register_forward_hook(self._root_forward_ends))
        self._per_forward = optimizer is None
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_stepped))
        self._cuda = torch.cuda.is_available() and any(
            p.device.type == "cuda" for p in model.parameters()
        )
        self._closed = False
        # one small all-reduce on the job's group (the scheduler's measure): the daemon's model of
        # the schedule prices each collective with it (autobyted/tuner/shard_schedule.py)
        self.collective_latency_s = (
            measure_latency(group, self._device(), torch.float32) if self.world > 1 else 0.0
        )
        # last, once nothing of attach can fail: a refused attach leaves the model as it was
        self.set_async_gathers(
            async_gathers
            if async_gathers is not None
            else any(_holds_the_thread(g) for g in self._param_groups)
        )
        # rank 0's first proposal: the caller's, else the start derived from the job (rank 0's
        # and every other rank's groups and budget are the same, so is the derived start)
        start = self.derived_config() if config is None else config
        if start != ShardConfig() and self.rank == 0:
            self.propose(start)
        # autobyte.init() streams this job's steps to autobyted and applies its decisions (at once
        # if init() ran before, else when it runs): the session hears of it as of a scheduler.
        self.report = _Reported(self)
        hooks.scheduler_created(self.report)

    # ------------------------------------------------------------------ public
    def propose(
        self, config: ShardConfig, at_step: int | None = None, *, decision_id: int = 0
    ) -> None:
        """Ask for `config` on every rank from the next step boundary (or from step `at_step`);
        rank 0's proposal is the one that takes effect; a newer one replaces a pending one.
        `decision_id` is autobyted's, when the proposal is its decision (the steps carry it)."""
        if not isinstance(config, ShardConfig):
            raise ValueError(f"config must be an autobyte.fsdp.ShardConfig, got {config!r}")
        if at_step is not None and (
            isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0
        ):
            raise ValueError(f"at_step must be a non-negative int, got {at_step!r}")
        reshard = config.reshard_after_forward
        if isinstance(reshard, tuple) and len(reshard) != len(self.groups):
            raise ValueError(
                f"reshard_after_forward has {len(reshard)} values for {len(self.groups)} groups "
                "(one per group that fully_shard made below the root, in forward order)"
            )
        self._check_budget(config, config.describe())
        with self._lock:
            self._proposal = (config, at_step or 0, decision_id)

    def set_async_gathers(self, on: bool) -> None:
        """Issue every group's all-gathers asynchronously (`on`), or as FSDP2 does (off). On gloo,
        whose collectives hold the training thread until they finish, FSDP2's prefetch cannot
        overlap anything: the thread that would compute waits in the prefetched all-gather. With
        asynchronous all-gathers it runs while the thread computes, as on a GPU's all-gather
        stream; the same collectives run on the same buffers (the parameters are FSDP2's to the
        bit). `attach` turns it on where the job's parameters are on CPU (gloo); a group with a
        custom all-gather of the user's keeps it. Call it on every rank between steps."""
        if not isinstance(on, bool):
            raise ValueError(f"set_async_gathers takes True or False, got {on!r}")
        for group in self._param_groups:
            own = self._own_gathers[id(group)]
            if own is None:
                continue
            group._all_gather_comm = _AsyncAllGather() if on and _fsdp_default(own) else own
        self.async_gathers = on

    def gathered_bytes(self, config: ShardConfig) -> int:
        """The most bytes of gathered (unsharded) parameters the job holds at once under `config`,
        predicted from the groups' sizes in forward order (module order before the first step
        ends): while group i runs forward, the groups its and the earlier groups' forward prefetch
        reached, and every earlier group that keeps its parameters after forward; while group i
        runs backward, the groups the backward prefetch of it and of the later groups reached, and
        every earlier group still kept; the root's own parameters throughout. A field left None
        counts as the user set it (their prefetch lists by length; FSDP2's implicit backward
        prefetch is 1)."""
        order = self._ordered()
        n = len(order)
        size = [self._bytes[id(m)] for m in order]
        ahead, behind, keep = [], [], []
        for i, module in enumerate(order):
            original = self._original[id(module)]
            forward, backward = config.forward_prefetch, config.backward_prefetch
            ahead.append(len(original.forward) if forward is None else forward)
            behind.append(max(1, len(original.backward)) if backward is None else backward)
            reshard = config.reshard_of(i)
            keep.append(not (original.reshard if reshard is None else reshard))
        peak, reach, low = 0, -1, n
        for i in range(n):  # forward
            reach = max(reach, i + ahead[i])
            held = sum(size[j] for j in range(i) if keep[j]) + sum(size[i : min(n, reach + 1)])
            peak = max(peak, held)
        for i in reversed(range(n)):  # backward
            low = max(0, min(low, i - behind[i]))
            held = sum(size[j] for j in range(low) if keep[j]) + sum(size[low : i + 1])
            peak = max(peak, held)
        return self._bytes[id(self.model)] + peak

    def derived_config(self) -> ShardConfig:
        """Where the job starts when `attach` is given no config: the first of these predicted
        within the memory budget (`gathered_bytes`), else the job as built:

        1. every group keeps its gathered parameters after forward, and forward prefetch 1;
        2. every group keeps them;
        3. forward prefetch 1.

        Keeping removes a step's second all-gather of every group (in backward): a third less
        traffic on a ring, no more compute, at the cost of holding every group's parameters from
        its forward to its backward. Forward prefetch 1 issues the next group's all-gather as a
        group's forward begins, so it runs while the group computes (FSDP2's implicit prefetch
        issues it only when the next group's forward begins: overlapped on a GPU, whose CPU runs
        ahead, not where the collectives are issued from the thread that computes), at the cost
        of one more group gathered. Both change when collectives run, never what they compute.
        Memory is never traded silently: without a budget the job starts as built, and a knob the
        user set before attach (any group's forward prefetch list, resharding already off) is
        theirs. The daemon's tuner starts from here too."""
        if self.memory_budget_bytes is None or not self.groups:
            return ShardConfig()
        own = [self._original[id(m)] for m in self.groups]
        forward = None if any(o.forward for o in own) else 1
        keep = None if all(not o.reshard for o in own) else False
        candidates = [
            ShardConfig(forward_prefetch=forward, reshard_after_forward=keep),
            ShardConfig(reshard_after_forward=keep),
            ShardConfig(forward_prefetch=forward),
        ]
        for candidate in candidates:
            if self.gathered_bytes(candidate) <= self.memory_budget_bytes:
                return candidate
        return ShardConfig()

    def over_budget(self) -> frozenset[ShardConfig]:
        """Every setting of the knobs autobyted may decide (forward prefetch as set or 0-3,
        backward as set or 1-3, resharding as set, on or off for every group: 60 points) that is
        predicted over the memory budget (empty without one). Forward order is the first step's
        once it has run, the modules' order before."""
        if self.memory_budget_bytes is None:
            return frozenset()
        return frozenset(
            config
            for forward in (None, *range(4))
            for backward in (None, *range(1, 4))
            for reshard in (None, True, False)
            if self.gathered_bytes(config := ShardConfig(forward, backward, reshard))
            > self.memory_budget_bytes
        )

    def _check_budget(self, config: ShardConfig, what: str) -> None:
        """ValueError where `config` is predicted to hold more than the memory budget: a
        configuration over it is never applied (the daemon's decision is then not applied, and
        says why in the rank's log)."""
        budget = self.memory_budget_bytes
        if budget is None:
            return
        need = self.gathered_bytes(config)
        if need > budget:
            raise ValueError(
                f"{what} would hold {need:,} bytes of gathered parameters at once (predicted from "
                f"the groups' sizes), over memory_budget_bytes={budget:,}; prefetch fewer groups "
                "or reshard more of them after forward, or raise the budget"
            )

    def add_step_callback(self, fn: Callable[[ShardStep], Any]) -> None:
        """fn(ShardStep) on the training thread after each step (exceptions logged, swallowed)."""
        if not callable(fn):
            raise ValueError("the step callback must be callable")
        self._callbacks.append(fn)

    @property
    def forward_order(self) -> list[str]:
        """The groups' names in first-forward order (empty before the first step ends)."""
        names = {id(m): n for n, m in self.model.named_modules()}
        return [names[id(m)] for m in self._order or []]

    def layout(self) -> ShardLayout:
        """Each group's gathered bytes in forward order (as built before the first step), the
        root's own and whether the all-gathers are asynchronous: what the daemon's model of the
        schedule needs (autobyte.records.ShardLayout)."""
        return ShardLayout(
            tuple(self._bytes[id(m)] for m in self._ordered()),
            self._bytes[id(self.model)],
            self.async_gathers,
        )

    def _device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _ordered(self) -> list[Any]:
        """The groups in forward order, then any the first forward did not run."""
        order = list(self._order or [])
        return order + [m for m in self.groups if all(m is not o for o in order)]

    def close(self) -> None:
        """Remove the hooks and the proposal channel; the model keeps its current settings."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._traffic.remove()
        self.set_async_gathers(False)
        if self._incoming is not None:
            self._incoming[0].wait()
            self._retire()
        dist.destroy_process_group(self._channel)

    # ------------------------------------------------------------------ hooks
    def _group_forward(self, module: nn.Module, _args: Any) -> None:
        if self._order is None and all(module is not m for m in self._seen):
            self._seen.append(module)

    def _root_forward_begins(self, _module: nn.Module, _args: Any) -> None:
        if self._per_forward and self._t_forward_end is not None:
            self._boundary()
        self._t_forward_begin = time.perf_counter()

    def _root_forward_ends(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        now = time.perf_counter()
        self._forward_s += now - self._t_forward_begin
        self._t_forward_end = now

    def _optimizer_stepped(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._boundary()

    # ------------------------------------------------------------------ the boundary
    def _boundary(self) -> None:
        if self._closed:
            return
        now = time.perf_counter()
        forward_end = self._t_forward_end if self._t_forward_end is not None else now
        peak = 0
        if self._cuda:
            peak = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        all_gather_s, all_gathers, reduce_scatter_s, gathered_peak = self._traffic.take()
        measured = ShardStep(
            self.step,
            now - self._t_start,
            self._forward_s,
            now - forward_end,
            peak,
            self.config,
            self.decision_id,
            all_gather_s,
            all_gathers,
            reduce_scatter_s,
            gathered_peak,
        )
        self.step += 1
        self._t_start, self._forward_s, self._t_forward_end = now, 0.0, None
        if self._order is None:
            self._order = list(self._seen)
            self._seen = []
        self._exchange()
        self.last_step = measured
        for fn in self._callbacks:
            try:
                fn(measured)
            except Exception:  # a callback never breaks the step
                logger.exception("autobyte.fsdp step callback failed")

    def _exchange(self) -> None:
        """Wait for the broadcast started at the last boundary (every rank, the same content),
        apply what is due, and start the next one."""
        if self._incoming is not None:
            work, payload = self._incoming
            work.wait()
            self._retire()
            number = int(payload[0])
            if number > self._received:
                self._received = number
                self._pending = (
                    ShardConfig.decode(payload[3:].tolist()),
                    int(payload[1]),
                    int(payload[2]),
                )
        if self._pending is not None and self.step >= self._pending[1]:
            config, _, decision_id = self._pending
            self._pending = None
            self._apply(config)
            self.decision_id = decision_id
        # [proposal number, at_step, decision id, the configuration (ShardConfig.encode)]
        payload = torch.zeros(6 + len(self.groups), dtype=torch.int64)
        if self.rank == 0:
            with self._lock:
                proposal, self._proposal = self._proposal, None
            if proposal is not None:
                self._sent += 1
                config, at_step, decision_id = proposal
                payload[:] = torch.tensor(
                    [self._sent, at_step, decision_id, *config.encode(len(self.groups))]
                )
            else:
                payload[0] = self._sent
        if self.world > 1:
            work = dist.broadcast(payload, src=self._leader, group=self._channel, async_op=True)
            self._incoming = (work, payload)
        else:
            self._incoming = (_Done(), payload)

    def _retire(self) -> None:
        """Keep the completed broadcast's work and tensor referenced a while longer, beyond this
        job's life (`_RETIRED`): gloo's worker thread drops its own reference just after `wait()`
        returns, and were that the last, it would free a Python tensor, which needs the GIL; at
        the interpreter's exit that thread cannot get it and the process aborts ("terminate called
        without an active exception", seen at the end of FSDP2 jobs)."""
        _RETIRED.append(self._incoming)
        self._incoming = None

    def _apply(self, config: ShardConfig) -> None:
        order = self._order or []
        for i, module in enumerate(order):
            original = self._original[id(module)]
            if config.forward_prefetch is None:
                module._get_fsdp_state()._states_to_forward_prefetch = list(original.forward)
            else:
                module.set_modules_to_forward_prefetch(
                    order[i + 1 : i + 1 + config.forward_prefetch]
                )
            if config.backward_prefetch is None:
                module._get_fsdp_state()._states_to_backward_prefetch = list(original.backward)
            elif config.backward_prefetch == 1:
                module.set_modules_to_backward_prefetch([])  # FSDP2's default: the previous group
            else:
                first = max(0, i - config.backward_prefetch)
                module.set_modules_to_backward_prefetch(order[first:i][::-1])
        for index, module in enumerate(self._ordered()):
            reshard = config.reshard_of(index)
            if reshard is None:
                reshard = self._original[id(module)].reshard
            module.set_reshard_after_forward(reshard, recurse=False)
        self.config = config


class _Reported:
    """A sharded job as autobyte's session streams and steers it (autobyte/transport/): what a
    ScheduledOptimizer offers the reporter, for FSDP2. Its steps become StepMetrics (the step,
    forward and the rest as backward_s, the time in collectives as exposed_comm_s; bytes_reduced is the parameters' bytes, partitions the
    groups); autobyted's decisions set FSDP2's knobs (autobyte.types.Config) through `propose`."""

    engine_name = "fsdp2"

    def __init__(self, job: ShardedJob) -> None:
        self._job = job
        self.model = job.model
        self.process_group = job.group
        self.local_job_pids = job.local_job_pids
        self.rank_addresses = job.rank_addresses
        self._bytes = sum(p.numel() * p.element_size() for p in job.model.parameters())
        self._partitions = len(job.groups) + 1

    @property
    def config(self) -> Config:
        return self._job.config.to_config()

    def memory_limits(self) -> MemoryLimits | None:
        """The budget and the configurations over it, for the job's registration (autobyted
        never decides one of them); None without a budget."""
        budget = self._job.memory_budget_bytes
        if budget is None:
            return None
        return MemoryLimits(budget, frozenset(c.to_config() for c in self._job.over_budget()))

    @property
    def collective_latency_s(self) -> float:
        return self._job.collective_latency_s

    def shard_layout(self) -> ShardLayout:
        """The groups for the job's registration (autobyted's model of the schedule)."""
        return self._job.layout()

    def add_step_callback(self, fn: Callable[[StepMetrics], Any]) -> None:
        self._job.add_step_callback(lambda step: fn(self._metrics(step)))

    def _metrics(self, step: ShardStep) -> StepMetrics:
        return StepMetrics(
            step=step.step,
            wall_time_s=time.time(),
            step_time_s=step.step_time_s,
            forward_s=step.forward_s,
            backward_s=step.rest_s,
            exposed_comm_s=step.comm_s,
            bytes_reduced=self._bytes,
            partitions=self._partitions,
            config=step.config.to_config(),
            decision_id=step.decision_id,
        )

    def apply_decision(self, config: Config, decision_id: int, at_step: int) -> None:
        """autobyted's decision (autobyte/transport/control.py); ValueError for the scheduler's
        knobs, changing nothing."""
        self._job.propose(ShardConfig.from_config(config), at_step, decision_id=decision_id)

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Every step is measured at its boundary: nothing runs on after it."""


class _Done:
    def wait(self) -> None:
        return None


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    config: ShardConfig | None = None,
    group: dist.ProcessGroup | None = None,
    memory_budget_bytes: int | None = None,
    async_gathers: bool | None = None,
) -> ShardedJob:
    """Measure an FSDP2 model's steps and apply `ShardConfig`s on every rank at the same step
    (the module docstring). Call it on every rank, after every `fully_shard` call; `config`, if
    given, is rank 0's first proposal (`ShardConfig()`: the job as built), else the job starts
    from the configuration derived from it (`ShardedJob.derived_config`: with a memory budget,
    the gathered parameters kept after forward and forward prefetch 1 where they fit; without
    one, as built). `memory_budget_bytes`: the most bytes of gathered
    parameters the job may hold at once (`ShardedJob.gathered_bytes`); a proposal predicted over
    it is refused (ValueError), a daemon's decision over it is not applied. `async_gathers`:
    issue the all-gathers asynchronously (`ShardedJob.set_async_gathers`; None: where the
    parameters are on CPU)."""
    return ShardedJob(model, optimizer, config, group, memory_budget_bytes, async_gathers)
