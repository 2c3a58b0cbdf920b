"""tier.jax.OffloadedAdamW: an MLP trains as under optax.adamw (state on NVMe and in host memory,
schedules, masks, clipping), bf16 params keep fp32 masters, bad inputs change nothing, state dicts
and checkpoints resume exactly, and the result has the params' structure, shapes and dtypes.

jax and optax are test dependencies (requirements.txt): these tests do not skip without them."""

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import tier.jax
from tier.jax import OffloadedAdamW

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01
SIZES = (8, 32, 32, 4)


def mlp(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * len(SIZES))
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        w = jax.random.normal(keys[2 * i], (a, b)) / math.sqrt(a)
        bias = 0.1 * jax.random.normal(keys[2 * i + 1], (b,))
        layers.append({"w": w.astype(dtype), "b": bias.astype(dtype)})
    return {"layers": layers}


def data(dtype=jnp.float32):
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    return jax.random.normal(kx, (64, SIZES[0])).astype(dtype), jax.random.normal(ky, (64, SIZES[-1])).astype(dtype)


def loss_fn(params, x, y):
    h = x
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i < len(params["layers"]) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


grad_fn = jax.jit(jax.grad(loss_fn))
loss_jit = jax.jit(loss_fn)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def max_diff(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max((float(np.max(np.abs(f32(x) - f32(y)))) if np.size(x) else 0.0) for x, y in zip(la, lb))


def adamw(lr=LR, **kw):
    return optax.adamw(lr, b1=BETAS[0], b2=BETAS[1], eps=EPS, eps_root=0.0, weight_decay=WD, **kw)


def offloaded(params, home, tmp_path, **kw):
    kw.setdefault("lr", LR)
    nvme = str(tmp_path / "swap") if home == "nvme" else None
    return OffloadedAdamW(params, betas=BETAS, eps=EPS, weight_decay=kw.pop("weight_decay", WD), nvme_path=nvme, **kw)


def adam_state(state):
    """optax's ScaleByAdamState inside an adamw state."""
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return found[0]


def train_pair(opt, tx, params, steps, before_step=None):
    """Trains `params` with `opt` and a copy with optax `tx`, each on its own gradients; returns
    (tier's params, optax's params, optax's state, the largest difference at each step)."""
    x, y = data()
    mine, ref, state = params, params, tx.init(params)
    diffs = []
    for s in range(steps):
        if before_step is not None:
            mine, ref, state = before_step(s, mine, ref, state)
        updates, state = tx.update(grad_fn(ref, x, y), state, ref)
        ref = optax.apply_updates(ref, updates)
        mine = opt.step(mine, grad_fn(mine, x, y))
        diffs.append(max_diff(mine, ref))
    return mine, ref, state, diffs


# ------------------------------------------------------------------ (a), (b): the same training as optax
@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_mlp_trains_as_optax_adamw(home, tmp_path):
    params = mlp()
    opt = offloaded(params, home, tmp_path)
    x, y = data()
    first = float(loss_jit(params, x, y))
    mine, ref, state, diffs = train_pair(opt, adamw(), params, 20)
    print(f"{home}: max |tier - optax| per step: {max(diffs):.3g}")
    assert max(diffs) < 1e-5, diffs
    assert float(loss_jit(mine, x, y)) < 0.8 * first  # it trained
    assert opt.step_count == 20 and opt.last_report["applied"]

    # The moments are optax's mu and nu.
    sd = opt.state_dict()
    adam = adam_state(state)
    for ours, theirs in ((sd["exp_avg"], adam.mu), (sd["exp_avg_sq"], adam.nu)):
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            # Each side stepped on its own gradients: allow for params 1e-6 apart.
            np.testing.assert_allclose(a, f32(b), rtol=1e-3, atol=1e-4 * float(np.max(np.abs(f32(b)))))
    assert max_diff(sd["master"], mine) == 0.0  # fp32 params are their masters

    stats = opt.stats()
    assert stats["home"] == ("nvme" if home == "nvme" else "host")
    assert opt.home == home
    if home == "nvme":
        assert stats["nvme_bytes"] > 0 or stats["nvme_allocated_bytes"] > 0
        assert any(os.scandir(tmp_path / "swap"))
    else:
        assert stats["nvme_capacity_bytes"] == 0


# ------------------------------------------------------------------ (c): bf16 params, fp32 masters
def test_bf16_params_keep_fp32_masters(tmp_path):
    params = mlp(dtype=jnp.bfloat16)
    opt = offloaded(params, "nvme", tmp_path, lr=1e-3)
    tx = adamw(lr=1e-3)
    x, y = data(jnp.bfloat16)
    mine = params
    ref = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # optax on fp32 copies
    state = tx.init(ref)
    for _ in range(20):
        g = grad_fn(mine, x, y)  # bf16 gradients, handed over as they are
        assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(g))
        updates, state = tx.update(jax.tree.map(lambda t: t.astype(jnp.float32), g), state, ref)
        ref = optax.apply_updates(ref, updates)
        mine = opt.step(mine, g)
        assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(mine))
    master = opt.state_dict()["master"]
    # The masters are fp32 AdamW on the same gradients.
    diff = max_diff(master, ref)
    print(f"bf16: max |master - optax fp32| {diff:.3g}")
    assert diff < 1e-5
    # The params are their masters rounded to bf16 (to nearest), within bf16's precision of optax's.
    for p, m, r in zip(jax.tree.leaves(mine), jax.tree.leaves(master), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(f32(p), f32(m.astype(ml_dtypes.bfloat16)))
        np.testing.assert_allclose(f32(p), f32(r), rtol=2.0**-7, atol=1e-6)
    # ... and the masters hold what bf16 cannot: updates smaller than a bf16 step accumulated.
    assert any(np.any(m != f32(p)) for p, m in zip(jax.tree.leaves(mine), jax.tree.leaves(master)))


# ------------------------------------------------------------------ (d): bad input changes nothing
class _FailingDriver:
    """The real driver, except that the n-th add_grad raises (an error the driver finds only
    after some gradients were taken)."""

    def __init__(self, driver, fail_at):
        self._driver, self._left = driver, fail_at

    def add_grad(self, index, grad):
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("injected add_grad failure")
        self._driver.add_grad(index, grad)

    def __getattr__(self, name):
        return getattr(self._driver, name)


def test_bad_input_names_the_leaf_and_applies_nothing(tmp_path):
    params = mlp()
    opt = offloaded(params, "nvme", tmp_path)
    tx = adamw()
    x, y = data()
    mine, ref, state = params, params, tx.init(params)

    def good_step():
        nonlocal mine, ref, state
        updates, state = tx.update(grad_fn(ref, x, y), state, ref)
        ref = optax.apply_updates(ref, updates)
        mine = opt.step(mine, grad_fn(mine, x, y))
        return max_diff(mine, ref)

    assert good_step() < 1e-5
    before = opt.state_dict()
    g = grad_fn(mine, x, y)

    def edited(fn):
        tree = jax.tree.map(lambda t: t, g)  # a copy of the containers
        fn(tree)
        return tree

    bad = [
        (ValueError, "grads['layers'][1]['b']", edited(lambda t: t["layers"][1].pop("b"))),  # a leaf missing
        (ValueError, "grads['extra']", {**g, "extra": jnp.zeros(3)}),  # one too many
        (ValueError, "grads['layers'][2]", {"layers": g["layers"][:2]}),  # a layer missing
        (ValueError, "grads['layers'][0]['w']", edited(lambda t: t["layers"][0].update(w=t["layers"][0]["w"].T))),
        (TypeError, "grads['layers'][2]['b']", edited(lambda t: t["layers"][2].update(b=jnp.ones(4, jnp.int32)))),
        (ValueError, "tree structure", {"layers": tuple(g["layers"])}),  # a tuple for the list
    ]
    for exc, name, grads in bad:
        with pytest.raises(exc, match=re.escape(name)):
            opt.step(mine, grads)
    for lr in (float("nan"), float("inf"), -1e-3):
        with pytest.raises(ValueError, match="lr"):
            opt.step(mine, g, lr=lr)
        with pytest.raises(ValueError, match="lr"):
            opt.lr = lr
    with pytest.raises(ValueError, match=re.escape("params['layers'][1]['w']")):  # params edited to another shape
        opt.step(edited(lambda t: t["layers"][1].update(w=jnp.zeros((3, 3)))), g)
    # An error after some gradients went in: they are dropped, not summed into the next step.
    real = opt._driver
    opt._driver = _FailingDriver(real, fail_at=3)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step(mine, g)
    opt._driver = real

    assert opt.step_count == 1 and opt.lr == LR
    after = opt.state_dict()
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert max_diff(before[kind], after[kind]) == 0.0, kind
    diffs = [good_step() for _ in range(3)]
    assert max(diffs) < 1e-5, diffs
    assert opt.step_count == 4


def test_non_float_params_are_refused(tmp_path):
    params = {"w": jnp.ones((3, 2)), "count": jnp.zeros((), jnp.int32)}
    with pytest.raises(TypeError, match=re.escape("params['count']")):
        OffloadedAdamW(params)
    with pytest.raises(TypeError, match=re.escape("params['x']")):
        OffloadedAdamW({"x": np.ones(3, np.float64)})
    with pytest.raises(ValueError, match="no array leaves"):
        OffloadedAdamW({"a": None})


# ------------------------------------------------------------------ (e): state dicts and checkpoints
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_state_dict_round_trip_continues_identically(dtype, tmp_path):
    x, y = data(dtype)
    a = offloaded(mlp(dtype=dtype), "nvme", tmp_path / "a")
    pa = mlp(dtype=dtype)
    for _ in range(5):
        pa = a.step(pa, grad_fn(pa, x, y))
    sd = a.state_dict()
    assert sd["step"] == 5
    assert jax.tree.structure(sd["exp_avg"]) == jax.tree.structure(pa)

    b = offloaded(mlp(seed=7, dtype=dtype), "cpu", tmp_path / "b")  # other values, other home
    with pytest.raises(ValueError, match=re.escape("exp_avg['layers'][0]['w']")):
        b.load_state_dict({**sd, "exp_avg": jax.tree.map(lambda t: t.T if t.ndim == 2 else t, sd["exp_avg"])})
    with pytest.raises(ValueError, match="lacks 'exp_avg_sq'"):
        b.load_state_dict({k: v for k, v in sd.items() if k != "exp_avg_sq"})
    assert b.step_count == 0
    b.load_state_dict(sd)
    assert b.step_count == 5
    pb = b.params()
    assert max_diff(pb, pa) == 0.0
    assert all(leaf.dtype == dtype for leaf in jax.tree.leaves(pb))
    for _ in range(5):
        g = grad_fn(pa, x, y)
        pa, pb = a.step(pa, g), b.step(pb, g)
        assert max_diff(pa, pb) == 0.0
    assert max_diff(a.state_dict()["master"], b.state_dict()["master"]) == 0.0


def test_save_and_load_continue_identically(tmp_path):
    x, y = data()
    a = offloaded(mlp(), "nvme", tmp_path / "a")
    pa = mlp()
    for _ in range(4):
        pa = a.step(pa, grad_fn(pa, x, y))
    path = tmp_path / "opt.ckpt"
    a.save(path)
    b = offloaded(mlp(seed=3), "nvme", tmp_path / "b")
    b.load(path)
    assert b.step_count == 4
    pb = b.params()
    assert max_diff(pa, pb) == 0.0
    for _ in range(4):
        g = grad_fn(pa, x, y)
        pa, pb = a.step(pa, g), b.step(pb, g)
        assert max_diff(pa, pb) == 0.0


# ------------------------------------------------------------------ (f): the result's structure
def test_result_has_the_params_structure_shapes_and_dtypes(tmp_path):
    k = jax.random.split(jax.random.PRNGKey(2), 6)
    params = {
        "embed": jax.random.normal(k[0], (10, 4)),
        "blocks": [
            (jax.random.normal(k[1], (4, 4)).astype(jnp.bfloat16), jax.random.normal(k[2], (4,)).astype(jnp.float16)),
            {"scale": jnp.asarray(1.5), "unused": None},
        ],
        "empty": jnp.zeros((0, 3)),
        "head": jax.random.normal(k[3], (4, 2, 2)),
    }
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.25, p.dtype), params)
    opt = offloaded(params, "cpu", tmp_path)
    out = params
    for _ in range(3):
        out = opt.step(out, grads)
    assert jax.tree.structure(out) == jax.tree.structure(params)
    for p, o in zip(jax.tree.leaves(params), jax.tree.leaves(out)):
        assert isinstance(o, jax.Array)
        assert (o.shape, o.dtype) == (p.shape, p.dtype)
        assert o.devices() == p.devices()
    assert out["blocks"][1]["unused"] is None
    assert opt.param_names == [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    # Against optax on fp32 copies (bf16/fp16 leaves within their precision).
    tx = adamw()
    ref = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state = tx.init(ref)
    g32 = jax.tree.map(lambda t: t.astype(jnp.float32), grads)
    for _ in range(3):
        updates, state = tx.update(g32, state, ref)
        ref = optax.apply_updates(ref, updates)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(f32(o), f32(r), rtol=2.0**-7, atol=1e-5)


# ------------------------------------------------------------------ lr, schedules, masks, clipping
def test_lr_setter_step_lr_and_schedules_follow_optax(tmp_path):
    params = mlp()
    opt = offloaded(params, "cpu", tmp_path)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    x, y = data()
    mine, ref, state = params, params, tx.init(params)
    for s in range(15):
        lr = LR if s < 5 else 2e-3 if s < 10 else 5e-3
        state.hyperparams["learning_rate"] = jnp.asarray(lr)
        updates, state = tx.update(grad_fn(ref, x, y), state, ref)
        ref = optax.apply_updates(ref, updates)
        if s == 5:
            opt.lr = 2e-3
        g = grad_fn(mine, x, y)
        mine = opt.step(mine, g, lr=5e-3) if s == 10 else opt.step(mine, g)
        assert opt.lr == lr
        assert max_diff(mine, ref) < 1e-5

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=5, decay_steps=20, end_value=1e-4)
    opt2 = offloaded(params, "cpu", tmp_path, lr=schedule)
    *_, diffs = train_pair(opt2, adamw(lr=schedule), params, 20)
    assert max(diffs) < 1e-5, diffs
    assert opt2.lr == pytest.approx(float(schedule(20)))


