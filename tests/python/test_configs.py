"""DeepSpeed configs as DeepSpeed, transformers and accelerate publish them: `tier-bench config
--check` and `tier.torch.initialize` (plus one training step) reach the same verdict on each file of
tests/data/ds_configs, and the intentionally bad ones are refused by both for the same reason."""

import copy
import json
import os
import pathlib
import subprocess

import pytest

torch = pytest.importorskip("torch")

import tier  # noqa: E402
import tier.torch  # noqa: E402

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "ds_configs"
FILES = sorted(p.name for p in CORPUS.glob("*.json"))
TOTAL_STEPS = 20  # what the Trainer passes as total_num_steps

# Why each bad file is refused (a fragment both verdicts must carry).
REFUSED = {
    "bad_onebitlamb.json": "adam, adamw, adagrad, lion or lamb",
    "bad_aio_conflict.json": "'zero_optimization.aio.block_size'",
    "bad_scheduler_param.json": "does not apply to WarmupDecayLR",
    "bad_fp16_and_bf16.json": "enable at most one",
}


def tier_bench():
    exe = os.environ.get("TIER_BENCH")
    if exe:
        return exe
    here = pathlib.Path(tier.__file__).resolve()
    for cand in (here.parents[2] / "bin" / "tier-bench", here.parents[3] / "build" / "bin" / "tier-bench"):
        if cand.exists():
            return str(cand)
    return None


def check_verdict(path):
    """(accepted, message) from `tier-bench config --check`, else from the same C++ entry point."""
    exe = tier_bench()
    if exe:
        r = subprocess.run([exe, "config", "--check", str(path)], capture_output=True, text=True, timeout=60)
        return r.returncode == 0, r.stderr
    try:
        tier.Config.from_file(str(path))
        return True, ""
    except tier.TierError as e:
        return False, str(e)


def with_local_paths(cfg, swap_dir):
    """The file's config with its NVMe paths on this machine, the emulated device and a bounded
    swap file; nothing that decides a verdict changes."""
    cfg = copy.deepcopy(cfg)

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "nvme_path":
                    node[k] = swap_dir
                else:
                    walk(v)

    walk(cfg)
    cfg["tier"] = {"device": "emulated"}
    if '"nvme"' in json.dumps(cfg):
        cfg["tier"]["budgets"] = {"nvme": "64M"}
    return cfg


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def initialize_and_train_one_step(cfg):
    model = tiny_model()
    kwargs = {"total_num_steps": TOTAL_STEPS}
    if "optimizer" not in cfg:
        # As the Trainer does for a config without an optimizer: it builds one and passes it.
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
    engine, *_ = tier.torch.initialize(model, cfg, **kwargs)
    x = torch.randn(4, 8, dtype=engine.compute_dtype)
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert engine.global_steps + engine.skipped_steps == 1
    engine.close()
    return engine


def test_the_corpus_covers_what_the_issue_lists():
    assert len(FILES) >= 15
    text = {name: (CORPUS / name).read_text() for name in FILES}
    for needle in ('"stage": 1', '"stage": 2', '"stage": 3', '"nvme"', '"cpu_offload"', '"bfloat16"', '"auto"',
                   "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", '"fp16"', '"bf16"'):
        assert any(needle in t for t in text.values()), needle
    assert any('"aio"' in json.dumps(json.loads(t).get("zero_optimization", {})) for t in text.values())


@pytest.mark.parametrize("name", FILES)
def test_check_and_initialize_reach_the_same_verdict(name, swap_dir):
    path = CORPUS / name
    accepted, check_message = check_verdict(path)
    cfg = with_local_paths(json.loads(path.read_text()), swap_dir)
    if name in REFUSED:
        assert not accepted, f"config --check accepted {name}"
        with pytest.raises(Exception) as info:
            initialize_and_train_one_step(cfg)
        message = str(info.value)
        assert REFUSED[name] in message, message
        # The same status and text; config --check adds the file's name after the status code.
        code, _, text = message.partition(": ")
        assert f"{code}: config file '{path}': {text}" in check_message, (message, check_message)
        return
    assert accepted, f"config --check refused {name}: {check_message}"
    engine = initialize_and_train_one_step(cfg)
    assert engine.global_steps + engine.skipped_steps == 1


