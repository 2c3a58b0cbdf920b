"""tier.torch checkpoints survive kills and damage, refuse unsafe input, and tier deletes only its
own files (issue #19, Python side)."""

import base64
import errno
import hashlib
import json
import os
import stat
import sys

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_kill_child as kc  # noqa: E402

KILLS = int(os.environ.get("TIER_CKPT_KILLS", "80"))


@pytest.fixture
def engine(swap_dir):
    e = kc.new_engine(swap_dir)
    yield e
    e.close()


def snapshot(engine):
    """Everything a load would change."""
    return {
        "params": engine.state_dict_fp32(),
        "steps": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "lr": engine.get_lr(),
        "sched": engine.scheduler.last_step,
        "rng": torch.get_rng_state(),
    }


def assert_same(a, b):
    assert a["steps"] == b["steps"]
    assert a["lr"] == b["lr"]
    assert a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"])
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


def saved_then_moved_on(engine, ckpt, **kw):
    """Trains 2 steps, saves, trains 1 more: the engine's state then differs from the checkpoint
    (params, counters, lr, RNG), so a partial load would show."""
    kc.train_step(engine)
    kc.train_step(engine)
    path = engine.save_checkpoint(ckpt, **kw)
    kc.train_step(engine)
    return path


def resign(path, leave_out=()):
    """Rewrites manifest.json for the files as they are now (a consistent but altered checkpoint)."""
    files = {}
    for name in sorted(os.listdir(path)):
        if name == "manifest.json" or name in leave_out:
            continue
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {"format": "tier-checkpoint-2", "files": files}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    os.chmod(os.path.join(path, "manifest.json"), 0o600)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(dict(body, sha256=digest), f)


# ---------------------------------------------------------------------------- 1: crash-safe saves
def _save_killed_at(engine, ckpt, tag, n):
    """Runs a save that 'dies' at its n-th file-system mutation; returns False if it finished.
    Every create, write, fsync, rename, symlink, mkdir and removal of a save (Python's and the
    optimizer's C++ writer's) goes through tier's file layer; the fault-injecting one stops every
    call from the n-th mutation on, and then powers on again keeping what was written: a killed
    process, whose page cache survives (test_power_loss.py drops it)."""
    fault = tier._tier._install_fault_fs()
    try:
        fault.cut_power_after_mutations(n)
        try:
            engine.save_checkpoint(ckpt, tag=tag)
        except OSError:
            if not fault.powered_off:
                raise
        return fault.powered_off
    finally:
        fault.restore_power()
        fault.uninstall()


def test_a_save_first_removes_what_killed_saves_left(engine, tmp_path, monkeypatch):
    """A killed save leaves its version folder behind; the next save removes it before writing
    anything, not only once it completes, so saves killed one after another leave no more than
    the last one's debris."""
    import tier.torch.checkpoint as ck

    ckpt = str(tmp_path / "ckpt")
    kc.train_step(engine)
    engine.save_checkpoint(ckpt, tag="a")
    published = set(os.listdir(ckpt))
    # Killed at its first file operation after which something of it is left (its version folder).
    for n in range(50):
        assert _save_killed_at(engine, ckpt, "a", n), "the save finished before leaving anything behind"
        if any("~" in name for name in set(os.listdir(ckpt)) - published):
            break
    else:
        raise AssertionError("no killed save left its version folder")

    def killed(*args, **kwargs):
        raise OSError(errno.EIO, "killed as it starts writing")

    monkeypatch.setattr(ck, "_save_locked", killed)
    with pytest.raises(OSError, match="killed as it starts"):
        engine.save_checkpoint(ckpt, tag="a")
    assert set(os.listdir(ckpt)) == published


