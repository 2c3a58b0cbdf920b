"""The LoRA adapter's round trip through plain PEFT, at any preset (issue #33: 7b-lora).

Runs the main job (``python -m tier.examples.finetune_llama --preset P --save-adapter DIR``) in a
process of its own, which trains the adapter over the streamed base and saves, beside it, the
trained model's logits on a fixed probe. Then, once that process has exited (its memory given
back), builds the base eagerly with plain transformers (the same seed and dtype, so the same
weights tier.torch.init built), loads the adapter with ``peft.PeftModel.from_pretrained`` and
compares its logits on the probe with tier's: the target is equal to 1e-5 (``torch.allclose``
with rtol = atol = 1e-5). The plain side holds the whole base in host memory: 13.5 GB for
7b-lora.

    TIER_BUDGETS_HOST=2G python3 bench/lora_roundtrip.py --preset 7b-lora --steps 3 \\
        --swap-dir /path/on/nvme [--layers 2] [--json]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="7b-lora")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="run K of the preset's layers (0: all)")
    p.add_argument("--swap-dir", required=True)
    p.add_argument("--adapter-dir", help="where the adapter goes (default: a temporary folder, removed)")
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    from tier.examples import finetune_llama

    keep = args.adapter_dir is not None
    adapter = args.adapter_dir or tempfile.mkdtemp(prefix="tier-adapter-")
    job = [sys.executable, "-m", "tier.examples.finetune_llama", "--preset", args.preset, "--steps",
           str(args.steps), "--swap-dir", args.swap_dir, "--save-adapter", adapter, "--json"]
    if args.layers:
        job += ["--layers", str(args.layers)]
    env = dict(os.environ)
    env.setdefault("TIER_BUDGETS_HOST", "2G")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(HERE, "..", "python"), env.get("PYTHONPATH")]))
    print("tier run: " + " ".join(job), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    run = subprocess.run(job, env=env, stdout=subprocess.PIPE, text=True)
    tier_seconds = time.perf_counter() - t0
    if run.returncode != 0:
        print(run.stdout[-4000:], file=sys.stderr)
        print(f"lora_roundtrip: the main job failed (exit {run.returncode})", file=sys.stderr)
        return 1
    out = run.stdout
    summary = json.loads(out[out.index("{\n"):])["summary"]

    # The same arguments the job resolved (the preset's widths, --layers), for the plain build.
    job_args = finetune_llama.resolve_args(job[3:])
    probe = torch.load(os.path.join(adapter, finetune_llama.PROBE_FILE))
    print(f"plain PEFT: building the base eagerly ({summary['parameters'] / 1e9:.2f} B parameters in "
          f"{job_args.dtype}) and loading the adapter", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    timings = {}
    plain = finetune_llama.plain_peft_logits(job_args, adapter, probe["input_ids"], timings)
    plain_seconds = time.perf_counter() - t0
    mine = probe["logits"]
    diff = (plain - mine).abs()
    ok = bool(torch.allclose(plain, mine, rtol=args.tolerance, atol=args.tolerance))
    result = {
        "preset": args.preset,
        "layers": job_args.layers,
        "parameters": summary["parameters"],
        "steps": args.steps,
        "losses": [summary["first_loss"], summary["last_loss"]],
        # One fixed batch before the first step and after the last: whether the adapter learned.
        "held_out_losses": [summary["held_out_loss_before"], summary["held_out_loss_after"]],
        "tier_peak_rss_bytes": summary["peak_rss_bytes"],
        "tier_seconds": tier_seconds,
        "plain_seconds": plain_seconds,
        # The build into the engine against torch's eager init of the same model (no tier, nothing
        # written): what the build would take if writing cost nothing.
        "build_seconds": summary["build_seconds"],
        "build_bytes_written": summary["build_bytes_written"],
        "build_write_rate": summary["build_bytes_written"] / summary["build_seconds"],
        "eager_init_seconds": timings["init_seconds"],
        "build_over_eager_init": summary["build_seconds"] / timings["init_seconds"],
        "plain_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "probe_tokens": int(probe["input_ids"].numel()),
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float((diff / mine.abs().clamp_min(1e-6)).max()),
        "logits_abs_max": float(mine.abs().max()),
        "tolerance": args.tolerance,
        "pass": ok,
    }
    if not keep:
        import shutil

        shutil.rmtree(adapter, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.preset} ({result['parameters'] / 1e9:.2f} B params, {result['layers']} layers): "
              f"loss {result['losses'][0]:.3f} -> {result['losses'][1]:.3f} (held-out batch "
              f"{result['held_out_losses'][0]:.4f} -> {result['held_out_losses'][1]:.4f}), tier peak RSS "
              f"{result['tier_peak_rss_bytes'] / 2**30:.2f} GiB in {tier_seconds:.0f} s")
        print(f"build: {result['build_seconds']:.0f} s, {result['build_write_rate'] / 2**20:.0f} MiB/s written; "
              f"torch's eager init of the same model alone: {result['eager_init_seconds']:.0f} s "
              f"(build / init {result['build_over_eager_init']:.2f})")
        print(f"plain PEFT logits on {result['probe_tokens']} probe tokens: max |diff| {result['max_abs_diff']:.3g} "
              f"(logits up to {result['logits_abs_max']:.3g}); equal to {args.tolerance:g}: "
              f"{'pass' if ok else 'MISS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
