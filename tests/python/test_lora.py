"""LoRA through tier.torch: a peft model whose frozen base weights are homed on NVMe and streamed
to a device smaller than the model, the adapters trained by the offloaded optimizer. Same losses
as plain PEFT with torch AdamW; no gradients or optimizer state for the frozen weights; the saved
adapter loads into plain PEFT and gives the same logits."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import tier.torch  # noqa: E402
from test_torch_llama import LR, SEQ, VOCAB, batch, make_model, max_rel_diff, tier_config  # noqa: E402


def make_qwen2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ * 2,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2ForCausalLM(cfg)


FAMILIES = {"llama": make_model, "qwen2": make_qwen2}


def with_lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(1)
    return peft.get_peft_model(model, cfg)


def peft_losses(family, steps, gas=2):
    model = with_lora(FAMILIES[family]())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for step in range(steps):
        for micro in range(gas):
            out = model(**batch(step * gas + micro))
            losses.append(out.loss.item())
            (out.loss / gas).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_streams_frozen_weights_and_matches_plain_peft(family, swap_dir, tmp_path):
    steps = 4
    expected = peft_losses(family, steps)
    model = with_lora(FAMILIES[family]())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    engine, *_ = tier.torch.initialize(model, tier_config(swap_dir, gas=2))
    got = []
    for step in range(steps):
        for micro in range(2):
            out = engine(**batch(step * 2 + micro))
            got.append(out.loss.item())
            engine.backward(out.loss)
            engine.step()
    assert max_rel_diff(got, expected) <= 1e-5, (got, expected)

    native = engine.native
    infos = [native.info(i) for i in range(len(native))]
    # Engine tensors: the model's parameters, their gradients (grad/...) and tier's own (tier/...,
    # the optimizer's pipeline buffers inside the host budget).
    params = {i["name"]: i for i in infos if not i["name"].startswith(("grad/", "tier/"))}
    grads = [i for i in infos if i["name"].startswith("grad/")]
    # Optimizer state and gradients only for the adapters; the frozen base weights live on NVMe.
    assert engine.stats()["optimizer"]["elements"] == trainable < total // 10
    assert grads and all("lora_" in g["name"] for g in grads)
    frozen = [name for name in params if "lora_" not in name]
    assert frozen and all(params[name]["home"] == "nvme" for name in frozen)
    stats = engine.stats()
    assert stats["tiers"]["device"]["budget_bytes"] < total * 4  # the model does not fit on the device
    assert stats["links"]["nvme_to_host"]["bytes"] > 0 and stats["links"]["host_to_device"]["bytes"] > 0

    # The adapter saved through PEFT loads into a plain model and computes the same logits.
    out_dir = tmp_path / "adapter"
    engine.module.save_pretrained(str(out_dir))
    probe = batch(99)["input_ids"]
    with torch.no_grad():
        mine = engine(input_ids=probe).logits
    plain = peft.PeftModel.from_pretrained(FAMILIES[family](), str(out_dir))
    with torch.no_grad():
        ref = plain(input_ids=probe).logits
    assert torch.allclose(mine, ref, rtol=1e-5, atol=1e-5), (mine - ref).abs().max()
    engine.destroy()
