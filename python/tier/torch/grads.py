"""Gradient intake for tier.torch: how a gradient leaves autograd and reaches the offloaded
optimizer.

- :class:`GradStaging`: CUDA gradients copied asynchronously into pinned host buffers.
- :class:`MicroStepGrads`: with the optimizer state in host memory, a step's micro-steps summed
  in fp32 host tensors (or, under engine.backward with one micro-step per step, handed straight
  to the optimizer).
- :class:`EngineGrads`: with the state on NVMe, the sums kept in engine tensors homed there and
  declared to the optimizer at the step. A CUDA gradient that starts its tensor's sum in the
  tensor's dtype is DMA'd straight into the engine's pinned host copy (no staging, no host pass).

After a failed step each keeps its gradients for a retry (``after_step(False)``); ``withdraw``
forgets what the optimizer was told before they change.
"""

import collections
import weakref

import torch

from .. import _tier


class GradStaging:
    """Copies CUDA gradients into pinned host buffers asynchronously, then hands them to the optimizer.

    Each gradient is copied with ``non_blocking=True`` on the stream that produced it, into a pinned
    buffer taken from a pool (keyed by dtype and element count, so a model's repeated layer shapes
    reuse a few buffers), and an event is recorded after the copy. ``poll`` passes on the gradients
    whose copies have completed, in order, without waiting; ``drain`` waits for all of them. A buffer
    returns to the pool once ``add_grad`` has consumed it (it copies or accumulates before returning).
    At most ``max_pending_bytes`` of copies are in flight: beyond that, the oldest is waited for.
    """

    def __init__(self, optimizer, native, max_pending_bytes=256 << 20):
        self._optimizer = optimizer
        self._native = native
        self._max_pending = max_pending_bytes
        self._pending = collections.deque()  # (pid, grad, buffer, start event, end event)
        self._pending_bytes = 0
        self._free = {}  # (dtype, numel) -> [pinned buffers]
        self.pinned_bytes = 0  # held by the pool and the copies in flight

    def _buffer(self, dtype, numel):
        free = self._free.get((dtype, numel))
        if free:
            return free.pop()
        buf = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.pinned_bytes += numel * buf.element_size()
        return buf

    def push(self, pid, grad):
        buf = self._buffer(grad.dtype, grad.numel())
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        buf.view(grad.shape).copy_(grad, non_blocking=True)
        end.record()
        # `grad` stays referenced until the copy has completed.
        self._pending.append((pid, grad, buf, start, end))
        self._pending_bytes += buf.numel() * buf.element_size()
        while self._pending_bytes > self._max_pending and len(self._pending) > 1:
            self._consume(wait=True)
        self.poll()

    def poll(self):
        while self._pending and self._pending[0][4].query():
            self._consume(wait=False)

    def drain(self):
        while self._pending:
            self._consume(wait=True)

    def _consume(self, wait):
        pid, _grad, buf, start, end = self._pending.popleft()
        if wait:
            end.synchronize()
        nbytes = buf.numel() * buf.element_size()
        self._pending_bytes -= nbytes
        self._native.note_transfer("device_to_host", nbytes, start.elapsed_time(end) / 1000.0)
        self._optimizer.add_grad(pid, buf)
        self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)


