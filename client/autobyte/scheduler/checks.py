"""The setup checks of a ScheduledOptimizer: the model, the optimizers and the options it is given
are validated (ValueError naming the bad value) before anything collective happens."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

# Optimizers that cannot be updated one parameter at a time (closure-based or sparse-only).
_UNSUPPORTED_OPTIMIZERS = tuple(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam") if hasattr(torch.optim, name)
)


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _UNSUPPORTED_OPTIMIZERS):
        raise ValueError(
            f"{type(optimizer).__name__} cannot be applied one parameter at a time "
            "(closure-based or sparse-only); use an element-wise optimizer such as "
            "SGD, Adam or AdamW"
        )


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "pass the bare module, not a DistributedDataParallel wrapper: "
            "ScheduledOptimizer replaces DDP's gradient sync"
        )
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"module {name or type(module).__name__!r} produces sparse gradients "
                "(sparse=True), which the scheduler cannot partition; use sparse=False"
            )


class Setup(NamedTuple):
    """What the checks established about a model and its optimizers."""

    optimizers: list  # the optimizers, as a list
    params: list  # trainable parameters, each once, in registration order
    index_of: dict  # parameter -> its index in params
    names: dict  # parameter -> its first name in the model
    owner: list  # per parameter: (optimizer index, param group index), or None
    uncovered: list  # per parameter: held by no optimizer given
    frozen: list  # (name, parameter) of floating-point parameters without requires_grad


def check_setup(
    model: Any, optimizer: Any, clip_grad_norm: Any, timeout_s: Any, grad_scaler: Any
) -> Setup:
    """Validate ScheduledOptimizer's arguments; ValueError for the first bad one."""
    check_model(model)
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError("optimizer must be a torch.optim.Optimizer or a non-empty list of them")
    for opt in optimizers:
        check_optimizer(opt)
    if clip_grad_norm is not None and not (
        isinstance(clip_grad_norm, (int, float))
        and not isinstance(clip_grad_norm, bool)
        and 0 < clip_grad_norm < float("inf")
    ):
        raise ValueError(
            f"clip_grad_norm must be a positive finite number or None, got {clip_grad_norm!r}"
        )
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter that requires a gradient")
    first = params[0]
    for p in params:
        if p.dtype != first.dtype or p.device != first.device:
            names = {q: n for n, q in model.named_parameters(remove_duplicate=False)}
            raise ValueError(
                "all trainable parameters must share one dtype and device (autobyte reduces them "
                f"in one buffer): {names.get(first, '?')!r} is {first.dtype} on {first.device}, "
                f"{names.get(p, '?')!r} is {p.dtype} on {p.device}. Keep the weights in one "
                "dtype on one device (model.to(dtype)) and use torch.autocast for mixed precision"
            )
        if not p.dtype.is_floating_point:
            raise ValueError(f"trainable parameters must be floating point, found {p.dtype}")
        if p.layout != torch.strided:
            raise ValueError(f"only dense (strided) parameters are supported, found {p.layout}")
    index_of = {p: i for i, p in enumerate(params)}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    all_model_params = set(model.parameters())
    owner: list[tuple[int, int] | None] = [None] * len(params)
    for k, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if p not in all_model_params:
                    raise ValueError(
                        "the optimizer holds a tensor that is not a parameter of the model"
                    )
                if p in index_of:
                    if owner[index_of[p]] is not None:
                        raise ValueError(f"parameter {names.get(p)!r} is held by two optimizers")
                    owner[index_of[p]] = (k, g)
    uncovered = [owner[i] is None for i in range(len(params))]
    if any(uncovered) and (clip_grad_norm is not None or grad_scaler is not None):
        missing = [names.get(p) for p, u in zip(params, uncovered) if u][:3]
        raise ValueError(
            f"parameters {missing} are in no optimizer given to ScheduledOptimizer: "
            "with clip_grad_norm= or grad_scaler= every trainable parameter must be "
            "updated by the scheduler; pass every optimizer (a list)"
        )
    if grad_scaler is not None:
        if not (hasattr(grad_scaler, "scale") and hasattr(grad_scaler, "_growth_factor")):
            raise ValueError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
            )
        if first.dtype == torch.float16:
            raise ValueError(
                "grad_scaler needs float32 parameters (torch.amp.GradScaler refuses to "
                "unscale float16 gradients); keep the model in float32 under autocast"
            )
    frozen = [
        (name, p)
        for name, p in model.named_parameters()
        if not p.requires_grad and p.dtype.is_floating_point
    ]
    return Setup(optimizers, params, index_of, names, owner, uncovered, frozen)


@dataclasses.dataclass(frozen=True)
class Managed:
    """The parameters a ScheduledOptimizer reduces, fixed at construction; parameter i is
    `params[i]` (registration order) everywhere in the scheduler."""

    params: tuple  # trainable parameters, each once
    names: tuple[str, ...]  # each one's first name in the model
    owner: tuple  # per parameter: (optimizer index, param group index), or None
    uncovered: tuple[bool, ...]  # per parameter: held by no optimizer given (.grad handed back)
    frozen: tuple  # (name, parameter) of floating-point parameters without requires_grad
    sparse_idx: tuple[int, ...]  # weights reduced row-sparse (the same on every rank)
    uncovered_idx: tuple[int, ...]  # the indices of the uncovered
    n: int
    dtype: Any
    device: Any


def managed(setup: Setup, sparse_idx: Any) -> Managed:
    params = setup.params
    return Managed(
        tuple(params),
        tuple(setup.names.get(p, f"#{i}") for i, p in enumerate(params)),
        tuple(setup.owner),
        tuple(setup.uncovered),
        tuple(setup.frozen),
        tuple(sparse_idx),
        tuple(i for i, u in enumerate(setup.uncovered) if u),
        len(params),
        params[0].dtype,
        params[0].device,
    )
