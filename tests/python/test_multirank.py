"""ZeRO stages 1, 2 and 3 across Gloo ranks (tier.torch.zero): each rank is a process running
multirank_worker.py; the losses over 10 steps (accumulation, clipping that triggers) match one
process with the same global batch, each rank's NVMe bytes are 1/world of the single-rank
figure, checkpoints saved at 2 ranks resume at 1 and at 4 with the same losses, a dead rank makes
the others fail with a clear error, and mismatched configs are refused."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch has no Gloo backend", allow_module_level=True)

import tier  # noqa: E402,F401 (the in-tree build, as conftest arranges)

pytestmark = pytest.mark.slow  # ranks are processes: the quick tier leaves them out

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multirank_worker.py")
TIMEOUT = 240  # seconds for a whole run of ranks (a hang fails the test instead of CI)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, world, *args, name="run", expect_ok=True):
    """Starts `world` ranks; returns ([report per rank or None], [stderr per rank], [exit codes])."""
    d = tmp_path / name
    d.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the tier the tests import
    env.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    procs = []
    for r in range(world):
        cmd = [sys.executable, WORKER, "--rank", str(r), "--world", str(world), "--port", str(port)]
        cmd += ["--swap", str(d / "swap"), "--out", str(d / f"out{r}.json"), *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs, codes = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"ranks still running after {TIMEOUT} s (a hang): {args}")
        outs.append(err)
        codes.append(p.returncode)
    if expect_ok:
        for r, (c, err) in enumerate(zip(codes, outs)):
            wrote = (d / f"out{r}.json").exists()
            assert c == 0, f"rank {r} failed ({c}; {'after' if wrote else 'before'} writing its report):\n{err[-3000:]}"
    reports = []
    for r in range(world):
        f = d / f"out{r}.json"
        reports.append(json.loads(f.read_text()) if f.exists() else None)
    return reports, outs, codes


def max_rel(a, b):
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


_REFERENCE = {}


def reference(tmp_path, family, *args):
    """The one-process run (cached per family and arguments)."""
    key = (family, args)
    if key not in _REFERENCE:
        reports, _, _ = run_ranks(tmp_path, 1, "--family", family, *args, name=f"ref-{family}")
        _REFERENCE[key] = reports[0]
    return _REFERENCE[key]


@pytest.mark.parametrize(
    "family,world,stage",
    [
        ("llama", 2, 1),
        ("llama", 2, 2),
        ("llama", 2, 3),
        ("llama", 4, 3),
        ("gpt_neox", 2, 1),
        ("gpt_neox", 2, 2),
        ("gpt_neox", 2, 3),
        ("qwen2", 2, 3),
    ],
)
def test_losses_match_one_process(tmp_path, family, world, stage):
    ref = reference(tmp_path, family)
    reports, _, _ = run_ranks(tmp_path, world, "--family", family, "--stage", stage)
    for r, rep in enumerate(reports):
        assert max_rel(rep["losses"], ref["losses"]) <= 1e-5, (r, rep["losses"], ref["losses"])
        # Clipping took part: the global norm (equal on every rank) is the one-process norm.
        assert max(ref["grad_norms"]) > 0.5
        assert max_rel(rep["grad_norms"], ref["grad_norms"]) <= 1e-5
        assert abs(rep["master_sum"] - ref["master_sum"]) <= 1e-5 * ref["master_abs_sum"]
        assert abs(rep["param_sum"] - ref["param_sum"]) <= 1e-5 * ref["master_abs_sum"]
        if stage == 3:
            # After the first micro-step, every module's all-gather was started ahead of its fetch.
            z = rep["zero"]
            assert z["gather_prefetch_hits"] >= 5 * z["gather_prefetch_misses"], z
    # Each rank holds 1/world of the optimizer state: its elements exactly, its NVMe bytes to
    # within one 64 KiB block (records are 4 KiB-aligned).
    assert sum(rep["optimizer_elements"] for rep in reports) == ref["optimizer_elements"]
    for rep in reports:
        assert rep["optimizer_elements"] <= -(-ref["optimizer_elements"] // world) + world * 64
        # (each rank's short last chunk takes a whole chunk's slot)
        slack = 65536 + rep["optimizer_chunk_bytes"]
        assert abs(rep["optimizer_nvme_bytes"] - ref["optimizer_nvme_bytes"] / world) <= slack


@pytest.mark.parametrize(
    "stage,checkpointing,offload",
    [(3, "nonreentrant", "none"), (2, "reentrant", "none"), (1, "nonreentrant", "none"), (3, "nonreentrant", "nvme")],
)
def test_gradient_checkpointing_across_ranks_matches_one_process(tmp_path, stage, checkpointing, offload):
    # Recomputing changes no value: the one-process run without checkpointing is the reference.
    # The recompute holds a layer's parameters until their backward: the device fits one layer.
    # With the checkpoints offloaded, each rank offloads those of its own micro-batch.
    ref = reference(tmp_path, "llama")
    reports, _, _ = run_ranks(
        tmp_path, 2, "--stage", stage, "--checkpointing", checkpointing, "--device-budget", "320K",
        "--offload-activations", offload,
    )
    for rep in reports:
        assert max_rel(rep["losses"], ref["losses"]) <= 1e-5, (rep["losses"], ref["losses"])
        assert max_rel(rep["grad_norms"], ref["grad_norms"]) <= 1e-5
        assert rep["activations_offloaded"] == (0 if offload == "none" else 2 * 10 * 2)  # layers x steps x gas


def test_serial_step_and_host_params_match(tmp_path):
    ref = reference(tmp_path, "llama", "--param-home", "cpu", "--overlap", "serial")
    reports, _, _ = run_ranks(tmp_path, 2, "--stage", 3, "--param-home", "cpu", "--overlap", "serial", "--bucket", 10**9)
    for rep in reports:
        assert max_rel(rep["losses"], ref["losses"]) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2])
def test_a_backward_outside_the_engine_reduces_at_step(tmp_path, stage):
    ref = reference(tmp_path, "llama")
    reports, _, _ = run_ranks(tmp_path, 2, "--stage", stage, "--plain-backward", "--overlap", "serial")
    for rep in reports:
        assert max_rel(rep["losses"], ref["losses"]) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_loop_that_steps_only_at_the_boundary_reduces_every_micro_step(tmp_path, stage):
    """accelerate's loop: loss.backward() for each micro-step and the optimizer's step() only at
    the boundary, so the second micro-step's backward comes before any step(). Each micro-step's
    gradients must be reduced (the reducer held the second one's back and dropped it: stages 2
    and 3 trained on half the gradients)."""
    ref = reference(tmp_path, "llama")
    reports, _, _ = run_ranks(tmp_path, 2, "--stage", stage, "--caller-loop", "--overlap", "serial")
    for rep in reports:
        assert max_rel(rep["losses"], ref["losses"]) <= 1e-5
        assert abs(rep["master_abs_sum"] - ref["master_abs_sum"]) <= 1e-5 * ref["master_abs_sum"]


def test_checkpoint_saved_at_2_resumes_at_1_and_4(tmp_path):
    full = reference(tmp_path, "llama", "--steps", 6)
    ckpt = tmp_path / "ckpt"
    run_ranks(tmp_path, 2, "--stage", 2, "--steps", 3, "--save", ckpt, name="save2")
    names = sorted(os.listdir(os.path.join(ckpt, "global_step3")))
    assert names == ["manifest.json", "meta.json", "rank0.bin", "rank0.json", "rank1.bin", "rank1.json"]
    tail = full["losses"][3 * 2 :]
    one, _, _ = run_ranks(tmp_path, 1, "--steps", 6, "--start", 3, "--load", ckpt, name="load1")
    assert max_rel(one[0]["losses"], tail) <= 1e-5
    four, _, _ = run_ranks(tmp_path, 4, "--stage", 3, "--steps", 6, "--start", 3, "--load", ckpt, name="load4")
    for rep in four:
        assert max_rel(rep["losses"], tail) <= 1e-5
        assert abs(rep["master_sum"] - full["master_sum"]) <= 1e-5 * full["master_abs_sum"]
    # At the world and stage it was saved with, each rank loads its own file through the
    # optimizer's loader, the ranks agreeing before any commits.
    two, _, _ = run_ranks(tmp_path, 2, "--stage", 2, "--steps", 6, "--start", 3, "--load", ckpt, name="load2")
    for rep in two:
        assert max_rel(rep["losses"], tail) <= 1e-5
        assert abs(rep["master_sum"] - full["master_sum"]) <= 1e-5 * full["master_abs_sum"]

    # Consolidated offline into one fp32 state dict: the masters the 2 ranks held.
    out = tmp_path / "consolidated.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-m", "tier.torch.zero_to_fp32", str(ckpt), str(out)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    sd = torch.load(out, weights_only=True)
    assert len(sd) > 10 and all(t.dtype == torch.float32 for t in sd.values())
    # They are the masters the 2 ranks held after step 3 (the sum the ranks reported).
    saved, _, _ = run_ranks(tmp_path, 1, "--steps", 3, "--load", ckpt, "--start", 3, name="reload")
    assert abs(sum(float(t.double().sum()) for t in sd.values()) - saved[0]["master_sum"]) <= 1e-9 * saved[0]["master_abs_sum"]
    out16 = tmp_path / "consolidated.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "tier.torch.zero_to_fp32", str(ckpt), str(out16), "--dtype", "bf16"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    sd16 = load_file(str(out16))
    assert sd16.keys() == sd.keys() and all(sd16[k].dtype == torch.bfloat16 for k in sd)
    assert all(torch.equal(sd16[k], sd[k].to(torch.bfloat16)) for k in sd)

    # A shard file damaged inside its records (its size and trailer still those the manifest
    # lists) is refused on every rank, and nothing is loaded: rank 1's reader finds the damage
    # as it loads, before committing, and rank 0, whose own file verified, waits for rank 1's
    # verdict before it commits its own.
    target = os.path.realpath(os.path.join(ckpt, "global_step3"))
    with open(os.path.join(target, "rank1.bin"), "r+b") as f:
        at = f.seek(0, os.SEEK_END) // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    _, errs, codes = run_ranks(
        tmp_path, 2, "--stage", 2, "--steps", 4, "--start", 3, "--load", ckpt, name="damaged", expect_ok=False
    )
    assert all(c != 0 for c in codes)
    assert re.search(r"rank1\.bin: record \d+ .* fails its \w+ checksum", errs[1]), errs[1][-2000:]
    assert "rank 1 refused it" in errs[0], errs[0][-2000:]
    done = subprocess.run(
        [sys.executable, "-m", "tier.torch.zero_to_fp32", str(ckpt), str(out)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and re.search(r"rank1\.bin: record \d+ .* checksum", done.stderr), done.stderr


def _resign(path):
    """Rewrites path's manifest for its files as they are now, every one by its SHA-256 (as manifests
    were before optimizer.bin was listed by its trailer): damage only a file's own reader sees."""
    from tier.torch import checkpoint as ck

    files = {}
    for name in sorted(os.listdir(path)):
        if name != ck.MANIFEST:
            n, digest = ck._sha256_file(os.path.join(path, name))
            files[name] = {"bytes": n, "sha256": digest}
    body = {"format": ck.FORMAT, "files": files}
    with open(os.path.join(path, ck.MANIFEST), "w") as f:
        json.dump(dict(body, sha256=ck._manifest_body_digest(body)), f)


