"""Adagrad, Lion and Lamb through tier.torch: the losses of ten steps match torch.optim.Adagrad, a
reference Lion and a reference Lamb written here in plain torch, with the state in host memory and
on NVMe; a client torch.optim.Adagrad maps onto tier's, and what tier cannot run is refused."""

import json

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402

STEPS = 10


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


TARGET = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))


def batch(step):
    """Inputs of the step and a learnable target (a fixed linear map), so that losses fall."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 + step))
    return x, x @ TARGET


def loss_of(out, y):
    return (out.float() - y).pow(2).mean()


def config(optimizer, swap_dir=None):
    cfg = {"optimizer": optimizer, "tier": {"device": "emulated"}}
    if swap_dir is None:
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    else:
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir}}
        cfg["tier"]["budgets"] = {"nvme": "64M"}
    return cfg


def tier_losses(cfg=None, optimizer_factory=None):
    model = make_model()
    kwargs = {}
    if optimizer_factory is not None:
        kwargs["optimizer"] = optimizer_factory(model.parameters())
    engine, *_ = tier.torch.initialize(model, cfg or {"tier": {"device": "emulated"}}, **kwargs)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_of(engine(x), y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == STEPS
    engine.close()
    return losses


def torch_losses(update):
    """Plain torch training; update(params, step) applies one step from p.grad."""
    model = make_model()
    params = list(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_of(model(x), y)
        losses.append(loss.item())
        loss.backward()
        with torch.no_grad():
            update(params, step + 1)
        for p in params:
            p.grad = None
    return losses


def trains(losses):
    """Lower losses than the untrained model's on the same batches, at the last step and overall."""
    frozen = torch_losses(lambda params, step: None)
    return losses[-1] < frozen[-1] and sum(losses) < sum(frozen)


def max_rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def torch_adagrad(lr, eps, weight_decay):
    state = {}

    def update(params, step):
        if "opt" not in state:
            state["opt"] = torch.optim.Adagrad(params, lr=lr, eps=eps, weight_decay=weight_decay)
        state["opt"].step()

    return update


def reference_lion(lr, betas, weight_decay):
    state = {}

    def update(params, step):
        for p in params:
            m = state.setdefault(id(p), torch.zeros_like(p))
            c = m * betas[0] + p.grad * (1 - betas[0])
            p.mul_(1 - lr * weight_decay)
            p.add_(torch.sign(c), alpha=-lr)
            m.mul_(betas[1]).add_(p.grad, alpha=1 - betas[1])

    return update


def reference_lamb(lr, betas, eps, weight_decay, max_coeff, min_coeff, bias_correction=True):
    state = {}

    def update(params, step):
        for p in params:
            m, v = state.setdefault(id(p), (torch.zeros_like(p), torch.zeros_like(p)))
            g = p.grad
            m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            bc1 = 1 - betas[0] ** step if bias_correction else 1.0
            bc2 = 1 - betas[1] ** step if bias_correction else 1.0
            u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * p
            pn, un = p.norm().item(), u.norm().item()
            trust = 1.0 if pn == 0 or un == 0 else min(max(pn / un, min_coeff), max_coeff)
            p.sub_(lr * trust * u)

    return update


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_adagrad_matches_torch_adagrad(home, swap_dir):
    params = {"lr": 0.05, "eps": 1e-10, "weight_decay": 0.01}
    got = tier_losses(config({"type": "Adagrad", "params": params}, swap_dir if home == "nvme" else None))
    want = torch_losses(torch_adagrad(**params))
    assert max_rel_diff(got, want) <= 1e-5, (got, want)
    assert trains(want)  # the comparison is not of constants