@pytest.mark.parametrize("tag", ["same", "other"])
def test_a_save_dying_at_any_file_operation_leaves_a_loadable_checkpoint(engine, tmp_path, swap_dir, tag):
    """Over the tag 'latest' names (the old code removed it first) and over another existing tag:
    killed before or after each create/write/fsync/rename/symlink/mkdir/unlink/rmdir of the save,
    a checkpoint loads, and it is the old state or the new one, never a mix."""
    ckpt = str(tmp_path / "ckpt")
    kc.train_step(engine)
    engine.save_checkpoint(ckpt, tag="other")
    kc.train_step(engine)
    engine.save_checkpoint(ckpt, tag="same")  # latest -> same, at step 2
    old = engine.state_dict_fp32()
    kc.train_step(engine)
    new = engine.state_dict_fp32()  # what the killed saves try to store (step 3)
    other_swap = os.path.join(swap_dir, "verify")
    os.makedirs(other_swap)
    verifier = kc.new_engine(other_swap, seed=99)
    points = 0
    while _save_killed_at(engine, ckpt, tag, points):
        verifier.load_checkpoint(ckpt)
        got = verifier.state_dict_fp32()
        assert verifier.global_steps in (2, 3), points
        want = old if verifier.global_steps == 2 else new
        for name in want:
            assert torch.equal(got[name], want[name]), (points, name)
        points += 1
    assert points >= 10, "the save has fewer kill points than expected; is the harness counting?"
    # The save that was not killed switched latest to the new state, and left no debris behind.
    verifier.load_checkpoint(ckpt)
    assert verifier.global_steps == 3
    versions = [n for n in os.listdir(ckpt) if "~" in n]
    assert len(versions) == 2, versions  # one per tag
    verifier.close()


def test_a_save_over_an_old_format_directory_dying_anywhere_leaves_a_loadable_checkpoint(engine, tmp_path,
                                                                                         swap_dir):
    """A tier-checkpoint-1 tag is a plain directory, which rename cannot replace: it is moved aside
    first, and a load in that window falls back to the newest complete version of the tag."""
    other_swap = os.path.join(swap_dir, "verify")
    os.makedirs(other_swap)
    verifier = kc.new_engine(other_swap, seed=99)
    kc.train_step(engine)
    points = 0
    while True:
        ckpt = str(tmp_path / f"ckpt{points}")
        version = os.path.realpath(engine.save_checkpoint(ckpt, tag="t"))
        _to_old_format(version, {"cpu": torch.get_rng_state(), "cuda": []})
        os.unlink(os.path.join(ckpt, "t"))
        os.rename(version, os.path.join(ckpt, "t"))
        verifier.load_checkpoint(ckpt)  # the old format loads
        if not _save_killed_at(engine, ckpt, "t", points):
            break
        verifier.load_checkpoint(ckpt)
        assert verifier.global_steps == 1, points
        points += 1
    assert points >= 10
    verifier.load_checkpoint(ckpt)
    assert os.path.islink(os.path.join(ckpt, "t"))
    assert os.path.isfile(os.path.join(ckpt, "t", "manifest.json"))
    verifier.close()


@pytest.mark.slow
def test_sigkill_at_random_points_of_saves_and_steps_always_leaves_an_exact_checkpoint(tmp_path):
    """A trainer process is killed (SIGKILL) KILLS times, at random points of a save or of a
    training step, and resumed each time from the newest checkpoint; after every kill the
    newest checkpoint loads, is no older than the last save reported done, and training from it
    gives the same losses, bit for bit, as a run that was never interrupted."""
    summary = kc.run_kills(KILLS, str(tmp_path), seed=1)
    assert summary["kills"] == KILLS
    # Every kill after the first completed save is followed by a verified, bit-identical resume.
    assert summary["resumed"] + summary["no_checkpoint_yet"] == KILLS, summary
    assert summary["resumed"] >= min(50, KILLS - 5), summary
    assert summary["in_save"] >= KILLS // 4, summary
    assert summary["in_train"] >= KILLS // 4, summary
    assert summary["max_step"] >= KILLS // 4, summary  # the trainers made progress across kills
    # Debris of killed saves is removed by the next save: at most the current version per tag,
    # plus what the last kill left.
    assert summary["versions_left"] <= len(set(kc.TAGS)) + 2, summary["entries_left"]
    print(f"\n{KILLS} kills ({summary['in_save']} in a save, {summary['in_train']} in a step), "
          f"{summary['resumed']} bit-identical resumes, in {summary['seconds']:.1f} s; reached step "
          f"{summary['max_step']}")