@pytest.mark.parametrize("compute,state", [("fp32", "fp32"), ("bf16", "int8")])
def test_zero_to_fp32_consolidates_a_checkpoint_saved_by_one_process(tmp_path, swap_dir, compute, state):
    """A one-process checkpoint (tier-checkpoint-2) keeps the trainable masters only in
    optimizer.bin, the optimizer's own file: zero_to_fp32 reads them with the native reader
    (issue #32). Every tensor is the engine's fp32 master, or the frozen parameter widened,
    exactly; a damaged optimizer.bin is exit status 2 with the reason, whether the manifest or,
    once the manifest is rewritten to match, the reader's own checksums find it."""
    import tier.torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ckpt_kill_child as kc

    cfg = kc.config(swap_dir)
    del cfg["scheduler"]  # a constant lr: the first steps move every trainable parameter
    if compute == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg["tier"]["optimizer"] = {"state_dtype": state}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[compute]
    engine = tier.torch.initialize(kc.make_model(), cfg)[0]
    try:
        torch.manual_seed(3)
        for _ in range(2 * kc.GAS):
            x = torch.randn(8, 16)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), torch.sin(x[:, :4] * 2.0))
            engine.backward(loss)
            engine.step()
        ckpt = tmp_path / "ckpt"
        saved = os.path.realpath(engine.save_checkpoint(str(ckpt)))
        expected = engine.state_dict_fp32()
        assert engine.stats()["optimizer"]["state_dtype"] == state
    finally:
        engine.close()
    assert "frozen.bin" in os.listdir(saved)
    # The frozen weight is the initial one in the compute dtype, widened; the trainable ones moved.
    initial = kc.make_model()
    assert torch.equal(expected["2.weight"], initial[2].weight.detach().to(dtype).float())
    assert not torch.equal(expected["0.weight"], initial[0].weight.detach().to(dtype).float())

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def consolidate(out):
        return subprocess.run(
            [sys.executable, "-m", "tier.torch.zero_to_fp32", str(ckpt), str(out)],
            env=env, capture_output=True, text=True, timeout=TIMEOUT,
        )

    from safetensors.torch import load_file

    for out in (tmp_path / "one.safetensors", tmp_path / "one.pt"):
        done = consolidate(out)
        assert done.returncode == 0, done.stderr
        got = load_file(str(out)) if out.suffix == ".safetensors" else torch.load(out, weights_only=True)
        assert list(got) == list(expected) if out.suffix == ".pt" else sorted(got) == sorted(expected)
        for name, want in expected.items():
            assert got[name].dtype == torch.float32 and got[name].shape == want.shape, name
            assert torch.equal(got[name], want), name

    # One flipped bit in optimizer.bin: the manifest lists its trailer, so its reader finds it (each
    # byte is checked once). A manifest of before the trailer was listed (SHA-256s) finds it itself.
    opt = os.path.join(saved, "optimizer.bin")
    size = os.path.getsize(opt)

    def flip():
        with open(opt, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))

    flip()
    out = tmp_path / "damaged.pt"
    done = consolidate(out)
    assert done.returncode == 2, done.stderr
    assert "optimizer.bin" in done.stderr and "the file is corrupt" in done.stderr, done.stderr
    flip()  # (back as saved)
    _resign(saved)
    flip()
    done = consolidate(out)
    assert done.returncode == 2 and "optimizer.bin does not match the manifest" in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_inf_on_one_rank_makes_every_rank_skip_the_step(tmp_path, stage):
    reports, _, _ = run_ranks(tmp_path, 2, "--stage", stage, "--steps", 4, "--inf-at-step", 2)
    for rep in reports:
        assert rep["skipped_steps"] == 1 and rep["global_steps"] == 3, rep
        assert rep["grad_norms"][2] != rep["grad_norms"][2] or rep["grad_norms"][2] == float("inf")
    # The ranks still agree on every parameter (the skipped step changed none of them).
    assert reports[0]["param_sum"] == reports[1]["param_sum"]
    assert reports[0]["master_sum"] == reports[1]["master_sum"]


