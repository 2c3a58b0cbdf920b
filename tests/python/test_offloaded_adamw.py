"""tier.torch.OffloadedAdamW in plain PyTorch loops and under the Hugging Face Trainer: the same
training as torch.optim.AdamW (accumulation, clipping, LR schedules, parameters without a
gradient), state dicts in AdamW's format both ways, and Trainer checkpoints that resume."""

import copy
import math
import os

import pytest
import torch

import tier.torch

HOMES = ["cpu", "nvme"]


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 48), torch.nn.GELU(), torch.nn.Linear(48, 4)
    )


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)


def offloaded(params, home, tmp_path, **kw):
    if home == "nvme":
        return tier.torch.OffloadedAdamW(params, nvme_path=str(tmp_path / "swap"), **kw)
    return tier.torch.OffloadedAdamW(params, **kw)


def train(model, opt, steps, sched=None, gas=2, clip=0.5, frozen_at=None, start=0):
    """`gas` micro-steps per step, clipping, an optional scheduler; from step `frozen_at` on the
    first layer gets no gradient (its grads stay None)."""
    x, y = data()
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for micro in range(gas):
            xb = x[micro * 32 : (micro + 1) * 32]
            yb = y[micro * 32 : (micro + 1) * 32]
            loss = torch.nn.functional.mse_loss(model(xb), yb) / gas
            loss.backward()
            total += loss.item()
        if frozen_at is not None and step >= frozen_at:
            for p in model[0].parameters():
                p.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("home", HOMES)
def test_matches_torch_adamw_with_accumulation_clipping_schedule_and_frozen_params(home, tmp_path):
    ref, mine = make_model(), make_model()
    groups = lambda m: [  # noqa: E731
        {"params": list(m[0].parameters()) + list(m[2].parameters())},
        {"params": list(m[4].parameters()), "lr": 3e-3, "weight_decay": 0.0},
    ]
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    opt = offloaded(groups(mine), home, tmp_path, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    warm = lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(math.pi * s / 10))  # noqa: E731
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, warm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    a = train(ref, opt_ref, 8, sched_ref, frozen_at=5)
    b = train(mine, opt, 8, sched, frozen_at=5)
    assert max(abs(p - q) / abs(p) for p, q in zip(a, b)) <= 1e-5, (a, b)
    assert max_param_diff(ref, mine) <= 1e-5
    assert opt.param_groups[1]["lr"] == opt_ref.param_groups[1]["lr"]  # the schedule wrote it
    assert opt.stats()["home"] == ("nvme" if home == "nvme" else "host")
    assert opt.last_report["step"] == 8


def test_bf16_params_keep_an_fp32_master(tmp_path):
    model = make_model().to(torch.bfloat16)
    opt = offloaded(model.parameters(), "nvme", tmp_path, lr=1e-3)
    x, y = data()
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        master = sd["state"][i]["master"]
        assert master.dtype == torch.float32 and master.shape == p.shape
        assert torch.equal(master.to(torch.bfloat16), p.detach())  # the params are the master, rounded
    # The fp32 masters carry steps too small for bf16 to show: they differ from the params.
    assert any(not torch.equal(sd["state"][i]["master"], p.detach().float()) for i, p in enumerate(model.parameters()))


@pytest.mark.parametrize("home", HOMES)
def test_state_dicts_go_both_ways_with_torch_adamw(home, tmp_path):
    # torch AdamW -> OffloadedAdamW: continuing gives torch's own continuation.
    ref = make_model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=5e-3)
    train(ref, opt_ref, 3)
    snapshot = {k: v.clone() for k, v in ref.state_dict().items()}
    saved = copy.deepcopy(opt_ref.state_dict())  # torch hands out its live tensors
    cont_ref = train(ref, opt_ref, 3, start=3)

    mine = make_model()
    mine.load_state_dict(snapshot)
    opt = offloaded(mine.parameters(), home, tmp_path, lr=5e-3)
    opt.load_state_dict(saved)
    cont = train(mine, opt, 3, start=3)
    assert max(abs(p - q) / abs(p) for p, q in zip(cont_ref, cont)) <= 1e-5, (cont_ref, cont)
    assert max_param_diff(ref, mine) <= 1e-5

    # OffloadedAdamW -> torch AdamW.
    back = make_model()
    back.load_state_dict(mine.state_dict())
    opt_back = torch.optim.AdamW(back.parameters(), lr=5e-3)
    opt_back.load_state_dict(opt.state_dict())
    a = train(back, opt_back, 2, start=6)
    b = train(mine, opt, 2, start=6)
    assert max(abs(p - q) / abs(p) for p, q in zip(a, b)) <= 1e-5, (a, b)