def test_a_client_torch_adagrad_maps_onto_tiers():
    got = tier_losses(
        {"tier": {"device": "emulated"}},
        lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-10, weight_decay=0.01),
    )
    want = torch_losses(torch_adagrad(0.05, 1e-10, 0.01))
    assert max_rel_diff(got, want) <= 1e-5, (got, want)


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_lion_matches_a_reference_lion(home, swap_dir):
    params = {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}
    got = tier_losses(config({"type": "Lion", "params": params}, swap_dir if home == "nvme" else None))
    want = torch_losses(reference_lion(params["lr"], params["betas"], params["weight_decay"]))
    assert max_rel_diff(got, want) <= 1e-5, (got, want)
    assert trains(want)


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_lamb_matches_a_reference_lamb(home, swap_dir):
    params = {"lr": 0.02, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01, "max_coeff": 10.0,
              "min_coeff": 0.01}
    got = tier_losses(config({"type": "Lamb", "params": params}, swap_dir if home == "nvme" else None))
    want = torch_losses(reference_lamb(0.02, (0.9, 0.999), 1e-6, 0.01, 10.0, 0.01))
    assert max_rel_diff(got, want) <= 1e-5, (got, want)
    assert trains(want)
    # With the trust ratio pinned to 1 the losses differ: the ratio is in play.
    untrusted = torch_losses(reference_lamb(0.02, (0.9, 0.999), 1e-6, 0.01, 1.0, 1.0))
    assert max_rel_diff(untrusted, want) > 1e-4


def test_lamb_clamp_and_bias_correction_reach_the_update():
    params = {"lr": 0.02, "weight_decay": 0.0, "max_coeff": 0.5, "min_coeff": 0.2, "bias_correction": False}
    got = tier_losses(config({"type": "LAMB", "params": params}))
    want = torch_losses(reference_lamb(0.02, (0.9, 0.999), 1e-8, 0.0, 0.5, 0.2, bias_correction=False))
    assert max_rel_diff(got, want) <= 1e-5, (got, want)


def test_the_engine_reports_the_kind():
    model = make_model()
    engine, *_ = tier.torch.initialize(model, config({"type": "lion", "params": {"lr": 1e-4}}))
    assert engine.optimizer.kind(0) == "lion"
    resolved = json.loads(engine.config.to_json())["optimizer"]
    assert resolved["type"] == "lion" and resolved["params"]["betas"] == [0.9, 0.99]
    engine.close()


def test_what_tier_cannot_run_is_refused_clearly():
    with pytest.raises(ValueError, match="lr_decay"):
        tier_losses(None, lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01))
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        tier_losses(None, lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1))
    with pytest.raises(TypeError, match="Adagrad"):
        tier_losses(None, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(tier.InvalidArgument, match="adam, adamw, adagrad, lion or lamb"):
        tier_losses(config({"type": "OneBitAdam", "params": {"lr": 1e-3}}))
    with pytest.raises(tier.InvalidArgument, match="min_coeff"):
        tier_losses(config({"type": "Lamb", "params": {"max_coeff": 0.1, "min_coeff": 0.2}}))


@pytest.mark.parametrize("kind", ["Adagrad", "Lion", "Lamb"])
def test_a_checkpoint_continues_each_kind_exactly(kind, swap_dir, tmp_path):
    """Saved after three steps and loaded into a fresh engine, the next three losses are the same
    as the original engine's, bit for bit (the state, the kind and its step counter came back)."""
    params = {"Adagrad": {"lr": 0.05}, "Lion": {"lr": 1e-3, "weight_decay": 0.1},
              "Lamb": {"lr": 0.02, "weight_decay": 0.01, "max_coeff": 5.0}}[kind]
    cfg = config({"type": kind, "params": params}, swap_dir)

    def run(engine, steps):
        losses = []
        for step in steps:
            x, y = batch(step)
            loss = loss_of(engine(x), y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        return losses

    a, *_ = tier.torch.initialize(make_model(), cfg)
    run(a, range(3))
    a.save_checkpoint(str(tmp_path / "ckpt"), tag="t3")
    want = run(a, range(3, 6))
    a.close()
    torch.manual_seed(123)
    b, *_ = tier.torch.initialize(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                                      torch.nn.Linear(32, 4)), cfg)
    b.load_checkpoint(str(tmp_path / "ckpt"), tag="t3")
    assert b.optimizer.kind(0) == kind.lower()
    assert run(b, range(3, 6)) == want
    b.close()
