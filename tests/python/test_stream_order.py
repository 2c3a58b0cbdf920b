"""Device leases handed to Python end in stream order (tier.emulated.delayed_streams: each stream
handle is a worker that runs its queued work later, as a GPU stream does)."""

import json
import time

import numpy as np
import pytest

import tier


def _engine(swap_dir, delayed=True):
    t = {
        "device": "emulated",
        "emulated": {"delayed_streams": delayed},
        "budgets": {"device": "1M", "host": "4M", "nvme": "32M"},
        "swap_paths": [swap_dir],
    }
    return tier.Engine.create(tier.Config.from_json(json.dumps({"tier": t})))


def _readers_become(e, tid, n, timeout=10.0):
    end = time.monotonic() + timeout
    while e.info(tid)["readers"] != n:
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


STREAM = 0x77


def test_a_view_with_a_stream_ends_its_lease_after_that_stream(swap_dir):
    e = _engine(swap_dir)
    data = np.arange(1000, dtype=np.float32)
    tid = e.register("w", "fp32", 1000, "param", 0, "host", data)
    gate = e._hold_stream(STREAM)  # work queued on STREAM from now on runs after gate.open()
    view = np.from_dlpack(e.acquire(tid, "device", "read").as_tensor(stream=STREAM))
    assert view[7] == 7
    del view
    time.sleep(0.05)
    assert e.info(tid)["readers"] == 1  # the stream has not passed the point the view died at
    gate.open()
    assert _readers_become(e, tid, 0)


def test_release_after_a_stream(swap_dir):
    e = _engine(swap_dir)
    tid = e.register("w", "fp32", 256, "param", 0, "host", np.ones(256, dtype=np.float32))
    gate = e._hold_stream(STREAM)
    lease = e.acquire(tid, "device", "read")
    lease.release_after(STREAM)
    time.sleep(0.05)
    assert e.info(tid)["readers"] == 1
    gate.open()
    assert _readers_become(e, tid, 0)
    with pytest.raises(tier.FailedPrecondition):
        lease.release_after(STREAM)


def test_a_view_without_a_stream_ends_at_once_and_plain_devices_refuse_the_gate(swap_dir):
    e = _engine(swap_dir, delayed=False)
    tid = e.register("w", "fp32", 256, "param", 0, "host", np.ones(256, dtype=np.float32))
    view = np.from_dlpack(e.acquire(tid, "device", "read").as_tensor(stream=STREAM))
    del view  # no delayed streams: the event is complete when recorded
    assert _readers_become(e, tid, 0, timeout=2.0)
    with pytest.raises(tier.FailedPrecondition):
        e._hold_stream(STREAM)
