"""The Hugging Face Trainer through tier's engine (tier.hf.TierTrainer) with a DeepSpeed-format
config whose "auto" values come from the TrainingArguments: the same losses as the plain Trainer
with AdamW, clear errors where the config and the arguments disagree, and a resume from the
Trainer's checkpoint that reproduces the uninterrupted run."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tier.hf  # noqa: E402

VOCAB = 128


# The small decoder every test here builds (Qwen2, and Phi-3 below, take these as they are).
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def make_model():
    cfg = transformers.Qwen2Config(**SMALL)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=48, seq=16):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(swap_dir, **over):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir},
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "bf16": {"enabled": "auto"},
        "tier": {"device": "emulated", "budgets": {"device": "256K", "host": "16M", "nvme": "64M"}},
    }
    cfg.update(over)
    return cfg


def args(tmp_path, name, max_steps=6, **over):
    kw = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.01,
        max_grad_norm=0.5,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_steps=max_steps,
        save_steps=3,
        save_strategy="steps",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def losses_of(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def test_tier_trainer_matches_the_plain_trainer_and_resumes(swap_dir, tmp_path):
    plain = transformers.Trainer(model=make_model(), args=args(tmp_path, "plain"), train_dataset=Tokens())
    plain.train()
    expected = losses_of(plain)

    trainer = tier.hf.TierTrainer(
        model=make_model(), args=args(tmp_path, "tier"), train_dataset=Tokens(), tier_config=ds_config(swap_dir)
    )
    trainer.train()
    got = losses_of(trainer)
    assert len(got) == len(expected) == 6
    assert rel(expected, got) <= 1e-5, (expected, got)
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    plain_norms = [h["grad_norm"] for h in plain.state.log_history if "grad_norm" in h]
    # The first norm is of the same gradients (summation order apart); later ones follow params that
    # drifted by the losses' 1e-5, so compare those more loosely.
    assert abs(plain_norms[0] - grad_norms[0]) <= 1e-6 * plain_norms[0], (plain_norms, grad_norms)
    assert rel(plain_norms, grad_norms) <= 1e-3, (plain_norms, grad_norms)
    resolved = trainer.tier_config_resolved
    assert resolved["optimizer"]["params"]["lr"] == 3e-3 and resolved["gradient_clipping"] == 0.5
    assert resolved["train_batch_size"] == 8 and resolved["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    engine = trainer.tier_engine
    assert engine.global_steps == 6
    assert engine.stats()["links"]["nvme_to_host"]["bytes"] > 0  # parameters came from NVMe

    # Resume from the checkpoint at step 3: steps 4-6 as in the uninterrupted run.
    ckpt = tmp_path / "tier" / "checkpoint-3"
    assert (ckpt / "tier").is_dir()
    engine.destroy()
    resumed = tier.hf.TierTrainer(
        model=make_model(), args=args(tmp_path, "resumed"), train_dataset=Tokens(), tier_config=ds_config(swap_dir)
    )
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert rel(got[3:], losses_of(resumed)[-3:]) <= 1e-5, (got, losses_of(resumed))
    resumed.tier_engine.destroy()


def test_config_and_arguments_that_disagree_are_an_error(swap_dir, tmp_path):
    cfg = ds_config(swap_dir, gradient_accumulation_steps=4, gradient_clipping=1.0)
    cfg["optimizer"]["params"]["lr"] = 1e-3
    trainer = tier.hf.TierTrainer(model=make_model(), args=args(tmp_path, "bad"), train_dataset=Tokens(), tier_config=cfg)
    with pytest.raises(ValueError) as e:
        trainer.train()
    msg = str(e.value)
    for part in ("gradient_accumulation_steps=4", "TrainingArguments.gradient_accumulation_steps=2",
                 "gradient_clipping=1.0", "max_grad_norm=0.5", "optimizer.params.lr=0.001", "learning_rate=0.003"):
        assert part in msg, msg


def test_an_auto_without_counterpart_and_a_client_optimizer_are_refused(swap_dir, tmp_path):
    cfg = ds_config(swap_dir)
    cfg["tier"]["budgets"]["host"] = "auto"  # a tier size: "auto" is its own value there, not filled
    cfg["aio"] = {"block_size": "auto"}
    trainer = tier.hf.TierTrainer(model=make_model(), args=args(tmp_path, "auto"), train_dataset=Tokens(), tier_config=cfg)
    with pytest.raises(ValueError, match="aio.block_size"):
        trainer.train()
    model = make_model()
    with pytest.raises(ValueError, match="optimizers"):
        tier.hf.TierTrainer(
            model=model,
            args=args(tmp_path, "client"),
            train_dataset=Tokens(),
            tier_config=ds_config(swap_dir),
            optimizers=(torch.optim.AdamW(model.parameters()), None),
        )


def other_family(name):
    """Small models of families the other tests do not build: Phi-3 (fused qkv and gate_up
    projections), GPT-J (attention and MLP in parallel, partial rotary), BLOOM (ALiBi, fused
    query_key_value) and Mamba (no attention: a state-space mixer whose forward uses its conv1d's
    and dt_proj's weights without calling them)."""
    torch.manual_seed(0)
    if name == "mamba":
        cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8,
                                       use_cache=False)
        return transformers.MambaForCausalLM(cfg)
    if name == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**SMALL, pad_token_id=0))
    if name == "gptj":
        cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)
        return transformers.GPTJForCausalLM(cfg)
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    return transformers.BloomForCausalLM(cfg)