def test_a_dead_rank_makes_the_others_fail_clearly(tmp_path):
    _, errs, codes = run_ranks(
        tmp_path, 2, "--stage", 2, "--steps", 5, "--die-after", 1, "--timeout", 60, name="dies", expect_ok=False
    )
    assert codes[1] == 3
    assert codes[0] != 0
    assert "another rank has probably died" in errs[0], errs[0][-2000:]


def test_ranks_with_different_configs_are_refused(tmp_path):
    _, errs, codes = run_ranks(tmp_path, 2, "--stage", 2, "--steps", 1, "--lr-mismatch", name="mismatch", expect_ok=False)
    assert all(c != 0 for c in codes)
    assert all("optimizer.params.lr: 0.003 on rank 0, 0.006 on rank 1" in e for e in errs), errs[0][-2000:]


def test_stage_0_across_ranks_is_refused(tmp_path):
    _, errs, codes = run_ranks(tmp_path, 2, "--stage", 0, "--steps", 1, name="stage0", expect_ok=False)
    assert all(c != 0 for c in codes)
    assert all("zero_optimization.stage: 0 across 2 ranks is not supported" in e for e in errs)


def test_the_main_job_runs_under_torchrun(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    cmd += ["-m", "tier.examples.finetune_llama", "--steps", "2", "--hidden", "64", "--layers", "2", "--heads", "4"]
    cmd += ["--seq", "32", "--swap-dir", str(tmp_path / "swap"), "--corpus", os.path.join(os.path.dirname(WORKER), "..", "..", "docs")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    # Rank 0 reports, once.
    assert done.stdout.count("summary") == 1 and "step   2/2" in done.stdout
    assert not os.listdir(tmp_path / "swap") if (tmp_path / "swap").exists() else True


class _OneRank:
    """A group of one for GatherPrefetcher: an all-gather is the shard itself."""

    world = 1

    def all_gather(self, local, async_op=False):
        return local.clone(), None

    def wait(self, work, what):
        pass


class _Slot:
    def __init__(self, name, numel):
        self.name, self.numel, self.zero_shard = name, numel, numel


def test_the_stage3_gather_prefetcher_keeps_the_training_record_through_evaluation_forwards():
    """An evaluation's forward runs a prefix of the training step's fetches: the record stays, so
    the training step after it is prefetched; from the second such forward in a row the
    lookahead stops where they stop (no gathers of the backward's parameters for a forward), and
    a micro-step that goes past that place looks ahead again."""
    from tier.torch.zero import GatherPrefetcher

    a, b, c, d = (_Slot(n, 4) for n in "abcd")
    started = []
    pf = GatherPrefetcher(_OneRank(), budget=10**6, read_shard=lambda s: (started.append(s.name), torch.ones(4))[1])

    def micro_step(fetches):
        pf.begin()
        before = (pf.hits, pf.misses)
        for s in fetches:
            pf.gather([s])
        return pf.hits - before[0], pf.misses - before[1]

    train, evaluate = [a, b, c, d], [a, b]
    micro_step(train)
    assert micro_step(train) == (4, 0)  # recorded, then prefetched whole
    assert micro_step(evaluate) == (2, 0)
    assert pf.record == [(a,), (b,), (c,), (d,)]
    started.clear()
    micro_step(evaluate)  # the second in a row: from now on the lookahead stops at its end
    started.clear()
    assert micro_step(evaluate) == (2, 0) and "c" not in started and "d" not in started
    hits, misses = micro_step(train)  # goes past the end: c is fetched on the spot, d ahead again
    assert (hits, misses) == (3, 1)
    assert micro_step(train) == (4, 0) and pf.end_hint is None
