"""Untrusted inputs are refused with clear errors (issue #31, item 5, Python side): a ``latest``
that is a symlink out of the checkpoint folder (its target's content was echoed in the error), a
``latest`` holding anything but a tag (never quoted), a version directory that is a symlink out of
the folder, shard-index entries leading out of the model folder, integer tensors loaded into float parameters, a NUL byte in a swap path; and tier's
``NoSpace`` carries ``errno`` ENOSPC. (The C++ side: tests/optim/optimizer_checkpoint_untrusted_test.cpp,
tests/core/config_limits_test.cpp.)"""

import copy
import errno
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_kill_child as kc  # noqa: E402

SECRET = "password: hunter2 (someone else's file)"


@pytest.fixture
def engine(swap_dir):
    e = kc.new_engine(swap_dir)
    yield e
    e.close()


# ---------------------------------------------------------------------------- latest
def test_latest_symlinked_out_of_the_folder_is_refused_without_its_content(engine, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    ckpt = tmp_path / "ckpt"
    kc.train_step(engine)
    engine.save_checkpoint(str(ckpt), tag="good")
    os.unlink(ckpt / "latest")
    os.symlink(str(secret), str(ckpt / "latest"))
    steps = engine.global_steps
    kc.train_step(engine)
    with pytest.raises(ValueError) as info:
        engine.load_checkpoint(str(ckpt))
    msg = str(info.value)
    assert "symbolic link" in msg and "good" in msg, msg  # says why and what there is instead
    assert "hunter2" not in msg and "password" not in msg, msg
    assert engine.global_steps == steps + 1
    # A symlink to a tag-shaped file is refused the same way: tier never follows latest.
    tagged = tmp_path / "tag.txt"
    tagged.write_text("good")
    os.unlink(ckpt / "latest")
    os.symlink(str(tagged), str(ckpt / "latest"))
    with pytest.raises(ValueError, match="symbolic link"):
        engine.load_checkpoint(str(ckpt))
    engine.load_checkpoint(str(ckpt), tag="good")  # the checkpoint itself is fine
    assert engine.global_steps == steps


@pytest.mark.parametrize("content", [SECRET, "../" + "x" * 5000, "a\nb", "\x00\x01binary"])
def test_latest_holding_no_tag_is_refused_without_quoting_it(engine, tmp_path, content):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt), tag="good")
    os.unlink(ckpt / "latest")
    (ckpt / "latest").write_text(content)
    with pytest.raises(ValueError, match="does not hold a tag") as info:
        engine.load_checkpoint(str(ckpt))
    msg = str(info.value)
    assert "hunter2" not in msg and "xxxxx" not in msg and "binary" not in msg, msg
    assert len(msg) < 600


def test_latest_that_is_a_fifo_is_refused_without_blocking(engine, tmp_path):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt), tag="good")
    os.unlink(ckpt / "latest")
    os.mkfifo(ckpt / "latest")
    with pytest.raises(ValueError, match="not a regular file"):
        engine.load_checkpoint(str(ckpt))


def test_a_version_directory_that_is_a_symlink_is_not_followed(engine, tmp_path):
    kc.train_step(engine)
    real = os.path.realpath(engine.save_checkpoint(str(tmp_path / "elsewhere"), tag="t"))  # valid, outside
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    version = os.path.basename(real)  # t~<version>: a name tier's own pattern accepts
    os.symlink(real, ckpt / version)
    os.symlink(version, ckpt / "t")
    with pytest.raises(FileNotFoundError, match="no checkpoint tagged 't'"):
        engine.load_checkpoint(str(ckpt), tag="t")


def test_a_huge_tag_is_quoted_cut_short(engine, tmp_path):
    with pytest.raises(ValueError, match="plain name") as info:
        engine.load_checkpoint(str(tmp_path), tag="x/" * 100_000)
    assert len(str(info.value)) < 600


# ---------------------------------------------------------------------------- from_pretrained
transformers = pytest.importorskip("transformers")


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def sharded(tmp_path):
    folder = tmp_path / "model"
    tiny_llama().save_pretrained(str(folder), safe_serialization=True, max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    return folder, index


def rewrite_index(folder, index):
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "dotdot-inside"])
def test_shard_index_entries_leading_out_of_the_folder_are_refused(swap_dir, tmp_path, where):
    folder, index = sharded(tmp_path)
    name, shard = next(iter(index["weight_map"].items()))
    outside = tmp_path / "outside.safetensors"
    os.rename(folder / shard, outside)  # the old loader read it from there
    target = {"dotdot": "../outside.safetensors", "absolute": str(outside),
              "dotdot-inside": "sub/../../outside.safetensors"}[where]
    index["weight_map"] = {k: (target if v == shard else v) for k, v in index["weight_map"].items()}
    rewrite_index(folder, index)
    with pytest.raises(ValueError, match="not a file name inside the model folder") as info:
        tier.torch.from_pretrained(str(folder), kc.config(swap_dir))
    assert "model.safetensors.index.json" in str(info.value)


def test_an_integer_tensor_for_a_float_parameter_is_refused_naming_it(swap_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    tiny_llama().save_pretrained(str(folder), safe_serialization=True)
    sd = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = (sd[name] * 1000).to(torch.int64)  # the old loader made these floats without a word
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor '{name}' is torch.int64 .*parameter is torch.float32"):
        tier.torch.from_pretrained(str(folder), kc.config(swap_dir))


def test_a_good_sharded_checkpoint_still_loads(swap_dir, tmp_path):
    folder, _ = sharded(tmp_path)
    engine = tier.torch.from_pretrained(str(folder), kc.config(swap_dir))
    want = tiny_llama().state_dict()
    got = engine.module_state_dict()
    for name in want:
        if name in got:
            assert torch.equal(got[name].float(), want[name].float()), name
    engine.destroy()


# ---------------------------------------------------------------------------- swap paths and errno
def test_a_nul_byte_in_a_swap_path_is_refused(tmp_path):
    cfg = kc.config(str(tmp_path / "swap"))
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "swap") + "\0/elsewhere"
    with pytest.raises(tier.InvalidArgument, match="NUL byte"):
        tier.torch.initialize(kc.make_model(), cfg)
    cfg = kc.config(str(tmp_path / "swap"))
    cfg["tier"]["swap_paths"] = [str(tmp_path / "a\0b")]
    with pytest.raises(ValueError, match="NUL byte"):
        tier.torch.initialize(kc.make_model(), cfg)
    assert not (tmp_path / "a").exists()


def test_no_space_carries_errno(tmp_path):
    cfg = copy.deepcopy(kc.config(str(tmp_path / "swap")))
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    cfg["tier"]["budgets"]["nvme"] = "1000T"  # more than any test machine's disk
    cfg["tier"]["io"] = {"preallocate": True}  # reserved up front (else the budget is only a cap)
    with pytest.raises(tier.NoSpace) as info:
        tier.torch.initialize(kc.make_model(), cfg)
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC, (e.errno, str(e))
    assert "needs" in str(e) and not str(e).startswith("[Errno")  # the message is tier's, whole
