"""With the optimizer state on NVMe, gradients are summed in engine tensors homed there too: no
host accumulator grows with the model, and the training is the same."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier.torch  # noqa: E402
from test_torch_llama import baseline_losses, make_model, max_rel_diff, tier_config, tier_losses  # noqa: E402


def grad_tensors(engine):
    n = engine.native
    return [n.info(i) for i in range(len(n)) if n.info(i)["name"].startswith("grad/")]


def test_nvme_optimizer_keeps_no_host_accumulators_and_matches_pytorch(swap_dir):
    steps = 6
    expected = baseline_losses(steps, gas=2)
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=2))
    got = tier_losses(engine, steps)
    assert max_rel_diff(got, expected) <= 1e-5, (got, expected)
    grads = grad_tensors(engine)
    trainable = sum(1 for s in engine._slots if s.pid is not None)
    assert len(grads) == trainable
    assert all(g["home"] == "nvme" and g["dtype"] == "fp32" for g in grads)
    assert engine.stats()["optimizer"]["accumulator_bytes"] == 0
    assert not engine._grads.held  # consumed by the step


def test_small_host_budget_still_trains(swap_dir):
    """Host budget about the size of the model: gradients, params and staging must take turns
    (write-backs, evictions) instead of waiting for each other."""
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    cfg = tier_config(swap_dir, gas=2)
    # Params and gradients are 8 bytes per element together: half of that fits, beside the
    # optimizer's pipeline buffers, which the host budget holds too.
    cfg["tier"]["budgets"]["host"] = numel * 4 + 256 * 1024
    cfg["tier"]["optimizer"] = {"buffer_bytes": "256K"}
    cfg["tier"]["acquire_timeout_ms"] = 20000
    engine, *_ = tier.torch.initialize(model, cfg)
    expected = baseline_losses(3, gas=2)
    got = tier_losses(engine, 3)
    assert max_rel_diff(got, expected) <= 1e-5, (got, expected)
    stats = engine.stats()
    assert stats["metrics"]["engine.writebacks"] > 0
    # The pipeline buffers are inside the budget, and the host tier never went over it.
    host = stats["tiers"]["host"]
    assert host["budget_bytes"] == cfg["tier"]["budgets"]["host"]
    assert host["resident_bytes"] >= stats["optimizer"]["pinned_bytes"] > 0
    assert host["peak_bytes"] <= host["budget_bytes"]


def test_host_optimizer_sums_in_host_memory_once(swap_dir):
    """Host-resident state keeps host sums; with accumulation the native optimizer borrows them
    for the step instead of copying them into accumulators of its own (4 bytes per element, not 8)."""
    cfg = tier_config(swap_dir, gas=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    expected = baseline_losses(3, gas=2)
    got = tier_losses(engine, 3)
    assert max_rel_diff(got, expected) <= 1e-5, (got, expected)
    assert not grad_tensors(engine)
    assert engine.stats()["optimizer"]["accumulator_bytes"] == 0
    assert not engine._grads.held  # released after the step


@pytest.mark.parametrize("host_budget", ["auto", "16M"])
def test_the_optimizers_io_is_on_the_engines_registered_arena(swap_dir, host_budget):
    """The optimizer's pipeline buffers are blocks of the engine's host arena, and its chunks'
    I/O (through the engine's swap space, which it shares) is on fixed buffers there: under an
    explicit budget the arena is registered whole at start, under the auto budget extent by
    extent as it is committed."""
    cfg = tier_config(swap_dir, gas=1)
    if host_budget == "auto":
        del cfg["tier"]["budgets"]["host"]
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    tier_losses(engine, 1)
    stats = engine.stats()
    if stats["info"].get("io_engine") != "uring":
        pytest.skip(f"fixed buffers are io_uring's; this machine's I/O engine is {stats['info'].get('io_engine')!r}")
    host = stats["tiers"]["host"]
    assert host["pinned_bytes"] > 0 and host["io_registered_bytes"] > 0
    optimizer = engine.native_optimizer.stats()
    assert optimizer["shared_swap"]
    assert optimizer["io_registered_bytes"] >= optimizer["pinned_bytes"] > 0
    engine.destroy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_gradient_is_summed_with_its_sum_of_squares_in_one_pass(dtype):
    """The intake of a gradient into its engine tensor (tier.torch's, for declared gradients): the
    addition in fp32 and the sum of squares of the result come from one pass, and the sum is the one
    a separate pass gives, bit for bit."""
    from tier import _tier

    g = torch.Generator().manual_seed(3)
    n = 300_001  # several of the kernel's blocks, and a tail
    a = torch.randn(n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    acc = torch.full((n,), 7.0)
    first = _tier.accumulate_grad(acc, a, True)
    assert torch.equal(acc, a.float())
    assert first == _tier.sum_of_squares(acc)
    second = _tier.accumulate_grad(acc, b, False)
    assert torch.equal(acc, a.float() + b.float())
    assert second == _tier.sum_of_squares(acc)
    assert second == pytest.approx(float(acc.double().pow(2).sum()), rel=1e-12)
    with pytest.raises(tier.InvalidArgument, match="299999 elements, the sum 300001"):
        _tier.accumulate_grad(acc, b[:299_999], False)
    assert torch.equal(acc, a.float() + b.float())  # refused: nothing added
    with pytest.raises(tier.InvalidArgument):
        _tier.accumulate_grad(acc.double(), b, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_gradient_kept_in_its_dtype_is_copied_with_its_sum_of_squares_in_one_pass(dtype):
    """The intake of a bf16/fp16 model's gradient into an engine tensor of its own dtype: copied as
    is, and the sum of squares from the same pass is the one a separate pass gives, bit for bit."""
    from tier import _tier

    g = torch.Generator().manual_seed(4)
    grad = torch.randn(300_001, generator=g).to(dtype)
    dst = torch.full_like(grad, 5.0)
    sumsq = _tier.copy_grad(dst, grad)
    assert torch.equal(dst, grad)
    assert sumsq == _tier.sum_of_squares(grad)
    assert sumsq == pytest.approx(float(grad.double().pow(2).sum()), rel=1e-12)
    kept = torch.full((300_001,), 5.0)
    if dtype != torch.float32:  # another dtype, or another length, is refused: nothing written
        with pytest.raises(tier.InvalidArgument, match="dtype"):
            _tier.copy_grad(kept, grad)
    with pytest.raises(tier.InvalidArgument, match="300001 elements"):
        _tier.copy_grad(kept[:10], grad.float())
    assert torch.equal(kept, torch.full((300_001,), 5.0))


# ("delayed" refuses fp16 loss scaling.)
@pytest.mark.parametrize(
    "dtype,overlap", [("bf16", "exact"), ("bf16", "serial"), ("bf16", "delayed"), ("fp16", "exact"), ("fp16", "serial")]
)
def test_a_16_bit_model_keeps_its_gradients_in_16_bits_with_the_same_steps(swap_dir, monkeypatch, dtype, overlap):
    """#29 item 4, bytes matched to dtypes: a model trained in bf16/fp16 with one micro-step per
    step stores each gradient on NVMe as backward made it (2 bytes, not an fp32 sum's 4), and
    trains bit for bit as with fp32 sums: converting a 16-bit gradient to fp32 is exact, and its
    sum of squares (the clipping, the overflow check) is the same. Clipping at 0.05 clips every
    step. With two micro-steps per step the sums stay fp32."""
    from tier.torch import grads as grads_mod

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    steps = 4

    def run(force_fp32):
        if force_fp32:
            original = grads_mod.EngineGrads.register
            monkeypatch.setattr(
                grads_mod.EngineGrads,
                "register",
                lambda self, native, pid, name, numel, home, dtype="fp32": original(
                    self, native, pid, name, numel, home, "fp32"
                ),
            )
        cfg = tier_config(swap_dir, gas=1, clip=0.05)
        cfg[dtype] = {"enabled": True}
        if dtype == "fp16":
            cfg["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 1000})
        cfg["tier"]["optimizer"]["overlap"] = overlap
        engine, *_ = tier.torch.initialize(make_model(dtype=torch_dtype), cfg)
        losses = tier_losses(engine, steps, gas=1)
        stored = {g["dtype"] for g in grad_tensors(engine)}
        nvme = engine.stats()["tiers"]["nvme"]["peak_bytes"]
        params = [p.detach().float().clone() for p in engine.module_state_dict().values()]
        norms = engine.get_global_grad_norm()
        engine.destroy()
        monkeypatch.undo()
        return losses, stored, nvme, params, norms

    losses, stored, nvme, params, norm = run(False)
    ref_losses, ref_stored, ref_nvme, ref_params, ref_norm = run(True)
    assert stored == {dtype} and ref_stored == {"fp32"}
    assert losses == ref_losses
    assert norm == ref_norm and norm > 0.05
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # Half the gradient bytes on NVMe (the model here is small: its 16-bit params are the rest).
    numel = sum(p.numel() for p in make_model().parameters())
    assert ref_nvme - nvme >= 2 * numel * 0.9, (ref_nvme, nvme)

    cfg = tier_config(swap_dir, gas=2)
    cfg[dtype] = {"enabled": True}
    engine, *_ = tier.torch.initialize(make_model(dtype=torch_dtype), cfg)
    assert {g["dtype"] for g in grad_tensors(engine)} == {"fp32"}
    engine.destroy()
