"""tier.torch's engine API as accelerate and the Hugging Face Trainer drive deepspeed.initialize and
DeepSpeedEngine: the 4-tuple, the boundary set from outside, the engine's query methods, gathered
weights for save_pretrained / save_16bit_model, the checkpoint keyword arguments, destroy()."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier  # noqa: E402
import tier.torch  # noqa: E402
from test_torch_llama import LR, batch, make_model, max_rel_diff, tier_config  # noqa: E402


def baseline(steps, gas, clip=1.0, schedule=None, skip_first=False):
    """Plain PyTorch AdamW: losses, the global grad norm before clipping and the lr of each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    losses, norms, lrs = [], [], []
    for step in range(steps):
        for micro in range(gas):
            out = model(**batch(step * gas + micro))
            losses.append(out.loss.item())
            (out.loss / gas).backward()
        lrs.append(opt.param_groups[0]["lr"])
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return losses, norms, lrs


def accelerate_replay(engine, steps, gas, optimizer=None, lr_scheduler=None):
    """accelerate's DeepSpeedEngineWrapper.backward as the Trainer reaches it: the boundary is set
    from outside before each backward, step() runs only at the boundary; then the Trainer's
    wrapped optimizer.step() and scheduler step (no-ops under DeepSpeed), get_global_grad_norm,
    get_last_lr and model.zero_grad()."""
    losses, norms, lrs, applied = [], [], [], []
    for step in range(steps):
        for micro in range(gas):
            sync = micro == gas - 1
            engine.set_gradient_accumulation_boundary(is_boundary=sync)
            out = engine(**batch(step * gas + micro))
            losses.append(out.loss.item())
            engine.backward(out.loss)
            if sync:
                lrs.append(engine.get_lr()[0])
                engine.step()
                applied.append(engine.was_step_applied())
                norms.append(engine.get_global_grad_norm())
                if optimizer is not None:
                    optimizer.step()  # the Trainer's call; the engine's step was the update
                engine.zero_grad()
    return losses, norms, lrs, applied


@pytest.mark.parametrize("gas", [2, 4])
def test_accelerate_call_pattern_matches_pytorch_adamw(swap_dir, gas):
    steps = 4
    expected, expected_norms, _ = baseline(steps, gas)
    engine, optimizer, loader, sched = tier.torch.initialize(
        model=make_model(), config_params=tier_config(swap_dir, gas=gas)
    )
    assert loader is None and sched is None
    losses, norms, _, applied = accelerate_replay(engine, steps, gas, optimizer)
    assert max_rel_diff(losses, expected) <= 1e-5, (losses, expected)
    assert max_rel_diff(norms, expected_norms) <= 1e-5, (norms, expected_norms)
    assert applied == [True] * steps
    # DeepSpeed counts step() calls as micro-steps; accelerate makes one per boundary.
    assert (engine.global_steps, engine.micro_steps) == (steps, steps)
    engine.destroy()


def test_trainer_with_client_adamw_and_lambda_scheduler(swap_dir):
    """What the Trainer passes for a config without optimizer and scheduler sections: its own AdamW
    and a LambdaLR over it; the engine runs both, the lr each step used is the schedule's."""
    gas, steps = 3, 4

    def schedule(i):
        return 1.0 / (1 + i)

    expected, expected_norms, expected_lrs = baseline(steps, gas, schedule=schedule)
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    client_sched = torch.optim.lr_scheduler.LambdaLR(client, schedule)
    cfg = tier_config(swap_dir, gas=gas)
    del cfg["optimizer"]
    engine, optimizer, _, sched = tier.torch.initialize(model, cfg, optimizer=client, lr_scheduler=client_sched)
    assert sched is client_sched and engine.lr_scheduler is client_sched
    losses, norms, lrs, _ = accelerate_replay(engine, steps, gas, optimizer)
    assert max_rel_diff(losses, expected) <= 1e-5
    assert max_rel_diff(norms, expected_norms) <= 1e-5
    assert lrs == pytest.approx(expected_lrs, rel=1e-12)
    assert sched.get_last_lr()[0] == pytest.approx(LR / (1 + steps))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / (1 + steps))


