"""Model code that streamed parameters used to break, trained under tier.torch (params and state
on NVMe, a device budget below the model) against plain PyTorch AdamW:

- Falcon (parallel attention): ``mlp_output += attention_output`` modifies a module's output in
  place;
- ALBERT: one layer's module run by every layer (its parameters fetched and released again and
  again in one step);
- a parameter on the root module;
- a module using another module's weight outside that module's forward (``F.linear(h,
  self.emb.weight)``, a hand-tied head);
- a module using its children's weights without calling them, through calls that save nothing of
  them for backward (Mamba's mixer: ``self.conv1d.weight.squeeze(1)``), with and without
  activation checkpointing;
- projections whose input is a leaf (a reentrant checkpoint's detached input, as Whisper's
  cross-attention reads the encoder's states), whose gradient autograd accumulates in no set order
  with the projections' own."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

import tier.torch  # noqa: E402
from test_torch_llama import baseline_losses, batch, max_rel_diff, tier_config, tier_losses  # noqa: E402

STEPS = 3


def _falcon():
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=False, parallel_attn=True)
    return transformers.FalconForCausalLM(cfg)


def _albert():
    torch.manual_seed(0)
    cfg = transformers.AlbertConfig(vocab_size=512, embedding_size=32, hidden_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)
    return transformers.AlbertForMaskedLM(cfg)


def _output(logits, labels):
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class _RootParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(256, 64)
        self.scale = torch.nn.Parameter(torch.ones(64))  # the root's own
        self.head = torch.nn.Linear(64, 256)

    def forward(self, input_ids, labels):
        return _output(self.head(self.emb(input_ids) * self.scale), labels)


class _BorrowedWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(256, 64)
        self.mids = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for mid in self.mids:
            h = torch.tanh(mid(h))
        return _output(F.linear(h, self.emb.weight), labels)  # the embedding's weight, outside its forward


class _Mixer(torch.nn.Module):
    """Mamba's mixer, in small: the forward uses its children's parameters without calling their
    forwards, through calls that save nothing of them for backward (`weight.squeeze(1)`), and one
    that hands back the parameter itself (`bias.float()` in fp32)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(64, 64, kernel_size=4, groups=64, padding=3)
        self.dt = torch.nn.Linear(64, 64)

    def forward(self, h):
        seq = h.shape[1]
        w = self.conv.weight.squeeze(1)  # (64, 4)
        x = F.conv1d(h.transpose(1, 2), w.unsqueeze(1), self.conv.bias, padding=3, groups=64)[..., :seq]
        t = self.dt.weight @ x  # (B, 64, seq)
        return torch.tanh(t.transpose(1, 2) + self.dt.bias.float())


class _ChildWeightsInAParentsForward(torch.nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.emb = torch.nn.Embedding(256, 64)
        self.mixers = torch.nn.ModuleList(_Mixer() for _ in range(2))
        self.head = torch.nn.Linear(64, 256)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for mixer in self.mixers:
            # Recomputed in backward when checkpointed: the children's weights are brought again.
            h = torch.utils.checkpoint.checkpoint(mixer, h, use_reentrant=False) if self.checkpointed else mixer(h)
        return _output(self.head(h), labels)


class _CrossAttentionLike(torch.nn.Module):
    """Whisper's decoder layer under reentrant checkpointing, in small: two projections without
    bias read the same input, which the recompute sees as a leaf (the checkpoint detaches its
    inputs), so that input's gradient is accumulated beside the projections' weights, in no set
    order."""

    def __init__(self):
        super().__init__()
        self.k = torch.nn.Linear(64, 64, bias=False)
        self.v = torch.nn.Linear(64, 64, bias=False)

    def forward(self, h):
        return torch.tanh(self.k(h)) * self.v(h)


class _LeafInputsCheckpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(256, 64)
        self.blocks = torch.nn.ModuleList(_CrossAttentionLike() for _ in range(2))
        self.head = torch.nn.Linear(64, 256)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return _output(self.head(h), labels)


# (the model, a device budget below its parameters that holds its largest modules)
MODELS = {
    "falcon": (_falcon, "160K"),
    "albert": (_albert, "160K"),
    "root_parameter": (_RootParameter, "96K"),
    "borrowed_weight": (_BorrowedWeight, "96K"),
    "child_weights_in_a_parents_forward": (_ChildWeightsInAParentsForward, "96K"),
    "child_weights_checkpointed": (lambda: _ChildWeightsInAParentsForward(checkpointed=True), "96K"),
    "leaf_inputs_checkpointed": (_LeafInputsCheckpointed, "96K"),
}


@pytest.mark.parametrize("overlap", ["serial", "exact"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_code_trains_as_plain_pytorch(swap_dir, name, overlap):
    make, budget = MODELS[name]
    expected = baseline_losses(STEPS, make=make)
    cfg = tier_config(swap_dir, device_budget=budget)
    cfg["tier"]["optimizer"]["overlap"] = overlap
    engine, *_ = tier.torch.initialize(make(), cfg)
    model_bytes = sum(slot.numel * 4 for slot in engine._slots)
    assert engine.stats()["tiers"]["device"]["budget_bytes"] < model_bytes, "the parameters must stream"
    got = tier_losses(engine, STEPS)
    metrics = engine.stats()["metrics"]
    brought = engine._fetch_on_use.brought
    engine.destroy()
    assert max_rel_diff(got, expected) <= 1e-5, (got, expected)
    assert metrics["prefetch.order_changes"] == 0
    if name in ("borrowed_weight", "child_weights_in_a_parents_forward", "child_weights_checkpointed"):
        assert brought > 0, "the borrowed weight is brought for the call that uses it"


def test_frozen_modules_with_leaf_inputs_are_released_in_backward(swap_dir):
    """Frozen modules whose inputs are leaves (a reentrant checkpoint's), under `loss.backward()`
    of the caller's own: the gradient reaching the leaf input releases them during backward (they
    have no final gradient to do it), so the next layers' fetches find room in a device budget
    that does not hold every layer, and nothing is left fetched after step()."""
    model = _LeafInputsCheckpointed()
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    engine, *_ = tier.torch.initialize(model, tier_config(swap_dir, gas=1, device_budget="96K"))
    for i in range(3):
        engine(**batch(i)).loss.backward()
        engine.step()
        held = [s.name for s in engine._slots if s.fetches or s.backward_fetches or s.recompute_holds]
        assert not held, f"still fetched after step {i}: {held}"
    engine.destroy()
