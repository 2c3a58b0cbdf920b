"""One rank of a Hugging Face training loop over tier, started as torchrun starts ranks (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment; accelerate's state joins the
process group), or alone without them. test_hf_trainer.py starts it.

argv: mode out_json swap_dir work_dir global_batch [resume]. mode "trainer": tier.hf.TierTrainer;
mode "accelerate": accelerate's own loop (prepare, accumulate, backward, step) over the engine of
tier.torch.initialize; modes "generate" and "modify": see generate_ragged and modify_on_one_rank. Trains 4 optimizer steps of the test's small
Qwen2 with a global batch of `global_batch` sequences (split evenly over the ranks) and
accumulation 2, then rank 0 writes every parameter's fp32 master (a collective across ranks) and
the Trainer's last logged loss. Every run saves a Trainer checkpoint at step 2; with `resume`
the run starts from that checkpoint of the run in work_dir instead (trains steps 3 and 4)."""

import faulthandler
import json
import os
import pathlib
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tier.hf  # noqa: E402
import tier.torch  # noqa: E402
from test_hf_trainer import Tokens, args, ds_config, make_model  # noqa: E402


def main():
    faulthandler.enable(all_threads=True)
    mode, out, swap, work, global_batch = sys.argv[1], sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4]), int(sys.argv[5])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if mode == "generate":
        generate_ragged(swap, out, rank, world)
    if mode == "modify":
        modify_on_one_rank(swap, out, rank, world)
    saved = None
    if mode == "accelerate":
        engine, wrapped, steps_run = accelerate_loop(swap, rank, world, global_batch)
        saved = work / "pretrained"  # written as transformers' no_trainer examples write it
    else:
        engine, wrapped, steps_run = trainer_run(swap, work, rank, world, global_batch, sys.argv[6:] == ["resume"])
    masters = engine.state_dict_fp32()  # every rank takes part
    if saved is not None:
        accelerator = accelerate_state["accelerator"]
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(engine).save_pretrained(
            saved, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(engine))
        accelerator.wait_for_everyone()
    if rank == 0:
        report = {
            "world": world,
            "wrapped": wrapped,
            "steps_run": steps_run,
            "params": {k: v.flatten().tolist() for k, v in masters.items()},
        }
        if saved is not None:
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
            report["saved_max_diff"] = max((reloaded[k] - v.view(reloaded[k].shape)).abs().max().item()
                                           for k, v in masters.items())
        pathlib.Path(out).write_text(json.dumps(report))
    finish(engine, world)


def finish(engine, world):
    """Tears the rank down and exits 0."""
    engine.destroy()
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch keeps the Gloo group's threads past destroy (see multirank_worker.py)


accelerate_state = {}


def plain_config(swap, rank, **top):
    """The test's DeepSpeed config for an engine made directly (not by the Trainer): without the
    "auto" values the Trainer fills, fp32, lr 1e-3; ``top`` sets top-level keys."""
    cfg = ds_config(f"{swap}/rank{rank}")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping"):
        cfg.pop(key)
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        cfg["zero_optimization"].pop(key)
    cfg["optimizer"]["params"] = {"lr": 1e-3}
    cfg["bf16"] = {"enabled": False}
    cfg.update(top)
    return cfg


def modify_on_one_rank(swap, out, rank, world):
    """engine.modify_parameters with modifier_rank 1 (stage 3 across ranks): rank 1 halves
    lm_head and rank 0 multiplies it by 7, which must not count; rank 0 writes the gathered
    masters and the logits of a forward after it."""
    if world > 1:
        torch.distributed.init_process_group("gloo")
    cfg = plain_config(swap, rank)
    model = make_model()
    engine, _, _, _ = tier.torch.initialize(model=model, config=cfg)
    modifier = world - 1
    with engine.modify_parameters([model.lm_head.weight], modifier_rank=modifier):
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5 if rank == modifier else 7.0)
    with torch.no_grad():
        logits = engine(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    masters = engine.state_dict_fp32()
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps({
            "world": world, "logits": logits.flatten().tolist(),
            "lm_head": masters["lm_head.weight"].flatten().tolist()}))
    finish(engine, world)


def generate_ragged(swap, out, rank, world):
    """Greedy generate on a training engine (stage 3 across ranks) where rank 1's sequence ends
    at its first token (its eos) and rank 0's runs 6 tokens: rank 0 writes its token ids."""
    if world > 1:
        torch.distributed.init_process_group("gloo")  # (the Trainer's and accelerate's state do this)
    cfg = plain_config(swap, rank)  # (with its optimizer: an inference-only engine spans one process)
    engine, _, _, _ = tier.torch.initialize(model=make_model(), config=cfg)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        first = engine.module.generate(ids, max_new_tokens=1, do_sample=False)[0, -1].item()
        got = engine.module.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                     eos_token_id=first if rank == 1 else None)
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps({"world": world, "ids": got[0].tolist()}))
    finish(engine, world)


def accelerate_loop(swap, rank, world, global_batch):
    import accelerate

    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    accelerate_state["accelerator"] = accelerator
    cfg = plain_config(swap, rank, gradient_accumulation_steps=2, gradient_clipping=0.5)
    cfg["optimizer"]["params"] = {"lr": 3e-3, "weight_decay": 0.01}
    engine, optimizer, _, _ = tier.torch.initialize(model=make_model(), config=cfg)
    loader = torch.utils.data.DataLoader(Tokens(n=32), batch_size=global_batch // world, shuffle=False)
    model, optimizer, loader = accelerator.prepare(engine, optimizer, loader)
    steps_run = []
    for micro in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**micro).loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps_run.append(len(steps_run) + 1)
    return engine, type(model).__name__, steps_run


def trainer_run(swap, work, rank, world, global_batch, resume):
    ta = args(work, "trainer", max_steps=4, per_device_train_batch_size=global_batch // world,
              save_strategy="steps", save_steps=2, report_to=[], dataloader_drop_last=True)
    steps_run = []

    class Count(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            steps_run.append(state.global_step)

    trainer = tier.hf.TierTrainer(model=make_model(), args=ta, train_dataset=Tokens(),
                                  tier_config=ds_config(f"{swap}/rank{rank}"), callbacks=[Count()])
    trainer.train(resume_from_checkpoint=str(work / "trainer" / "checkpoint-2") if resume else None)
    return trainer.tier_engine, type(trainer.model_wrapped).__name__, steps_run


if __name__ == "__main__":
    main()
