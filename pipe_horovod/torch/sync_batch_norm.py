"""Batch normalization over the whole global batch, on CPU and GPU, on every engine.

Horovod's `SyncBatchNorm` and `torch.nn.SyncBatchNorm` both refuse CPU
tensors (they call CUDA-only kernels); this one is plain tensor arithmetic
on pipe_horovod's collectives, so it runs wherever they do, with Horovod's
signature and behaviour: batch statistics are synchronized in training
(and when running statistics are not tracked), evaluation with running
statistics is local, and the affine parameters' gradients stay local (the
DistributedOptimizer averages them like any other).

Forward: each rank computes, per channel, its count n_r, mean m_r and sum of
squared deviations M2_r, and one allgather brings every rank's triple
(Chan et al.'s pairwise combination, which is stable where the sum of
squares minus the squared mean is not):

    N = sum n_r,  mean = sum n_r m_r / N,  var = sum (M2_r + n_r (m_r - mean)^2) / N

Backward of y = w * xhat + b with xhat = (x - mean) * invstd, for the loss
summed over every rank's samples: one allreduce (Sum) of sum(dy) and
sum(dy * xhat), then

    dx = w * invstd * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N).
"""
from typing import Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .mpi_ops import Sum, allgather_async, allreduce_async, size, synchronize


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose statistics come from every rank's batch.

    Why: with a small per-rank batch, each rank's own mean and variance are
    noisy and differ between ranks; normalizing by the global batch's gives
    every rank the statistics one large batch would have. Horovod's
    signature; runs on CPU too (see the module docstring).

    Args:
        num_features: C of an (N, C, ...) input.
        eps: added to the variance, as torch.nn.BatchNorm*'s.
        momentum: of the running statistics; None: a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics for evaluation (then
            evaluation is local, as in Horovod).

    Raises (in forward):
        ValueError: an input of fewer than 2 dimensions, or 1 value per channel
            or fewer across every rank in training.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _run_bn(self, input, momentum):
        return torch.nn.functional.batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias,
            self.training or not self.track_running_stats, momentum, self.eps)

    def forward(self, input):
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:      # cumulative moving average, as torch's BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return self._run_bn(input, momentum)
        if size() == 1:
            return self._run_bn(input, momentum)
        running = self.track_running_stats and self.training
        return _SyncBatchNorm.apply(input, self.weight, self.bias,
                                    self.running_mean if running else None,
                                    self.running_var if running else None, self.eps, momentum)


def _per_channel(tensor, dtype):
    """(C, samples) view of an (N, C, ...) tensor, in `dtype`."""
    return tensor.transpose(0, 1).reshape(tensor.shape[1], -1).to(dtype)


def _channel_shape(values, ndim):
    return values.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        # Statistics in at least float32: half-precision sums lose the batch.
        stat_dtype = torch.promote_types(input.dtype, torch.float32)
        x = _per_channel(input, stat_dtype)
        count = x.shape[1]
        mean = x.mean(1) if count else x.new_zeros(x.shape[0])
        m2 = ((x - mean[:, None]) ** 2).sum(1)
        mine = torch.cat([x.new_tensor([count]), mean, m2]).unsqueeze(0)
        table = synchronize(allgather_async(mine, "sync_batch_norm.stats"))
        counts, means, m2s = table[:, :1], table[:, 1:1 + x.shape[0]], table[:, 1 + x.shape[0]:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel across ranks "
                             f"in training, got {int(total)}")
        global_mean = (counts * means).sum(0) / total
        var = (m2s + counts * (means - global_mean) ** 2).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype),
                                                     alpha=momentum)
                unbiased = var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        shape_mean = _channel_shape(global_mean, input.dim())
        shape_invstd = _channel_shape(invstd, input.dim())
        xhat = (input.to(stat_dtype) - shape_mean) * shape_invstd
        out = xhat
        if weight is not None:
            out = out * _channel_shape(weight.to(stat_dtype), input.dim())
        if bias is not None:
            out = out + _channel_shape(bias.to(stat_dtype), input.dim())
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = total
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        ndim = xhat.dim()
        dy = grad_output.to(xhat.dtype)
        sum_dy = _per_channel(dy, xhat.dtype).sum(1)
        sum_dy_xhat = _per_channel(dy * xhat, xhat.dtype).sum(1)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            both = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xhat]),
                                               name="sync_batch_norm.grad_stats", op=Sum))
            all_dy, all_dy_xhat = both.split(sum_dy.shape[0])
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = _channel_shape(scale, ndim) * (
                dy - _channel_shape(all_dy / ctx.total, ndim)
                - xhat * _channel_shape(all_dy_xhat / ctx.total, ndim))
            grad_input = grad_input.to(grad_output.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