def test_a_scheduler_factory_gets_the_returned_optimizer(swap_dir):
    cfg = tier_config(swap_dir, gas=1)
    seen = []

    def factory(opt):
        seen.append(opt)
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    engine, optimizer, _, sched = tier.torch.initialize(make_model(), cfg, lr_scheduler=factory)
    assert seen == [optimizer] and sched.optimizer is optimizer
    for i in range(2):
        out = engine(**batch(i))
        engine.backward(out.loss)
        engine.step()
    assert engine.get_lr() == pytest.approx([LR / 4])  # the next step's lr, halved after each step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / 4)


def test_counter_boundary_still_matches_pytorch_adamw(swap_dir):
    """Without an outside boundary, DeepSpeed's loop (step() every micro-step) keeps working."""
    gas, steps = 2, 3
    expected, _, _ = baseline(steps, gas)
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=gas))
    losses = []
    applied = []
    for i in range(steps * gas):
        out = engine(**batch(i))
        losses.append(out.loss.item())
        engine.backward(out.loss)
        engine.step()
        applied.append(engine.was_step_applied())
    assert max_rel_diff(losses, expected) <= 1e-5
    assert applied == [False, True] * steps
    assert (engine.global_steps, engine.micro_steps) == (steps, steps * gas)


def test_zero_grad_forgets_the_micro_steps_taken(swap_dir):
    """A micro-step dropped by zero_grad() leaves no trace: the run equals one without it (and one
    where it is not dropped differs, so the check can fail)."""
    gas, steps = 2, 2
    expected, _, _ = baseline(steps, gas)

    def run(drop):
        engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=gas))
        engine.set_gradient_accumulation_boundary(False)
        out = engine(**batch(999))  # a stray micro-step
        engine.backward(out.loss)
        if drop:
            engine.zero_grad()
        losses, _, _, _ = accelerate_replay(engine, steps, gas)
        engine.destroy()
        return losses

    assert max_rel_diff(run(drop=True), expected) <= 1e-5
    assert max_rel_diff(run(drop=False), expected) > 1e-4


@pytest.mark.parametrize("gas", [1, 2])
def test_a_second_backward_on_the_boundary_adds_up(swap_dir, gas):
    """Two backward calls with the boundary set (from outside with accumulation 2, by the counter
    with accumulation 1) and no step between them are one step's sum (the native optimizer would
    refuse a second gradient of a partition)."""
    expected, _, _ = baseline(1, 2)
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=gas))
    if gas == 2:
        engine.set_gradient_accumulation_boundary(True)
    for i in range(2):
        engine.backward(engine(**batch(i)).loss)
    engine.step()
    assert engine.global_steps == 1
    out = engine(**batch(2))
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for i in range(2):
        (model(**batch(i)).loss / gas).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert abs(out.loss.item() - model(**batch(2)).loss.item()) <= 1e-5 * abs(expected[0])


def test_engine_methods_report_the_config(swap_dir):
    cfg = tier_config(swap_dir, gas=3, clip=0.5, train_micro_batch_size_per_gpu=2)
    engine, optimizer, loader, sched = tier.torch.initialize(make_model(), cfg)
    assert engine.gradient_accumulation_steps() == 3
    assert engine.gradient_clipping() == 0.5
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.train_batch_size() == 6
    assert engine.zero_optimization_stage() == 3
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, False)
    assert engine.get_global_grad_norm() is None and engine.was_step_applied() is False
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups[0]["lr"] == LR and optimizer.param_groups[0]["weight_decay"] == 0.01
    n_trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == n_trainable
    engine.destroy()

    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=4, train_batch_size=12, dtype="bf16"))
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (3, 12)
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, True)
    engine.destroy()


def test_initialize_returns_a_dataloader_with_the_micro_batch_size(swap_dir):
    data = [{"input_ids": torch.full((4,), i)} for i in range(10)]
    cfg = tier_config(swap_dir, train_micro_batch_size_per_gpu=3)
    engine, _, loader, _ = tier.torch.initialize(make_model(), cfg, training_data=data)
    assert isinstance(loader, torch.utils.data.DataLoader)
    sizes = [b["input_ids"].shape[0] for b in loader]
    assert sizes == [3, 3, 3, 1]
    engine.destroy()