def test_nested_aio_values_reach_the_engine(swap_dir):
    cfg = with_local_paths(json.loads((CORPUS / "hf_zero3_nvme_nested_aio.json").read_text()), swap_dir)
    engine, *_ = tier.torch.initialize(tiny_model(), cfg)
    resolved = json.loads(engine.config.to_json())
    assert resolved["aio"]["block_size"] == 262144
    assert resolved["aio"]["queue_depth"] == 32
    assert not any("not known" in n for n in engine.config.notes), engine.config.notes


# ----------------------------------------------------------------------------------- optimizer
def base_config():
    return {"tier": {"device": "emulated", "budgets": {"device": "4M", "host": "16M"}}}


def test_no_optimizer_section_and_no_client_optimizer_runs_inference_only_and_refuses_training():
    # DeepSpeed's ZeRO-Inference config: no optimizer is guessed, and training says how to get one.
    engine, optimizer, _, _ = tier.torch.initialize(tiny_model(), base_config())
    assert engine.inference_only and optimizer is None
    with pytest.raises(ValueError, match=r'no "optimizer" section.*optimizer=torch.optim.AdamW'):
        engine.step()


def test_a_client_adamw_is_taken_over_with_its_hyper_parameters_and_groups():
    model = tiny_model()
    groups = [
        {"params": list(model[0].parameters()), "lr": 3e-4},
        {"params": list(model[2].parameters()), "lr": 1e-4, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=5e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    engine, *_ = tier.torch.initialize(model, base_config(), optimizer=opt)
    assert engine.optimizer.group_count == 2
    assert engine.get_lr() == pytest.approx([3e-4, 1e-4])
    params = json.loads(engine.config.to_json())["optimizer"]["params"]
    assert params["betas"] == pytest.approx([0.8, 0.95])
    assert params["eps"] == pytest.approx(1e-7)


def test_a_client_adam_keeps_torchs_l2_weight_decay():
    model = tiny_model()
    engine, *_ = tier.torch.initialize(model, base_config(), optimizer=torch.optim.Adam(model.parameters(), lr=1e-3,
                                                                                         weight_decay=0.1))
    params = json.loads(engine.config.to_json())["optimizer"]["params"]
    assert params["adam_w_mode"] is False


def test_other_client_optimizers_and_both_sources_are_refused_by_name():
    model = tiny_model()
    with pytest.raises(TypeError, match=r"torch.optim.Adam, torch.optim.AdamW and torch.optim.Adagrad, not SGD"):
        tier.torch.initialize(model, base_config(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = base_config()
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    with pytest.raises(ValueError, match="keep one"):
        tier.torch.initialize(model, cfg, optimizer=torch.optim.AdamW(model.parameters()))


# ----------------------------------------------------------------------------------- startup
def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_auto_host_budget_is_a_cap_not_touched_at_startup(swap_dir):
    # The auto host budget (a quarter of physical memory) used to be faulted in page by page and
    # registered as io_uring fixed buffers at initialize: 20-25 s on a 2-core machine.
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap_dir}},
        "tier": {"device": "emulated", "budgets": {"nvme": "64M"}},
    }
    before = rss_bytes()
    engine, *_ = tier.torch.initialize(tiny_model(), cfg)
    grown = rss_bytes() - before
    host = engine.stats()["tiers"]["host"]["budget_bytes"]
    if host < (2 << 30):
        pytest.skip("the machine is too small for the auto host budget to stand out")
    assert grown < min(host // 4, 1 << 30), f"initialize grew the RSS by {grown} bytes for a {host}-byte budget"