class MicroStepGrads:
    """Sums the gradients of a step's micro-steps in fp32 and hands the native optimizer one final
    gradient per partition when the step runs.

    The native optimizer is created with one micro-step per step, so the number of micro-steps is
    the caller's: the engine's counter, or the boundary set from outside
    (``set_gradient_accumulation_boundary``), as accelerate does; a second backward before
    ``step()`` adds to the sum instead of failing. Held sums cost 4 bytes per trainable element; the
    native optimizer borrows them for the step instead of copying them.
    With ``gradient_accumulation_steps == 1`` and no boundary set from outside, a gradient goes to
    the optimizer at once (nothing held, and its sum of squares is computed during backward).
    """

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.held = {}  # partition -> fp32 CPU tensor
        self.lent = set()  # partitions whose sum the native optimizer borrows until the step

    def add_grad(self, pid, grad):
        engine = self._engine()
        engine._withdraw_failed_step()
        acc = self.held.get(pid)
        # Straight into the optimizer only when engine.backward() says this backward makes the
        # step; a backward of the caller's own may be one of several before the step.
        direct = engine._gas == 1 and engine._boundary is None and not engine._delayed and engine._engine_backward
        if acc is None and direct:
            engine.native_optimizer.add_grad(pid, grad.reshape(-1))
        elif acc is None:
            self.held[pid] = grad.detach().reshape(-1).to(torch.float32, copy=True)
        else:
            acc.add_(grad.reshape(-1))

    def flush(self, optimizer):
        # Borrowed, not copied: the sums stay here until the step has run (after_step), so they
        # are not held twice. After a failed step they are still lent for the retry.
        for pid in sorted(self.held):
            if pid not in self.lent:
                optimizer.add_grad(pid, self.held[pid], borrow=True)
                self.lent.add(pid)

    def after_step(self, ok):
        if ok:
            self.held.clear()
            self.lent.clear()

    def withdraw(self):
        """After a failed step, before gradients change: the sums stay here, no longer lent (the
        optimizer's clear_grads() forgets what it borrowed)."""
        self.lent.clear()

    def clear(self):
        self.held.clear()
        self.lent.clear()


