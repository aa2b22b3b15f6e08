"""BatchNorm whose training statistics are those of every worker's batch together, through the communicator.

torch's ``nn.SyncBatchNorm`` refuses CPU tensors and sends its statistics outside any ledger; this module does
the same computation on any device with abtrain's :class:`~abtrain.comm.communicator.Communicator`, in plain
tensor operations (the fused kernels torch's uses, ``torch.batch_norm_stats`` and its kin, have no CPU version),
so every byte is counted (by the ledger's phase of the step: ``warmup``, ``ab``, ``rebound``). In a training
forward each layer gathers every worker's per-channel mean, biased variance and element count (one all-gather of
2·C + 1 floats per worker) and normalises with their combination; its backward sums the per-channel sums of the
gradient and of the gradient times the normalised input over the workers (one all-reduce of 2·C floats), so that
the input's gradient is that of the sum of every worker's loss, as with ``nn.SyncBatchNorm``. The weight's and
bias's gradients stay each worker's own, averaged by the method like any other parameter. The running statistics
are updated from the combined ones, so every worker's agree. Evaluation uses them as BatchNorm does, and nothing
is sent.

:func:`convert_sync_batchnorm` swaps every ``nn.BatchNorm1d/2d/3d`` of a model for this layer, keeping its
parameters and buffers (so ``state_dict`` keys, checkpoints and the exported model are unchanged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...comm.communicator import Communicator
from ...comm.group import Group


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, comm: Communicator, group: Group) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        count = x.numel() // channels
        var_local, mean_local = torch.var_mean(xf, dim=dims, correction=0)
        mine = torch.cat([mean_local, var_local, torch.tensor([float(count)], device=x.device)])
        stats = torch.stack(comm.all_gather(mine, group))  # (workers, 2C + 1)
        means, variances, counts = stats[:, :channels], stats[:, channels:2 * channels], stats[:, -1:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"BatchNorm with statistics over {group.size} workers needs more than one value per "
                             f"channel in all, got {int(total)} (input shape {tuple(x.shape)})")
        mean = (counts * means).sum(0) / total
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / total  # biased, as the normalisation uses
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.comm, ctx.group, ctx.total, ctx.shape = comm, group, total, shape
        out = xhat
        if weight is not None:
            out = out * weight.float().view(shape)
        if bias is not None:
            out = out + bias.float().view(shape)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        shape, channels = ctx.shape, xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        dy = grad_out.float()
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None  # a bias comes with a weight
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = ctx.comm.all_reduce(torch.cat([sum_dy, sum_dy_xhat]), ctx.group)
            mean_dy, mean_dy_xhat = (both[:channels] / ctx.total).view(shape), (both[channels:] / ctx.total).view(shape)
            scale = invstd.view(shape) * (weight.float().view(shape) if weight is not None else 1.0)
            grad_x = (scale * (dy - mean_dy - xhat * mean_dy_xhat)).to(grad_out.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``nn.BatchNorm*d`` with the statistics of every worker of ``group`` in training (see the module docstring).

    Built by :func:`convert_sync_batchnorm`; its parameters and buffers are those of the layer it replaces.
    """

    def __init__(self, num_features: int, comm: Communicator, group: Group, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True, track_running_stats: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.comm, self.group = comm, group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least a 2D input (batch, channels, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training or self.running_mean is None) or self.group.size <= 1:
            return super().forward(input)  # the running statistics, or one worker: BatchNorm's own path
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as BatchNorm's
                momentum = 1.0 / float(self.num_batches_tracked)
        # running_mean/var are None when not tracked, and so outside training on this path
        return _sync_batch_norm(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                momentum, self.comm, self.group)


_apply_uncompiled: Any = None  # the function's apply out of torch.compile's reach, made at its first call


def _sync_batch_norm(*args: Any) -> torch.Tensor:
    """The layer's function, which torch.compile leaves out of its graphs (collectives in the forward and
    backward). Wrapped at the first call, not at import: wrapped at import (every run imports this module), it
    left gloo threads behind a script that compiles after init_process_group and then destroys its process
    group (tests/test_own_loop.py)."""
    global _apply_uncompiled
    if _apply_uncompiled is None:
        _apply_uncompiled = torch.compiler.disable(_SyncBatchNormFunction.apply)
    return _apply_uncompiled(*args)


def convert_sync_batchnorm(module: nn.Module, comm: Communicator, group: Group) -> tuple[nn.Module, int]:
    """``module`` with every ``nn.BatchNorm1d/2d/3d`` replaced by :class:`SyncBatchNorm` over ``group`` (the same
    parameter and buffer tensors), and how many were replaced. A model that is itself such a layer is returned
    replaced."""
    count = 0

    def swap(m: nn.Module) -> nn.Module:
        nonlocal count
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and not isinstance(m, SyncBatchNorm):
            new = SyncBatchNorm(m.num_features, comm, group, m.eps, m.momentum, m.affine, m.track_running_stats)
            new._parameters, new._buffers = m._parameters, m._buffers  # the same tensors, under the same names
            new.training = m.training
            count += 1
            return new
        for name, child in m.named_children():
            replaced = swap(child)
            if replaced is not child:
                setattr(m, name, replaced)
        return m

    return swap(module), count
