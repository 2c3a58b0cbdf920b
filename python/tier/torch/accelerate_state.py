"""accelerate's ``save_state`` / ``load_state`` for tier engines.

accelerate saves a prepared model as its state dict and an optimizer as its ``state_dict()``. A
tier engine's optimizer keeps its fp32 masters, moments and step counts in the engine (on NVMe
for a large model), so that state dict holds the param groups' hyper-parameters only, and a
weights-only state dict cannot be loaded back into an engine whose parameters it holds.
:func:`register_accelerate_hooks` makes ``save_state`` write each engine's tier checkpoint
(``tier_engine_<i>/`` in the state's folder: params, masters, moments, counters, the config's
scheduler; checksummed, all or nothing on load) in place of its weights, and ``load_state``
restore it. With several ranks every rank calls ``save_state`` and ``load_state``, as
accelerate asks.
"""

import os

from .engine import TierEngine

FOLDER = "tier_engine_{}"


def register_accelerate_hooks(accelerator):
    """Registers the save and load pre-hooks on ``accelerator``; returns their two handles."""

    def save(models, weights, output_dir):
        engines = [i for i, m in enumerate(models) if isinstance(m, TierEngine)]
        for n, i in enumerate(engines):
            models[i].save_checkpoint(os.path.join(output_dir, FOLDER.format(n)), tag="state")
        # accelerate writes the rest; an engine's weights are in its checkpoint. (The hook sees
        # the models list accelerate keeps, so it is left whole; the weights list is this call's.)
        for i in reversed(engines):
            del weights[i]

    def load(models, input_dir):
        engines = [i for i, m in enumerate(models) if isinstance(m, TierEngine)]
        for n, i in enumerate(engines):
            path = os.path.join(input_dir, FOLDER.format(n))
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"accelerate load_state: {input_dir} has no {FOLDER.format(n)}/ (a tier engine's checkpoint); it was "
                    "saved without tier.torch.register_accelerate_hooks"
                )
            models[i].load_checkpoint(path, tag="state")
        for i in reversed(engines):
            del models[i]  # (accelerate's list of what to load: the engines are loaded)

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
