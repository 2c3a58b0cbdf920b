"""tier.torch.init, from_pretrained and save_pretrained: models built, loaded and saved without
holding them whole, with the same losses and logits as the eager path."""

import json
import time
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from test_torch_llama import TORCH_DEVICE, batch, tier_config  # noqa: E402

STEPS = 4


def llama_config(tied=True):
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )


def neox_config():
    # Another family: LayerNorm with biases, fused QKV, untied output embedding.
    return transformers.GPTNeoXConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )


def build(hf_config, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config)


def losses(engine, steps=STEPS):
    out = []
    for i in range(steps):
        b = batch(i)
        b = {k: v % engine.module.config.vocab_size for k, v in b.items()}
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def cfg(swap_dir):
    return tier_config(swap_dir, gas=1, device_budget="4M")


@pytest.mark.parametrize("make_config", [llama_config, neox_config], ids=["llama-tied", "gpt-neox"])
def test_a_model_built_under_init_trains_exactly_like_the_eager_one(swap_dir, make_config):
    expected = losses(tier.torch.initialize(build(make_config()), cfg(swap_dir))[0])
    torch.manual_seed(0)
    with tier.torch.init(cfg(swap_dir)):
        model = transformers.AutoModelForCausalLM.from_config(make_config())
    params = list(model.parameters())
    assert params and all(p.device.type == "meta" for p in params), "parameters must be staged, not held"
    assert all(b.device.type == "cpu" for b in model.buffers())
    got = losses(tier.torch.initialize(model, cfg(swap_dir))[0])
    assert got == expected  # same random numbers drawn in the same order, same arithmetic


def test_building_under_init_writes_each_weight_about_twice_not_once_per_level(swap_dir):
    """Construction stages each weight once; transformers' init visits every module after its
    children and brings the children's weights again: only values that changed are written back,
    so a model costs about twice its bytes to build, not once per level of the module tree."""
    with tier.torch.init(cfg(swap_dir)) as ctx:
        model = transformers.AutoModelForCausalLM.from_config(llama_config(tied=False))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes <= ctx.store.written_bytes <= 2 * model_bytes, (ctx.store.written_bytes, model_bytes)


