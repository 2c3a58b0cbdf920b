"""One writer per checkpoint folder (issue #31, item 4): a save holds an flock on
``<dir>/.tier-writer.lock``; a second save into the folder, from another process, fails at once
naming the holder, and the holder's checkpoint comes out whole. Before, both went ahead: one's
garbage collection removed the other's version in progress, or one run's checkpoints silently
replaced the other's."""

import os
import selectors
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from tier.torch import checkpoint as ckpt_mod  # noqa: E402
from tier.torch import zero_checkpoint  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ckpt_kill_child as kc  # noqa: E402

TIMEOUT = 180  # seconds for a child to reach a point (a hang fails the test instead of CI)

# A process that saves into CKPT and stops half way, holding the lock, until GO exists: its save
# is paused as it writes meta.json into its version directory.
SAVER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import ckpt_kill_child as kc
from tier.torch import checkpoint as ck
ckpt, swap, go = sys.argv[2:5]
engine = kc.new_engine(swap)
kc.train_step(engine)
write_new = ck._write_new
def paused(path, data):
    if os.path.basename(path) == "meta.json":
        print("holding", flush=True)
        while not os.path.exists(go):
            time.sleep(0.01)
    return write_new(path, data)
ck._write_new = paused
engine.save_checkpoint(ckpt, tag="child")
print("saved", flush=True)
"""

# A process that only takes the lock (as a save does) and keeps it until GO exists.
HOLDER = r"""
import os, sys, time
from tier.torch import checkpoint as ck
with ck.writer_lock(sys.argv[1]):
    print("holding", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
print("released", flush=True)
"""


def start(code, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(proc, line):
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if sel.select(timeout=1):
            got = proc.stdout.readline()
            if got.strip() == line:
                return
            if not got:
                break
    proc.kill()
    pytest.fail(f"child did not print {line!r}: {proc.stderr.read()[-3000:]}")


@pytest.fixture
def engine(swap_dir):
    e = kc.new_engine(swap_dir)
    yield e
    e.close()


def test_a_second_writer_is_refused_at_once_naming_the_holder(engine, tmp_path):
    ckpt = tmp_path / "ckpt"
    kc.train_step(engine)
    kc.train_step(engine)
    engine.save_checkpoint(str(ckpt), tag="first")  # at step 2; the child's is at step 1
    go = tmp_path / "go"
    child = start(SAVER, HERE, ckpt, tmp_path / "child-swap", go)
    try:
        wait_for(child, "holding")
        with pytest.raises(tier.FailedPrecondition) as info:
            engine.save_checkpoint(str(ckpt), tag="second")
        msg = str(info.value)
        assert f"pid {child.pid} on host {socket.gethostname()}" in msg, msg
        assert str(ckpt) in msg and "another writer" in msg
        assert child.poll() is None, "the refusal came while the holder still held the lock (it did not wait)"
        assert not os.path.lexists(ckpt / "second")
        go.touch()
        wait_for(child, "saved")
        assert child.wait(timeout=TIMEOUT) == 0
    finally:
        if child.poll() is None:
            child.kill()
    # The holder's checkpoint is whole and is latest; the first one is untouched.
    assert (ckpt / "latest").read_text() == "child"
    names = sorted(n for n in os.listdir(ckpt) if not n.startswith("."))
    assert [n for n in names if "~" not in n] == ["child", "first", "latest"]
    assert len([n for n in names if "~" in n]) == 2  # one version each, nothing half-written
    _, client = engine.load_checkpoint(str(ckpt))
    assert client == {} and engine.global_steps == 1
    engine.load_checkpoint(str(ckpt), tag="first")
    assert engine.global_steps == 2
    # The holder is gone: saving works again.
    engine.save_checkpoint(str(ckpt), tag="second")
    assert (ckpt / "latest").read_text() == "second"


def test_a_killed_holder_leaves_no_lock_behind(engine, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    child = start(HOLDER, ckpt, tmp_path / "never")
    try:
        wait_for(child, "holding")
        with pytest.raises(tier.FailedPrecondition, match=f"pid {child.pid}"):
            engine.save_checkpoint(str(ckpt), tag="t")
    finally:
        child.kill()
        child.wait()
    engine.save_checkpoint(str(ckpt), tag="t")
    assert (ckpt / "latest").read_text() == "t"


def test_a_save_by_ranks_takes_the_same_lock(engine, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    go = tmp_path / "go"
    child = start(HOLDER, ckpt, go)
    try:
        wait_for(child, "holding")
        with pytest.raises(tier.FailedPrecondition, match="another writer"):
            zero_checkpoint.save(engine, str(ckpt), "t", {})
        assert sorted(os.listdir(ckpt)) == [ckpt_mod.LOCK]
        go.touch()
        wait_for(child, "released")
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    zero_checkpoint.save(engine, str(ckpt), "t", {})
    assert zero_checkpoint.is_rank_checkpoint(str(ckpt), None)


def test_one_process_saving_twice_in_a_row_is_not_refused(engine, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for tag in ("a", "b", "a"):
        kc.train_step(engine)
        engine.save_checkpoint(ckpt, tag=tag)
    with open(os.path.join(ckpt, ckpt_mod.LOCK), "rb") as f:
        assert f.read() == b"", "a released lock names nobody"
