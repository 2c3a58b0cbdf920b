"""The torch optimizer tier.torch.initialize returns: torch's surface over the engine's offloaded
optimizer (engine.py builds it)."""

import weakref

import torch



class _OptimizerView(torch.optim.Optimizer):
    """What ``initialize`` returns as the optimizer: torch's optimizer surface over the engine's
    offloaded one. ``param_groups`` hold the model's parameters and each group's hyper-parameters;
    an ``lr`` written into a group (by a client LR scheduler, say) is the one the next step uses,
    and the engine writes its own scheduler's lr back. The state (fp32 masters and moments) lives
    in the engine: ``state_dict`` carries the hyper-parameters only; checkpoints go through
    ``engine.save_checkpoint``."""

    def __init__(self, engine, groups, shared_groups=None):
        super().__init__(groups, {})
        if shared_groups is not None:
            # A client optimizer's own groups: its scheduler then drives this view too.
            self.param_groups = shared_groups
        self._engine = weakref.ref(engine)

    def __getattr__(self, name):
        # tier's own optimizer methods (stats(), kind(), group_count, ...) reach through to the
        # engine's offloaded optimizer, so engine.optimizer serves both surfaces.
        if name == "_engine":
            raise AttributeError(name)
        engine = self._engine()
        native = engine.native_optimizer if engine is not None else None
        if native is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(native, name)

    def step(self, closure=None):
        """Steps the engine when gradients came in since its last ``step()`` without it being
        called: a loop of the caller's own (plain ``loss.backward()``, accelerate's
        ``accelerator.backward`` and ``optimizer.step()`` at each accumulation boundary) gets its
        update here, with every gradient taken since the last step. After ``engine.step()``
        (DeepSpeed's loop, the Trainer) there is nothing left and this does nothing."""
        loss = closure() if closure is not None else None
        engine = self._engine()
        if engine is not None and engine._grads_since_step:
            engine._step_now()
        return loss

    def zero_grad(self, set_to_none=True):
        engine = self._engine()
        if engine is not None:
            engine.zero_grad()

    @property
    def overflow(self):
        """Whether the last boundary step was skipped (fp16 overflow), as accelerate reads it."""
        engine = self._engine()
        return bool(engine is not None and engine.last_report is not None and not engine.last_report["applied"])

    def state_dict(self):
        groups = []
        index = 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(entry)
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} param groups, the engine's optimizer {len(self.param_groups)}"
            )
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        engine = self._engine()
        if engine is not None:
            engine._apply_lr()
