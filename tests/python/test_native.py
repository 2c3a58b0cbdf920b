"""The native module: configs, engine, leases as tensors, errors as exceptions."""

import json
import time

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


def _ranked_driver(tmp_path, sub, arrays):
    """A step driver with the given parameters (name -> fp32 array), state on NVMe under tmp_path/sub."""
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / sub)}},
        "tier": {"io": {"use_direct": False}, "optimizer": {"chunk_elements": 1024}},
    }
    d = tier._tier.StepDriver(tier._tier.Config.from_json(json.dumps(cfg)), sum(a.size for a in arrays.values()))
    for name, a in arrays.items():
        d.add_param(name, a)
    return d


def test_step_driver_ranks_clip_by_the_global_norm_through_a_communicator(tmp_path):
    """Two ranks (threads), each driver holding one parameter, step with a _tier.Communicator whose
    all-reduce is Python's: their params, norms and clip coefficients equal, bit for bit, those of one
    driver holding both. A raising all-reduce fails the step on every rank with nothing applied."""
    import threading

    sizes = {"w0": 3000, "w1": 1000}
    init = {n: (0.5 * np.sin(0.37 * np.arange(k) + i)).astype(np.float32) for i, (n, k) in enumerate(sizes.items())}

    def grad(step, i, n):
        scale = 40.0 if step == 2 else 0.004  # step 2 is clipped at 1.0
        return (scale * np.sin(0.11 * np.arange(n) + step * 3 + i)).astype(np.float32)

    ref = _ranked_driver(tmp_path, "ref", init)
    ref_out, ref_rep = {}, {}
    for step in (1, 2, 3):
        for i, (n, k) in enumerate(sizes.items()):
            ref.add_grad(i, grad(step, i, k))
        outs = [np.zeros(k, np.float32) for k in sizes.values()]
        ref_rep[step] = ref.step(outputs=outs)
        ref_out[step] = outs
    assert ref_rep[2]["clip_coefficient"] < 1.0 and ref_rep[1]["clip_coefficient"] == 1.0

    barrier = threading.Barrier(2, timeout=60)
    slots = [None, None]
    calls = []
    fail = {"on": False}

    def all_reduce(rank):
        def fn(array, op):
            assert op == "sum" and array.dtype == np.float64
            if fail["on"]:
                raise RuntimeError(f"rank {rank}: the peer left")
            slots[rank] = float(array[0])
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            array[0] = total
            calls.append(rank)

        return fn

    results, errors = [{}, {}], []

    def rank_main(rank, name):
        try:
            comm = tier._tier.Communicator(rank, 2, all_reduce(rank), name="threads")
            d = _ranked_driver(tmp_path, f"r{rank}", {name: init[name]})
            out = np.zeros(sizes[name], np.float32)
            for step in (1, 2, 3):
                g = grad(step, rank, sizes[name])
                d.add_grad(0, g)
                if step == 2:
                    before = out.copy()
                    fail["on"] = True
                    with pytest.raises(tier.TierError, match="the peer left"):
                        d.step(outputs=[out], comm=comm)
                    barrier.wait()  # both ranks saw it fail before the flag goes back
                    fail["on"] = False
                    assert d.group_step(0) == 1 and np.array_equal(out, before)
                if step == 3:  # overlapped: the gradient comes after the start
                    d.clear_grads()
                    d.start_overlap(outputs=[out], comm=comm)
                    d.add_grad(0, g)
                    rep = d.finish_overlap()
                else:
                    rep = d.step(outputs=[out], comm=comm)
                results[rank][step] = (rep, out.copy())
        except BaseException as e:  # reported below
            errors.append((rank, e))
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r, n)) for r, n in enumerate(sizes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for rank in (0, 1):
        for step in (1, 2, 3):
            rep, out = results[rank][step]
            assert rep["grad_norm"] == ref_rep[step]["grad_norm"], (rank, step)
            assert rep["clip_coefficient"] == ref_rep[step]["clip_coefficient"], (rank, step)
            assert rep["applied"] and rep["step"] == ref_rep[step]["step"]
            np.testing.assert_array_equal(out, ref_out[step][rank])
    assert sorted(calls) == [0, 0, 0, 1, 1, 1]  # one all-reduce per rank and applied step


def test_communicator_refuses_bad_input_and_a_step_refuses_comm_with_a_wrong_type(tmp_path):
    with pytest.raises(tier.TierError, match="callable"):
        tier._tier.Communicator(0, 1, 5)
    with pytest.raises(tier.TierError, match="rank 2 is outside"):
        tier._tier.Communicator(2, 2, lambda a, op: None)
    comm = tier._tier.Communicator(0, 1, lambda a, op: None)
    assert (comm.rank, comm.world, comm.name) == (0, 1, "python")
    assert comm.all_reduce_f64(2.5) == 2.5
    d = _ranked_driver(tmp_path, "d", {"w": np.ones(16, np.float32)})
    d.add_grad(0, np.ones(16, np.float32))
    with pytest.raises(TypeError):
        d.step(comm="not a communicator")
    with pytest.raises(TypeError, match="Communicator or None, not str"):
        d.start_overlap(comm="no")
    assert not d.overlap_running
    assert d.group_step(0) == 0
    assert d.step(comm=comm)["applied"]


def test_acquire_many_grants_all_in_one_call_or_none(swap_dir):
    e = tier.Engine.create(engine_config(swap_dir))
    tids = [e.register(f"w{i}", "fp32", 256, "param", 0, "nvme", np.full(256, i, dtype=np.float32)) for i in range(3)]
    leases = e.acquire_many(tids, "device", "read")
    assert [lease.tier for lease in leases] == ["device"] * 3
    views = [np.from_dlpack(lease.as_tensor()) for lease in leases]
    assert [float(v[5]) for v in views] == [0.0, 1.0, 2.0]
    assert all(e.info(t)["readers"] == 1 for t in tids)
    del views, leases
    assert all(e.info(t)["readers"] == 0 for t in tids)
    # One that cannot be granted (over the 1 MiB device budget): none is held afterwards.
    big = e.register("big", "fp32", 1 << 19, "param", 0, "nvme")
    with pytest.raises(tier.ResourceExhausted):
        e.acquire_many([tids[0], big, tids[1]], "device", "read")
    deadline = time.monotonic() + 5
    while any(e.info(t)["readers"] for t in tids) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert all(e.info(t)["readers"] == 0 for t in tids)
    with pytest.raises(tier.InvalidArgument):
        e.acquire_many(tids, "device", "borrow")


def test_state_ranges_and_the_checkpoint_state_reader(tmp_path):
    """write_state/read_state with an offset touch that range only (a range past the parameter is
    refused, nothing written); read_checkpoint_state gives every state array of a saved file as
    the optimizer holds it, in pieces; an exception from its visitor stops the read and comes out
    as it was raised; a damaged file is tier.DataLoss."""
    sizes = {"w0": 5000, "w1": 300}
    init = {n: np.linspace(-1, 1, k, dtype=np.float32) for n, k in sizes.items()}
    d = _ranked_driver(tmp_path, "s", init)
    for i, (n, k) in enumerate(sizes.items()):
        d.add_grad(i, np.full(k, 0.01 * (i + 1), np.float32))
    d.step(outputs=[np.zeros(k, np.float32) for k in sizes.values()])

    before = np.zeros(5000, np.float32)
    d.read_state(0, "exp_avg", before)
    piece = np.arange(100, dtype=np.float32)
    d.write_state(0, "exp_avg", piece, offset=1234)
    after = np.zeros(5000, np.float32)
    d.read_state(0, "exp_avg", after)
    want = before.copy()
    want[1234:1334] = piece
    assert np.array_equal(after, want)
    got = np.zeros(100, np.float32)
    d.read_state(0, "exp_avg", got, offset=1234)
    assert np.array_equal(got, piece)
    with pytest.raises(tier.InvalidArgument):
        d.write_state(0, "exp_avg", piece, offset=4950)
    with pytest.raises(tier.InvalidArgument):
        d.write_state(0, "exp_avg", piece)  # without an offset: the whole array
    d.read_state(0, "exp_avg", after)
    assert np.array_equal(after, want)

    path = str(tmp_path / "opt.bin")
    d.save(path)
    seen = {(i, kind): [] for i in range(2) for kind in ("master", "exp_avg", "exp_avg_sq")}

    def visit(pid, kind, offset, values):
        assert not values.flags.writeable
        assert offset == sum(len(v) for v in seen[(pid, kind)])
        seen[(pid, kind)].append(values.copy())

    tier._tier.read_checkpoint_state(path, visit)
    for (pid, kind), pieces in seen.items():
        held = np.zeros(list(sizes.values())[pid], np.float32)
        d.read_state(pid, kind, held)
        assert np.array_equal(np.concatenate(pieces), held), (pid, kind)

    class Stop(Exception):
        pass

    def stop(pid, kind, offset, values):
        raise Stop(f"{kind} of {pid}")

    with pytest.raises(Stop, match="master of 0"):
        tier._tier.read_checkpoint_state(path, stop)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x40
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(raw))
    with pytest.raises(tier.DataLoss):
        tier._tier.read_checkpoint_state(str(bad), lambda *a: None)


