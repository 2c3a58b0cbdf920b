"""tier.optimizer.overlap "delayed": the update of step k runs while step k+1's forward and
backward compute on the params of step k (ZeRO-Offload's delayed parameter update). The losses and
final params equal a plain-PyTorch loop that does exactly that."""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tier.torch  # noqa: E402
from test_torch_llama import LR, batch, make_model, max_rel_diff, tier_config, tier_losses  # noqa: E402

STEPS = 5
GAS = 2


def dpu_reference(steps=STEPS, gas=GAS, clip=1.0):
    """AdamW where step k's gradients are taken on the params before update k-1 was applied."""
    theta = make_model()
    stale = copy.deepcopy(theta)  # what forward and backward see: one update behind
    opt = torch.optim.AdamW(theta.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for step in range(steps):
        for micro in range(gas):
            out = stale(**batch(step * gas + micro))
            losses.append(out.loss.item())
            (out.loss / gas).backward()
        for p, q in zip(theta.parameters(), stale.parameters()):
            p.grad, q.grad = q.grad, None
        if clip:
            torch.nn.utils.clip_grad_norm_(theta.parameters(), clip)
        before = [p.detach().clone() for p in theta.parameters()]
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for q, b in zip(stale.parameters(), before):
                q.copy_(b)
    return losses, {n: p.detach().clone() for n, p in theta.named_parameters()}


def delayed_config(swap_dir, home="nvme", overlap="delayed", **extra):
    cfg = tier_config(swap_dir, gas=GAS, **extra)
    cfg["tier"]["optimizer"]["overlap"] = overlap
    cfg["zero_optimization"]["offload_optimizer"]["device"] = home
    return cfg


def train(engine, steps, start=0):
    return tier_losses(engine, steps, gas=GAS, start=start)


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_delayed_update_matches_the_delayed_reference(swap_dir, home):
    ref_losses, ref_params = dpu_reference()
    engine, *_ = tier.torch.initialize(make_model(), delayed_config(swap_dir, home))
    losses = train(engine, STEPS)
    assert engine.last_report is not None and engine.last_report["clip_coefficient"] < 1.0  # clipping ran
    assert max_rel_diff(losses, ref_losses) <= 1e-5
    # The two gradient sets alternate from step to step outside the access trace: the trace holds,
    # and the prefetcher serves every step after the first.
    metrics = engine.stats()["metrics"]
    assert metrics["prefetch.order_changes"] == 0 and metrics["prefetch.hits"] > 0
    params = engine.state_dict_fp32()  # waits for the last update
    assert engine.global_steps == STEPS
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=2e-5)
    engine.destroy()


def test_delayed_is_not_serial(swap_dir, tmp_path):
    """The delay is real: from the second step on, the losses are not the serial loop's."""
    engine, *_ = tier.torch.initialize(make_model(), delayed_config(swap_dir))
    delayed = train(engine, 3)
    engine.destroy()
    other = tmp_path / "serial"
    other.mkdir()
    engine, *_ = tier.torch.initialize(make_model(), delayed_config(str(other), overlap="serial"))
    serial = train(engine, 3)
    engine.destroy()
    assert delayed[:GAS] == pytest.approx(serial[:GAS], rel=1e-6)  # the first step: the initial params
    # The second step still computes on the initial params in "delayed", on the updated ones in "serial".
    assert max_rel_diff(delayed[GAS : 2 * GAS], serial[GAS : 2 * GAS]) > 1e-4


def test_a_checkpoint_waits_for_the_update_and_resumes_identically(swap_dir, tmp_path):
    engine, *_ = tier.torch.initialize(make_model(), delayed_config(swap_dir))
    train(engine, 2)
    assert engine.optimizer.async_running
    # The main job reads the stats every step: they come (as the update found them), without waiting.
    s = engine.stats()
    assert s["optimizer"]["update_running"] and engine.optimizer.async_running
    engine.save_checkpoint(tmp_path / "ckpt")  # completes the pending update first
    assert not engine.optimizer.async_running and engine.global_steps == 2
    rest = train(engine, 4, start=2)
    engine.destroy()

    other = tmp_path / "swap2"
    other.mkdir()
    engine, *_ = tier.torch.initialize(make_model(seed=1), delayed_config(str(other)))
    engine.load_checkpoint(tmp_path / "ckpt")
    resumed = train(engine, 4, start=2)
    engine.destroy()
    assert resumed == rest


def test_delayed_refuses_what_it_cannot_do(swap_dir):
    with pytest.raises(ValueError, match='overlap: "delayed": fp16 loss scaling is not supported'):
        tier.torch.initialize(make_model(), delayed_config(swap_dir, fp16={"enabled": True}))
    cfg = delayed_config(swap_dir)
    cfg["optimizer"] = {"type": "Lamb", "params": {"lr": LR}}
    with pytest.raises(ValueError, match='overlap: "delayed": Lamb is not supported'):
        tier.torch.initialize(make_model(), cfg)


def test_a_nvme_budget_without_room_for_the_second_gradients_is_an_error_at_initialize(swap_dir):
    """The delayed update's second set of fp32 gradients lives on NVMe beside the first: a budget
    that cannot hold it is refused at initialize (naming the key and the figure), instead of a
    registration timing out at the first step."""
    measured = delayed_config(swap_dir, overlap="exact")
    # (as "delayed" keeps them: a master of the optimizer's own beside each fp32 parameter)
    measured["tier"]["optimizer"]["params_are_masters"] = False
    engine, *_ = tier.torch.initialize(make_model(), measured)
    opt = engine.optimizer.stats()
    # The tensors on NVMe, and the optimizer's room in the same swap files and budget.
    assert opt["shared_swap"]
    held = engine.stats()["tiers"]["nvme"]["resident_bytes"] - opt["nvme_bytes"] + opt["nvme_capacity_bytes"]
    need = 4 * sum(p.numel() for p in make_model().parameters())
    engine.destroy()
    cfg = delayed_config(swap_dir)
    cfg["tier"]["budgets"]["nvme"] = held + need - 4096
    with pytest.raises(ValueError, match=r'"delayed" keeps a second set .* raise tier.budgets.nvme|tier.budgets.nvme is'):
        tier.torch.initialize(make_model(), cfg)
    cfg["tier"]["budgets"]["nvme"] = held + need + (8 << 20)
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    assert len(train(engine, 2)) == 2 * GAS
    engine.destroy()
