"""Global-norm gradient clipping of a whole step's reduced gradients, exactly as
`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` computes it after DDP's backward.

The total norm is a floating-point sum over per-tensor norms, so its bits depend on the order of
the tensors: it is summed in `model.parameters()` order (the scheduler's parameter indices), never
in the order the gradients happened to complete (which differs per rank and per run: replicas
drifted apart), and with torch's own functions, so foreach or not gives what DDP's users get.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def clip_in_parameter_order(
    grads_by_index: Sequence[tuple[int, torch.Tensor]],
    max_norm: float,
    norm_type: float,
    foreach: bool | None = None,
) -> torch.Tensor | None:
    """Clip the gradients (index, tensor) in place to `max_norm`; returns the total norm (None if
    there is no gradient). Indices are positions in `model.parameters()`."""
    if not grads_by_index:
        return None
    grads = [grad for _, grad in sorted(grads_by_index, key=lambda item: item[0])]
    total = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    # clip_grads_with_norm_'s arithmetic (it reads p.grad, so it cannot take the buffer's views);
    # an element-wise product: foreach or per tensor gives the same bits
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return total
