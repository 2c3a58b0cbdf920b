"""tier.torch: train PyTorch (and Hugging Face ``transformers``) models with parameters and
optimizer state offloaded to host memory and NVMe, in the manner of ``deepspeed.initialize``."""

from .engine import TierEngine, initialize  # noqa: F401
from .zero_init import init  # noqa: F401
from .fast_random import fast_random  # noqa: F401
from .hf import from_pretrained  # noqa: F401
from .optim import OffloadedAdamW  # noqa: F401
from .accelerate_state import register_accelerate_hooks  # noqa: F401
