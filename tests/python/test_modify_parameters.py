"""engine.modify_parameters: editing parameters after initialize (the role of DeepSpeed's
zero.GatheredParameters). Outside it a parameter is an empty placeholder, so an in-place edit of
``model.lm_head.weight`` changes nothing; inside it the parameter holds its values, and what the
block changed is written to the engine and to the fp32 master the next step starts from."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tier.torch  # noqa: E402
from test_torch_llama import LR, batch, make_model, tier_config  # noqa: E402


def _edit(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
        model.model.norm.weight.add_(0.25)


def test_an_edit_in_the_block_is_what_forward_and_the_next_step_start_from(swap_dir):
    ref = make_model()
    _edit(ref)
    model = make_model()
    engine, _, _, _ = tier.torch.initialize(model, tier_config(swap_dir, gas=1))
    with engine.modify_parameters([model.lm_head.weight, "model.norm.weight"]):
        assert model.lm_head.weight.shape == ref.lm_head.weight.shape  # the values, not the placeholder
        _edit(model)
    masters = engine.state_dict_fp32()
    for name, p in ref.named_parameters():
        assert torch.equal(masters[name], p.detach()), name
    # A step from there is torch's AdamW step from the edited model.
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(2):
        b = batch(step)
        out = engine(**b)
        engine.backward(out.loss)
        engine.step()
        ref_loss = ref(**b).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    engine.destroy()


def test_what_the_block_did_not_change_keeps_its_fp32_master_exactly(swap_dir):
    """In bf16 the block shows the bf16 values; a parameter left alone keeps its fp32 master bit
    for bit (it is not written back from bf16), and one that changed takes the edit."""
    engine, _, _, _ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=1, dtype="bf16"))
    b = batch(0)
    engine.backward(engine(**b).loss)
    engine.step()  # masters now hold more than bf16 can
    before = engine.state_dict_fp32()
    model = engine.module
    with engine.modify_parameters():
        assert model.model.norm.weight.dtype == torch.bfloat16
        with torch.no_grad():
            model.model.norm.weight.fill_(2.0)
    after = engine.state_dict_fp32()
    for name in before:
        if name == "model.norm.weight":
            assert torch.equal(after[name], torch.full_like(before[name], 2.0))
        else:
            assert torch.equal(after[name], before[name]), name
    engine.destroy()


def test_a_block_that_fails_or_reshapes_writes_nothing(swap_dir):
    model = make_model()
    engine, _, _, _ = tier.torch.initialize(model, tier_config(swap_dir, gas=1))
    before = engine.state_dict_fp32()
    with pytest.raises(RuntimeError, match="boom"):
        with engine.modify_parameters([model.lm_head.weight]):
            with torch.no_grad():
                model.lm_head.weight.mul_(3.0)
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="nothing was written"):
        with engine.modify_parameters(["lm_head.weight", "model.norm.weight"]):
            model.lm_head.weight.data = torch.zeros(2, 2)
    with pytest.raises(KeyError, match="not a parameter"):
        with engine.modify_parameters(["no.such.weight"]):
            pass
    after = engine.state_dict_fp32()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.lm_head.weight.numel() == model.model.norm.weight.numel() == 0  # the placeholders are back
    engine.destroy()


def test_across_ranks_the_modifier_ranks_edit_is_the_one_kept(tmp_path):
    """Stage 3 on 2 ranks, modifier_rank 1: rank 1 halves lm_head, rank 0 multiplies it by 7 (not
    kept). The masters and the logits after it are those of one process that halves it."""
    from test_hf_trainer import make_model as small_model, _run_trainer_ranks

    one = _run_trainer_ranks(tmp_path, 1, "one", mode="modify")
    two = _run_trainer_ranks(tmp_path, 2, "two", mode="modify")
    assert two["world"] == 2
    halved = (small_model().lm_head.weight.detach() * 0.5).flatten()
    assert torch.equal(torch.tensor(one["lm_head"]), halved)
    assert two["lm_head"] == one["lm_head"] and two["logits"] == one["logits"]


def test_resizing_the_embeddings_after_initialize_is_refused_with_the_way_that_works(swap_dir):
    model = make_model()
    engine, _, _, _ = tier.torch.initialize(model, tier_config(swap_dir, gas=1))
    with pytest.raises(RuntimeError, match="resize the model before initialize"):
        engine.module.resize_token_embeddings(model.config.vocab_size + 2)
    out = engine(**batch(0))  # the engine is as it was
    assert torch.isfinite(out.loss)
    engine.destroy()


def test_an_edit_of_a_placeholder_is_not_lost_without_a_word(swap_dir):
    """Outside a forward (and outside modify_parameters) a parameter is an empty placeholder: an
    in-place edit of it changes nothing the engine holds. The next forward that needs it says so
    instead of running as if the edit had applied; after that the engine runs on, unchanged."""
    model = make_model()
    engine, _, _, _ = tier.torch.initialize(model, tier_config(swap_dir, gas=1))
    before = engine.state_dict_fp32()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="lm_head.weight was changed in place.*modify_parameters"):
        engine(**batch(0))
    out = engine(**batch(0))  # said once; nothing changed
    engine.backward(out.loss)
    engine.step()
    assert not torch.equal(engine.state_dict_fp32()["lm_head.weight"], before["lm_head.weight"] * 0.5)
    engine.destroy()