# ---------------------------------------------------------------------------- 2: verified, all or nothing
@pytest.mark.parametrize("name", ["meta.json", "frozen.bin", "optimizer.bin", "manifest.json"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_is_refused_before_anything_is_applied(engine, tmp_path, name, damage):
    ckpt = str(tmp_path / "ckpt")
    path = saved_then_moved_on(engine, ckpt)
    target = os.path.join(path, name)
    size = os.path.getsize(target)
    os.chmod(target, 0o600)
    if damage == "flip":
        with open(target, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
    elif damage == "truncate":
        os.truncate(target, size - 1)
    else:
        os.unlink(target)
    before = snapshot(engine)
    with pytest.raises((tier.DataLoss, ValueError)) as info:
        engine.load_checkpoint(ckpt)
    if name != "manifest.json" or damage != "delete":
        assert isinstance(info.value, tier.DataLoss), info.value
    assert_same(before, snapshot(engine))


def test_optimizer_bin_is_checked_by_its_reader_not_hashed_again(engine, tmp_path, monkeypatch):
    """Each byte is checked once per save and once per load: the manifest lists optimizer.bin (the
    largest file) by its size and its trailer, which chains the CRCs of its header and of every
    record, and the optimizer's reader checks every byte against it as it loads; Python never
    reads it to hash it."""
    from tier.torch import checkpoint as ck
    from tier.torch import checkpoint_load as ckl

    hashed = []
    real = ck._sha256_file

    def spy(p):
        hashed.append(os.path.basename(p))
        return real(p)

    monkeypatch.setattr(ck, "_sha256_file", spy)
    monkeypatch.setattr(ckl, "_sha256_file", spy)
    ckpt = str(tmp_path / "ckpt")
    path = saved_then_moved_on(engine, ckpt)
    with open(os.path.join(path, "manifest.json")) as f:
        entry = json.load(f)["files"]["optimizer.bin"]
    opt = os.path.join(path, "optimizer.bin")
    with open(opt, "rb") as f:
        f.seek(-32, os.SEEK_END)
        tail = f.read()
    assert tail.startswith(b"TIERTAIL")
    assert entry == {"bytes": os.path.getsize(opt), "trailer": tail.hex()}
    steps = engine.global_steps
    engine.load_checkpoint(ckpt)
    assert engine.global_steps == steps - 1
    assert "optimizer.bin" not in hashed, hashed


def test_without_its_tag_link_a_damaged_newest_version_gives_way_to_an_older_one(engine, tmp_path):
    """A process that died before it linked the tag leaves versions only: the newest whose files
    all check out is used, optimizer.bin's every record included (its reader's checks are made
    while choosing), so one damaged inside, with its trailer intact, is passed over."""
    import shutil

    ckpt = tmp_path / "ckpt"
    first = os.path.realpath(saved_then_moved_on(engine, str(ckpt), tag="t"))
    first_steps = engine.global_steps - 1
    kept = tmp_path / "kept"
    shutil.copytree(first, kept)
    second = os.path.realpath(engine.save_checkpoint(str(ckpt), tag="t"))
    assert not os.path.exists(first)  # collected by the second save
    shutil.copytree(kept, first)  # an older version of the tag, as a killed save leaves it
    os.unlink(ckpt / "t")
    opt = os.path.join(second, "optimizer.bin")
    os.chmod(opt, 0o600)
    with open(opt, "r+b") as f:
        f.seek(os.path.getsize(opt) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(opt) // 2)
        f.write(bytes([b[0] ^ 0x10]))
    engine.load_checkpoint(str(ckpt), tag="t")
    assert engine.global_steps == first_steps


@pytest.mark.parametrize("edit", ["steps-not-int", "no-scheduler-step", "short-rng", "rng-not-base64",
                                  "frozen-short", "other-model", "no-client-state"])
def test_consistent_but_invalid_metadata_changes_nothing(engine, tmp_path, edit):
    """Files that match their (re-signed) manifest but do not fit the engine: refused, with the
    engine as it was (the old code applied params and optimizer state, then failed)."""
    ckpt = str(tmp_path / "ckpt")
    path = os.path.realpath(saved_then_moved_on(engine, ckpt))
    mpath = os.path.join(path, "meta.json")
    with open(mpath) as f:
        meta = json.load(f)
    if edit == "steps-not-int":
        meta["micro_steps"] = "four"
    elif edit == "no-scheduler-step":
        del meta["scheduler"]["last_step"]
    elif edit == "short-rng":
        meta["rng"]["cpu"] = base64.b64encode(b"\0" * 16).decode()
    elif edit == "rng-not-base64":
        meta["rng"]["cpu"] = "!!!"
    elif edit == "frozen-short":
        os.chmod(os.path.join(path, "frozen.bin"), 0o600)
        os.truncate(os.path.join(path, "frozen.bin"), 8)
    elif edit == "other-model":
        meta["params"][0]["shape"] = [47, 16]
    else:
        del meta["client_state"]
    os.chmod(mpath, 0o600)
    with open(mpath, "w") as f:
        json.dump(meta, f)
    resign(path)
    before = snapshot(engine)
    with pytest.raises(ValueError):
        engine.load_checkpoint(ckpt)
    assert_same(before, snapshot(engine))


def test_a_manifest_that_does_not_cover_frozen_bin_is_refused(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    path = os.path.realpath(saved_then_moved_on(engine, ckpt))
    resign(path, leave_out=("frozen.bin",))
    before = snapshot(engine)
    with pytest.raises(tier.DataLoss, match="frozen.bin"):
        engine.load_checkpoint(ckpt)
    assert_same(before, snapshot(engine))


def test_load_restores_everything_and_a_good_checkpoint_still_loads(engine, tmp_path, swap_dir):
    ckpt = str(tmp_path / "ckpt")
    kc.train_step(engine)
    kc.train_step(engine)
    engine.save_checkpoint(ckpt, client_state={"note": "x"})
    saved = snapshot(engine)
    kc.train_step(engine)
    path, client = engine.load_checkpoint(ckpt)
    assert client == {"note": "x"}
    assert os.path.isfile(os.path.join(path, "manifest.json"))
    assert_same(saved, snapshot(engine))


# ---------------------------------------------------------------------------- 3: no pickle
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _to_old_format(path, rng_obj):
    """Turns a new checkpoint into the tier-checkpoint-1 layout (rng.pt, no manifest)."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        os.unlink(os.path.join(path, "manifest.json"))
    mpath = os.path.join(path, "meta.json")
    with open(mpath) as f:
        meta = json.load(f)
    meta["format"] = "tier-checkpoint-1"
    meta.pop("rng", None)
    os.chmod(mpath, 0o600)
    with open(mpath, "w") as f:
        json.dump(meta, f)
    torch.save(rng_obj, os.path.join(path, "rng.pt"))


def test_checkpoints_hold_no_pickle(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    path = engine.save_checkpoint(ckpt)
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            head = f.read(2)
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), name
        assert not name.endswith((".pt", ".pkl", ".pth")), name


def test_old_format_rng_pickle_cannot_run_code(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    path = os.path.realpath(saved_then_moved_on(engine, ckpt))
    marker = str(tmp_path / "pwned")
    _to_old_format(path, {"cpu": _Evil(marker), "cuda": []})
    before = snapshot(engine)
    try:
        engine.load_checkpoint(ckpt)
        err = None
    except Exception as e:  # noqa: BLE001 - checked below, after the marker
        err = e
    assert not os.path.exists(marker), "loading a checkpoint ran code from rng.pt"
    assert isinstance(err, ValueError) and "rng.pt" in str(err), repr(err)
    assert_same(before, snapshot(engine))


def test_old_format_with_plain_rng_state_still_loads(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    kc.train_step(engine)
    path = os.path.realpath(engine.save_checkpoint(ckpt))
    saved = snapshot(engine)
    _to_old_format(path, {"cpu": torch.get_rng_state(), "cuda": []})
    kc.train_step(engine)
    engine.load_checkpoint(ckpt)
    assert_same(saved, snapshot(engine))


# ---------------------------------------------------------------------------- 4: names
BAD_TAGS = ["../x", "a/b", "/abs", "", ".", "..", "latest", ".hidden", "a..b", "a\0b", "x" * 129, "tab\t"]


@pytest.mark.parametrize("tag", BAD_TAGS)
def test_bad_tags_are_refused_on_save_and_load(engine, tmp_path, tag):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="plain name"):
        engine.save_checkpoint(str(ckpt), tag=tag)
    assert not ckpt.exists() and not (tmp_path / "x").exists() and not os.path.exists("/abs")
    with pytest.raises(ValueError, match="plain name"):
        engine.load_checkpoint(str(ckpt), tag=tag)


@pytest.mark.parametrize("content", ["../outside", "/etc", "a/b", "..", ""])
def test_latest_naming_a_path_is_refused(engine, tmp_path, content):
    """A good checkpoint sits outside the directory: the old code followed ``latest`` to it."""
    kc.train_step(engine)
    engine.save_checkpoint(str(tmp_path), tag="outside")  # tmp_path/outside is a valid checkpoint
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text(content)
    before = snapshot(engine)
    with pytest.raises(ValueError, match="latest"):
        engine.load_checkpoint(str(ckpt))
    assert_same(before, snapshot(engine))


def test_tag_symlink_leading_out_of_the_directory_is_refused(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    engine.save_checkpoint(ckpt, tag="good")
    os.symlink("../elsewhere", os.path.join(ckpt, "evil"))
    with pytest.raises(ValueError, match="not a version"):
        engine.load_checkpoint(ckpt, tag="evil")


def test_unknown_tag_names_the_directory_and_the_tags(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    engine.save_checkpoint(ckpt, tag="first")
    engine.save_checkpoint(ckpt, tag="second")
    with pytest.raises(FileNotFoundError) as info:
        engine.load_checkpoint(ckpt, tag="third")
    msg = str(info.value)
    assert ckpt in msg and "'third'" in msg and "first, second" in msg
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        engine.load_checkpoint(empty)


def test_user_files_in_the_checkpoint_directory_are_left_alone(engine, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    mine = {"notes.txt": "keep", "x~y": "keep too", ".latest": "mine"}
    for n, text in mine.items():
        (ckpt / n).write_text(text)
    for _ in range(3):
        kc.train_step(engine)
        engine.save_checkpoint(str(ckpt), tag="t")
    for n, text in mine.items():
        assert (ckpt / n).read_text() == text


def test_a_tag_named_like_a_users_file_or_folder_is_refused_not_replaced(engine, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "results").mkdir(parents=True)
    (ckpt / "results" / "table.csv").write_text("1,2")
    (ckpt / "notes").write_text("keep")
    os.symlink(str(tmp_path), str(ckpt / "link"))
    for tag in ("results", "notes"):
        with pytest.raises(FileExistsError, match="not a tier checkpoint"):
            engine.save_checkpoint(str(ckpt), tag=tag)
    with pytest.raises(ValueError, match="not a version"):
        engine.save_checkpoint(str(ckpt), tag="link")
    assert (ckpt / "results" / "table.csv").read_text() == "1,2"
    assert (ckpt / "notes").read_text() == "keep"
    assert os.readlink(str(ckpt / "link")) == str(tmp_path)
    assert sorted(os.listdir(ckpt)) == ["link", "notes", "results"]


# ---------------------------------------------------------------------------- 5: permissions
def test_files_and_directories_are_private(engine, tmp_path):
    old = os.umask(0o022)
    try:
        ckpt = str(tmp_path / "new-dir")
        path = os.path.realpath(engine.save_checkpoint(ckpt, tag="t"))
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.lstat(p).st_mode)

    assert mode(ckpt) == 0o700
    assert mode(path) == 0o700
    assert mode(os.path.join(ckpt, "latest")) == 0o600
    names = os.listdir(path)
    assert {"optimizer.bin", "frozen.bin", "meta.json", "manifest.json"} <= set(names)
    for n in names:
        assert mode(os.path.join(path, n)) == 0o600, n


# ---------------------------------------------------------------------------- 6: the example's swap dir
def _user_tree(root):
    os.makedirs(os.path.join(root, "sub"), exist_ok=True)
    with open(os.path.join(root, "thesis.tex"), "w") as f:
        f.write("years of work")
    with open(os.path.join(root, "sub", "data.bin"), "wb") as f:
        f.write(b"\1\2\3")


TINY = ["--steps", "1", "--gas", "1", "--batch", "1", "--seq", "16", "--hidden", "64", "--layers", "1",
        "--heads", "2"]


def test_example_leaves_the_users_swap_dir_and_its_files(tmp_path, capsys):
    from tier.examples import finetune_llama

    swap = str(tmp_path / "users-folder")
    _user_tree(swap)
    finetune_llama.main(TINY + ["--swap-dir", swap])
    with open(os.path.join(swap, "thesis.tex")) as f:
        assert f.read() == "years of work"
    with open(os.path.join(swap, "sub", "data.bin"), "rb") as f:
        assert f.read() == b"\1\2\3"
    assert sorted(os.listdir(swap)) == ["sub", "thesis.tex"], "tier's own folder is gone too"
    assert os.path.join(swap, "tier-") in capsys.readouterr().out, "the run names its own folder"


def test_example_removes_a_swap_dir_it_created_and_cleans_up_after_errors(tmp_path, monkeypatch):
    from tier.examples import finetune_llama

    fresh = str(tmp_path / "a" / "new")
    finetune_llama.main(TINY + ["--swap-dir", fresh])
    assert not os.path.exists(fresh)

    swap = str(tmp_path / "users-folder")
    _user_tree(swap)
    seen = []

    def boom(args, own):
        seen.append(own)
        with open(os.path.join(own, "tier-file"), "w") as f:
            f.write("x")
        raise RuntimeError("training failed")

    monkeypatch.setattr(finetune_llama, "run", boom)
    with pytest.raises(RuntimeError):
        finetune_llama.main(TINY + ["--swap-dir", swap])
    assert os.path.dirname(seen[0]) == swap and os.path.basename(seen[0]).startswith("tier-")
    assert sorted(os.listdir(swap)) == ["sub", "thesis.tex"]
