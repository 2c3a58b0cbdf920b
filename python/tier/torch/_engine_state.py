"""TierEngine's state and queries: stats, the timeline, the fp32 masters, checkpoints, state dicts
and save_pretrained, DeepSpeed's engine queries, close and destroy (mixed into TierEngine,
engine.py)."""

import atexit
import contextlib
import json
import os
import time
import warnings
import weakref

import torch

from . import zero as _zero
from ._engine_fetch import _DESTROYED_GUARDS, _destroyed_guard


_LIVE_ENGINES = weakref.WeakSet()


@atexit.register
def _destroy_live_engines():
    # The native engines must go before the interpreter tears the extension down, or nanobind
    # reports them as leaked (an engine kept alive by a reference cycle or a global).
    for engine in list(_LIVE_ENGINES):
        try:
            engine.destroy()
        except Exception:  # noqa: BLE001 - at exit, nothing is left to report to
            pass


class StateMixin:
    # ------------------------------------------------------------------ the training loop
    def _span(self, name, t0_ns):
        """A compute span on the timeline (tier.trace_file or start_trace), from t0_ns to now."""
        if self.native.tracing:
            self.native.trace_span("compute", name, t0_ns, time.monotonic_ns())

    def start_trace(self, max_events=1_000_000):
        """Starts recording the timeline (as ``"tier": {"trace_file": ...}`` does from the start):
        each transfer per link, stalls, forward/backward/optimizer spans."""
        self.native.start_trace(max_events)

    def save_trace(self, path):
        """Writes the timeline recorded so far as Chrome trace-event JSON (open it in
        ui.perfetto.dev or chrome://tracing); recording goes on."""
        self.native.write_trace(os.fspath(path))

    # ------------------------------------------------------------------ state
    def stats(self):
        """The engine's snapshot (tiers, links, metrics) with the optimizer's figures."""
        s = json.loads(self.native.stats_json())
        if self.native_optimizer is not None:
            if self.native_optimizer.async_running:
                # A delayed update is running: the figures as it found them (it owns the optimizer).
                s["optimizer"] = dict(self.__dict__.get("_optimizer_stats") or {}, update_running=True)
            else:
                s["optimizer"] = self._optimizer_stats = self.native_optimizer.stats()
        z = self.__dict__.get("_zero")
        if z is not None:
            pf = self.__dict__.get("_prefetcher")
            s["zero"] = {
                "rank": z.rank,
                "world": z.world,
                "stage": z.stage,
                "reduce_scatter_bytes": z.bytes_reduced,
                "all_gather_bytes": z.bytes_gathered,
                "gather_prefetch_hits": pf.hits if pf else 0,
                "gather_prefetch_misses": pf.misses if pf else 0,
            }
        return s

    def timers(self):
        """Seconds spent so far in forward, backward and step (the optimizer), as a new dict."""
        return dict(self._timers)

    def parameter(self, name):
        """The current value of a parameter, as a CPU tensor of the compute dtype."""
        slot = next((s for s in self._slots if s.name == name), None)
        if slot is None:
            raise KeyError(f"no parameter named {name!r}")
        self._settle()
        if self._zero is not None and self._zero.stage == 3:
            # A collective: every rank asks for the same parameters in the same order.
            if slot.fetches > 0:
                return slot.param.data.detach().to("cpu", copy=True)
            shard = torch.empty(slot.zero_shard, dtype=self.compute_dtype)
            self.native.read(slot.tid, shard)
            full = _zero.gather_full(self._zero, [slot], lambda s: shard.to(self._zero.device))
            return full[id(slot)].view(slot.shape).to("cpu", copy=True)
        out = torch.empty(slot.shape, dtype=self.compute_dtype)
        self.native.read(slot.tid, out)
        return out

    @contextlib.contextmanager
    def modify_parameters(self, params=None, modifier_rank=0):
        """Inside the block the given parameters (the module's ``Parameter`` objects or their names;
        all of them by default) hold their current values instead of their empty placeholders, in
        the compute dtype, so they can be read and edited as in a plain model
        (``deepspeed.zero.GatheredParameters(params, modifier_rank=...)``'s role). On leaving, each
        one whose values changed is written back: to the engine, and for a trainable one to its
        fp32 master too, which the next step starts from (its moments are kept); the others are
        left exactly as they were. Run no forward inside the block.

        Across ranks a collective: every rank enters with the same parameters, and the values of
        rank ``modifier_rank`` are the ones kept. A block left by an exception writes nothing."""
        self._settle()
        if self.native_optimizer is not None:
            self._finish_owed_step()
        if params is None:
            slots = list(self._slots)
        else:
            by_name = {s.name: s for s in self._slots}
            slots = []
            for p in params:
                s = by_name.get(p) if isinstance(p, str) else self._slot_of.get(id(p))
                if s is None:
                    raise KeyError(f"modify_parameters: {p if isinstance(p, str) else 'a tensor'} is not a parameter "
                                   "the engine holds")
                if s not in slots:
                    slots.append(s)
        if self._zero is not None and not 0 <= modifier_rank < self._zero.world:
            raise ValueError(f"modify_parameters: modifier_rank {modifier_rank} is not a rank of {self._zero.world}")
        held = []  # (slot, its values as the block began)
        try:
            for s in slots:
                value = self.parameter(s.name).view(s.shape)
                held.append((s, value.clone()))
                s.param.data = value
            yield
        finally:
            left = [(s, s.param.data) for s, _ in held]
            for s, _ in held:  # every placeholder back, whatever follows (the block's edits were its own)
                self._placeholder(s)
        for s, now in left:
            if tuple(now.shape) != s.shape:
                raise ValueError(f"modify_parameters: {s.name} left the block with shape {tuple(now.shape)}, not "
                                 f"{s.shape}; nothing was written")
        values = [now.detach().to("cpu", self.compute_dtype).contiguous() for _, now in left]
        flags = torch.tensor([0 if torch.equal(v, b) else 1 for v, (_, b) in zip(values, held)], dtype=torch.int32)
        if self._zero is not None:
            # The modifier's values everywhere, and which of them it changed.
            self._zero.broadcast(flags, modifier_rank)
            for v, f in zip(values, flags.tolist()):
                if f:
                    self._zero.broadcast(v, modifier_rank)
        changed = [(s, v) for (s, _), v, f in zip(held, values, flags.tolist()) if f]
        self._write_parameters(changed)

    def _write_parameters(self, values):
        """Writes whole values (compute dtype, CPU) of parameters into the engine: a trainable one's
        fp32 master (this rank's part), and the engine's copy from it as the optimizer converts."""
        if not values:
            return
        for s, v in values:
            flat = v.reshape(-1)
            if s.pid is not None:
                master = flat[s.zero_start : s.zero_start + s.zero_count].float().contiguous()
                self.native_optimizer.write_state(s.pid, "master", master)
                self._param_from_master(s)
            else:
                self._write_frozen(s, flat)
        if self._zero is not None and self._zero.stage < 3:
            self._gather_updated_params()
        self.native.flush()
        self._param_version += 1

    def _param_from_master(self, slot):
        """The engine's copy of a trainable parameter (this rank's part) from its fp32 master, as
        the optimizer converts its outputs. Stages 1 and 2 then need _gather_updated_params."""
        low = torch.empty(slot.zero_count, dtype=self.compute_dtype)
        self.native_optimizer.read_param(slot.pid, low)
        lease = self.native.acquire(slot.tid, "host", "read_write")
        t = torch.from_dlpack(lease.as_tensor())
        at = 0 if self._zero is not None and self._zero.stage == 3 else slot.zero_start
        t[at : at + slot.zero_count] = low
        del t, lease

    def _write_frozen(self, slot, flat):
        """A frozen parameter's whole value (flat, compute dtype) into the engine: this rank's shard
        in stage 3, else all of it."""
        if self._zero is not None and self._zero.stage == 3:
            shard = torch.zeros(slot.zero_shard, dtype=self.compute_dtype)
            shard[: slot.zero_count] = flat[slot.zero_start : slot.zero_start + slot.zero_count]
            self.native.write(slot.tid, shard)
        else:
            self.native.write(slot.tid, flat.view(slot.shape))

    def _gathered_master(self, slot):
        """Across ranks: the fp32 master of one trainable parameter, gathered (a collective)."""

        def master(s):
            m = torch.zeros(s.zero_shard, dtype=torch.float32)
            if s.pid is not None:
                self.native_optimizer.read_param(s.pid, m[: s.zero_count])
            return m.to(self._zero.device)

        return _zero.gather_full(self._zero, [slot], master)[id(slot)].view(slot.shape).to("cpu", copy=True)

    def state_dict_fp32(self):
        """Every trainable parameter's fp32 master value, by name (CPU tensors)."""
        self._settle()
        out = {}
        if self._zero is not None:
            # Collectives: the masters' shards gathered from their owners.
            def master(s):
                m = torch.zeros(s.zero_shard, dtype=torch.float32)
                if s.pid is not None:
                    self.native_optimizer.read_param(s.pid, m[: s.zero_count])
                return m.to(self._zero.device)

            trainable = [s for s in self._slots if s.trainable]
            for bucket in _zero.gather_buckets(self._zero, trainable):
                full = _zero.gather_full(self._zero, bucket, master)
                for s in bucket:
                    out[s.name] = full[id(s)].view(s.shape).to("cpu", copy=True)
            for s in self._slots:
                if not s.trainable:
                    out[s.name] = self.parameter(s.name).float()
            return {s.name: out[s.name] for s in self._slots}
        for slot in self._slots:
            if slot.pid is None:
                out[slot.name] = self.parameter(slot.name).float()
                continue
            t = torch.empty(slot.shape, dtype=torch.float32)
            self.native_optimizer.read_param(slot.pid, t.view(-1))
            out[slot.name] = t
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Saves everything needed to resume as ``save_dir/<tag>`` (default ``global_step<N>``) and,
        with ``save_latest``, makes it ``latest``; a process killed meanwhile leaves the previous
        checkpoint loadable. ``client_state`` must be JSON-serializable. Returns the checkpoint's
        path. ``exclude_frozen_parameters=True`` is refused: a tier checkpoint is always complete."""
        from .checkpoint import save

        if self.native_optimizer is None:
            raise ValueError(
                "engine.save_checkpoint(): the engine runs inference only (no optimizer) and a tier checkpoint holds "
                "training state; write the weights with engine.save_pretrained(dir)"
            )
        if exclude_frozen_parameters:
            raise NotImplementedError(
                "save_checkpoint(exclude_frozen_parameters=True): tier checkpoints always hold the frozen "
                "parameters (load checks them against the model); drop the argument"
            )
        self._settle()
        if self._zero is not None:
            from .zero_checkpoint import save as save_ranks

            return save_ranks(self, save_dir, tag, client_state or {}, save_latest=save_latest)
        return save(self, save_dir, tag, client_state or {}, save_latest=save_latest)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        """Restores the checkpoint ``tag`` (default: the one ``load_dir/latest`` names), all or
        nothing: every file is checked against its manifest (``tier.DataLoss`` if damaged) and all
        metadata against the model (ValueError) before the engine changes. Returns the directory
        loaded and the client state.

        The keyword arguments are DeepSpeed's; tier restores module, optimizer and scheduler
        together, so only their defaults (what the Hugging Face Trainer passes) are accepted, and a
        partial load is refused with the reason."""
        from .checkpoint_load import load

        if self.native_optimizer is None:
            raise ValueError(
                "engine.load_checkpoint(): the engine runs inference only (no optimizer) and a tier checkpoint holds "
                "training state; load weights with tier.torch.from_pretrained(dir, config)"
            )
        partial = {
            "load_module_strict": (load_module_strict, True),
            "load_optimizer_states": (load_optimizer_states, True),
            "load_lr_scheduler_states": (load_lr_scheduler_states, True),
            "load_module_only": (load_module_only, False),
            "custom_load_fn": (custom_load_fn, None),
        }
        for key, (value, default) in partial.items():
            if value != default if default is not None else value is not None:
                raise NotImplementedError(
                    f"load_checkpoint({key}={value!r}): a tier checkpoint is restored whole (module, optimizer and "
                    f"scheduler state together, names checked strictly); leave {key} at {default!r}"
                )
        self._settle()
        from .zero_checkpoint import is_rank_checkpoint

        if self._zero is not None or is_rank_checkpoint(load_dir, tag):
            from .zero_checkpoint import load as load_ranks

            out = load_ranks(self, load_dir, tag)
        else:
            out = load(self, load_dir, tag)
        # The gradients taken so far belong to the params before the load; a refused load (which
        # applies nothing) keeps them.
        self.zero_grad()
        self._param_version += 1
        return out

    # ------------------------------------------------------------------ DeepSpeed's engine surface
    def gradient_accumulation_steps(self):
        """Micro-steps per step, from the config (the boundary set from outside may differ)."""
        return self._gas

    def gradient_clipping(self):
        """The global-norm clipping threshold (0: none)."""
        return self._clip

    def get_global_grad_norm(self):
        """The global L2 norm of the last boundary step's gradient, before clipping (inf or nan
        when it overflowed); None before the first step."""
        if self.last_report is None:
            return None
        return float(self.last_report["grad_norm"])

    def was_step_applied(self):
        """Whether the last ``step()`` updated the parameters (False off the boundary and when an
        fp16 overflow skipped the update)."""
        return self._step_applied

    def fp16_enabled(self):
        return self.compute_dtype_name == "fp16"

    def bfloat16_enabled(self):
        return self.compute_dtype_name == "bf16"

    def zero_optimization_stage(self):
        return int(self._resolved.get("zero_optimization", {}).get("stage", 0))

    def zero_optimization(self):
        return self.zero_optimization_stage() > 0

    def train_micro_batch_size_per_gpu(self):
        """The config's micro-batch size; from ``train_batch_size / (gradient_accumulation_steps x
        ranks)`` when only that is given; 1 when neither is."""
        micro = self._raw_config.get("train_micro_batch_size_per_gpu")
        if micro is not None:
            return int(micro)
        total = self._raw_config.get("train_batch_size")
        if total is not None:
            return max(1, int(total) // (self._gas * self._world()))
        return 1

    def train_batch_size(self):
        """Samples per step over all ranks: the config's ``train_batch_size``, else micro-batch
        size x gradient_accumulation_steps x ranks."""
        total = self._raw_config.get("train_batch_size")
        if total is not None:
            return int(total)
        return self.train_micro_batch_size_per_gpu() * self._gas * self._world()

    def _world(self):
        return 1 if self.__dict__.get("_zero") is None else self._zero.world

    def get_global_step(self):
        return self.global_steps

    def deepspeed_io(self, dataset, batch_size=None, shuffle=True, collate_fn=None, num_workers=0):
        """A DataLoader over ``dataset`` with the micro-batch size (what initialize returns)."""
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            shuffle=shuffle,
            collate_fn=collate_fn,
            num_workers=num_workers,
        )

    # ------------------------------------------------------------------ gathered weights
    def _install_state_dict_hooks(self, model):
        """``module.state_dict()`` (and so ``save_pretrained``) returns the engine's current values
        instead of the empty placeholders the parameters hold between forwards."""
        ref = weakref.ref(self)
        for mod in model.modules():
            if mod._parameters:
                self._hook_handles.append(
                    mod._register_state_dict_hook(
                        lambda m, sd, prefix, meta, r=ref: r()._fill_state_dict(m, sd, prefix)
                    )
                )

    def _gathered(self, slot, memo):
        t = memo.get(slot.name)
        if t is None:
            t = self.parameter(slot.name)
            memo[slot.name] = t
        return t

    def _fill_state_dict(self, module, state_dict, prefix):
        if self.__dict__.get("native") is None:
            return
        self._settle()
        key = (id(state_dict), self._param_version)
        memo_key, memo = self.__dict__.get("_gather_memo", (None, None))
        if memo_key != key:
            memo = {}
            self._gather_memo = (key, memo)
        for name, p in module._parameters.items():
            slot = self._slot_of.get(id(p)) if p is not None else None
            full = prefix + name
            if slot is None or full not in state_dict or p.numel() == slot.numel:
                continue  # not ours, not saved, or fetched right now (the view is current)
            t = self._gathered(slot, memo)
            state_dict[full] = t.requires_grad_(p.requires_grad) if state_dict[full].requires_grad else t

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Refused: the engine holds the parameters (and their fp32 masters and moments), and the
        module's are placeholders, so torch's copy into them cannot restore a run. Raises with the
        ways that do."""
        raise RuntimeError(
            "TierEngine.load_state_dict: the engine holds the parameters, with their fp32 masters and the "
            "optimizer's moments; restore a tier checkpoint with engine.load_checkpoint(dir), or load weights "
            "with tier.torch.from_pretrained(dir, config). With accelerate, call "
            "tier.torch.register_accelerate_hooks(accelerator) before save_state and load_state: they then "
            "write and restore the engine's checkpoint"
        )

    def module_state_dict(self, exclude_frozen_parameters=False):
        """The model's state dict with every parameter gathered from the engine (compute dtype, CPU).
        With ``exclude_frozen_parameters`` only the trainable parameters (and the buffers) are
        gathered: a LoRA adapter's state dict reads megabytes, not the frozen base."""
        if not exclude_frozen_parameters:
            return self.module.state_dict()
        sd = {}
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                slot = self._slot_of.get(id(p))
                sd[name] = self.parameter(slot.name) if slot is not None else p.detach().cpu()
        for prefix, mod in self.module.named_modules():
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent_buffers_set:  # as state_dict()
                    sd[f"{prefix}.{name}" if prefix else name] = b.detach().cpu()
        return sd

    def save_pretrained(
        self,
        save_dir,
        *,
        max_shard_size="5GB",
        dtype=None,
        save_config=True,
        is_main_process=True,
        save_function=None,
        state_dict=None,
        safe_serialization=True,
        push_to_hub=False,
    ):
        """Writes the current weights to ``save_dir`` as a transformers safetensors checkpoint
        (sharded, with its index and the model's ``config.json``), one tensor in host memory at a
        time; see :func:`tier.torch.hf.save_pretrained`. Returns the files written.

        Across ranks every rank calls it (the weights are gathered) and rank 0 writes. The
        keywords of ``PreTrainedModel.save_pretrained`` that scripts pass (accelerate's
        ``save_pretrained(dir, is_main_process=..., save_function=accelerator.save)``) are
        accepted: ``is_main_process`` and ``save_function`` do not change who writes or how (the
        files are safetensors); a ``state_dict`` is not needed, since the engine's own current
        weights are written, and one passed is refused unless it is the engine's (the same keys);
        ``safe_serialization=False`` and ``push_to_hub`` are refused."""
        from . import hf

        del is_main_process, save_function
        if not safe_serialization:
            raise NotImplementedError("engine.save_pretrained writes safetensors only; leave safe_serialization=True")
        if push_to_hub:
            raise NotImplementedError("engine.save_pretrained does not push to the Hub; push the folder it writes")
        if state_dict is not None:
            mine = {n for n, _ in self.module.named_parameters()}
            theirs = {k[len("module.") :] if k.startswith("module.") else k for k in state_dict}
            if not mine <= theirs:
                missing = sorted(mine - theirs)[:3]
                raise ValueError(
                    f"engine.save_pretrained(state_dict=...): the engine writes its own weights, and the state dict "
                    f"given is not the engine's (it lacks {missing}); write another state dict with transformers"
                )
        return hf.save_pretrained(self, save_dir, max_shard_size=max_shard_size, dtype=dtype, save_config=save_config)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Writes the gathered weights (and persistent buffers) as ``save_dir/save_filename`` with
        ``torch.save``, in the compute dtype: bf16 or fp16 when enabled, else fp32 (as DeepSpeed
        saves what the model computes in). The file is written under a fresh temporary name
        (``O_EXCL|O_NOFOLLOW``: nothing planted in ``save_dir`` is written through) and renamed.
        Returns True."""
        from .. import fs as _fs
        from .atomic_file import atomic_write

        _fs.makedirs(save_dir, exist_ok=True)
        sd = {k: v.detach().cpu() for k, v in self.module_state_dict(exclude_frozen_parameters).items()}
        with atomic_write(os.path.join(save_dir, save_filename)) as f:
            torch.save(sd, f)
        return True

    def close(self):
        """Removes the hooks; the engine's files are removed when it is destroyed."""
        if self.__dict__.get("_prefetcher") is not None:
            self._prefetcher.drop()  # stage 3: no all-gather left in flight
        for h in self._hook_handles + self.__dict__.get("_excluded_grad_hooks", []):
            h.remove()
        self._hook_handles = []
        self._excluded_grad_hooks = []

    def destroy(self):
        """Ends the engine: removes the hooks and releases the native optimizer and engine (their
        swap files go with them). The model's parameters keep their empty placeholders; read what
        you need (``module_state_dict``, ``save_16bit_model``) before. Calling it twice is harmless."""
        if self.__dict__.get("native") is None:
            return
        self._drain_grads()
        if self.native_optimizer is not None:
            try:
                self._join_delayed()
            except Exception as e:  # noqa: BLE001 (the engine goes anyway; say what was lost)
                warnings.warn(f"engine.destroy(): the last delayed update failed and is dropped: {e}", stacklevel=2)
        if self.device.type == "cuda":
            # Device leases end after the kernels queued before their views were freed: let them
            # run before the engine (and its device memory) goes.
            torch.cuda.current_stream(self.device).synchronize()
        self.close()
        for mod, owned in self._module_slots.items():
            guard = _destroyed_guard([(s.param, s.numel) for s in owned])
            _DESTROYED_GUARDS[mod] = mod.register_forward_pre_hook(guard)
        self._grads.clear()
        self.__dict__.pop("_grad_staging_state", None)
        self._saved_params.offload = None
        self._saved_params.clear()
        self._activations = None
        for slot in self._slots:
            slot.param.grad = None
            slot.param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        if self.native_optimizer is not None:
            self.native_optimizer.close()
        self.native_optimizer = None
        self._comm = None
        if self.__dict__.get("_zero") is not None:
            self._zero.release()
        self.native = None
        self.config = None  # a native object too: nothing of tier's may outlive the interpreter
        _LIVE_ENGINES.discard(self)
