"""TierEngine's parameter streaming: the module hooks that bring each module's parameters from
the engine before its forward and backward and release them after, the gathering of ZeRO shards,
and the hand-over of gradients as backward finishes them (mixed into TierEngine, engine.py)."""

import time
import weakref

import torch

from . import activations as _activations
from .grads import GradStaging as _GradStaging
from . import saved_params as _saved_params
from . import zero as _zero


_ENGINE_GONE = (
    "this model's parameters are managed by a tier engine that {what}; they are empty placeholders now. Keep the "
    "engine returned by tier.torch.initialize referenced (and not destroyed) while the model runs, e.g. "
    "engine, *_ = tier.torch.initialize(model, config); engine.module.generate(...); write the weights out "
    "first (engine.save_pretrained) if you need them after the engine"
)


def _alive(ref):
    """The engine a hook serves; a clear error when it was freed (only the model was kept)."""
    engine = ref()
    if engine is None:
        raise RuntimeError(_ENGINE_GONE.format(what="was freed (nothing referenced it any more)"))
    return engine


def _tensors(obj, depth=0):
    """The tensors in a module's inputs or outputs (tuples, lists, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def _once_on_grad(tensors, ref, action, when=None):
    """Runs ``action(engine)`` once, on the first gradient to reach any of ``tensors`` (for which
    ``when()``, if given, holds); returns the flag that says it ran."""
    ran = [False]

    def hook(_grad):
        engine = ref()
        if engine is not None and not ran[0] and (when is None or when()):
            ran[0] = True
            action(engine)

    for t in tensors:
        t.register_hook(hook)
    return ran


def _hook_backward(ref, module, args, out):
    """One use of a module's backward, bracketed by hooks on the tensors of its forward: the first
    gradient to reach one of its outputs (their total gradient, so every consumer's backward is
    done) starts it, which fetches its parameters; the gradient reaching its inputs ends it, which
    releases them (without inputs that take a gradient: the parameter's final gradient, or the end
    of backward, does; at a leaf input, see below). Tensor hooks stay with a tensor modified in
    place, so model code may do that to a module's output."""
    if not torch.is_grad_enabled():
        return
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not outs:
        return
    started = _once_on_grad(outs, ref, lambda engine: engine._bring_for_backward(engine._module_slots[module]))
    # An input made by an operator ends it: its gradient reaches it through that operator's node,
    # which autograd runs after the accumulation of the gradients the module's backward gave its
    # parameters (accumulations go first). A leaf input's gradient is an accumulation too, in no
    # set order with the parameters' (a reentrant checkpoint's detached inputs): there only the
    # frozen parameters are released, the trainable ones at their final gradient, which could
    # otherwise be taken away before their gradient is added.
    inputs = [t for t in _tensors(args) if t.requires_grad]
    ended = {"frozen": False, "trainable": False}  # (this use's, whichever input comes first)

    def end(engine, parts):
        todo = [p for p in parts if not ended[p]]
        for p in todo:
            ended[p] = True
        if todo:
            engine._after_module_backward(module, frozen="frozen" in todo, trainable="trainable" in todo)

    made = [t for t in inputs if t.grad_fn is not None]
    leaves = [t for t in inputs if t.grad_fn is None]
    _once_on_grad(made, ref, lambda engine: end(engine, ("frozen", "trainable")), when=lambda: started[0])
    _once_on_grad(leaves, ref, lambda engine: end(engine, ("frozen",)), when=lambda: started[0])


def _hook_use_backward(ref, slots, out):
    """A trainable parameter used outside its module's forward (FetchOnUse): its gradient reaches
    it through this call's backward, which may save nothing of it (`weight.squeeze(1)`), so the
    first gradient to reach the call's result brings it back, in place with its shape when its
    gradient is accumulated; the final gradient (_grad_ready) or the end of backward releases it,
    as for a module's backward fetch."""
    if not torch.is_grad_enabled():
        return
    trainable = [s for s in slots if s.trainable]
    # (A result that is a parameter itself, `bias.float()` in fp32, is no call's output: the call
    # that uses it next is hooked instead; a hook on a leaf would stay for every later step.)
    outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
    if trainable and outs:
        _once_on_grad(outs, ref, lambda engine: engine._bring_for_backward(trainable))