def test_register_with_a_fill_writes_straight_into_the_engine(swap_dir):
    """register(fill=f): f gets a writable uint8 view of the tensor's host copy and writes its
    bytes (no buffer of the caller's in between); its exception comes out as raised and nothing
    is registered; initial and fill together are refused."""
    e = tier.Engine.create(engine_config(swap_dir))
    data = np.arange(1000, dtype=np.float32)
    got = {}

    def fill(view):
        got["view"] = (view.dtype, view.shape, view.flags.writeable)
        view[:] = data.view(np.uint8)

    for durable in (True, False):
        tid = e.register(f"w{durable}", "fp32", 1000, "param", 0, "nvme", fill=fill, durable=durable)
        assert got["view"] == (np.uint8, (4000,), True)
        e.flush()
        out = np.zeros(1000, dtype=np.float32)
        e.read(tid, out)
        np.testing.assert_array_equal(out, data)

    class Short(Exception):
        pass

    def short(view):
        raise Short("the file ended")

    with pytest.raises(Short, match="the file ended"):
        e.register("bad", "fp32", 1000, "param", 0, "nvme", fill=short)
    with pytest.raises(tier.NotFound):
        e.find("bad")
    with pytest.raises(tier.InvalidArgument):
        e.register("both", "fp32", 1000, "param", 0, "nvme", data, fill=fill)
    e.register("bad", "fp32", 1000, "param", 0, "nvme", fill=fill)  # the name is free


def test_load_before_commit_declines_or_raises_and_nothing_changes(tmp_path):
    """StepDriver.load(path, before_commit=f): f runs once the file verified; False is
    tier.Cancelled and an exception of f's comes out as raised, both leaving the state as it was;
    True loads the file."""
    d = _ranked_driver(tmp_path, "c", {"w": np.linspace(-1, 1, 3000, dtype=np.float32)})
    path = str(tmp_path / "opt.bin")
    d.save(path)
    saved = np.zeros(3000, np.float32)
    d.read_state(0, "master", saved)
    d.write_state(0, "master", np.full(3000, 7.0, np.float32))

    class Refused(Exception):
        pass

    def refuse():
        raise Refused("rank 1 refused it")

    with pytest.raises(tier.Cancelled):
        d.load(path, before_commit=lambda: False)
    with pytest.raises(Refused, match="rank 1 refused it"):
        d.load(path, before_commit=refuse)
    now = np.zeros(3000, np.float32)
    d.read_state(0, "master", now)
    assert np.all(now == 7.0)
    d.load(path, before_commit=lambda: True)
    d.read_state(0, "master", now)
    assert np.array_equal(now, saved)