@pytest.mark.parametrize("family", ["phi3", "gptj", "bloom", "mamba"])
def test_other_families_with_the_trainers_gradient_checkpointing(swap_dir, tmp_path, family):
    """TrainingArguments(gradient_checkpointing=True), as a Trainer user turns it on: the Trainer
    enables it on the model before tier wraps it, and the losses are the plain Trainer's."""
    plain = transformers.Trainer(
        model=other_family(family),
        args=args(tmp_path, "plain", max_steps=4, gradient_checkpointing=True),
        train_dataset=Tokens(),
    )
    plain.train()
    trainer = tier.hf.TierTrainer(
        model=other_family(family),
        args=args(tmp_path, "tier", max_steps=4, gradient_checkpointing=True),
        train_dataset=Tokens(),
        tier_config=ds_config(swap_dir),
    )
    trainer.train()
    expected, got = losses_of(plain), losses_of(trainer)
    assert len(got) == len(expected) == 4
    assert rel(expected, got) <= 1e-5, (expected, got)
    assert trainer.tier_engine.global_steps == 4
    assert trainer.model.is_gradient_checkpointing


class Labelled(torch.utils.data.Dataset):
    """Classification examples: token ids (a text classifier) or 32x32 images (a vision one)."""

    def __init__(self, kind, n=48):
        g = torch.Generator().manual_seed(5)
        self.key = "input_ids" if kind == "bert" else "pixel_values"
        self.x = torch.randint(0, VOCAB, (n, 16), generator=g) if kind == "bert" else torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {self.key: self.x[i], "labels": self.y[i]}


def classifier(kind):
    """An encoder with a classification head: BERT over token ids, ViT over image patches (inputs
    that are not token ids, a head that is not a language model's)."""
    torch.manual_seed(0)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=3,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **shape)
        return transformers.BertForSequenceClassification(cfg)
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, **shape)
    return transformers.ViTForImageClassification(cfg)


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_classifiers_train_and_evaluate_as_with_the_plain_trainer(swap_dir, tmp_path, kind):
    """Sequence and image classification, with gradient checkpointing: the training losses and the
    evaluation loss are the plain Trainer's, and the parameters streamed from NVMe."""
    runs = {}
    for name in ("plain", "tier"):
        kw = dict(model=classifier(kind), args=args(tmp_path, name, max_steps=4, gradient_checkpointing=True),
                  train_dataset=Labelled(kind))
        trainer = (
            tier.hf.TierTrainer(**kw, tier_config=ds_config(swap_dir)) if name == "tier" else transformers.Trainer(**kw)
        )
        trainer.train()
        runs[name] = (trainer, losses_of(trainer), trainer.evaluate(Labelled(kind, 12))["eval_loss"])
    (_, expected, plain_eval), (trainer, got, tier_eval) = runs["plain"], runs["tier"]
    assert len(got) == len(expected) == 4
    # (The clipping norm's summation order differs: a few 1e-6 apart.)
    assert rel(expected, got) <= 2e-5, (expected, got)
    assert abs(tier_eval - plain_eval) <= 2e-5 * abs(plain_eval), (plain_eval, tier_eval)
    stats = trainer.tier_engine.stats()
    assert stats["links"]["nvme_to_host"]["bytes"] > 0 and stats["links"]["host_to_device"]["bytes"] > 0
    trainer.tier_engine.destroy()


def _run_trainer_ranks(tmp_path, world, name, resume_in=None, mode="trainer"):
    """hf_rank.py as `world` ranks (torch.distributed.run for more than one); its report.
    `resume_in`: the folder of an earlier run, resumed from its step-2 checkpoint."""
    import json
    import os
    import socket
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_rank.py")
    d = tmp_path / name
    d.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    cmd = [sys.executable]
    if world > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port)]
    cmd += [worker, mode, str(d / "out.json"), str(d / "swap"), str(resume_in or d), "4"]
    if resume_in is not None:
        cmd.append("resume")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((d / "out.json").read_text())


def _same_masters(two, one):
    assert one["params"].keys() == two["params"].keys()
    moved = 0.0
    for name, ref in one["params"].items():
        a, b = torch.tensor(two["params"][name]), torch.tensor(ref)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (name, (a - b).abs().max().item())
        moved = max(moved, (b - make_model().state_dict()[name].flatten()).abs().max().item())
    assert moved > 1e-3  # the steps trained


