"""Power cuts under tier.torch checkpoints (issue #31, item 6).

The kill tests (test_checkpoint_safety.py) keep the page cache, so a missing fsync goes unseen.
Here every file operation of a save, Python's and the optimizer's C++ writer's, goes through tier's
file layer with the fault-injecting implementation installed (``tier._tier._install_fault_fs()``):
for each sync point k of a save the power is cut after k syncs, the power loss is simulated (every
file gets its last synced content back, every directory change not made durable by a directory
sync is undone), and then, in another engine:

- ``load_checkpoint(dir)`` succeeds (0 unloadable) and gives exactly the state of the previous save
  or of the new one, bit for bit (masters, moments, step counters, low-precision params, counters,
  lr, scheduler, RNG, client state); the new one whenever the save had returned;
- one more training step from it equals the step the uninterrupted run took from that state.

A save is cut at every one of its sync points, in a sequence of saves (the tag ``latest`` names,
other tags, the first save into a new directory), for host-memory state, NVMe state, per-rank
checkpoints (tier.torch.zero_checkpoint, one rank) and a tag of the old format. Power is also cut
in the middle of training steps. And the harness is shown to have teeth: with one fsync of the
protocol left out, it finds the loss.
"""

import collections
import os
import random
import re
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from tier import _tier  # noqa: E402
from tier.torch import checkpoint as ckpt_mod  # noqa: E402
from tier.torch import zero_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_kill_child as kc  # noqa: E402

TAGS = ("rolling", "rolling", "a", "rolling", "b", "a")
SAVES = int(os.environ.get("TIER_POWER_LOSS_SAVES", "5"))  # saves per configuration, each cut at every sync point
CASES = collections.Counter()  # power cuts at a sync point, per configuration (for the summary test)


def config(swap_dir, nvme=False, bf16=False):
    cfg = kc.config(swap_dir)
    if nvme:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": swap_dir}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def snapshot(engine):
    """Everything a checkpoint holds, as the engine has it now."""
    opt = engine.optimizer
    moments = {}
    for s in engine._slots:
        if s.pid is None:
            continue
        for kind in ("exp_avg", "exp_avg_sq"):
            buf = torch.empty(s.zero_count, dtype=torch.float32)
            opt.read_state(s.pid, kind, buf)
            moments[f"{s.name}.{kind}"] = buf
    return {
        "masters": engine.state_dict_fp32(),
        "params": {s.name: engine.parameter(s.name).clone() for s in engine._slots},
        "moments": moments,
        "group_steps": [opt.group_step(g) for g in range(opt.group_count)],
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "lr": engine.get_lr(),
        "sched": engine.scheduler.last_step,
        "rng": torch.get_rng_state(),
    }


def differences(a, b):
    """What differs between two snapshots, bit for bit ([] when nothing)."""
    out = [k for k in ("group_steps", "counters", "lr", "sched") if a[k] != b[k]]
    if not torch.equal(a["rng"], b["rng"]):
        out.append("rng")
    for part in ("masters", "params", "moments"):
        if a[part].keys() != b[part].keys():
            out.append(part)
            continue
        out += [f"{part}:{n}" for n in a[part] if not torch.equal(a[part][n], b[part][n])]
    return out