def test_initialize_reads_config_from_args_and_refuses_ambiguity(swap_dir, tmp_path):
    import json
    import types

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(tier_config(swap_dir, gas=5)))
    engine, *_ = tier.torch.initialize(make_model(), args=types.SimpleNamespace(deepspeed_config=str(path)))
    assert engine.gradient_accumulation_steps() == 5
    engine.destroy()
    with pytest.warns(UserWarning, match="args=.*ignored"):
        engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=2), args=types.SimpleNamespace())
    assert engine.gradient_accumulation_steps() == 2
    engine.destroy()
    with pytest.raises(ValueError, match="config_params"):
        tier.torch.initialize(make_model(), tier_config(swap_dir), config_params=tier_config(swap_dir))
    with pytest.raises(ValueError, match="scheduler"):
        cfg = tier_config(swap_dir, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
        tier.torch.initialize(make_model(), cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))
    other = torch.optim.AdamW(make_model().parameters())
    with pytest.raises(ValueError, match="another optimizer"):
        foreign = torch.optim.lr_scheduler.StepLR(other, 1)
        tier.torch.initialize(make_model(), tier_config(swap_dir), lr_scheduler=foreign)


def trained_engine(swap_dir, steps=2, **cfg_extra):
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=1, **cfg_extra))
    for i in range(steps):
        engine.backward(engine(**batch(i)).loss)
        engine.step()
    return engine


def test_save_pretrained_round_trips_the_trained_weights(swap_dir, tmp_path):
    engine = trained_engine(swap_dir)
    initial = make_model().state_dict()
    sd = engine.module.state_dict()
    assert all(t.numel() > 0 for t in sd.values())
    out = tmp_path / "hf"
    engine.module.save_pretrained(out)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out)
    moved = 0
    for name, value in reloaded.state_dict().items():
        if name in dict(engine.module.named_parameters()):
            assert torch.equal(value, engine.parameter(name)), name
            moved += not torch.equal(value, initial[name])
    assert moved > 0  # the trained weights, not the initial ones
    # The reloaded model computes what the engine computes.
    b = batch(7)
    with torch.no_grad():
        assert abs(reloaded(**b).loss.item() - engine(**b).loss.item()) <= 1e-5


def test_save_16bit_model_writes_the_gathered_compute_dtype_weights(swap_dir, tmp_path):
    engine = trained_engine(swap_dir, dtype="bf16")
    assert engine.save_16bit_model(str(tmp_path), "model.bin") is True
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    names = dict(engine.module.named_parameters())
    assert set(names) <= set(saved)
    for name in names:
        assert saved[name].dtype == torch.bfloat16
        assert torch.equal(saved[name], engine.parameter(name)), name
    assert set(saved) == set(make_model().state_dict())


def test_checkpoints_take_the_trainers_keyword_arguments(swap_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    engine = trained_engine(swap_dir)
    engine.save_checkpoint(str(ckpt), tag="first", client_state={}, save_latest=False)
    assert not (ckpt / "latest").exists()
    engine.save_checkpoint(str(ckpt), tag="kept")
    assert (ckpt / "latest").read_text().strip() == "kept"
    expected = engine.state_dict_fp32()
    engine.backward(engine(**batch(5)).loss)
    engine.step()
    path, client = engine.load_checkpoint(
        str(ckpt), load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    assert os.path.basename(path).startswith("kept~") and client == {}
    got = engine.state_dict_fp32()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert engine.global_steps == 2
    for kw in ({"load_module_only": True}, {"load_optimizer_states": False}, {"load_module_strict": False}):
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            engine.load_checkpoint(str(ckpt), **kw)


def test_destroy_releases_the_engine_and_exit_reports_no_leak(swap_dir, tmp_path):
    engine = trained_engine(swap_dir)
    engine.destroy()
    engine.destroy()  # harmless
    assert engine.native is None and engine.optimizer is None
    # A failure inside backward leaves the engine referenced by the traceback at exit; nanobind
    # must not find tier objects alive when the interpreter ends.
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_torch_llama as t, tier.torch
        engine, *_ = tier.torch.initialize(t.make_model(), t.tier_config({swap_dir!r}, gas=1))
        loss = engine(**t.batch(0)).loss
        def fail(grad):
            raise RuntimeError("a failure inside backward")
        loss.register_hook(fail)
        engine.backward(loss)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ))
    assert "a failure inside backward" in r.stderr, r.stderr[-2000:]
    assert "leaked" not in r.stderr, r.stderr[-2000:]