def test_a_bad_state_dict_changes_nothing(tmp_path):
    model = make_model()
    opt = offloaded(model.parameters(), "nvme", tmp_path, lr=1e-2)
    train(model, opt, 2)
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][1]["exp_avg"] = torch.zeros(3)  # wrong size
    with pytest.raises(ValueError, match="exp_avg has 3 elements"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": before["param_groups"] * 2})
    after = opt.state_dict()
    for k in before["state"]:
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before["state"][k][kind], after["state"][k][kind])


def test_params_changed_outside_the_optimizer_are_taken_up(tmp_path):
    """model.load_state_dict after some steps: the next step starts from the loaded weights, as
    with torch's AdamW (whose master is the parameter itself)."""
    ref, mine = make_model(), make_model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = offloaded(mine.parameters(), "cpu", tmp_path, lr=1e-2)
    train(ref, opt_ref, 2)
    train(mine, opt, 2)
    other = make_model(seed=7).state_dict()
    ref.load_state_dict(other)
    mine.load_state_dict(other)
    a = train(ref, opt_ref, 2, start=2)
    b = train(mine, opt, 2, start=2)
    assert max(abs(p - q) / abs(p) for p, q in zip(a, b)) <= 1e-5, (a, b)
    assert max_param_diff(ref, mine) <= 1e-5


def test_streamed_checkpoint_round_trip(tmp_path):
    model = make_model()
    opt = offloaded(model.parameters(), "nvme", tmp_path, lr=1e-2)
    train(model, opt, 2)
    path = str(tmp_path / "opt.tier")
    opt.save_checkpoint(path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    expected = train(model, opt, 2, start=2)
    opt.load_checkpoint(path)  # also puts the params back to the checkpoint's masters
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    assert train(model, opt, 2, start=2) == expected


def test_refuses_what_it_does_not_run():
    params = make_model().parameters()
    with pytest.raises(ValueError, match="amsgrad"):
        tier.torch.OffloadedAdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        tier.torch.OffloadedAdamW(make_model().parameters(), maximize=True)
    with pytest.raises(TypeError, match="fp32, fp16 or bf16"):
        tier.torch.OffloadedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


# ------------------------------------------------------------------ Hugging Face Trainer


# ------------------------------------------------------------------ overlap "exact"


def overlap_pair(tmp_path, dtype=torch.float32, **kw):
    """The same model twice, with a serial and an exact OffloadedAdamW (state on NVMe)."""
    models, opts = [], []
    for mode in ("serial", "exact"):
        m = make_model().to(dtype)
        models.append(m)
        opts.append(
            tier.torch.OffloadedAdamW(
                m.parameters(), lr=1e-2, weight_decay=0.1, nvme_path=str(tmp_path / mode), overlap=mode, **kw
            )
        )
    return models, opts


def assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "clip,gas,frozen_at,dtype",
    [
        (0, 1, None, torch.float32),  # the speculation holds from the second step on
        (1e3, 2, None, torch.float32),  # clip_grad_norm_ multiplies by 1.0: the same bits, kept
        (0.05, 2, None, torch.float32),  # clipped: every step redone serially
        (0, 2, 3, torch.float32),  # grads set to None after backward: redone
        (0, 1, None, torch.bfloat16),
    ],
)
def test_exact_overlap_is_the_serial_step_bit_for_bit(tmp_path, clip, gas, frozen_at, dtype):
    (ms, mx), (os_, ox) = overlap_pair(tmp_path, dtype)
    assert ox.overlap == "exact" and os_.overlap == "serial"
    ox.overlap_max_backoff = 0  # speculate at every step (the back-off has its own test)
    if dtype == torch.bfloat16:
        ms.forward = lambda x, m=ms: torch.nn.Sequential.forward(m, x.bfloat16()).float()
        mx.forward = lambda x, m=mx: torch.nn.Sequential.forward(m, x.bfloat16()).float()
    a = train(ms, os_, 6, gas=gas, clip=clip, frozen_at=frozen_at)
    b = train(mx, ox, 6, gas=gas, clip=clip, frozen_at=frozen_at)
    assert a == b
    assert_same_params(ms, mx)
    st = ox.stats()["overlap_steps"]
    assert st["steps"] == 6
    if clip in (0, 1e3) and frozen_at is None:
        # The first step teaches the backward count; every later one is committed as speculated.
        assert st["overlapped"] == st["committed"] == 5 and st["redone"] == 0, st
        assert ox.last_report["overlapped"] and not ox.last_report["redone"]
    elif clip == 0.05:
        assert st["committed"] == 0 and st["redone"] == 5, st
        assert "changed after backward" in st["last_redo_reason"]
    else:
        assert st["committed"] == 2 and st["redone"] == 3, st  # steps 2 and 3 held, 4-6 lost layer 0's grads
        assert "dropped" in st["last_redo_reason"]
    # The state dicts (read from NVMe) agree too.
    sa, sb = os_.state_dict()["state"], ox.state_dict()["state"]
    for k in sa:
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][kind], sb[k][kind])


