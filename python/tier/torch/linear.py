"""A linear layer whose backward reads the weight through the Parameter, not a saved view.

``torch.nn.functional.linear`` saves ``weight.t()`` for backward: a view of the weight's storage
at forward time. tier releases a parameter's device copy after forward and brings it back before
backward (possibly at another address), so a saved view would point at memory the engine may
have reused. While a tier engine runs forward, ``F.linear`` is replaced by :func:`linear`, which
saves the Parameter object itself and reads ``weight`` at backward time, when the backward
pre-hook has put it back in place.
"""

import contextlib
import threading

import torch
import torch.nn.functional as F

_original_linear = F.linear
_active = threading.local()


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input)
        ctx.weight = weight  # the Parameter: its .data is current again at backward time
        ctx.has_bias = bias is not None
        return _original_linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        weight = ctx.weight
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight.to(grad_output.dtype))
        if ctx.needs_input_grad[1]:
            g2 = grad_output.reshape(-1, grad_output.shape[-1])
            i2 = input.reshape(-1, input.shape[-1])
            grad_weight = g2.t().matmul(i2.to(g2.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def linear(input, weight, bias=None):
    """Drop-in for ``F.linear`` that is safe with parameters moved in and out by tier."""
    if isinstance(weight, torch.nn.Parameter) and torch.is_grad_enabled():
        return _LinearFunction.apply(input, weight, bias)
    return _original_linear(input, weight, bias)


@contextlib.contextmanager
def patched_linear():
    """Replaces ``torch.nn.functional.linear`` with :func:`linear` for the duration (re-entrant)."""
    depth = getattr(_active, "depth", 0)
    if depth == 0:
        F.linear = linear
    _active.depth = depth + 1
    try:
        yield
    finally:
        _active.depth -= 1
        if _active.depth == 0:
            F.linear = _original_linear
