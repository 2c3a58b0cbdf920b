"""Untrusted inputs are refused with clear errors (issue #31, item 5, Python side); tier's
``NoSpace`` carries ``errno`` ENOSPC."""

import copy
import errno
import os
import sys

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_kill_child as kc  # noqa: E402


def test_no_space_carries_errno(tmp_path):
    cfg = copy.deepcopy(kc.config(str(tmp_path / "swap")))
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    cfg["tier"]["budgets"]["nvme"] = "1000T"  # more than any test machine's disk
    with pytest.raises(tier.NoSpace) as info:
        tier.torch.initialize(kc.make_model(), cfg)
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC, (e.errno, str(e))
    assert "needs" in str(e) and not str(e).startswith("[Errno")  # the message is tier's, whole
