"""The native module: configs, engine, leases as tensors, errors as exceptions."""

import json

import numpy as np
import pytest

import tier


def engine_config(swap_dir, **tier_extra):
    t = {"device": "emulated", "budgets": {"device": "1M", "host": "4M", "nvme": "32M"}, "swap_paths": [swap_dir]}
    t.update(tier_extra)
    return tier.Config.from_json(json.dumps({"tier": t}))


def test_config_notes_and_auto_keys():
    cfg = tier.Config.from_json(json.dumps({"zero_optimization": {"overlap_comm": True}, "gradient_clipping": "auto"}))
    assert any(n.startswith("zero_optimization.overlap_comm:") for n in cfg.notes)
    assert "gradient_clipping" in cfg.auto_keys
    assert json.loads(cfg.to_json())["gradient_clipping"] == 1.0


def test_bad_config_raises_invalid_argument_naming_the_key():
    with pytest.raises(tier.InvalidArgument) as e:
        tier.Config.from_json(json.dumps({"aio": {"queue_depth": 0}}))
    assert "aio.queue_depth" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_register_acquire_as_tensor_and_read_back(swap_dir):
    e = tier.Engine.create(engine_config(swap_dir))
    data = np.arange(1000, dtype=np.float32)
    tid = e.register("w", "fp32", 1000, "param", 0, "nvme", data)
    lease = e.acquire(tid, "device", "read")
    view = np.from_dlpack(lease.as_tensor([10, 100]))
    assert view.shape == (10, 100)
    assert view[3, 7] == 307
    assert e.info(tid)["readers"] == 1
    del view  # the view owned the lease
    assert e.info(tid)["readers"] == 0
    out = np.zeros(1000, dtype=np.float32)
    e.read(tid, out)
    np.testing.assert_array_equal(out, data)


def test_write_lease_changes_contents(swap_dir):
    e = tier.Engine.create(engine_config(swap_dir))
    tid = e.register("w", "fp32", 256, "param", 0, "nvme")
    view = np.from_dlpack(e.acquire(tid, "device", "write").as_tensor())
    view[:] = 7.0
    del view
    e.flush()
    out = np.zeros(256, dtype=np.float32)
    e.read(tid, out)
    assert (out == 7.0).all()
    assert e.info(tid)["copies"]["nvme"] == "valid_clean"


def test_errors_map_to_exception_classes(swap_dir):
    e = tier.Engine.create(engine_config(swap_dir))
    with pytest.raises(tier.NotFound):
        e.acquire(12345, "device", "read")
    with pytest.raises(tier.InvalidArgument) as err:
        e.register("x", "fp32", 10, "param", 0, "nvme", np.zeros(3, dtype=np.float32))
    assert "40" in str(err.value)
    tid = e.register("big", "fp32", 1 << 19, "param", 0, "nvme")  # 2 MiB: over the 1 MiB device budget
    with pytest.raises(tier.ResourceExhausted) as err:
        e.acquire(tid, "device", "read")
    assert "tier.budgets.device" in str(err.value)
    assert isinstance(err.value, MemoryError)


def test_stats_has_links_and_engine_metrics(swap_dir):
    e = tier.Engine.create(engine_config(swap_dir))
    tid = e.register("w", "fp32", 4096, "param", 0, "nvme", np.ones(4096, dtype=np.float32))
    e.acquire(tid, "device", "read").release()
    s = tier.stats(e)
    assert s["links"]["host_to_device"]["bytes"] == 4096 * 4
    assert s["metrics"]["engine.acquires"] >= 1
    assert s["info"]["device"] == "emulated"


def test_the_zero_shard_layout_is_shard_maps():
    """tier.torch's ZeRO shards are tier::ShardMap's (the C ABI's tier_shard_range): ceil(numel / world)
    per rank, tiling the tensor in rank order, the last ranks owning less or nothing; an empty
    parameter keeps a one-element shard for the engine."""
    from tier import _tier
    from tier.torch.zero import shard_range

    for numel in (0, 1, 5, 7, 8, 9, 1000, 1001):
        for world in (1, 2, 3, 8):
            want = -(-numel // world)
            covered = 0
            for rank in range(world):
                shard, start, count = shard_range(numel, world, rank)
                assert (shard, start, count) == (max(1, want), *_tier.shard_range(numel, world, rank)[1:])
                assert _tier.shard_range(numel, world, rank)[0] == want
                assert start == min(numel, covered) and 0 <= count <= want
                covered += count
            assert covered == numel
    with pytest.raises(tier.InvalidArgument, match="rank 2 is not in"):
        _tier.shard_range(10, 2, 2)
    with pytest.raises(tier.InvalidArgument, match="world 0"):
        _tier.shard_range(10, 0, 0)


def test_outputs_that_would_need_a_copy_are_refused_not_filled_in_a_copy(swap_dir):
    """An output array the binding would have to convert (another dtype, not C-contiguous) is
    refused: before, nanobind made a converted copy, the call filled that and returned, and the
    caller's array kept its old values."""
    torch = pytest.importorskip("torch")
    from tier import _tier

    e = tier.Engine.create(engine_config(swap_dir))
    tid = e.register("x", "fp32", 12, "param", 0, "host", torch.arange(12, dtype=torch.float32))
    for out in (torch.zeros(4, 3).t(), torch.zeros(12, dtype=torch.float64)):
        with pytest.raises(tier.InvalidArgument):
            e.read(tid, out)
    out = torch.zeros(12)
    e.read(tid, out)
    assert torch.equal(out, torch.arange(12, dtype=torch.float32))
    with pytest.raises(tier.InvalidArgument):
        _tier.accumulate_grad(torch.zeros(4, 3).t(), torch.ones(12), True)
