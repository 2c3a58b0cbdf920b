"""tier.jax: tier's offloaded optimizer for JAX training loops.

``tier.jax.OffloadedAdamW`` is AdamW over a pytree of JAX arrays whose fp32 master weights and
moments live in tier (on NVMe, or in host memory) and are updated there by tier's CPU Adam. The
step is a plain function call outside ``jit``: ``params = opt.step(params, grads)``. See
docs/jax.md.

Importing ``tier`` does not import JAX; importing ``tier.jax`` does, and says so when it is
missing.
"""

try:
    import jax as _jax  # noqa: F401
    import ml_dtypes as _ml_dtypes  # noqa: F401  (JAX's own dependency: numpy's bfloat16)
except ImportError as _e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "tier.jax needs JAX, which is not importable here "
        f"({_e}); install it with `pip install jax` (the CPU wheel is enough: tier does the "
        "optimizer step on the CPU)"
    ) from _e

from .optim import OffloadedAdamW  # noqa: E402

__all__ = ["OffloadedAdamW"]