def _release(ref, module):
    engine = ref()
    if engine is not None:
        engine._release(module)


def _exit_forward(ref):
    engine = ref()
    if engine is not None:  # a freed engine was reported by _alive already
        engine._exit_forward()


_DESTROYED_GUARDS = weakref.WeakKeyDictionary()  # module -> handle of its _destroyed_guard hook


def _destroyed_guard(params):
    """A forward pre-hook for a module whose parameters a destroyed engine emptied: a clear error
    instead of a shape error from deep inside torch (unless they got real values again)."""

    def hook(module, args):
        if any(p.numel() != n for p, n in params):
            raise RuntimeError(_ENGINE_GONE.format(what="has been destroyed (engine.destroy())"))

    return hook


class FetchMixin:
    def _install_hooks(self, model):
        self._module_slots = {}
        self._forward_fetches = {}  # module -> forward fetches not yet released
        self._hook_handles = []
        self._forward_depth = 0
        self._inference_step = False
        self._in_backward = False  # engine.backward() is running (recomputed forwards run inside it)
        ref = weakref.ref(self)
        # Saved views of streamed parameters become references for the duration of a training
        # forward (the hooks are entered by the outermost module call and exited after it).
        self._saved_params = _saved_params.SavedParams(lambda slot, r=ref: r()._bring_for_backward([slot]))
        self._saved_hooks = None
        # A parameter used outside its module's forward is brought for the call that uses it.
        self._fetch_on_use = _saved_params.FetchOnUse(
            self._slot_of,
            lambda slots, r=ref: r()._bring_all(slots),
            lambda slot, r=ref: r()._drop(slot),
            lambda slots, out, r=ref: _hook_use_backward(r, slots, out),
        )
        self._fetch_on_use_active = False
        for mod in model.modules():
            guard = _DESTROYED_GUARDS.pop(mod, None)  # the model is managed again
            if guard is not None:
                guard.remove()
            owned = [self._slot_of[id(p)] for p in mod.parameters(recurse=False)]
            # Every module brackets the access-trace step (_enter_forward/_exit_forward): its
            # pre-hook runs before the module's fetch, its forward hook after the release.
            self._hook_handles.append(mod.register_forward_pre_hook(lambda m, args, r=ref: _alive(r)._enter_forward()))
            if owned:
                self._module_slots[mod] = owned
                self._hook_handles.append(mod.register_forward_pre_hook(lambda m, args, r=ref: r()._fetch(m)))
                # always_call: a forward that raises (or a recompute stopped early by activation
                # checkpointing, which raises once it has what backward needs) still releases.
                self._hook_handles.append(
                    mod.register_forward_hook(lambda m, args, out, r=ref: _release(r, m), always_call=True)
                )
            self._hook_handles.append(
                mod.register_forward_hook(lambda m, args, out, r=ref: _exit_forward(r), always_call=True)
            )
            if not owned or self.inference_only:
                continue
            # Backward brackets, as hooks on the forward's own tensors (see _hook_backward) rather
            # than full backward hooks, whose wrapping of outputs breaks models that modify a
            # module's output in place (Falcon's mlp_output += attention_output).
            self._hook_handles.append(
                mod.register_forward_hook(lambda m, args, out, r=ref: _hook_backward(r, m, args, out))
            )
        for slot in self._slots:
            if slot.trainable:
                ref = weakref.ref(self)
                self._hook_handles.append(
                    slot.param.register_post_accumulate_grad_hook(lambda p, r=ref: r()._grad_ready(p))
                )

    # ------------------------------------------------------------------ parameter movement
    def _placeholder(self, slot):
        """The parameter's values leave it: the empty placeholder, its version counter noted."""
        slot.param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        slot.placeholder_version = slot.param._version

    def _check_placeholder(self, slot):
        """Refuses a fetch of a parameter whose placeholder was changed in place since the engine
        took its values (``model.lm_head.weight.mul_(0.5)`` after initialize): that edit was lost,
        and training on as if it had applied would be wrong without a word."""
        noted = slot.placeholder_version
        if noted is not None and slot.param._version != noted:
            slot.placeholder_version = slot.param._version  # said once
            raise RuntimeError(
                f"{slot.name} was changed in place while the engine held its values (outside a forward the "
                "module's parameter is an empty placeholder), so the change was lost; edit parameters after "
                "tier.torch.initialize inside engine.modify_parameters(...)"
            )

    def _bring(self, slot):
        if slot.fetches == 0:
            self._check_placeholder(slot)
            if self._zero is not None and self._zero.stage == 3:
                self._gather_params([slot])
            else:
                stream = _activations.lease_stream(self.device)
                self._place(slot, self.native.acquire(slot.tid, "device", "read", stream=stream), stream)
        slot.fetches += 1

    def _place(self, slot, lease, stream):
        # The view owns the lease: it ends when nothing references the memory any more, and on
        # CUDA only once the kernels queued by then on `stream` (the one the lease was ordered on)
        # have run.
        slot.param.data = torch.from_dlpack(lease.as_tensor(list(slot.shape), stream=stream))
        self._saved_params.placed(slot)

    def _shard_of(self, slot, device):
        """This rank's stage-3 shard of a parameter (padded), on ``device``."""
        stream = _activations.lease_stream(self.device)
        lease = self.native.acquire(slot.tid, "device", "read", stream=stream)
        view = torch.from_dlpack(lease.as_tensor(stream=stream))
        out = view.to(device, copy=True)
        del view, lease
        return out

    def _gather_params(self, slots):
        """Stage 3: all-gathers the parameters of ``slots`` (one collective) into their ``.data``."""
        full = self._prefetcher.gather(slots)
        for s in slots:
            s.param.data = full[id(s)].view(s.shape).to(self.device)
            self._saved_params.placed(s)

    def _gather_updated_params(self):
        """Stages 1 and 2, after an applied step: every rank's updated shards into every rank's
        whole parameters, in buckets of ``reduce_bucket_size`` elements."""
        group = self._zero
        trainable = [s for s in self._slots if s.trainable]

        def mine(s):
            out = torch.zeros(s.zero_shard, dtype=self.compute_dtype)
            if s.zero_count > 0:
                lease = self.native.acquire(s.tid, "host", "read")
                flat = torch.from_dlpack(lease.as_tensor())
                out[: s.zero_count] = flat[s.zero_start : s.zero_start + s.zero_count]
                del flat, lease
            return out.to(group.device)

        for bucket in _zero.gather_buckets(group, trainable):
            full = _zero.gather_full(group, bucket, mine)
            for s in bucket:
                self.native.write(s.tid, full[id(s)].to("cpu").contiguous())

    def _drop(self, slot):
        slot.fetches -= 1
        if slot.fetches == 0:
            self._saved_params.removed(slot)
            # Kernels queued on the stream may still read the memory: the view's lease ends after
            # them (lease_stream at the fetch), not here.
            self._placeholder(slot)

    def _enter_forward(self):
        # A forward that is not part of a training micro-step (under no_grad, or in an
        # inference-only engine) is one step of the access trace on its own: the per-token forwards
        # of generate() replay the order the first one recorded, so the scheduler streams the next
        # layers while the current ones compute, and at the end of a forward the first layers of
        # the next. The outermost module called brackets the step (a PEFT model's generate() calls
        # the base model's).
        self._forward_depth += 1
        if self._forward_depth > 1:
            return  # an inner module
        if self._in_backward or torch._C._current_graph_task_id() != -1:
            # A forward recomputed during backward (activation checkpointing): part of the
            # micro-step already running, and under the recompute's own saved-tensor hooks, which
            # must stay the innermost. A parameter it uses outside its module's forward is brought
            # for the call, as in the forward it repeats.
            if not self._fetch_on_use_active and not self.inference_only:
                self._fetch_on_use.__enter__()
                self._fetch_on_use_active = True
                self._fetch_on_use_recompute = True
            return
        if torch.is_grad_enabled() and not self.inference_only and self._saved_hooks is None:
            if self._activations is not None:
                _activations.mark_model_checkpoints(self.module)  # (enabled after initialize?)
                self._activations.begin_step()
            self._saved_hooks = self._saved_params.hooks()
            self._saved_hooks.__enter__()
            self._fetch_on_use.__enter__()
            self._fetch_on_use_active = True
        # A forward of the model itself (engine.module.generate, say) between the boundary backward
        # and step() must see the committed params, as engine(...) does.
        self._cancel_overlap()
        if self._prefetcher is not None:
            self._prefetcher.begin()
        if not self._in_step and (self.inference_only or not torch.is_grad_enabled()):
            self.native.begin_step()
            self._inference_step = True

    def _exit_forward(self):
        self._forward_depth -= 1
        if self._forward_depth == 0 and self.__dict__.get("_fetch_on_use_recompute"):
            self._fetch_on_use_recompute = False
            self._fetch_on_use_active = False
            self._fetch_on_use.__exit__(None, None, None)
            return
        if self._forward_depth == 0 and self._saved_hooks is not None:
            if self._fetch_on_use_active:
                self._fetch_on_use_active = False
                self._fetch_on_use.__exit__(None, None, None)
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
            if self._activations is not None and not self._activations_checked:
                self._activations_checked = True
                if self._activations.seen_in_step == 0:
                    raise ValueError(
                        f"tier.activations.offload is {self._activations.home!r} but the forward checkpointed nothing: "
                        "offloading needs activation checkpointing; turn it on (tier.activations.checkpoint: true, "
                        "model.gradient_checkpointing_enable(), or tier.torch.activations.checkpoint(fn, *args) in the model's "
                        "forward)"
                    )
        if self._forward_depth == 0 and self._inference_step:
            self._inference_step = False
            self.native.end_step()
            if self._prefetcher is not None:
                # No backward follows: the stage-3 gathers started ahead of this forward's end
                # (the record's backward fetches) are waited out now, not left in flight, where
                # a process that ends after an evaluation would meet them (gloo aborts on work
                # still pending at exit).
                self._prefetcher.drop()

    def _bring_all(self, slots):
        if self._zero is not None and self._zero.stage == 3:
            # Stage 3: one all-gather for those that are not here yet.
            need = list({id(s): s for s in slots if s.fetches == 0}.values())
            for slot in need:
                self._check_placeholder(slot)
            if need:
                self._gather_params(need)
            for slot in slots:
                slot.fetches += 1
            return
        # The parameters not in place yet come in one call into the engine: their loads start
        # together and the leases are granted all or none. On CUDA they are granted once their
        # copies are queued, with the current stream made to wait for them (stream-ordered
        # acquires): the host goes on queueing the module's kernels while the weights are copied.
        need = list({id(s): s for s in slots if s.fetches == 0}.values())
        for slot in need:
            self._check_placeholder(slot)
        if need:
            stream = _activations.lease_stream(self.device)
            leases = self.native.acquire_many([s.tid for s in need], "device", "read", stream=stream)
            placed = []
            try:
                for slot, lease in zip(need, leases):
                    self._place(slot, lease, stream)
                    placed.append(slot)
            except BaseException:
                for slot in placed:  # all or nothing: a failed fetch holds nothing
                    self._saved_params.removed(slot)
                    self._placeholder(slot)
                raise
            finally:
                del leases
        for slot in slots:
            slot.fetches += 1

    def _fetch(self, module):
        self._bring_all(self._module_slots[module])
        self._forward_fetches[module] = self._forward_fetches.get(module, 0) + 1

    def _release(self, module):
        held = self._forward_fetches.get(module, 0)
        if held == 0:  # the fetch itself failed
            return
        self._forward_fetches[module] = held - 1
        if torch._C._current_graph_task_id() != -1:
            # A forward recomputed in backward (activation checkpointing): what it saves for the
            # module's backward may be the parameter itself (a frozen one is saved as it is, not
            # detached), so the parameter stays in place until that backward is done.
            for slot in self._module_slots[module]:
                slot.recompute_holds += 1
            return
        for slot in self._module_slots[module]:
            self._drop(slot)

    def _bring_for_backward(self, slots):
        # A backward fetch: a module's (its outputs' first gradient), a saved view's unpack, or a
        # parameter used outside its module (_hook_use_backward). It ends when the module's
        # backward ends, at the parameter's final gradient, or at the end of backward.
        self._bring_all(slots)
        for slot in slots:
            slot.backward_fetches += 1

    def _end_recompute_holds(self, slot):
        while slot.recompute_holds > 0:
            slot.recompute_holds -= 1
            self._drop(slot)

    def _after_module_backward(self, module, frozen=True, trainable=True):
        # One use of the module has its backward done (the gradient reached its inputs): the fetch
        # that use made ends, for its frozen and/or trainable parameters (see _hook_backward). A
        # module run several times in a step (ALBERT's shared layer) so holds its parameters
        # during each use's backward only, not from the last use's to the first's, where a
        # trainable parameter's gradient is final (_grad_ready ends what is left).
        for slot in self._module_slots[module]:
            if not (trainable if slot.trainable else frozen):
                continue
            if slot.backward_fetches > 0:
                slot.backward_fetches -= 1
                self._drop(slot)
            self._end_recompute_holds(slot)

    def _grad_ready(self, param):
        slot = self._slot_of[id(param)]
        self._grads_since_step = True
        self._grads_in_window = True
        grad = param.grad
        if grad is not None:
            if self._reducer is not None:
                # Across ranks: reduce-scattered in buckets; this rank's shard goes on to _grads.
                self._reducer.add(slot, grad)
            elif grad.device.type == "cuda":
                # Queued behind the backward kernels on the current stream: DMA'd straight into its
                # engine tensor where it can be (EngineGrads.add_device_grad), else through pinned
                # staging, which the optimizer takes once the copy's event has completed (at the
                # latest at the end of backward).
                direct = getattr(self._grads, "add_device_grad", None)
                if direct is None or not direct(slot.pid, grad, _activations.lease_stream(grad.device)):
                    self._grad_staging().push(slot.pid, grad.detach())
            else:
                t0 = time.perf_counter()
                host = grad.detach().contiguous()
                self.native.note_transfer(
                    "device_to_host", host.numel() * host.element_size(), time.perf_counter() - t0
                )
                self._grads.add_grad(slot.pid, host)
            param.grad = None
        while slot.backward_fetches > 0:
            slot.backward_fetches -= 1
            self._drop(slot)
        self._end_recompute_holds(slot)

    def _grad_staging(self):
        staging = self.__dict__.get("_grad_staging_state")
        if staging is None:
            staging = _GradStaging(self._grads, self.native)
            self._grad_staging_state = staging
        return staging

    def _drain_grads(self):
        staging = self.__dict__.get("_grad_staging_state")
        if staging is not None:
            staging.drain()

    def forward(self, *args, **kwargs):
        # A forward between the boundary backward and step() must see the committed params.
        self._cancel_overlap()
        self._repair_params()
        if not self._in_backward and torch._C._current_graph_task_id() == -1:
            self._release_backward_leftovers()  # (a backward of the caller's own is over)
            if self._reducer is not None and self._reducer.active:
                # That backward's micro-step ends here, as engine.backward() ends its own: a loop
                # that steps only at the boundary (accelerate's) runs the next micro-step's backward
                # before any step(), and the reducer must start it from its first bucket (its
                # gradients were otherwise held back and never reduced).
                self._reducer.flush(self.is_gradient_accumulation_boundary())
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        if not self._in_step and torch.is_grad_enabled() and not self.inference_only:
            # One micro-step (forward + backward) is one step of the access trace.
            self.native.begin_step()
            self._in_step = True
        out = self.module(*args, **kwargs)
        self._timers["forward"] += time.perf_counter() - t0
        self._span("forward", t0_ns)
        return out