def test_weight_decay_mask_follows_optax(tmp_path):
    params = mlp()

    def mask(p):
        return jax.tree.map(lambda t: t.ndim > 1, p)

    opt = offloaded(params, "nvme", tmp_path, weight_decay=0.3, mask=mask)
    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=0.3, mask=mask)
    *_, diffs = train_pair(opt, tx, params, 10)
    assert max(diffs) < 1e-5, diffs
    # Without the mask the biases would decay: a different result.
    opt_all = offloaded(params, "cpu", tmp_path, weight_decay=0.3)
    mine, ref, *_ = train_pair(opt_all, tx, params, 10)
    assert max_diff(mine, ref) > 1e-5


def test_max_grad_norm_clips_as_optax(tmp_path):
    params = mlp()
    opt = offloaded(params, "cpu", tmp_path, max_grad_norm=0.05)
    tx = optax.chain(optax.clip_by_global_norm(0.05), adamw())
    *_, diffs = train_pair(opt, tx, params, 10)
    assert max(diffs) < 1e-5, diffs
    assert opt.last_report["clip_coefficient"] < 1.0


def test_fp16_loss_scaling_skips_an_overflowing_step(tmp_path):
    params = {"w": jnp.ones((3,), jnp.float16), "b": jnp.zeros((2,), jnp.float16)}
    opt = OffloadedAdamW(params, lr=0.1, config={"fp16": {"enabled": True, "initial_scale_power": 8}})
    scale = opt.loss_scale
    assert scale == 256.0
    grads = {"w": jnp.array([1.0, jnp.inf, 1.0], jnp.float16), "b": jnp.ones((2,), jnp.float16)}
    out = opt.step(params, grads)
    assert out is params and opt.last_report["overflow"] and not opt.last_report["applied"]
    assert opt.step_count == 0
    # Scaled gradients are unscaled: the same step as unscaled ones under optax.
    grads = {"w": jnp.full((3,), 0.5 * scale, jnp.float16), "b": jnp.full((2,), -0.25 * scale, jnp.float16)}
    out = opt.step(params, grads)
    assert opt.last_report["applied"] and opt.step_count == 1
    tx = optax.adamw(0.1, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    ref = jax.tree.map(lambda t: t.astype(jnp.float32), params)
    updates, _ = tx.update(jax.tree.map(lambda t: t.astype(jnp.float32) / scale, grads), tx.init(ref), ref)
    ref = optax.apply_updates(ref, updates)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert o.dtype == jnp.float16
        np.testing.assert_allclose(f32(o), f32(r), rtol=2.0**-10, atol=1e-4)


def test_params_changed_outside_become_the_masters(tmp_path):
    def halve_at_3(s, mine, ref, state):
        if s == 3:
            return jax.tree.map(lambda t: t * 0.5, mine), jax.tree.map(lambda t: t * 0.5, ref), state
        return mine, ref, state

    params = mlp()
    opt = offloaded(params, "nvme", tmp_path)
    *_, diffs = train_pair(opt, adamw(), params, 8, before_step=halve_at_3)
    assert max(diffs) < 1e-5, diffs


# ------------------------------------------------------------------ imports
def _python(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_import_tier_does_not_import_jax():
    r = _python("import sys, tier\nassert 'jax' not in sys.modules, 'import tier imported jax'\n"
                "import tier.jax\nassert 'jax' in sys.modules\nprint('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_import_without_jax_says_what_to_install():
    r = _python("import sys\nsys.modules['jax'] = None\ntry:\n    import tier.jax\nexcept ImportError as e:\n"
                "    print('ImportError:', e)\n")
    assert r.returncode == 0, r.stderr
    assert "tier.jax needs JAX" in r.stdout and "pip install jax" in r.stdout, r.stdout
