#!/usr/bin/env python3
"""The main job (tier.examples.finetune_llama) trained with fp32, bf16 and int8 optimizer moments
(tier.optimizer.state_dtype), everything else equal, and the final losses compared with fp32's.

    python bench/state_dtype_accuracy.py [--steps 200] [--swap-dir DIR] [--json]

Each run is the example's own process with its built-in config plus the state dtype, so the
comparison is the whole training: same model, data order, schedule and clipping. The final loss is
the mean of the last 10 steps' losses (one step's loss depends on its batch). Targets (issue #16):
bf16 within 1% and int8 within 2% of fp32.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, sd, swap, corpus):
    from tier.examples import finetune_llama as ex

    ns = argparse.Namespace(steps=args.steps, gas=2, batch=4, seq=128, hidden=256, layers=4, heads=8, lr=2e-3,
                            seed=0, device_fraction=0.4, device_budget=0, swap_dir=swap)
    cfg = ex.default_config(ns, ex.model_shape(ns))
    cfg.setdefault("tier", {}).setdefault("optimizer", {})["state_dtype"] = sd
    path = os.path.join(swap, f"config-{sd}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = subprocess.run(
        [sys.executable, "-m", "tier.examples.finetune_llama", "--steps", str(args.steps), "--config", path,
         "--swap-dir", swap, "--corpus", corpus, "--json"],
        capture_output=True, text=True, timeout=7200,
    )
    if out.returncode != 0:
        sys.exit(f"state_dtype_accuracy.py: the {sd} run failed:\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout[out.stdout.index("\n{") + 1:] if not out.stdout.startswith("{") else out.stdout)
    losses = [h["loss"] for h in summary["history"]]
    return {"final_loss": sum(losses[-10:]) / len(losses[-10:]), "first_loss": losses[0], "losses": losses}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    swap = tempfile.mkdtemp(prefix="tier-sd-acc-", dir=args.swap_dir)
    # The corpus (tier's docs) copied once, so that every run trains on the same bytes even if the
    # docs change meanwhile.
    corpus = os.path.join(swap, "corpus")
    shutil.copytree(os.path.join(HERE, "..", "docs"), corpus)
    try:
        runs = {sd: run(args, sd, swap, corpus) for sd in ("fp32", "bf16", "int8")}
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    base = runs["fp32"]["final_loss"]
    rows = {sd: {"final_loss": r["final_loss"], "first_loss": r["first_loss"],
                 "relative_to_fp32": (r["final_loss"] - base) / base} for sd, r in runs.items()}
    if args.json:
        print(json.dumps({"steps": args.steps, "runs": rows}, indent=1))
        return
    print(f"main job, {args.steps} steps; final loss = mean of the last 10 steps")
    print("| state dtype | first loss | final loss | vs fp32 | target |")
    print("|---|---|---|---|---|")
    for sd, r in rows.items():
        target = {"fp32": "", "bf16": "within 1%", "int8": "within 2%"}[sd]
        print(f"| {sd} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | {100 * r['relative_to_fp32']:+.2f}% | {target} |")


if __name__ == "__main__":
    main()