def train_step(engine, before_micro_step=None):
    """ckpt_kill_child.train_step in the engine's compute dtype, with a hook before each micro-step."""
    for _ in range(kc.GAS):
        if before_micro_step is not None:
            before_micro_step()
        x = torch.randn(8, 16)
        y = torch.sin(x[:, :4] * 2.0)
        out = engine(x.to(engine.compute_dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()


def save_whole(engine, ckpt, tag, client_state):
    engine.save_checkpoint(ckpt, tag=tag, client_state=client_state)


def save_ranks(engine, ckpt, tag, client_state):
    zero_checkpoint.save(engine, ckpt, tag, client_state)


def copy_tree(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    if os.path.exists(src):
        shutil.copytree(src, dst, symlinks=True)


class PowerCuts:
    """One training run whose saves are cut at every sync point, and the checks after each cut.

    ``expected[k]``: the state at global step k, when a save of it began; ``after_one[k]``: the
    state after the uninterrupted run's next step from there; ``resumed``: the states reached by
    one step from each loaded checkpoint, compared with ``after_one`` once the run got there."""

    def __init__(self, tmp_path, name, save=save_whole, **cfg):
        self.root = tmp_path / name
        self.ckpt = str(self.root / "out" / "ckpt")  # "out" does not exist yet: the first save makes both
        self.pristine = str(self.root / "pristine")  # the directory as the previous save left it
        swaps = [self.root / "swap-main", self.root / "swap-verify"]
        for d in swaps:
            d.mkdir(parents=True)
        self.main = tier.torch.initialize(kc.make_model(kc.SEED), config(str(swaps[0]), **cfg))[0]
        self.verifier = tier.torch.initialize(kc.make_model(kc.SEED + 1), config(str(swaps[1]), **cfg))[0]
        self.save = save
        self.name = name
        self.expected, self.after_one, self.resumed = {}, {}, []
        self.outcomes = collections.Counter()
        self.problems = []
        self.durable = None  # the step of the newest checkpoint a completed save wrote

    def close(self):
        self.main.close()
        self.verifier.close()

    def train(self, steps, before_micro_step=None):
        """The uninterrupted run."""
        for _ in range(steps):
            k = self.main.global_steps
            train_step(self.main, before_micro_step)
            if k in self.expected:
                self.after_one[k] = snapshot(self.main)

    def save_with_cuts(self, tag, limit=100):
        """Saves the main engine's state under ``tag``, once per sync point k: the power is cut
        after k syncs, lost, and the directory checked; ends with the save that completes."""
        k_new = self.main.global_steps
        self.expected[k_new] = snapshot(self.main)
        base = os.path.dirname(self.ckpt)  # the directory with everything a save may create in it
        copy_tree(base, self.pristine)
        for k in range(limit):
            copy_tree(self.pristine, base)
            fault = _tier._install_fault_fs()
            try:
                fault.cut_power_after_syncs(k)
                try:
                    self.save(self.main, self.ckpt, tag, {"step": k_new})
                except OSError:
                    assert fault.powered_off, f"{self.name}: the save failed before the power cut at sync point {k}"
                completed = not fault.powered_off
                fault.simulate_power_loss()
            finally:
                fault.uninstall()
            self.check(f"{self.name}: save of step {k_new} as {tag!r}, power cut after {k} syncs", k_new, completed)
            CASES[self.name] += 1
            if completed:
                self.durable = k_new
                return k
        raise AssertionError(f"{self.name}: the save did not complete within {limit} sync points")

    def check(self, context, k_new, completed):
        """Loads the checkpoint in the verifier and judges it; records the outcome."""
        keep = torch.get_rng_state()
        try:
            outcome = self._judge(context, k_new, completed)
        finally:
            torch.set_rng_state(keep)
        self.outcomes[outcome] += 1
        return outcome

    def _judge(self, context, k_new, completed):
        if not os.path.exists(os.path.join(self.ckpt, "latest")):
            if self.durable is None and not completed:
                return "none yet"  # the first save was cut: there was nothing to lose
            self.problems.append(f"{context}: no checkpoint at all")
            return "lost"
        try:
            _, client = self.verifier.load_checkpoint(self.ckpt)
        except Exception as e:  # noqa: BLE001 - every refusal is a finding
            self.problems.append(f"{context}: unloadable ({type(e).__name__}: {e})")
            return "unloadable"
        got = self.verifier.global_steps
        allowed = {k_new} if completed else {k_new, self.durable}
        if got not in allowed:
            self.problems.append(f"{context}: loaded step {got}, expected one of {sorted(x for x in allowed if x)}")
            return "lost" if completed else "wrong"
        diff = differences(snapshot(self.verifier), self.expected[got])
        if diff or client != {"step": got}:
            self.problems.append(f"{context}: step {got} loaded with other values: {diff[:6]} client {client}")
            return "wrong"
        train_step(self.verifier)
        self.resumed.append((got, snapshot(self.verifier), context))
        return "new" if got == k_new else "previous"

    def finish(self):
        """Trains the main run one step past its last save, then compares every resumed step."""
        self.train(1)
        for k, state, context in self.resumed:
            diff = differences(state, self.after_one[k])
            if diff:
                self.problems.append(f"{context}: one step after loading step {k} differs: {diff[:6]}")
        return self.problems


def run_saves(pc, saves=SAVES, steps_between=1):
    pc.train(2)
    for i in range(saves):
        pc.save_with_cuts(TAGS[i % len(TAGS)])
        pc.train(steps_between)
    problems = pc.finish()
    assert not problems, "\n".join(problems[:10])
    assert pc.outcomes["unloadable"] == 0
    assert pc.outcomes["new"] >= saves and pc.outcomes["previous"] >= saves, pc.outcomes
    return pc.outcomes


@pytest.mark.parametrize(
    "name,save,cfg",
    [
        ("host", save_whole, {}),
        ("nvme", save_whole, {"nvme": True}),
        ("ranks", save_ranks, {}),
        ("bf16", save_whole, {"bf16": True}),
    ],
)
def test_a_power_cut_at_every_sync_point_of_a_save_leaves_the_previous_or_the_new_checkpoint(tmp_path, name, save,
                                                                                            cfg):
    pc = PowerCuts(tmp_path, name, save, **cfg)
    try:
        outcomes = run_saves(pc)
    finally:
        pc.close()
    print(f"\n{name}: {sum(outcomes.values())} power cuts: {dict(outcomes)}")


def test_a_power_cut_while_an_old_format_tag_is_moved_aside(tmp_path):
    """A tier-checkpoint-1 tag is a plain directory that the save renames aside (a directory
    rename the power cut must undo, or not); every cut still loads the old or the new state."""
    import test_checkpoint_safety as safety

    pc = PowerCuts(tmp_path, "old-format")
    try:
        pc.train(2)
        pc.save_with_cuts("t")
        version = os.path.realpath(os.path.join(pc.ckpt, "t"))
        safety._to_old_format(version, {"cpu": pc.expected[pc.durable]["rng"], "cuda": []})
        os.unlink(os.path.join(pc.ckpt, "t"))
        os.rename(version, os.path.join(pc.ckpt, "t"))
        pc.train(1)
        pc.save_with_cuts("t")
        assert os.path.islink(os.path.join(pc.ckpt, "t"))
        problems = pc.finish()
    finally:
        pc.close()
    assert not problems, "\n".join(problems[:10])
    assert pc.outcomes["unloadable"] == 0


def test_a_power_cut_in_the_middle_of_training_leaves_the_last_checkpoint(tmp_path):
    """The power goes at a random micro-step between saves, or at a random file operation of
    the steps and the save after them: the newest completed checkpoint loads, exactly."""
    rnd = random.Random(5)
    pc = PowerCuts(tmp_path, "steps", nvme=True)
    try:
        pc.train(1)
        pc.save_with_cuts("rolling")
        for round_ in range(8):
            fault = _tier._install_fault_fs()
            try:
                if round_ % 2 == 0:
                    cut_at = rnd.randrange(2 * kc.GAS)  # a micro-step of the next two steps
                    done = [0]

                    def before_micro_step():
                        if done[0] == cut_at:
                            fault.cut_power_now()
                        done[0] += 1

                    pc.train(2, before_micro_step)  # the steps touch no durable file: they go on
                else:
                    pc.train(1)
                    pc.expected[pc.main.global_steps] = snapshot(pc.main)
                    fault.cut_power_after_mutations(rnd.randrange(40))
                    try:
                        save_whole(pc.main, pc.ckpt, TAGS[round_ % len(TAGS)], {"step": pc.main.global_steps})
                    except OSError:
                        pass
                    if not fault.powered_off:
                        pc.durable = pc.main.global_steps  # the cut came after the save
                    fault.cut_power_now()
                fault.simulate_power_loss()
            finally:
                fault.uninstall()
            outcome = pc.check(f"steps round {round_}", pc.main.global_steps, False)
            assert outcome in ("previous", "new"), pc.problems
            # The run goes on from where it is; its next save is checked as before.
            pc.save_with_cuts("rolling")
        problems = pc.finish()
    finally:
        pc.close()
    assert not problems, "\n".join(problems[:10])


def test_every_failed_call_of_a_save_raises_and_leaves_a_checkpoint_that_loads(tmp_path):
    """The nth file call of a save fails (ENOSPC), for every n: the save raises OSError with that
    errno (or succeeds when the call was one it may lose, such as removing an old version), the
    checkpoint directory still loads the previous state or the new one, and the next save works."""
    pc = PowerCuts(tmp_path, "failed-calls")
    failed = 0
    try:
        pc.train(2)
        pc.save_with_cuts("rolling")
        pc.train(1)
        k_new = pc.main.global_steps
        pc.expected[k_new] = snapshot(pc.main)
        for n in range(1, 1000):
            fault = _tier._install_fault_fs()
            try:
                fault.fail(nth=n, errno=28)  # ENOSPC, on whichever call comes nth
                try:
                    save_whole(pc.main, pc.ckpt, "rolling", {"step": k_new})
                    ok = True
                except OSError as e:
                    assert e.errno == 28, (n, e)
                    ok = False
                calls = sum(fault.counters()["calls"].values())
            finally:
                fault.uninstall()
            if ok and calls < n:
                break  # the save made fewer than n calls: every one of them has failed once
            failed += not ok
            outcome = pc.check(f"call {n} failed", k_new, False)
            assert outcome in ("previous", "new"), pc.problems
        assert failed >= 20, f"only {failed} calls of a save could fail"
        pc.save_with_cuts("rolling")
        assert not pc.finish(), pc.problems
    finally:
        pc.close()
    print(f"\n{failed} failed calls, each leaving a loadable checkpoint: {dict(pc.outcomes)}")


def test_the_fault_layer_goes_with_its_controller(tmp_path):
    """A test that drops its controller without uninstall() (it failed half way) leaves no fault
    layer behind: the next file operation goes to the disk."""
    import gc

    fault = _tier._install_fault_fs()
    fault.cut_power_now()
    with pytest.raises(OSError):
        tier.fs.write_new(tmp_path / "a", b"x")
    del fault
    gc.collect()
    tier.fs.write_new(tmp_path / "a", b"x")
    assert (tmp_path / "a").read_bytes() == b"x"


def cut_at_every_sync_point(prepare, op, check, limit=100):
    """For k = 0, 1, ...: prepare(), op() with the power cut after k syncs, the power loss, then
    check(k, completed); ends with the first op that completes. Returns the cases checked."""
    for k in range(limit):
        prepare()
        fault = _tier._install_fault_fs()
        try:
            fault.cut_power_after_syncs(k)
            try:
                op()
            except OSError:
                assert fault.powered_off, f"failed before the power cut at sync point {k}"
            completed = not fault.powered_off
            fault.simulate_power_loss()
        finally:
            fault.uninstall()
        check(k, completed)
        CASES["files"] += 1
        if completed:
            return k + 1
    raise AssertionError(f"did not complete within {limit} sync points")


def test_atomic_writes_and_published_files_are_old_or_new_at_every_sync_point(tmp_path):
    """tier.torch.atomic_file's writers (save_pretrained's shards, save_16bit_model, zero_to_fp32)
    under power cuts: the target is the old file or the new one, the new one once the write
    returned, and no temporary file or private folder survives."""
    from tier.torch import atomic_file

    target = tmp_path / "out" / "weights.bin"
    target.parent.mkdir()

    def prepare():
        shutil.rmtree(target.parent)
        target.parent.mkdir()
        target.write_bytes(b"old")

    def check(k, completed):
        assert target.read_bytes() in (b"old", b"new" * 1000), k
        if completed:
            assert target.read_bytes() == b"new" * 1000, f"{k}: a write that returned was lost"
        # A private folder whose creation was synced may come back (empty, or holding the file
        # whose move out of it was not): debris, as after a kill, never a half file.
        debris = [n for n in os.listdir(target.parent) if n != "weights.bin"]
        assert all(re.fullmatch(r"\.tier-[0-9a-f]{16}\.tmp", n) for n in debris), (k, debris)

    def publish():
        with atomic_file.private_dir(target.parent) as private:
            with open(os.path.join(private, "weights.bin"), "wb") as f:  # a writer that takes a folder
                f.write(b"new" * 1000)
            atomic_file.publish(private, "weights.bin", target.parent)

    assert cut_at_every_sync_point(prepare, lambda: atomic_file.write_bytes(target, b"new" * 1000), check) == 3
    assert cut_at_every_sync_point(prepare, publish, check) >= 4


@pytest.mark.parametrize("drop_folder_sync", [False, True])
def test_save_pretrained_is_old_or_new_at_every_sync_point(tmp_path, swap_dir, monkeypatch, drop_folder_sync):
    """engine.save_pretrained over a sharded save of other weights: after a power cut at any sync
    point every file there is whole, and once the save returned the folder holds exactly the new
    single file (a stale index coming back would make a loader read the old shards). Without the
    folder's fsync after the stale shards are removed, the check finds the index back."""
    from safetensors.torch import load_file

    engine = kc.new_engine(swap_dir)
    out = tmp_path / "model"
    pristine = tmp_path / "pristine"
    try:
        kc.train_step(engine)
        engine.save_pretrained(str(out), max_shard_size="2KB")  # the old weights, sharded
        old = {}
        for name in os.listdir(out):
            if name.endswith(".safetensors"):
                old.update(load_file(str(out / name)))
        assert len(os.listdir(out)) > 2, os.listdir(out)
        copy_tree(str(out), str(pristine))
        kc.train_step(engine)
        new = {s.name: engine.parameter(s.name) for s in engine._slots}
        if drop_folder_sync:
            monkeypatch.setattr(tier.fs, "fsync_dir", lambda p: None)
        found = []

        def check(k, completed):
            names = sorted(os.listdir(out))
            for name in names:
                if name.endswith(".safetensors"):
                    for key, t in load_file(str(out / name)).items():  # whole, or this raises
                        assert torch.equal(t, old[key]) or torch.equal(t, new[key]), (k, name, key)
            if completed and names != ["model.safetensors"]:
                found.append((k, names))
            if completed and "model.safetensors" in names:
                got = load_file(str(out / "model.safetensors"))
                assert all(torch.equal(got[n], new[n]) for n in new), k

        cut_at_every_sync_point(lambda: copy_tree(str(pristine), str(out)),
                                lambda: engine.save_pretrained(str(out)), check)
    finally:
        engine.close()
    if drop_folder_sync:
        assert found, "the harness missed the stale shards coming back"
    else:
        assert not found, found


@pytest.mark.parametrize("missing", ["latest-dir-fsync", "version-dir-fsync", "file-fsyncs", "parent-dir-fsync"])
def test_the_harness_finds_a_missing_fsync(tmp_path, monkeypatch, missing):
    """With one fsync of the protocol left out, some power cut loses a checkpoint or leaves one
    that does not load: the checks above would fail, so they have teeth."""
    real_sync_dir = ckpt_mod._fsync_dir
    seen = collections.Counter()

    def sync_dir(path):
        seen[path] += 1
        if missing == "latest-dir-fsync" and path == pc.ckpt and seen[path] == 2:
            return  # the second of the save's fsyncs of its directory: the one after latest's rename
        if missing == "version-dir-fsync" and os.path.dirname(path) == pc.ckpt:
            return  # the fsync of the version directory before the tag points at it
        real_sync_dir(path)

    def save_counting(*args):
        seen.clear()  # per save attempt
        save_whole(*args)

    pc = PowerCuts(tmp_path, f"teeth-{missing}", save_counting)
    try:
        pc.train(2)
        pc.save_with_cuts("rolling")  # A, saved with every fsync
        pc.train(1)
        if missing == "file-fsyncs":
            original = _tier._install_fault_fs

            def dropping():
                f = original()
                f.drop_syncs(files=True, dirs=False)
                return f

            monkeypatch.setattr(_tier, "_install_fault_fs", dropping)
        elif missing == "parent-dir-fsync":
            # The first save into a new directory, without the fsync of the folder it is made in.
            monkeypatch.setattr(tier.fs, "fsync_dir", lambda p: None if p != pc.ckpt else real_sync_dir(p))
            pc.ckpt = str(pc.root / "fresh" / "ckpt")
            pc.durable = None
        else:
            monkeypatch.setattr(ckpt_mod, "_fsync_dir", sync_dir)
        pc.save_with_cuts("other")  # B, to another tag: latest must move
    finally:
        pc.close()
    bad = pc.outcomes["lost"] + pc.outcomes["unloadable"] + pc.outcomes["wrong"]
    assert bad >= 1, f"the harness missed the {missing}: {dict(pc.outcomes)}"


def test_summary_at_least_200_power_cuts():
    """The power-cut tests above together cut the power at >= 200 sync points, none unloadable
    (each test asserts its own outcomes; this one adds them up when they ran in this session)."""
    if not {"host", "nvme", "ranks", "bf16"} <= set(CASES):
        pytest.skip("runs after the power-cut tests of this file (run the whole file)")
    total = sum(n for name, n in CASES.items() if not name.startswith("teeth"))
    print(f"\npower cuts at sync points: {total} ({dict(CASES)})")
    if SAVES >= 5:
        assert total >= 200, dict(CASES)
