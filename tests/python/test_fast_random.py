"""tier.torch.fast_random and tier.torch.init(fast_random=True): random weights from tier's
counter-based generator, keyed by parameter; a model built into the engine has the weights of the
same model built eagerly in the context, and each weight is written to the engine once. And what
init does with writes to parameters it has already staged (PEFT's adapters)."""

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from test_torch_llama import tier_config  # noqa: E402


def cfg(swap_dir):
    return tier_config(swap_dir, gas=1, device_budget="4M")


def llama(tied=False):
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)


def neox():
    return transformers.GPTNeoXConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64)


def opt():
    # An embedding with a padding row zeroed after its draw, learned positions, biases.
    return transformers.OPTConfig(vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                  pad_token_id=1)


def gpt2():
    # Conv1D layers, and an init of the block that rescales its children's c_proj weights.
    return transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)


def t5():
    # Encoder-decoder, one embedding shared by both stacks and the output; its model's init sets
    # its children's weights from the block level.
    return transformers.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)


def bloom():
    return transformers.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4)


def _auto(hf_config):
    if hf_config.is_encoder_decoder:
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


def eager(hf_config, seed=0):
    with tier.torch.fast_random(seed) as ctx:
        model = _auto(hf_config).from_config(hf_config)
    assert ctx.draws > 0
    return model


def test_draws_depend_on_the_seed_and_the_parameter_not_on_the_order():
    def two_layers(order, seed=5):
        with tier.torch.fast_random(seed):
            a, b = torch.nn.Linear(64, 32), torch.nn.Linear(32, 16)
            for layer in order(a, b):
                torch.nn.init.normal_(layer.weight, std=0.02)
        return a.weight.detach().clone(), b.weight.detach().clone()

    forward = two_layers(lambda a, b: (a, b))
    backward = two_layers(lambda a, b: (b, a))
    assert torch.equal(forward[0], backward[0]) and torch.equal(forward[1], backward[1])
    other = two_layers(lambda a, b: (a, b), seed=6)
    assert not torch.equal(forward[0], other[0])
    assert not torch.equal(forward[0].flatten()[:512], forward[1].flatten()[:512])  # each its own stream
    w = forward[0]
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    # A constructor's uniform draw (kaiming) stays inside its bound.
    with tier.torch.fast_random(1):
        layer = torch.nn.Linear(100, 50, dtype=torch.bfloat16)
    bound = 1 / 100 ** 0.5
    assert layer.weight.abs().max().item() <= bound * 1.01 and layer.weight.float().std().item() > bound / 2


def test_an_explicit_generator_other_devices_and_outside_the_context_stay_torch():
    before = torch.Tensor.normal_
    g = torch.Generator().manual_seed(3)
    want = torch.empty(100).normal_(generator=g)
    with tier.torch.fast_random(0) as ctx:
        got = torch.empty(100).normal_(generator=torch.Generator().manual_seed(3))
        with pytest.raises(RuntimeError, match="do not nest"):
            tier.torch.fast_random(1).__enter__()
        ints = torch.empty(4, dtype=torch.float64).uniform_()  # float64: PyTorch's
    assert torch.equal(got, want) and ctx.draws == 0 and ints.dtype == torch.float64
    assert torch.Tensor.normal_ is before


@pytest.mark.parametrize("make, rewrites", [(llama, False), (lambda: llama(tied=True), False), (neox, False),
                                            (opt, False), (gpt2, True), (t5, True), (bloom, False)],
                         ids=["llama", "llama-tied", "gpt-neox", "opt", "gpt2", "t5", "bloom"])
