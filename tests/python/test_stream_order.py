"""Device leases handed to Python end in stream order (tier.emulated.delayed_streams: each stream
handle is a worker that runs its queued work later, as a GPU stream does)."""

import json
import time

import numpy as np
import pytest

import tier


def _engine(swap_dir, delayed=True, latency_us=0):
    t = {
        "device": "emulated",
        "emulated": {"delayed_streams": delayed, "latency_us": latency_us},
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


def test_a_stream_ordered_fetch_is_granted_while_its_copies_are_in_flight(swap_dir):
    # Copies to the device take 200 ms: the leases come back before they land (the stream waits
    # for them, not the host), and end once the stream has passed the point they were ended at.
    e = _engine(swap_dir, latency_us=200000)
    a = e.register("a", "fp32", 1000, "param", 0, "host", np.arange(1000, dtype=np.float32))
    b = e.register("b", "fp32", 1000, "param", 0, "nvme", np.full(1000, 2.0, dtype=np.float32))
    leases = e.acquire_many([a, b], "device", "read", stream=STREAM)
    assert [e.info(t)["copies"]["device"] for t in (a, b)] == ["loading", "loading"]
    assert e.info(b)["copies"]["host"] == "valid_clean"  # the hop from NVMe was waited for
    for lease in leases:
        lease.release_after(STREAM)
    assert _readers_become(e, a, 0) and _readers_become(e, b, 0)
    assert e.info(a)["copies"]["device"] == "valid_clean"
    one = e.acquire(b, "device", "read", stream=STREAM)
    assert one.tier == "device"
    one.release_after(STREAM)
    assert _readers_become(e, b, 0)
    out = np.empty(1000, dtype=np.float32)
    e.read(b, out)
    assert (out == 2.0).all()


def test_a_stream_is_for_device_reads(swap_dir):
    e = _engine(swap_dir)
    tid = e.register("w", "fp32", 256, "param", 0, "host", np.ones(256, dtype=np.float32))
    with pytest.raises(ValueError, match="device copy"):
        e.acquire(tid, "host", "read", stream=STREAM)
    with pytest.raises(ValueError, match="access 'write'"):
        e.acquire_many([tid], "device", "write", stream=STREAM)
    assert e.info(tid)["readers"] == 0 and not e.info(tid)["writer"]
