"""One rank of a multi-rank tier.torch run (tests/python/test_multirank.py starts several).

Trains a small model for --steps steps with a global batch of --global-batch sequences per
micro-step, split evenly over the ranks, and writes a JSON report (the global loss of every
micro-step, this rank's NVMe and host figures, the final fp32 masters' checksum) to --out.
--world 1 runs in one process without torch.distributed: the reference.
"""

import argparse
import datetime
import faulthandler
import json
import os
import sys

import torch
import transformers

import tier.torch

VOCAB = 256
SEQ = 16
LR = 3e-3


def make_model(family):
    """A 2-layer model of ``family``: llama, gpt_neox, or qwen2 (tied embeddings)."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ * 2,
    )
    families = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False)),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(tie_word_embeddings=False)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    }
    if family not in families:
        raise SystemExit(f"unknown family {family}")
    config_cls, model_cls, extra = families[family]
    cfg = getattr(transformers, config_cls)(**shape, **extra)
    return getattr(transformers, model_cls)(cfg)


def config(args, swap):
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": args.clip,
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": args.bucket,
            "offload_param": {"device": args.param_home, "nvme_path": swap, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pin_memory": True},
        },
        "aio": {"block_size": 65536, "queue_depth": 8},
        "tier": {
            "device": os.environ.get("TIER_TEST_DEVICE", "emulated"),
            "budgets": {"device": args.device_budget, "host": "16M", "nvme": "64M"},
            "optimizer": {"buffer_bytes": "1M", "overlap": args.overlap},
        },
    }
    if args.offload_activations != "none":
        cfg["tier"]["activations"] = {"offload": args.offload_activations}
    if args.lr_mismatch and args.rank == 1:
        cfg["optimizer"]["params"]["lr"] = LR * 2
    return cfg


def batch(step, rank, world, global_batch):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    per = global_batch // world
    mine = ids[rank * per : (rank + 1) * per]
    return {"input_ids": mine, "labels": mine.clone()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--family", default="llama")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--start", type=int, default=0, help="first step (after --load)")
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--bucket", type=int, default=20000)
    p.add_argument("--param-home", default="nvme")
    p.add_argument("--overlap", default="exact")
    p.add_argument("--swap", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--save", default="", help="save a checkpoint here after the last step")
    p.add_argument("--load", default="", help="load the checkpoint here before training")
    p.add_argument("--die-after", type=int, default=-1, help="rank 1 exits abruptly after this step")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--lr-mismatch", action="store_true", help="rank 1 uses another lr (must be refused)")
    p.add_argument("--inf-at-step", type=int, default=-1, help="rank 1's loss is inf in this step")
    p.add_argument("--plain-backward", action="store_true", help="loss.backward() instead of engine.backward")
    p.add_argument("--caller-loop", action="store_true",
                   help="loss.backward() each micro-step, and the optimizer's step() and zero_grad() only at the "
                        "accumulation boundary (accelerate's loop); no engine.step()")
    p.add_argument("--checkpointing", default="none", choices=["none", "reentrant", "nonreentrant"],
                   help="transformers' gradient checkpointing")
    p.add_argument("--device-budget", default="160K")
    p.add_argument("--offload-activations", default="none", choices=["none", "host", "nvme"])
    args = p.parse_args()
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack

    if args.world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.world,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
    torch.set_num_threads(1)
    model = make_model(args.family)
    if args.checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.checkpointing == "reentrant"}
        )
        model.train()
    engine, optimizer, _, _ = tier.torch.initialize(model, config(args, args.swap))
    if args.load:
        engine.load_checkpoint(args.load)
    report = {"losses": [], "grad_norms": []}
    for step in range(args.start, args.steps):
        for micro in range(args.gas):
            b = batch(step * args.gas + micro, args.rank, args.world, args.global_batch)
            out = engine(**{k: v.to(engine.device) for k, v in b.items()})
            report["losses"].append(float(out.loss.detach()))
            loss = out.loss
            if step == args.inf_at_step and args.rank == 1:
                loss = loss * float("inf")  # its gradients are inf/nan: every rank must skip the step
            if args.caller_loop:
                (loss / args.gas).backward()
                if micro == args.gas - 1:
                    optimizer.step()
                    optimizer.zero_grad()
                continue
            if args.plain_backward:  # a loop of the caller's own: the gradients reach tier through hooks only
                (loss / args.gas).backward()
            else:
                engine.backward(loss)
            engine.step()
        report["grad_norms"].append(engine.get_global_grad_norm())
        if step == args.die_after and args.rank == 1:
            sys.stdout.flush()
            os._exit(3)
    if args.world > 1:  # the global batch's loss: the mean of the ranks' (equal shares)
        losses = torch.tensor(report["losses"], dtype=torch.float64)
        dist.all_reduce(losses)
        report["losses"] = (losses / args.world).tolist()
    if args.save:
        # The files are hashed as they are written: a save that reads one back to hash it fails.
        from tier.torch import checkpoint as _ck

        def read_back(path):
            raise AssertionError(f"the save read {path} back to hash it")

        _ck._sha256_file = read_back
        engine.save_checkpoint(args.save)
    masters = engine.state_dict_fp32()
    report["master_sum"] = float(sum(float(t.double().sum()) for t in masters.values()))
    report["master_abs_sum"] = float(sum(float(t.double().abs().sum()) for t in masters.values()))
    sd = engine.module_state_dict()
    report["param_sum"] = float(sum(float(t.double().sum()) for t in sd.values() if t.is_floating_point()))
    stats = engine.stats()
    # The state's share: each rank's optimizer also keeps a few spare chunks (state_copies 1).
    report["optimizer_nvme_bytes"] = stats["optimizer"]["nvme_bytes"] - stats["optimizer"]["spare_bytes"]
    # With one copy every slot holds a whole chunk's record, the short last chunk's too.
    report["optimizer_chunk_bytes"] = stats["optimizer"]["spare_bytes"] / max(1, stats["optimizer"]["spare_slots"])
    report["optimizer_elements"] = stats["optimizer"]["elements"]
    report["nvme_peak_bytes"] = stats["tiers"]["nvme"]["peak_bytes"]
    report["zero"] = stats.get("zero")
    report["activations_offloaded"] = engine._activations.offloaded if engine._activations is not None else 0
    report["skipped_steps"] = engine.skipped_steps
    report["global_steps"] = engine.global_steps
    with open(args.out, "w") as f:
        json.dump(report, f)
    engine.destroy()
    if args.world > 1:
        dist.destroy_process_group()
        print(f"rank {args.rank}: torn down", file=sys.stderr, flush=True)
        # torch keeps a Gloo group (and its worker threads) referenced past destroy_process_group;
        # met by the interpreter's finalization, those threads once aborted a rank that had finished
        # ("terminate called without an active exception"). Nothing is left to check: skip it.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
