"""The standard accelerate loop, with the real accelerate library, trains a tier engine exactly as
it trains the plain model: ``accelerator.prepare(engine, optimizer, loader, scheduler)``,
``accelerator.accumulate``, ``accelerator.backward`` and ``optimizer.step()`` at each boundary
(the optimizer ``initialize`` returns steps the engine), the LR scheduler, ``zero_grad``."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import tier.torch  # noqa: E402
from test_torch_llama import LR, batch, make_model, max_rel_diff, tier_config  # noqa: E402

STEPS = 4
GAS = 2


class _Batches(torch.utils.data.Dataset):
    def __len__(self):
        return STEPS * GAS

    def __getitem__(self, i):
        b = batch(i)
        return {k: v[0] for k, v in b.items()}, {k: v[1] for k, v in b.items()}


def _loader():
    # Each item is one micro-batch of 2 sequences (batch() makes them), kept in order.
    def collate(items):
        (a, b), = items
        return {k: torch.stack([a[k], b[k]]) for k in a}

    return torch.utils.data.DataLoader(_Batches(), batch_size=1, shuffle=False, collate_fn=collate)


def _loop(model, optimizer, scheduler, clip=None):
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=GAS, cpu=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, _loader(), scheduler)
    losses = _micro_steps(accelerator, model, optimizer, scheduler, loader, clip)
    accelerator.free_memory()
    return losses


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def test_the_accelerate_loop_trains_a_tier_engine_as_it_trains_the_model(swap_dir):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    expected = _loop(model, opt, _scheduler(opt))
    want = {name: p.detach().clone() for name, p in model.named_parameters()}

    cfg = tier_config(swap_dir, gas=1, clip=0.0)  # accumulation and its scaling are accelerate's
    cfg["tier"]["optimizer"]["overlap"] = "serial"
    engine, optimizer, _, _ = tier.torch.initialize(make_model(), cfg)
    got = _loop(engine, optimizer, _scheduler(optimizer))
    assert engine.global_steps == STEPS, "every boundary's optimizer.step() must step the engine"
    assert max_rel_diff(got, expected) <= 1e-5, (got, expected)
    # Every step's update, the last one included, with the scheduler's lr for it.
    got_params = engine.module_state_dict()
    for name, p in want.items():
        torch.testing.assert_close(got_params[name], p, rtol=1e-5, atol=2e-5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / (1 + STEPS))
    engine.destroy()


def test_a_loop_stepping_the_engine_itself_is_not_stepped_twice(swap_dir):
    """DeepSpeed's loop (engine.backward, engine.step) followed by the Trainer's optimizer.step():
    one update per step."""
    engine, optimizer, _, _ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=2))
    for i in range(4):
        out = engine(**batch(i))
        engine.backward(out.loss)
        engine.step()
        optimizer.step()
    assert engine.global_steps == 2
    engine.destroy()


def test_plain_backward_twice_then_the_optimizer_step_sums_both(swap_dir):
    """Two backwards of the caller's own, then optimizer.step(): one step with both gradients,
    whatever gradient_accumulation_steps says (the state in host memory takes them one at a time
    straight into the optimizer only under engine.backward())."""
    cfg = tier_config(swap_dir, gas=1, clip=0.0)
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    engine, optimizer, _, _ = tier.torch.initialize(make_model(), cfg)
    for i in range(2):
        (engine(**batch(i)).loss / 2).backward()
    optimizer.step()
    assert engine.global_steps == 1
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for i in range(2):
        (model(**batch(i)).loss / 2).backward()
    ref.step()
    got = engine.module_state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=2e-5)
    engine.destroy()


def _accelerate_engine(swap_dir, hooks):
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=GAS, cpu=True)
    if hooks:
        tier.torch.register_accelerate_hooks(accelerator)
    engine, optimizer, _, _ = tier.torch.initialize(make_model(), tier_config(swap_dir))
    scheduler = _scheduler(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(engine, optimizer, _loader(), scheduler)
    return accelerator, model, optimizer, list(loader), scheduler


def _micro_steps(accelerator, model, optimizer, scheduler, micros, clip=None):
    """accelerate's loop over `micros`; the loss of each."""
    losses = []
    for micro in micros:
        with accelerator.accumulate(model):
            out = model(**micro)
            losses.append(out.loss.item())
            accelerator.backward(out.loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses


def test_accelerate_save_state_and_load_state_resume_a_tier_engine_exactly(tmp_path, swap_dir):
    """With tier.torch.register_accelerate_hooks, accelerate's save_state writes the engine's tier
    checkpoint (masters, moments, counters) and load_state restores it: a run resumed from the
    state saved after 2 steps gives the uninterrupted run's last 2 steps bit for bit. Without the
    hooks load_state is refused with the way that works (the engine's load_state_dict), instead
    of a resume with fresh moments or torch's size mismatch on the placeholders."""
    acc, model, opt, micros, sched = _accelerate_engine(swap_dir, hooks=True)
    _micro_steps(acc, model, opt, sched, micros[: 2 * GAS])
    acc.save_state(str(tmp_path / "state"))
    assert (tmp_path / "state" / "tier_engine_0").is_dir()
    tail = _micro_steps(acc, model, opt, sched, micros[2 * GAS :])
    acc.free_memory()
    model.destroy()

    acc2, model2, opt2, _, sched2 = _accelerate_engine(swap_dir, hooks=True)
    acc2.load_state(str(tmp_path / "state"))
    assert _micro_steps(acc2, model2, opt2, sched2, micros[2 * GAS :]) == tail
    acc2.free_memory()
    model2.destroy()

    acc3, model3, _, _, _ = _accelerate_engine(swap_dir, hooks=False)
    acc3.save_state(str(tmp_path / "plain"))  # the gathered weights and the hyper-parameters
    with pytest.raises(RuntimeError, match="register_accelerate_hooks"):
        acc3.load_state(str(tmp_path / "plain"))
    acc3.free_memory()
    model3.destroy()


def test_save_pretrained_takes_transformers_keywords_and_refuses_what_it_cannot_honour(tmp_path, swap_dir):
    acc, model, _, _, _ = _accelerate_engine(swap_dir, hooks=False)
    engine = acc.unwrap_model(model)
    engine.save_pretrained(str(tmp_path / "a"), is_main_process=acc.is_main_process, save_function=acc.save,
                           state_dict=acc.get_state_dict(model))
    assert (tmp_path / "a" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="not the engine's"):
        engine.save_pretrained(str(tmp_path / "b"), state_dict={"other.weight": torch.zeros(1)})
    with pytest.raises(NotImplementedError, match="safetensors only"):
        engine.save_pretrained(str(tmp_path / "c"), safe_serialization=False)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    acc.free_memory()
    model.destroy()