def test_accelerate_across_two_ranks_trains_the_engine_as_one_process(tmp_path):
    """accelerate's own loop under torchrun, over the engine of tier.torch.initialize (ZeRO-3):
    prepare() hands the engine back instead of wrapping it in DistributedDataParallel (whose
    hooks made backward fail on the parameters' placeholders), and 2 ranks of 2 sequences end
    with the masters of one process that takes all 4."""
    one = _run_trainer_ranks(tmp_path, 1, "one", mode="accelerate")
    two = _run_trainer_ranks(tmp_path, 2, "two", mode="accelerate")
    assert two["wrapped"] == "TierEngine" and one["steps_run"] == two["steps_run"] == [1, 2, 3, 4]
    _same_masters(two, one)
    # The examples' save: unwrap_model(model).save_pretrained(dir, is_main_process=...,
    # save_function=accelerator.save, state_dict=accelerator.get_state_dict(model)) on every rank.
    assert one["saved_max_diff"] == 0 and two["saved_max_diff"] == 0


def test_two_ranks_under_torchrun_train_as_one_process_and_resume(tmp_path):
    """torchrun with 2 ranks: the Trainer must not put the model into accelerate's
    DistributedDataParallel (the engine reduces the gradients, and under ZeRO-3 DDP's hooks saw
    the parameters' empty placeholders: backward failed with "TBackward0 returned an invalid
    gradient ... expected shape compatible with [0]"). The 2 ranks, 2 sequences each, end with
    the masters of one process that takes all 4; their Trainer checkpoint (every rank saves its
    part) resumes to the same masters."""
    one = _run_trainer_ranks(tmp_path, 1, "one")
    two = _run_trainer_ranks(tmp_path, 2, "two")
    again = _run_trainer_ranks(tmp_path, 2, "again", resume_in=tmp_path / "two")
    ckpt = tmp_path / "two" / "trainer" / "checkpoint-2"
    assert (ckpt / "model.safetensors").exists() or (ckpt / "model.safetensors.index.json").exists()
    assert two["steps_run"] == [1, 2, 3, 4] and again["steps_run"] == [3, 4]
    assert two["params"] == again["params"]  # bit for bit
    assert two["world"] == 2 and two["wrapped"] == "TierEngine"
    _same_masters(two, one)


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    """load_best_model_at_end: the engine restores the best checkpoint (the Trainer's own path copied
    the weights into the model's parameters, which under ZeRO-3 are empty placeholders: "size
    mismatch ... the shape in current model is torch.Size([0])"). With greater_is_better the best
    is the first evaluation's (the loss falls), so what is restored is not what training left."""
    ta = args(tmp_path, "best", max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2,
              per_device_eval_batch_size=4, load_best_model_at_end=True, metric_for_best_model="loss",
              greater_is_better=True, save_total_limit=2)
    trainer = tier.hf.TierTrainer(model=make_model(), args=ta, train_dataset=Tokens(), eval_dataset=Tokens(n=8),
                                  tier_config=ds_config(str(tmp_path / "swap")))
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert sorted(evals) == [2, 4, 6] and evals[2] > evals[6]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[2], rel=1e-6)


def test_save_only_model_with_load_best_model_at_end_is_refused_at_once(tmp_path):
    ta = args(tmp_path, "refused", eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True,
              save_only_model=True)
    with pytest.raises(ValueError, match="save_only_model=True along with load_best_model_at_end"):
        tier.hf.TierTrainer(model=make_model(), args=ta, train_dataset=Tokens(), eval_dataset=Tokens(n=8),
                            tier_config=ds_config(str(tmp_path / "swap")))


def test_a_model_built_under_tier_init_trains_in_the_trainer_as_the_eager_one(tmp_path):
    """The Trainer moves its model to the device when it is created; a model built under
    tier.torch.init has its parameters in the engine (meta tensors) and is placed by it instead."""
    swaps = [tmp_path / "eager-swap", tmp_path / "init-swap"]
    for s in swaps:
        s.mkdir()
    eager = tier.hf.TierTrainer(model=make_model(), args=args(tmp_path, "eager", max_steps=3, save_strategy="no"),
                                train_dataset=Tokens(), tier_config=ds_config(str(swaps[0])))
    eager.train()
    torch.manual_seed(0)
    with tier.torch.init(ds_config(str(swaps[1]))):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    assert all(p.device.type == "meta" for p in model.parameters())
    staged = tier.hf.TierTrainer(model=model, args=args(tmp_path, "init", max_steps=3, save_strategy="no"),
                                 train_dataset=Tokens(), tier_config=ds_config(str(swaps[1])))
    staged.train()
    assert losses_of(staged) == losses_of(eager) and len(losses_of(eager)) == 3
