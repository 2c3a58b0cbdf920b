"""TierEngine's training step: backward (loss scaling, accumulation), the step at the accumulation
boundary with its overlap modes (serial, exact, delayed), the recovery of a failed step, zero_grad
and the learning rate (mixed into TierEngine, engine.py)."""

import json
import time
import warnings

import torch

from .. import _tier
from .grads import EngineGrads as _EngineGrads
from .grads import MicroStepGrads as _MicroStepGrads


_NO_OPTIMIZER = (
    'the config has no "optimizer" section and initialize got no optimizer, so the engine runs inference only; '
    'to train, add {"optimizer": {"type": "AdamW", "params": {"lr": ...}}} to the config, or pass '
    "optimizer=torch.optim.AdamW(model.parameters(), lr=...) to tier.torch.initialize"
)


class StepMixin:
    def _cancel_overlap(self):
        """Drops the overlapped step in flight, if any: the params it delivered go back to the
        committed ones, its declarations are forgotten (the gradients stay in their engine tensors,
        and step() declares them again) and the step will run serially. Anything that reads the
        params or changes the gradients between the boundary backward and step() calls this."""
        if self.native_optimizer is None or not self.native_optimizer.overlap_running:
            return
        self.native_optimizer.cancel_overlap()
        self.native_optimizer.clear_grads()
        self._grads.declared.clear()

    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False, scale_wrt_gas=True):
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale); with
        ``scale_wrt_gas=False`` the loss is not divided. ``allreduce_gradients`` and
        ``release_loss`` are DeepSpeed's: across ranks, gradients are always reduced (tier.torch.zero)."""
        self._require_optimizer("backward")
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        scaled = loss
        if scale_wrt_gas and self._gas > 1:
            scaled = scaled / self._gas
        if self.native_optimizer.loss_scale != 1.0:
            scaled = scaled * self.native_optimizer.loss_scale
        self._withdraw_failed_step()
        if self.native_optimizer.overlap_running:
            # A second backward on the boundary adds to gradients the pass may have used already.
            self._cancel_overlap()
        elif self._overlap and self.is_gradient_accumulation_boundary():
            # The step's update starts now and takes each chunk of the state as backward finishes
            # its gradients; step() validates it (and redoes it when clipping or an overflow says so).
            self._apply_lr()
            self.native_optimizer.start_overlap(
                zero_missing=True,
                engine=self.native,
                tensors=self._tensor_of_partition,
                grad_tensors=self._grads.tensors,
                offsets=self._partition_offsets,
                comm=self._comm,
            )
        self._in_backward = True
        self._engine_backward = True  # until its gradients are all handed over (drain, reduce)
        try:
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                self.native_optimizer.cancel_overlap()
                raise
            finally:
                self._in_backward = False
            self._drain_grads()
            if self._reducer is not None:
                self._reducer.flush(self.is_gradient_accumulation_boundary())
        finally:
            self._engine_backward = False
        if self._prefetcher is not None:
            self._prefetcher.drop()
        self._release_backward_leftovers()
        if self._in_step:
            self.native.end_step()
            self._in_step = False
        self._timers["backward"] += time.perf_counter() - t0
        self._span("backward", t0_ns)
        return loss

    def _release_backward_leftovers(self):
        """Parameters that took part in forward but got no gradient, or whose module's backward had
        no end to hook (leaf inputs), still hold a fetch once backward is over: it ends here. Called
        at the end of engine.backward(), and for a backward of the caller's own at the next
        forward or step()."""
        for slot in self._slots:
            self._end_recompute_holds(slot)
            while slot.backward_fetches > 0:
                slot.backward_fetches -= 1
                self._drop(slot)

    def is_gradient_accumulation_boundary(self):
        """Whether the current micro-step ends a step: the value set by
        ``set_gradient_accumulation_boundary`` if any, else every ``gradient_accumulation_steps``-th
        micro-step by the engine's counter."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Lets the caller decide where a step ends (accelerate does, before each backward): from now
        on the gradients of every micro-step are summed until one runs with ``is_boundary=True``,
        whatever ``gradient_accumulation_steps`` says; ``step()`` then applies the update."""
        self._boundary = bool(is_boundary)

    def step(self, lr_kwargs=None):
        """Counts a micro-step; at the accumulation boundary runs the offloaded optimizer (clipping,
        fp16 overflow check, Adam/AdamW) and then the LR scheduler. Returns the optimizer's report,
        or None off the boundary."""
        self._require_optimizer("step")
        self._grads_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        if self._reducer is not None:
            self._reducer.flush(boundary)  # a backward run outside engine.backward()
        if self._prefetcher is not None:
            self._prefetcher.drop()
        self._step_applied = False
        if not boundary:
            self.micro_steps += 1
            return None
        if not self._grads_in_window and self._failed_step is None and not self._delayed_retry:
            # No backward since the last step: as torch's optimizers skip a parameter without a
            # gradient, nothing is updated (no weight decay), and no step is counted.
            if not self.__dict__.get("_warned_empty_step"):
                self._warned_empty_step = True
                warnings.warn(
                    "engine.step() at an accumulation boundary with no backward() since the last step: nothing to "
                    "apply; the parameters, the optimizer state and the step count are left as they are",
                    stacklevel=2,
                )
            return None
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        self._drain_grads()  # gradients of a backward run outside engine.backward()
        self._release_backward_leftovers()  # (and what that backward left fetched)
        if self._delayed:
            report = self._start_delayed(lr_kwargs)
            self._grads_in_window = False
            self.micro_steps += 1
        else:
            report = self._boundary_step(lr_kwargs)
        self._timers["step"] += time.perf_counter() - t0
        self._span("step", t0_ns)
        return report

    def _step_now(self):
        """The optimizer view's step() for a loop that does not call engine.step(): the gradients
        taken since the last step make one, whatever the micro-step counter says."""
        saved = self._boundary
        self._boundary = True
        try:
            return self.step()
        finally:
            self._boundary = saved

    def _boundary_step(self, lr_kwargs):
        """The optimizer step of an accumulation boundary (serial, or finishing the overlapped one).

        A step that fails (an I/O error, a full disk) leaves one state, whatever comes next: the
        optimizer state and the params are the previous step's (the optimizer puts back the params
        it had delivered), the step's gradients are kept, and the micro-step is not counted, so
        the boundary is still the current micro-step. From there:

        - ``step()`` again retries the step with the kept gradients;
        - another ``backward()`` adds to the kept gradients (its micro-step is part of this step),
          and ``step()`` steps with the sum;
        - ``zero_grad()`` drops the gradients and starts the accumulation window again: the next
          ``gradient_accumulation_steps`` micro-steps make the step.

        A step that was applied but whose updated params could not all be delivered is counted;
        the params are rewritten from the fp32 masters before the next forward or step.

        With ``tier.optimizer.state_copies: 1`` (the state kept once on NVMe) a step that fails
        after some chunks of the state took their update cannot be undone: it is *owed*. Whatever
        the caller does next (``step()``, ``backward()``, ``zero_grad()``), the owed step is
        finished first, with the gradients and the lr it began with, and counted as the step it
        is; the later call then goes on from there. A failure before any chunk took its update
        is like the two-copy case above.
        """
        applied_before = self.native_optimizer.stats()["steps_applied"]
        try:
            self._grads.flush(self.native_optimizer)
            if self.native_optimizer.overlap_running:
                report = self.native_optimizer.finish_overlap()
            else:
                self._apply_lr()
                grad_tensors = self._grads.tensors if self._grads_in_engine else []
                report = self.native_optimizer.step(
                    zero_missing=True,
                    engine=self.native,
                    tensors=self._tensor_of_partition,
                    grad_tensors=grad_tensors,
                    offsets=self._partition_offsets,
                    comm=self._comm,
                )
        except BaseException:
            self._grads.after_step(False)
            stats = self.native_optimizer.stats()
            if stats.get("failed_step_owed"):
                self._failed_step = "owed"
                self._owed_lr_kwargs = lr_kwargs
                raise
            if stats["steps_applied"] == applied_before:
                self._failed_step = "pending"
                raise
            # Applied (the state moved on, the gradients were consumed), its outputs not all
            # delivered: counted, and the params are rewritten from the masters before use.
            self._failed_step = None
            self._grads.clear()
            self._params_behind = True
            self.micro_steps += 1
            applied = {"applied": True, "step": self.native_optimizer.stats()["step"], "grad_norm": float("nan"), "overflow": False}
            self._after_report(applied, lr_kwargs)
            raise
        self._grads.after_step(True)
        self._failed_step = None
        self._grads_in_window = False
        self.micro_steps += 1
        self._after_report(report, lr_kwargs)
        return report

    def _finish_owed_step(self):
        """state_copies 1: a step that failed part-way is finished before anything else touches
        the gradients (see _boundary_step); booked as the step it is. A failure leaves it owed."""
        if self.__dict__.get("_failed_step") != "owed":
            return
        lr_kwargs = self.__dict__.get("_owed_lr_kwargs")
        self._boundary_step(lr_kwargs)

    def _withdraw_failed_step(self):
        """A gradient is about to change after a failed step: what the optimizer was told about the
        kept gradients (declared engine tensors, lent sums) is withdrawn, as it would be stale; the
        gradients themselves stay, and the next step hands them over again. A step owed (state_copies
        1) is finished instead."""
        if self.__dict__.get("_failed_step") == "owed":
            self._finish_owed_step()
            return
        if self.__dict__.get("_failed_step") != "pending":
            return
        if isinstance(self._grads, _MicroStepGrads) and not self._grads.held:
            # One micro-step per step: the gradients went into the optimizer's own accumulators,
            # which cannot take a second one.
            raise RuntimeError(
                "the last step failed and its gradients are inside the optimizer, which cannot add another "
                "backward to them: call step() to retry it, or zero_grad() to drop them and start the step again"
            )
        self.native_optimizer.cancel_overlap()
        self.native_optimizer.clear_grads()
        self._grads.withdraw()
        self._failed_step = "withdrawn"

    def _repair_params(self):
        """Params that an applied step could not deliver (or a failed one could not put back) are
        rewritten from the fp32 masters before the next forward reads them."""
        if self.native_optimizer is None:
            return
        # state_copies 1: a step owed leaves params of two steps in place; it is finished first.
        self._finish_owed_step()
        behind = self.__dict__.get("_params_behind", False) or self.native_optimizer.outputs_stale
        if not behind:
            return
        if self._zero is not None:
            raise RuntimeError(
                "an optimizer step could not deliver its updated params across ranks; load the last checkpoint "
                "(engine.load_checkpoint) to go on"
            )
        self._params_from_masters()
        self._params_behind = False
        self.native_optimizer.outputs_rewritten()

    def _start_delayed(self, lr_kwargs):
        """overlap "delayed": waits for the previous step's update (and puts its params in place),
        then starts this step's on a thread of its own, reading this step's gradients while the
        next micro-steps gather theirs in the other set. Returns the previous step's report (None
        at the first)."""
        report = self._join_delayed()
        self._grads.flush(self.native_optimizer)
        grad_tensors = self._grads.tensors if self._grads_in_engine else []
        self._apply_lr()
        self._optimizer_stats = self.native_optimizer.stats()
        # The update writes the masters only (the params are in use meanwhile; _join_delayed
        # derives them).
        self.native_optimizer.start_async(zero_missing=True, engine=self.native, grad_tensors=grad_tensors)
        self._delayed_pending = (self._grads, lr_kwargs)
        if self._grads_in_engine:
            spare = self._spare_grads
            if spare is None:  # (made at initialize)
                spare = self._register_spare_grads()
            self._grads = spare
            self._spare_grads = None
        else:
            self._grads = _MicroStepGrads(self)
        return report

    def _register_spare_grads(self):
        """overlap "delayed" with NVMe state: the second set of gradient tensors, which the next
        micro-steps fill while an update reads the first. Checked against tier.budgets.nvme first,
        so that a budget without room for it is an error at initialize, not a timeout mid-run."""
        esize = 4 if self._grad_dtype == "fp32" else 2
        need = sum(esize * slot.zero_count for slot in self._slots if slot.pid is not None)
        nvme = json.loads(self.native.stats_json())["tiers"]["nvme"]
        # The NVMe figures include the optimizer's chunks. In the engine's swap files its whole
        # reservation counts in the budget; in files of its own (fault injection) none of it does.
        opt = self.native_optimizer.stats()
        held = nvme["resident_bytes"] - opt["nvme_bytes"] + (opt["nvme_capacity_bytes"] if opt["shared_swap"] else 0)
        if held + need > nvme["budget_bytes"]:
            raise ValueError(
                f'tier.optimizer.overlap: "delayed" keeps a second set of {self._grad_dtype} gradients on NVMe '
                f"({need} bytes) "
                f"beside the {held} bytes of tensors and optimizer state there; tier.budgets.nvme is "
                f"{nvme['budget_bytes']}: "
                f"raise it to at least {held + need} (plus room to stage transfers)"
            )
        spare = _EngineGrads(self, self.native_optimizer.param_count)
        for slot in self._slots:
            if slot.pid is not None:
                spare.tensors[slot.pid] = self.native.register(
                    f"grad.next/{slot.name}", self._grad_dtype, slot.zero_count, "grad", 0, "nvme"
                )
        return spare

    def _join_delayed(self):
        """Waits for the update started by the last boundary step() in "delayed" mode, writes the
        params it produced into the engine and books the step. Returns its report, or None.

        An update that fails (an I/O error, a full disk) stays pending with its gradients (the
        other set) and the state of the step before: the next call runs it again, with the same lr,
        before anything else, so whatever the caller does meanwhile (retry step(), zero_grad() and
        a new window, or another backward into this window) the updates are the same."""
        pending = self.__dict__.get("_delayed_pending")
        if pending is None:
            return None
        grads, lr_kwargs = pending
        if self.__dict__.get("_delayed_retry"):
            self._apply_lr()  # the scheduler has not moved since the update first started
            grad_tensors = grads.tensors if self._grads_in_engine else []
            self.native_optimizer.start_async(zero_missing=True, engine=self.native, grad_tensors=grad_tensors)
            self._delayed_retry = False
        try:
            report = self.native_optimizer.finish_async()
        except BaseException:
            grads.after_step(False)
            self._delayed_retry = True
            raise
        self._delayed_pending = None
        grads.after_step(True)
        if self._grads_in_engine:
            grads.clear()
            self._spare_grads = grads
        if not report["applied"]:
            self._after_report(report, lr_kwargs)
            return report
        # The update wrote the masters only (the params were in use meanwhile): derive them. If
        # that fails, the step still counts and the params are rewritten before the next forward.
        self._params_behind = True
        try:
            self._params_from_masters()
            self._params_behind = False
        finally:
            self._after_report(report, lr_kwargs)
        return report

    def _params_from_masters(self):
        """Writes every trainable parameter (one process: whole partitions) from its fp32 master,
        converted as the optimizer converts its outputs."""
        for slot in self._slots:
            if slot.pid is None:
                continue
            low = torch.empty(slot.shape, dtype=self.compute_dtype)
            self.native_optimizer.read_param(slot.pid, low.view(-1))
            self.native.write(slot.tid, low)

    def _settle(self):
        """The params and state as the steps so far leave them: no overlapped pass in flight, the
        delayed update (if any) done. Anything that reads them from outside the training loop
        calls this."""
        self._cancel_overlap()
        if self.native_optimizer is not None:
            self._join_delayed()

    def _after_report(self, report, lr_kwargs):
        """Books a finished optimizer step: counters, the schedulers, the next lr."""
        self._param_version += 1
        self.last_report = report
        if report["applied"] and self._zero is not None and self._zero.stage < 3:
            self._gather_updated_params()
        if report["applied"]:
            self.global_steps += 1
            self._step_applied = True
            if self.client_lr_scheduler is not None:
                with warnings.catch_warnings():
                    # torch warns when the scheduler steps before its optimizer did; here the
                    # engine's step is the optimizer's.
                    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                    self.client_lr_scheduler.step(**(lr_kwargs or {}))
            elif self.scheduler is not None:
                # DeepSpeed steps the scheduler after each applied step (not after a skipped one).
                self.scheduler.last_step = self.global_steps
            self._apply_lr()
        else:
            self.skipped_steps += 1

    def zero_grad(self, set_to_none=True):
        """Forgets every gradient taken since the last step: the micro-steps' sums held for the
        boundary and what the optimizer took already (``set_to_none`` is accepted and moot: the
        model's ``.grad`` are freed as soon as they are final)."""
        self._finish_owed_step()  # (state_copies 1: a step owed is the step; it is finished first)
        self._drain_grads()
        self._grads.clear()
        self._grads_in_window = False
        if self.__dict__.get("_failed_step") is not None or self.__dict__.get("_delayed_retry"):
            # After a failed step the whole accumulation window is dropped with its gradients: the
            # next gradient_accumulation_steps micro-steps make the step again.
            if self._boundary is None:
                self.micro_steps -= self.micro_steps % self._gas
            self._failed_step = None
        if self._reducer is not None:
            self._reducer.clear()
        if self.native_optimizer is not None:
            self.native_optimizer.cancel_overlap()
            # (A delayed update, running or failed and pending a retry, reads its own gradients.)
            if not self.native_optimizer.async_running and not self.__dict__.get("_delayed_retry"):
                self.native_optimizer.clear_grads()
        for slot in self._slots:
            slot.param.grad = None

    def _check_host_working_set(self):
        """A host budget that cannot hold what a step moves through host memory at once is refused
        now, with the numbers, not met as a TimedOut after tier.acquire_timeout_ms mid-step. Inside
        the budget: the optimizer's pinned buffers, then one chunk's gradients (fp32) and updated
        parameters (compute dtype) as the optimizer reads and delivers them, or the largest
        parameter's fp32 master and its update, whichever is more; with the parameters as masters,
        those of the chunks in flight too."""
        if self.native_optimizer is None:
            return
        budget = json.loads(self.native.stats_json())["tiers"]["host"]["budget_bytes"]
        st = self.native_optimizer.stats()
        esize = torch.empty(0, dtype=self.compute_dtype).element_size()
        elements = sum(s.zero_count for s in self._slots if s.trainable)  # (partitions come later)
        chunk = min(st["chunk_elements"], elements)
        largest = max((s.zero_count for s in self._slots if s.trainable), default=0)
        moving = max(chunk, largest) * (4 + esize)
        if self._engine_masters:
            # The parameters are the masters: a chunk's stay leased until its write completed, so
            # the chunks in the pipeline (buffer_count, and the next one, hinted) hold theirs, and
            # the partitions reaching past them, beside a chunk's gradients.
            masters = 4 * ((st["buffer_count"] + 2) * chunk + largest)
            moving = max(moving, masters + 4 * max(chunk, largest))
        need = st["pinned_bytes"] + moving
        if need > budget:
            fmt = _tier.format_bytes
            raise _tier.ResourceExhausted(
                f"tier.budgets.host is {fmt(budget)} ({budget} bytes): the optimizer's pinned buffers take "
                f"{fmt(st['pinned_bytes'])} and a step moves up to {fmt(moving)} of gradients and updated parameters "
                f"through host memory at once (a chunk of {st['chunk_elements']} elements, or the largest parameter); "
                f"raise tier.budgets.host to at least {fmt(need)} ({need} bytes), or lower tier.optimizer.buffer_bytes"
            )

    def _require_optimizer(self, what):
        if self.native_optimizer is None:
            if self.native is None:
                raise RuntimeError(f"engine.{what}(): the engine has been destroyed")
            raise ValueError(f"engine.{what}(): {_NO_OPTIMIZER}")

    def _apply_lr(self):
        if self.native_optimizer is None:
            return
        view = self.__dict__.get("torch_optimizer")
        if self.scheduler is None:
            if view is None:
                return
            # The groups' lr (a client scheduler's, or the caller's own) is the next step's.
            for g, group in enumerate(view.param_groups[: self.native_optimizer.group_count]):
                self.native_optimizer.set_lr(g, float(group["lr"]))
            return
        lrs = self.scheduler.lrs(self.global_steps)
        betas = self.scheduler.betas(self.global_steps)
        for g in range(self.native_optimizer.group_count):
            lr = lrs[min(g, len(lrs) - 1)]
            if betas is None:
                self.native_optimizer.set_lr(g, lr)
            else:
                h = self._group_hparams[g]
                beta1, beta2 = betas[min(g, len(betas) - 1)]
                self.native_optimizer.set_group(g, lr, beta1, beta2, h["eps"], h["weight_decay"])
            if view is not None and g < len(view.param_groups):
                view.param_groups[g]["lr"] = lr
                if betas is not None:
                    view.param_groups[g]["betas"] = tuple(betas[min(g, len(betas) - 1)])

    def get_lr(self):
        if self.native_optimizer is None:
            return []
        return [self.native_optimizer.lr(g) for g in range(self.native_optimizer.group_count)]

    @property
    def loss_scale(self):
        return 1.0 if self.native_optimizer is None else self.native_optimizer.loss_scale