def test_init_keeps_ties_and_drops_staging_copies(swap_dir):
    with tier.torch.init(cfg(swap_dir)) as ctx:
        model = transformers.AutoModelForCausalLM.from_config(llama_config(tied=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    staged = ctx.store.staged_bytes
    assert staged >= sum(p.numel() * 4 for p in model.parameters())
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    assert ctx.store.staged_bytes == 0 and not ctx.store.live
    assert engine.native is ctx.store.native


def test_init_restores_torch_and_refuses_a_different_engine_config(swap_dir, tmp_path):
    before = torch.nn.Linear.__init__
    with tier.torch.init(cfg(swap_dir)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    assert torch.nn.Linear.__init__ is before
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # outside the context: ordinary modules
    other = str(tmp_path / "other")
    os.makedirs(other)
    with pytest.raises(ValueError, match="same config"):
        tier.torch.initialize(model, cfg(other))


def test_a_plain_torch_model_built_under_init_matches_eager(swap_dir):
    def make():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    eager = make()
    expected = [p.detach().clone() for p in eager.parameters()]
    with tier.torch.init(cfg(swap_dir)):
        model = make()
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    got = [engine.parameter(s.name) for s in engine._slots]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_meta_parameter_without_values_is_refused(swap_dir):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta tensor"):
        tier.torch.initialize(model, cfg(swap_dir))


@pytest.mark.parametrize("shard", ["40KB", "100MB"], ids=["sharded", "single-file"])
@pytest.mark.parametrize("make_config", [llama_config, neox_config], ids=["llama-tied", "gpt-neox"])
def test_from_pretrained_trains_like_the_eager_model(swap_dir, tmp_path, shard, make_config):
    src = str(tmp_path / "src")
    build(make_config()).save_pretrained(src, max_shard_size=shard)
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json")) == (shard == "40KB")
    expected = losses(tier.torch.initialize(build(make_config()), cfg(swap_dir))[0])
    got = losses(tier.torch.from_pretrained(src, cfg(swap_dir)))
    assert got == expected


def test_from_pretrained_reads_a_bf16_checkpoint(swap_dir, tmp_path):
    src = str(tmp_path / "src")
    build(llama_config()).to(torch.bfloat16).save_pretrained(src)
    engine = tier.torch.from_pretrained(src, cfg(swap_dir))
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for slot in engine._slots:
        assert torch.equal(engine.parameter(slot.name), ref.get_parameter(slot.name).detach())


def test_a_checkpoint_in_the_compute_dtype_is_read_straight_into_the_engine(swap_dir, tmp_path, monkeypatch):
    """A bf16 checkpoint loaded to compute in bf16: every parameter is read from the file into the
    engine's host copy (register(fill=...)), none through the loader's buffers; the values are the
    file's, and training gives the losses of the same load through the buffers."""
    from tier.torch import hf

    src = str(tmp_path / "src")
    model = build(llama_config()).to(torch.bfloat16)
    model.save_pretrained(src, max_shard_size="40KB")
    config = dict(cfg(swap_dir), bf16={"enabled": True})
    calls = {"read_into": 0, "buffered": 0}
    read_into, tensor = hf.CheckpointReader.read_into, hf._ReadAhead.tensor

    def counted_read_into(self, *a):
        calls["read_into"] += 1
        return read_into(self, *a)

    def counted_tensor(self, *a):
        calls["buffered"] += 1
        return tensor(self, *a)

    monkeypatch.setattr(hf.CheckpointReader, "read_into", counted_read_into)
    monkeypatch.setattr(hf._ReadAhead, "tensor", counted_tensor)
    engine = tier.torch.from_pretrained(src, config)
    assert calls == {"read_into": len(engine._slots), "buffered": 0}
    for slot in engine._slots:
        assert torch.equal(engine.parameter(slot.name), model.get_parameter(slot.name).detach())
    got = losses(engine, steps=2)
    engine.close()
    monkeypatch.delattr(hf._StoredValue, "read_into")  # the engine takes tensors instead
    calls.update(read_into=0, buffered=0)
    buffered = tier.torch.from_pretrained(src, config)
    assert calls == {"read_into": 0, "buffered": len(buffered._slots)}
    assert losses(buffered, steps=2) == got


@pytest.mark.parametrize("shard", ["30KB", "5GB"], ids=["sharded", "single-file"])
@pytest.mark.parametrize("make_config", [llama_config, neox_config], ids=["llama-tied", "gpt-neox"])
def test_save_pretrained_reloads_in_plain_transformers_with_the_same_logits(swap_dir, tmp_path, shard, make_config):
    engine, *_ = tier.torch.initialize(build(make_config()), cfg(swap_dir))
    losses(engine, 2)
    out = str(tmp_path / "out")
    written = engine.save_pretrained(out, max_shard_size=shard)
    assert "config.json" in written
    if shard == "30KB":
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        assert len(set(index["weight_map"].values())) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out).to(TORCH_DEVICE)
    ids = batch(9)["input_ids"] % engine.module.config.vocab_size
    with torch.no_grad():
        ours = engine(input_ids=ids).logits.float()
        theirs = back(input_ids=ids).logits.float()
    assert (ours - theirs).abs().max().item() <= 1e-6


def test_save_pretrained_fp32_writes_the_masters_and_a_new_save_replaces_old_shards(swap_dir, tmp_path):
    engine, *_ = tier.torch.initialize(build(llama_config()), tier_config(swap_dir, gas=1, device_budget="4M", dtype="bf16"))
    losses(engine, 2)
    out = str(tmp_path / "out")
    engine.save_pretrained(out, max_shard_size="30KB", dtype="fp32")
    masters = engine.state_dict_fp32()
    from safetensors.torch import load_file

    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    for name, fname in index["weight_map"].items():
        if name in masters:
            assert torch.equal(load_file(os.path.join(out, fname))[name], masters[name])
    engine.save_pretrained(out)  # bf16, one file
    files = sorted(f for f in os.listdir(out) if f.startswith("model"))
    assert files == ["model.safetensors"]
    back = load_file(os.path.join(out, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in back.values())


def test_from_pretrained_errors_name_the_file_and_the_tensor(swap_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        tier.torch.from_pretrained(str(tmp_path / "nowhere"), cfg(swap_dir))
    empty = tmp_path / "empty"
    empty.mkdir()
    llama_config().save_pretrained(str(empty))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        tier.torch.from_pretrained(str(empty), cfg(swap_dir))

    from safetensors.torch import load_file, save_file

    src = str(tmp_path / "src")
    build(llama_config()).save_pretrained(src)
    weights = os.path.join(src, "model.safetensors")
    tensors = load_file(weights)

    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, weights, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        tier.torch.from_pretrained(src, cfg(swap_dir))

    wrong = dict(tensors)
    wrong["model.norm.weight"] = torch.ones(65)
    save_file(wrong, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[65\]"):
        tier.torch.from_pretrained(src, cfg(swap_dir))

    save_file(tensors, weights, metadata={"format": "pt"})
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        tier.torch.from_pretrained(src, cfg(swap_dir))


def test_staged_parameters_become_the_engine_tensors_without_a_copy(swap_dir):
    """Built under init in the compute dtype, each parameter's staging tensor is renamed into its
    engine tensor: initialize reads back only what the optimizer needs (the trainable parameters'
    fp32 masters) and writes no parameter again, so a 7B model is written once, as it is built."""
    torch.manual_seed(0)
    with tier.torch.init(cfg(swap_dir)) as ctx:
        model = transformers.AutoModelForCausalLM.from_config(llama_config())
    for name, p in model.named_parameters():
        p.requires_grad_(name == "model.norm.weight")  # a frozen base, one small trainable tensor
    staged_ids = set(ctx.store.live)
    acquires = json.loads(ctx.store.native.stats_json())["metrics"]["engine.acquires"]
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    reads = json.loads(engine.native.stats_json())["metrics"]["engine.acquires"] - acquires
    # The trainable tensor's read and the optimizer's pipeline buffers (host reservations); a copy
    # would read every parameter and write it again (44 acquires here).
    assert reads < len(engine._slots), f"initialize acquired {reads} tensors; only the trainable one is read"
    assert all(slot.tid in staged_ids for slot in engine._slots), "each parameter keeps its staging tensor"
    for slot in engine._slots:
        info = engine.native.info(slot.tid)
        assert info["name"] == slot.name and info["role"] == "param"


def test_the_checkpoint_reader_reads_every_dtype_without_mapping_the_files(tmp_path):
    """The reader gives safetensors' own values for each dtype, and reads the files instead of
    memory-mapping them: a mapped shard counts every page touched in the process's resident memory
    (16 GB loading a 7B model with a 2 GiB host budget), a read leaves them to the page cache."""
    from safetensors.torch import save_file

    from tier.torch.hf import CheckpointReader

    g = torch.Generator().manual_seed(3)
    tensors = {
        "a.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.fp16": torch.randn(7, generator=g).to(torch.float16),
        "c.fp32": torch.randn(2, 2, 2, generator=g),
        "d.i64": torch.arange(5, dtype=torch.int64),
        "e.u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "f.bool": torch.tensor([True, False, True]),
        "g.scalar": torch.tensor(2.5),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    reader = CheckpointReader(str(tmp_path))
    for name, t in tensors.items():
        got = reader.tensor(name, t.shape)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()

    # A file cut inside its last tensor's bytes is refused when opened, naming it.
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file .*ends at byte"):
        CheckpointReader(str(tmp_path)).tensor("a.bf16", (3, 5))


def test_read_ahead_gives_each_tensor_in_and_out_of_the_expected_order(tmp_path):
    """from_pretrained reads the next parameter while the engine registers this one, into the
    other of two buffers: every answer is the file's tensor, whether the request was the expected
    one (read ahead) or not (read on the spot), and reading ahead never writes into the buffer of
    the answer in use."""
    from safetensors.torch import save_file

    from tier.torch.hf import CheckpointReader, _ReadAhead

    g = torch.Generator().manual_seed(4)
    tensors = {f"t{i}": torch.randn(100 + 37 * i, generator=g).to(torch.bfloat16) for i in range(6)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reader = CheckpointReader(str(tmp_path))
    order = [(f"t{i}", tensors[f"t{i}"].shape) for i in range(6)]
    ahead = _ReadAhead(reader, [(n, tuple(s)) for n, s in order])
    try:
        for name in ["t0", "t1", "t3", "t2", "t3", "t4", "t5", "t0"]:
            got = ahead.tensor(name, tensors[name].shape)
            time.sleep(0.01)  # the read ahead of the next one runs meanwhile
            assert torch.equal(got, tensors[name]), name
    finally:
        ahead.close()
