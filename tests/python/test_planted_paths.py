"""No file tier writes goes through a path another user planted (issue #31, item 2).

Someone who can write the output folder (a shared scratch or project folder) plants the name a
writer is about to use as a symlink to a file of the user running tier. The old writers opened
``<name>.tmp`` with truncation (and transformers' config writer, and the Trainer's
``torch.save``, opened the final name itself), so tier overwrote the file the symlink pointed to.
Every writer now creates a fresh, unpredictably named file with ``O_EXCL|O_NOFOLLOW`` (or writes
in a private folder) and renames it: each test plants every predictable name, runs the writer, and
checks that the victim is unchanged and the output right."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from tier.torch import atomic_file  # noqa: E402
from tier.torch import checkpoint as ckpt_mod  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_kill_child as kc  # noqa: E402

SECRET = b"another user's file: must not change"


@pytest.fixture
def victim(tmp_path):
    p = tmp_path / "victim"
    p.write_bytes(SECRET)
    return p


def plant(path, victim):
    os.symlink(str(victim), str(path))


def intact(victim):
    return victim.read_bytes() == SECRET


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture
def llama_engine(swap_dir):
    engine = tier.torch.initialize(tiny_llama(), kc.config(swap_dir))[0]
    yield engine
    engine.destroy()


# ---------------------------------------------------------------------------- the helper itself
def test_atomic_write_never_opens_a_planted_name_and_leaves_nothing_on_error(tmp_path, victim):
    out = tmp_path / "out.bin"
    plant(str(out) + ".tmp", victim)
    atomic_file.write_bytes(out, b"new")
    assert intact(victim) and out.read_bytes() == b"new"
    plant(tmp_path / "link", victim)
    atomic_file.write_bytes(tmp_path / "link", b"replaced")  # a symlink at the target is replaced
    assert intact(victim) and not os.path.islink(tmp_path / "link")
    with pytest.raises(RuntimeError, match="half"):
        with atomic_file.atomic_write(out) as f:
            f.write(b"partial")
            raise RuntimeError("half way")
    assert out.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["link", "out.bin", "out.bin.tmp", "victim"]


# ---------------------------------------------------------------------------- the writers
def test_trace(swap_dir, tmp_path, victim):
    engine = kc.new_engine(swap_dir)
    engine.start_trace()
    kc.train_step(engine)
    path = tmp_path / "trace.json"
    plant(str(path) + ".tmp", victim)
    engine.save_trace(path)
    engine.destroy()
    assert intact(victim)
    assert "traceEvents" in json.loads(path.read_text())


def test_save_pretrained_single_file_and_configs(llama_engine, tmp_path, victim):
    out = tmp_path / "hf"
    out.mkdir()
    for name in ("model.safetensors.tmp", "config.json", "config.json.tmp", "generation_config.json"):
        plant(out / name, victim)
    written = llama_engine.save_pretrained(str(out))
    assert intact(victim)
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(written)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert not os.path.islink(out / name), name
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    mine = llama_engine.module_state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, mine[name].to(value.dtype)), name
    # No temporary file or private folder of tier's is left behind.
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_save_pretrained_shards_and_index(llama_engine, tmp_path, victim):
    out = tmp_path / "hf"
    out.mkdir()
    names = [f"model-{i:05d}-of-{n:05d}.safetensors.tmp" for n in range(2, 8) for i in range(1, n + 1)]
    for name in names + ["model.safetensors.index.json.tmp"]:
        plant(out / name, victim)
    written = llama_engine.save_pretrained(str(out), max_shard_size=20_000, save_config=False)
    assert intact(victim)
    shards = [n for n in written if n.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in written
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(shards)


def test_save_16bit_model(llama_engine, tmp_path, victim):
    out = tmp_path / "ds"
    out.mkdir()
    plant(out / "pytorch_model.bin.tmp", victim)
    assert llama_engine.save_16bit_model(str(out))
    assert intact(victim)
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert sd.keys() == llama_engine.module_state_dict().keys()


def _rank_checkpoint(directory):
    """A checkpoint as tier.torch.zero_checkpoint saves it (one rank), built by hand: two
    trainable parameters, rank0.bin written by the optimizer's own writer, the manifest signed as
    tier signs it."""
    from tier.torch import zero_checkpoint as zc

    vdir = directory / "t~0000000000000001-1-00000000"
    vdir.mkdir(parents=True)
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.full((4,), 0.5)
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    driver = tier._tier.StepDriver(tier._tier.Config.from_json(json.dumps(cfg)), a.numel() + b.numel())
    index = []
    for name, t in (("a", a), ("b", b)):
        driver.add_param(name, t.reshape(-1).numpy())
        index.append({"name": name, "start": 0, "count": t.numel()})
    driver.save(str(vdir / "rank0.bin"))
    (vdir / "rank0.json").write_text(json.dumps({"format": zc.FORMAT, "rank": 0, "world": 1, "params": index,
                                                 "group_steps": [0], "rng_cpu": ""}))
    (vdir / "meta.json").write_text(json.dumps({
        "format": zc.FORMAT, "world": 1, "stage": 2, "global_steps": 1, "micro_steps": 1, "skipped_steps": 0,
        "compute_dtype": "fp32", "scheduler": None, "client_state": {},
        "params": [{"name": "a", "shape": [2, 3], "trainable": True}, {"name": "b", "shape": [4], "trainable": True}],
    }))
    files = {}
    for name in sorted(os.listdir(vdir)):
        if name == "rank0.bin":
            files[name] = ckpt_mod.reader_checked_entry(str(vdir / name))
            continue
        n, digest = ckpt_mod._sha256_file(str(vdir / name))
        files[name] = {"bytes": n, "sha256": digest}
    body = {"format": zc.FORMAT, "files": files}
    (vdir / "manifest.json").write_text(json.dumps(dict(body, sha256=ckpt_mod._manifest_body_digest(body))))
    os.symlink(vdir.name, directory / "t")
    (directory / "latest").write_text("t")
    return {"a": a, "b": b}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_zero_to_fp32(tmp_path, victim, suffix):
    from tier.torch import zero_to_fp32

    expected = _rank_checkpoint(tmp_path / "ckpt")
    out = tmp_path / f"consolidated{suffix}"
    plant(str(out) + ".tmp", victim)
    assert zero_to_fp32.main([str(tmp_path / "ckpt"), str(out)]) == 0
    assert intact(victim)
    if suffix == ".pt":
        got = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        got = load_file(str(out))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "a temporary file or folder is left"


def test_trainer_files(swap_dir, tmp_path, victim):
    pytest.importorskip("accelerate")
    import tier.hf

    out = tmp_path / "trainer-out"
    out.mkdir()
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=2,
                                          learning_rate=1e-3, report_to=[], use_cpu=True)
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, **{k: v for k, v in kc.config(swap_dir).items()
                                                                         if k in ("zero_optimization", "tier")}}
    trainer = tier.hf.TierTrainer(model=tiny_llama(), args=args, tier_config=cfg)
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    for name in ("training_args.bin", "scheduler.pt", "training_args.bin.tmp", "scheduler.pt.tmp"):
        plant(out / name, victim)
    trainer._save(str(out))
    trainer._save_optimizer_and_scheduler(str(out))
    trainer.tier_engine.destroy()
    assert intact(victim)
    assert not os.path.islink(out / "training_args.bin") and not os.path.islink(out / "scheduler.pt")
    assert torch.load(out / "scheduler.pt", weights_only=True)["last_epoch"] == 0


def test_checkpoint_lock_file_planted_as_a_symlink_is_refused(swap_dir, tmp_path, victim):
    engine = kc.new_engine(swap_dir)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    plant(ckpt / ckpt_mod.LOCK, victim)
    with pytest.raises(FileExistsError, match="symbolic link"):
        engine.save_checkpoint(str(ckpt), tag="t")
    engine.close()
    assert intact(victim)
    assert sorted(os.listdir(ckpt)) == [ckpt_mod.LOCK]


def test_tier_bench_plan_write_config(tmp_path, victim):
    import subprocess

    from test_configs import tier_bench

    bench = tier_bench()
    if bench is None:
        pytest.fail("tier-bench not found: set TIER_BENCH (scripts/test.sh does)", pytrace=False)
    transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4).save_pretrained(tmp_path / "model")
    out = tmp_path / "recommended.json"
    plant(out, victim)  # the old writer opened the name itself, following the symlink
    plant(str(out) + ".tmp", victim)
    r = subprocess.run([bench, "plan", "--model", str(tmp_path / "model"), "--gpu", "24G", "--host", "64G",
                        "--write-config", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert intact(victim)
    assert not os.path.islink(out)
    assert "zero_optimization" in json.loads(out.read_text())