def test_exact_overlap_follows_a_changing_loop(tmp_path):
    """More or fewer backward passes than the last step, a learning rate changed between backward
    and step(), a step skipped with zero_grad(): each is noticed, and the result stays serial's."""
    (ms, mx), (os_, ox) = overlap_pair(tmp_path)
    ox.overlap_max_backoff = 0
    x, y = data()

    def micro_steps(model, opt, n):
        for i in range(n):
            loss = torch.nn.functional.mse_loss(model(x[i * 16 : (i + 1) * 16]), y[i * 16 : (i + 1) * 16])
            loss.backward()

    for model, opt in ((ms, os_), (mx, ox)):
        for n in (2, 2, 3, 1, 2):  # accumulation changes: 3 after 2 (more), 1 after 3 (fewer)
            micro_steps(model, opt, n)
            opt.step()
            opt.zero_grad()
        micro_steps(model, opt, 2)
        opt.param_groups[0]["lr"] = 3e-3  # between backward and step
        opt.step()
        opt.zero_grad()
        micro_steps(model, opt, 2)
        opt.zero_grad()  # a skipped step (as GradScaler skips one after an overflow)
        micro_steps(model, opt, 2)
        opt.step()
        opt.zero_grad()
    assert_same_params(ms, mx)
    st = ox.stats()["overlap_steps"]
    assert st["steps"] == 7
    # 2 (learned 2): kept; 3 (learned 2): the third backward accumulates again: redone; 1 (learned 3):
    # never reaches 3, serial; 2 (learned 1): the second backward accumulates again: redone; the lr
    # change: redone; after the skipped step's zero_grad: kept.
    assert st["committed"] == 2, st
    assert st["redone"] == 3, st


def test_a_loop_that_always_clips_backs_off(tmp_path):
    """Clipped at every step, the speculation fails at every try: after each failure the next 1,
    2, 4, ... steps run serially, so few passes are wasted; the results stay serial's."""
    (ms, mx), (os_, ox) = overlap_pair(tmp_path)
    a = train(ms, os_, 12, gas=1, clip=0.01)
    b = train(mx, ox, 12, gas=1, clip=0.01)
    assert a == b
    assert_same_params(ms, mx)
    st = ox.stats()["overlap_steps"]
    # Step 1 teaches the count; tries at 2, 4, 7, 12 fail (skipping 1, 2, 4 steps between).
    assert st["overlapped"] == st["redone"] == 4 and st["committed"] == 0, st
    assert st["backed_off"] == 7, st


def test_overlap_values_are_checked(tmp_path):
    with pytest.raises(ValueError, match="'serial' or 'exact'"):
        tier.torch.OffloadedAdamW(make_model().parameters(), overlap="eager")
    with pytest.raises(ValueError, match="delayed"):
        tier.torch.OffloadedAdamW(make_model().parameters(), nvme_path=str(tmp_path / "a"), overlap="delayed")
    # From the config, as tier.torch.initialize reads it.
    cfg = {"tier": {"optimizer": {"overlap": "exact"}}}
    opt = tier.torch.OffloadedAdamW(make_model().parameters(), nvme_path=str(tmp_path / "b"), config=cfg)
    assert opt.overlap == "exact"
    # The host home updates in place, so it steps serially; CPU parameters default to serial.
    assert tier.torch.OffloadedAdamW(make_model().parameters(), overlap="exact").overlap == "serial"
    assert tier.torch.OffloadedAdamW(make_model().parameters(), nvme_path=str(tmp_path / "c")).overlap == "serial"


def trainer_run(tmp_path, name, make_opt, max_steps, resume=None, max_grad_norm=0.5):
    import transformers
    from test_hf_trainer import Tokens, make_model as tiny_qwen2

    model = tiny_qwen2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=max_grad_norm,
        max_steps=max_steps,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    opt = make_opt(model) if make_opt is not None else None
    sched = transformers.get_cosine_schedule_with_warmup(opt, 1, max_steps) if opt is not None else None
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, model


def test_hf_trainer_matches_adamw_and_resumes_from_its_checkpoint(tmp_path):
    pytest.importorskip("accelerate")
    swap = tmp_path / "swap"

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def ours(model):
        return tier.torch.OffloadedAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, nvme_path=str(swap))

    ref_losses, ref_model = trainer_run(tmp_path, "ref", adamw, 4)
    losses, model = trainer_run(tmp_path, "tier", ours, 4)
    assert len(losses) == len(ref_losses) == 4
    assert max(abs(p - q) / abs(p) for p, q in zip(ref_losses, losses)) <= 1e-5, (ref_losses, losses)
    assert max_param_diff(ref_model, model) <= 1e-5

    # The Trainer saved optimizer.pt from state_dict() at step 2; resuming there reproduces steps 3-4.
    ckpt = tmp_path / "tier" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").exists()
    resumed_losses, resumed = trainer_run(tmp_path, "tier-resumed", ours, 4, resume=str(ckpt))
    assert max(abs(p - q) / abs(p) for p, q in zip(losses[2:], resumed_losses[-2:])) <= 1e-5, (losses, resumed_losses)
    assert max_param_diff(model, resumed) <= 1e-5
    assert os.path.isdir(swap)


