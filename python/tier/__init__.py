"""tier: a memory-tiering and offload engine.

Model state lives in GPU memory, pinned host memory or NVMe and moves just in time. The native
engine is in ``tier._tier``; ``tier.torch`` plugs it into PyTorch training loops in the manner of
``deepspeed.initialize``.
"""

from ._tier import (  # noqa: F401
    AlreadyExists,
    Cancelled,
    Config,
    DataLoss,
    DeviceError,
    Engine,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    IoError,
    Lease,
    NoSpace,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    TierError,
    TimedOut,
    Unsupported,
)

__version__ = "0.1.0"


def stats(engine: "Engine") -> dict:
    """The engine's stats snapshot as a dict (tiers, links, info, metrics)."""
    import json

    return json.loads(engine.stats_json())