def test_the_config_scheduler_answers_get_last_lr(swap_dir):
    """The Trainer logs lr_scheduler.get_last_lr()[0]; with a config WarmupLR it is the warmup's."""
    sec = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4,
                                          "warmup_type": "linear"}}
    engine, optimizer, _, sched = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=1, scheduler=sec))
    assert sched is engine.scheduler
    seen = []
    for i in range(3):
        seen.append(sched.get_last_lr()[0])
        assert optimizer.param_groups[0]["lr"] == pytest.approx(seen[-1])
        assert engine.get_lr()[0] == pytest.approx(seen[-1])
        engine.backward(engine(**batch(i)).loss)
        engine.step()
    # DeepSpeed runs optimizer step k with last_batch_iteration k - 1 (the warmup is at 0 for two steps)
    assert seen == pytest.approx([0.0, 0.0, LR / 4])


def test_a_typo_inside_zero_optimization_is_refused_naming_the_key(swap_dir):
    """DeepSpeed refuses unknown keys in zero_optimization; so does tier, instead of leaving the
    params silently not offloaded."""
    cfg = tier_config(swap_dir)
    cfg["zero_optimization"]["offload_parm"] = cfg["zero_optimization"].pop("offload_param")
    with pytest.raises(tier.InvalidArgument, match=r"zero_optimization\.offload_parm.*did you mean 'zero_optimization\.offload_param'"):
        tier.torch.initialize(make_model(), cfg)


def test_model_parameters_given_as_a_subset_trains_only_that_subset(swap_dir):
    """As DeepSpeed: the optimizer takes the parameters given; the others stay as they were."""
    model = make_model()
    subset = [p for n, p in model.named_parameters() if "mlp" in n]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, optimizer, _, _ = tier.torch.initialize(model, tier_config(swap_dir, gas=1), model_parameters=subset)
    for i in range(2):
        out = engine(**batch(i))
        engine.backward(out.loss)
        engine.step()
    after = engine.module_state_dict()
    for n in before:
        changed = not torch.equal(after[n], before[n])
        assert changed == ("mlp" in n), n
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(subset)
    engine.destroy()


def test_parameter_groups_given_as_a_generator_keep_their_groups(swap_dir):
    model = make_model()

    def groups():
        yield {"params": (p for n, p in model.named_parameters() if "norm" not in n)}
        yield {"params": (p for n, p in model.named_parameters() if "norm" in n), "weight_decay": 0.0}

    engine, optimizer, _, _ = tier.torch.initialize(model, tier_config(swap_dir, gas=1), model_parameters=groups())
    assert len(optimizer.param_groups) == 2
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert len(optimizer.param_groups[1]["params"]) == sum(1 for n, _ in model.named_parameters() if "norm" in n)
    assert engine.optimizer.group_count == 2
    # DeepSpeed's engine.optimizer is the optimizer initialize returned, param_groups and all.
    assert engine.optimizer is optimizer
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.01, 0.0]
    engine.optimizer.param_groups[0]["lr"] = LR / 2  # as a scheduler writes it: the next step uses it
    out = engine(**batch(0))
    engine.backward(out.loss)
    engine.step()
    assert engine.get_lr()[0] == pytest.approx(LR / 2)
    engine.destroy()


@pytest.mark.parametrize("overlap", ["serial", "delayed"])
def test_a_step_with_no_backward_changes_nothing(swap_dir, overlap):
    """step() at a boundary with no backward since the last step applies nothing (no weight decay),
    counts no step and says so once; a run with such stray steps equals one without them."""

    def run(stray):
        cfg = tier_config(swap_dir, gas=1)
        cfg["tier"]["optimizer"]["overlap"] = overlap
        engine, *_ = tier.torch.initialize(make_model(), cfg)
        if stray:
            before = {k: v.clone() for k, v in engine.module_state_dict().items()}
            with pytest.warns(UserWarning, match="no backward"):
                assert engine.step() is None
            assert engine.global_steps == 0
            assert engine.optimizer.stats()["step"] == 0
            after = engine.module_state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)
        losses = []
        for i in range(3):
            out = engine(**batch(i))
            losses.append(out.loss.item())
            engine.backward(out.loss)
            engine.step()
            if stray:
                engine.step()  # nothing since the last step
        steps = engine.global_steps
        engine.destroy()
        return losses, steps

    with_stray, steps_with = run(True)
    without, steps_without = run(False)
    assert steps_with == steps_without >= 2
    assert with_stray == without
    if overlap == "serial":
        expected, _, _ = baseline(3, 1)
        assert max_rel_diff(without, expected) <= 1e-5