def test_hf_trainer_with_the_exact_overlap_matches_the_serial_step(tmp_path):
    """The Trainer's loop (accumulation through accelerate, clip_grad_norm_ every step, a cosine
    schedule): with a clip threshold above the gradient norm the speculative updates are kept."""
    pytest.importorskip("accelerate")
    opts = {}

    def make(mode):
        def f(model):
            opts[mode] = tier.torch.OffloadedAdamW(
                model.parameters(), lr=3e-3, weight_decay=0.01, nvme_path=str(tmp_path / mode), overlap=mode
            )
            return opts[mode]

        return f

    serial_losses, serial_model = trainer_run(tmp_path, "serial", make("serial"), 4, max_grad_norm=1e3)
    exact_losses, exact_model = trainer_run(tmp_path, "exact", make("exact"), 4, max_grad_norm=1e3)
    assert serial_losses == exact_losses
    assert_same_params(serial_model, exact_model)
    st = opts["exact"].stats()["overlap_steps"]
    assert st["committed"] == 3 and st["redone"] == 0, st


def train_transformers(make, tmp_path, mode, vocab, steps=4, gas=2, seq2seq=False):
    """Accumulated steps of the transformers model make() builds (seeded: built right before its
    training, so that dropout draws the same), clipped at a threshold above the norm: "torch" is
    torch.optim.AdamW, else OffloadedAdamW with that overlap and no back-off. Returns the losses,
    the model and the optimizer."""
    model = make()
    if mode == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        opt = tier.torch.OffloadedAdamW(model.parameters(), lr=3e-3, nvme_path=str(tmp_path / mode), overlap=mode)
        opt.overlap_max_backoff = 0
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        for _ in range(gas):
            ids = torch.randint(0, vocab, (2, 16), generator=g)
            labels = ids.flip(1) if seq2seq else ids
            loss = model(input_ids=ids, labels=labels).loss / gas
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        opt.step()
        opt.zero_grad()
    return losses, model, opt


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
def test_exact_overlap_on_transformers_models_with_tied_and_frozen_weights(tmp_path, family):
    """GPT-2 (Conv1D layers, the embedding tied to the head: one hook for a weight used twice) and
    Mistral with its embedding frozen (a parameter the optimizer holds that never gets a gradient):
    the exact overlap equals serial bit for bit over accumulated, clipped steps, and keeps its
    speculation when the clip threshold is above the norm."""
    transformers = pytest.importorskip("transformers")

    def model():
        torch.manual_seed(0)
        if family == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)
            m = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
            m = transformers.MistralForCausalLM(cfg)
            m.get_input_embeddings().weight.requires_grad_(False)
        return m

    a, ma, _ = train_transformers(model, tmp_path, "serial", vocab=96)
    b, mb, ob = train_transformers(model, tmp_path, "exact", vocab=96)
    assert a == b
    assert_same_params(ma, mb)
    st = ob.stats()["overlap_steps"]
    assert st["committed"] == 3 and st["redone"] == 0, st
    if family == "mistral":
        frozen = mb.get_input_embeddings().weight
        assert torch.equal(frozen, model().get_input_embeddings().weight)  # untouched


@pytest.mark.parametrize("family", ["mixtral", "t5"])
def test_other_architectures_against_torch_adamw(tmp_path, family):
    """A mixture of experts (Mixtral) and an encoder-decoder whose embedding serves three places
    (T5): serial and exact match torch.optim.AdamW over accumulated, clipped steps, and the exact
    mode keeps its speculation (3 of 4 steps; the first has no count of backwards yet)."""
    pytest.importorskip("transformers")
    from test_overlap import _mixtral, _t5

    make = {"mixtral": _mixtral, "t5": _t5}[family]

    ref, mr, _ = train_transformers(make, tmp_path, "torch", vocab=256, seq2seq=family == "t5")
    serial, ms, _ = train_transformers(make, tmp_path, "serial", vocab=256, seq2seq=family == "t5")
    exact, me, oe = train_transformers(make, tmp_path, "exact", vocab=256, seq2seq=family == "t5")
    assert serial == exact
    assert_same_params(ms, me)
    assert max(abs(a - b) / abs(b) for a, b in zip(exact, ref)) <= 1e-5
    for p, q in zip(mr.parameters(), me.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    st = oe.stats()["overlap_steps"]
    assert st["committed"] == 3 and st["redone"] == 0, st