class EngineGrads:
    """Sums each step's gradients in fp32 in engine tensors homed with the optimizer state on NVMe
    (``grad/<name>``), so host memory holds only what the engine's host budget caches, however
    large the model. The first micro-step's gradient is written (no read), later ones added
    (read, add, write back, as the engine decides). On the boundary micro-step each partition's
    sum of squares is taken as its gradient is added; ``flush`` declares the gradients to the
    native optimizer, which reads them from the engine chunk by chunk during its step
    (the step's ``grad_tensors``)."""


    def __init__(self, engine, partition_count):
        self._engine = weakref.ref(engine)
        self.tensors = [-1] * partition_count  # partition -> engine tensor of its gradient
        self.held = set()  # partitions with a gradient this step
        self.sumsq = {}  # partition -> sum of squares of its final gradient (boundary micro-step)
        self.declared = set()  # declared already, to an overlapped step that is running
        # Device gradients DMA'd straight into their engine tensors on a boundary micro-step
        # (add_device_grad): partition -> (pinned host scalar, event after its copy), their sums of
        # squares on their way to the host.
        self._pending = collections.OrderedDict()
        self.direct = 0  # device gradients that went straight in (no staging, no host pass)

    def register(self, native, pid, name, numel, home, dtype="fp32"):
        """``dtype``: "fp32" sums in fp32; "bf16" or "fp16" (a model trained in that dtype, one
        micro-step per step: nothing is summed across micro-steps) stores the gradient as backward
        made it, half the bytes on disk and on the links."""
        self.tensors[pid] = native.register(f"grad/{name}", dtype, numel, "grad", 0, home)

    def add_device_grad(self, pid, grad, stream):
        """A CUDA gradient copied by DMA straight into its engine tensor's host copy (the engine's
        pinned arena), queued on ``stream`` behind the backward kernels that made it; its sum of
        squares is taken on the device beside the copy. So the gradient crosses host memory twice
        in all (this DMA, then the engine's write to NVMe) instead of through a staging buffer and a
        host pass. The write lease ends, and the engine publishes the new contents, once the stream
        has passed the copy (``Lease.as_tensor(stream=...)``).

        Only a step's first gradient of a partition in the tensor's own dtype goes this way; the
        caller stages the others (a sum to add to, or an upcast): returns False for those."""
        engine = self._engine()
        # Every gradient tensor has the engine's gradient dtype: fp32 sums, or the model's own.
        if grad.dtype != (torch.float32 if engine._grad_dtype == "fp32" else engine.compute_dtype):
            return False
        engine._withdraw_failed_step()
        if pid in self.held:
            return False
        lease = engine.native.acquire(self.tensors[pid], "host", "write", traced=not engine._delayed)
        flat = torch.from_dlpack(lease.as_tensor(stream=stream))
        g = grad.detach().reshape(-1)
        flat.copy_(g, non_blocking=True)
        del flat  # the lease ends after the copy, in the stream's order
        # The caller drops the gradient now: its block goes back to the caching allocator only
        # once this stream has passed the copy, whichever stream made it.
        g.record_stream(torch.cuda.current_stream(g.device))
        boundary = engine.is_gradient_accumulation_boundary()
        self.held.add(pid)
        self.sumsq.pop(pid, None)  # (one kept from a failed step is stale now)
        if boundary:
            # On the device (a reduction that reads bf16/fp16 as fp32 without a copy), brought
            # back behind the gradient and read once its event has completed.
            sq = torch.linalg.vector_norm(g, dtype=torch.float32).double().square()
            host = torch.empty((), dtype=torch.float64, pin_memory=True)
            host.copy_(sq, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending[pid] = (host, done)
        self.direct += 1
        self.poll()
        return True

    def poll(self, wait=False):
        """Takes in the device sums of squares whose copies have completed (all of them with
        ``wait``), declaring each to an overlapped step that is running."""
        while self._pending:
            pid, (host, done) = next(iter(self._pending.items()))
            if wait:
                done.synchronize()
            elif not done.query():
                return
            del self._pending[pid]
            self.sumsq[pid] = float(host)
            self._declare_if_running(pid)

    def _declare_if_running(self, pid):
        engine = self._engine()
        if pid in self.sumsq and engine.native_optimizer.overlap_running:
            # Final: the overlapped step's pass may take it now.
            engine.native_optimizer.declare_grad(pid, self.sumsq[pid])
            self.declared.add(pid)

    @staticmethod
    def _sum_of_squares(flat):
        return _tier.sum_of_squares(flat)  # (accumulate_grad's sum, bit for bit)

    def add_grad(self, pid, grad):
        engine = self._engine()
        engine._withdraw_failed_step()
        self._pending.pop(pid, None)  # (a device sum of squares this sum replaces)
        first = pid not in self.held
        # Intake is part of the access trace (the prefetcher brings a sum back before the next
        # micro-step adds to it), except with overlap "delayed", which alternates two sets of
        # gradient tensors from one step to the next: an order no one-step trace can hold.
        lease = engine.native.acquire(
            self.tensors[pid], "host", "write" if first else "read_write", traced=not engine._delayed
        )
        flat = torch.from_dlpack(lease.as_tensor())
        g = grad.detach().reshape(-1).contiguous()
        if flat.dtype == torch.float32:
            # Added in fp32 (whatever the gradient's dtype) with its sum of squares in one pass.
            sumsq = _tier.accumulate_grad(flat, g, first)
        else:
            # Kept in the model's dtype: written as backward made it, or added there as torch adds
            # a second backward into a bf16/fp16 .grad (a backward without a step between).
            if first:
                sumsq = _tier.copy_grad(flat, g)  # (its sum of squares from the same pass)
            else:
                flat.add_(g)
                sumsq = self._sum_of_squares(flat)
        self.held.add(pid)
        if engine.is_gradient_accumulation_boundary():
            self.sumsq[pid] = sumsq
        else:
            self.sumsq.pop(pid, None)  # (one kept from a failed step is stale now)
        del flat  # ends the lease
        self._declare_if_running(pid)

    def flush(self, optimizer):
        """Declares every gradient of the step not declared yet. They stay held (and declared)
        until the step has succeeded (after_step): a failed step keeps them for a retry."""
        engine = self._engine()
        self.poll(wait=True)
        for pid in sorted(self.held):
            if pid in self.declared:
                continue
            sumsq = self.sumsq.get(pid)
            if sumsq is None:  # the boundary was not known when the gradient came
                lease = engine.native.acquire(self.tensors[pid], "host", "read")
                flat = torch.from_dlpack(lease.as_tensor())
                sumsq = self._sum_of_squares(flat)
                del flat
                self.sumsq[pid] = sumsq
            optimizer.declare_grad(pid, sumsq)
            self.declared.add(pid)

    def withdraw(self):
        """After a failed step, before gradients change: the declarations go (the optimizer's
        clear_grads() forgets them), the sums stay in their engine tensors."""
        self.declared.clear()

    def after_step(self, ok):
        if ok:
            self.clear()

    def clear(self):
        self._pending.clear()  # (their pinned scalars are the caching host allocator's until copied)
        self.held.clear()
        self.sumsq.clear()
        self.declared.clear()