def test_a_model_built_under_init_has_the_eager_fast_random_weights_written_once(swap_dir, make, rewrites):
    expected = {n: p.detach().clone() for n, p in eager(make()).named_parameters()}
    torch.manual_seed(123)  # fast_random's seed is given: torch's global one does not matter
    with tier.torch.init(cfg(swap_dir), fast_random=True, seed=0) as ctx:
        model = _auto(make()).from_config(make())
    assert all(p.device.type == "meta" for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Each weight is drawn as its module's construction ends and written once (the constructor's
    # own draw, which transformers' init replaces, is never made): nothing written beyond the
    # staged tensors (with tied embeddings, also the embeddings a tie replaced after they were
    # built: the output layer's, T5's per-stack ones). GPT-2's and T5's block-level init sets
    # children's weights, which are written again.
    extra = ctx.store.staged_bytes - model_bytes
    assert extra % (96 * 64 * 4) == 0 and (extra > 0) == bool(model.config.tie_word_embeddings), extra
    if rewrites:
        assert ctx.store.staged_bytes < ctx.store.written_bytes < 2 * ctx.store.staged_bytes
    else:
        assert ctx.store.written_bytes == ctx.store.staged_bytes
    assert ctx.fast_random.deferred > 0
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    for slot in engine._slots:
        assert torch.equal(engine.parameter(slot.name), expected[slot.name]), slot.name
    if isinstance(model.config, transformers.OPTConfig):
        assert engine.parameter("model.decoder.embed_tokens.weight")[1].abs().max() == 0  # the padding row


class _Custom(torch.nn.Module):
    """Draws, then edits part of what it drew; draws twice into one tensor; a truncated normal
    (a uniform draw, then arithmetic on it); a draw with its own generator."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(16, 8))
        self.b = torch.nn.Parameter(torch.empty(32))
        self.c = torch.nn.Parameter(torch.empty(8, 8))
        self.d = torch.nn.Parameter(torch.empty(8))
        with torch.no_grad():
            torch.nn.init.normal_(self.a, std=0.5)
            self.a[0].zero_()
            self.a.mul_(2)
            self.b.uniform_(-1, 1)
            self.b.normal_()
            torch.nn.init.trunc_normal_(self.c, std=0.1, a=-0.2, b=0.2)
            self.d.normal_(generator=torch.Generator().manual_seed(9))


def test_a_deferred_draw_is_made_before_anything_else_touches_the_parameter(swap_dir):
    with tier.torch.fast_random(4):
        want = _Custom()
    assert want.a[0].abs().max() == 0 and want.a[1].std() > 0.5 and want.c.abs().max() <= 0.2
    with tier.torch.init(cfg(swap_dir), fast_random=True, seed=4):
        model = _Custom()
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    for slot in engine._slots:
        name = slot.name.split(".")[-1]
        assert torch.equal(engine.parameter(slot.name), getattr(want, name).detach()), slot.name


@pytest.mark.parametrize("fast", [False, True], ids=["torch-generator", "tier-generator"])
def test_lora_adapters_added_under_init_start_as_peft_makes_them(swap_dir, fast):
    """PEFT zeroes each LoRA B matrix and redraws A after their modules are built, when tier has
    already staged them: those writes reach the engine (B was left at the constructor's draw
    before, so the adapted model did not start as the base)."""
    peft = pytest.importorskip("peft")

    def build():
        model = transformers.AutoModelForCausalLM.from_config(llama())
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(model, lora, autocast_adapter_dtype=False)

    torch.manual_seed(0)
    with tier.torch.fast_random(0) if fast else contextlib.nullcontext():
        want = {n: p.detach().clone() for n, p in build().named_parameters()}
    torch.manual_seed(0)
    with tier.torch.init(cfg(swap_dir), fast_random=fast, seed=0):
        model = build()
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    names = [s.name for s in engine._slots]
    assert sum("lora_B" in n for n in names) == 4
    for name in names:
        got = engine.parameter(name)
        assert torch.equal(got, want[name]), name
        if "lora_B" in name:
            assert got.abs().max() == 0


def test_a_write_after_construction_reaches_the_engine_and_a_partial_one_is_refused(swap_dir):
    with tier.torch.init(cfg(swap_dir)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        with torch.no_grad():
            torch.nn.init.ones_(model[0].weight)
            model[1].bias.fill_(3.0)
            model[0].weight.requires_grad_(False)  # a flag, not a write: nothing read back
            with pytest.raises(RuntimeError, match="part of a parameter already staged"):
                model[1].weight[0].zero_()
    assert model[0].weight.device.type == "meta" and not model[0].weight.requires_grad
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    assert torch.equal(engine.parameter("0.weight"), torch.ones(8, 8))
    assert torch.equal(engine.parameter("1.bias"), torch.full((2,), 3.0))


class _LateConfig(transformers.PretrainedConfig):
    model_type = "tier_late_attr_test"


class _LateAttributeModel(transformers.PreTrainedModel):
    """Its init needs an attribute set after its layers are built: the early init of a layer
    draws, then fails, and is left to post_init, which must draw what an eager build draws."""

    config_class = _LateConfig

    def __init__(self, config):
        super().__init__(config)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 8)
        self.scale = 0.05
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            module.weight.data.mul_(self.scale / 0.02)
            torch.nn.init.zeros_(module.bias)


def test_an_early_init_that_fails_is_left_to_post_init_with_its_draws_undone(swap_dir):
    with tier.torch.fast_random(0):
        want = {n: p.detach().clone() for n, p in _LateAttributeModel(_LateConfig()).named_parameters()}
    with tier.torch.init(cfg(swap_dir), fast_random=True, seed=0):
        model = _LateAttributeModel(_LateConfig())
    engine, *_ = tier.torch.initialize(model, cfg(swap_dir))
    for slot in engine._slots:
        assert torch.equal(engine.parameter(slot.name), want[slot.name]), slot.name
    assert abs(want["a.weight"].std().item() - 0.05) < 0.01
