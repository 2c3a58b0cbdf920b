"""Kill a training process with SIGKILL many times, at random points of its checkpoint saves and
training steps, and check after every kill that the newest checkpoint loads and continues
exactly like an uninterrupted run (the harness of tests/python/test_checkpoint_safety.py, at
length).

    python bench/checkpoint_kill.py [--kills 500] [--seed 0] [--dir /tmp/x] [--json]

Needs tier on the Python path (pip install ., or PYTHONPATH=build/python). Exits 1 on the first
kill after which no good checkpoint loads or the resumed losses differ.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

import ckpt_kill_child as kc  # noqa: E402


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=500, help="SIGKILL rounds")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    p.add_argument("--dir", help="work folder (default: a new temporary one, removed at the end)")
    p.add_argument("--verbose", action="store_true", help="a line per kill")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="tier-ckpt-kill-", dir=args.dir)
    try:
        try:
            s = kc.run_kills(args.kills, work, seed=args.seed, log=print if args.verbose else None)
        except AssertionError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "kills": s["kills"],
        "killed_in_save": s["in_save"],
        "killed_in_step": s["in_train"],
        "killed_before_first_checkpoint": s["no_checkpoint_yet"],
        "all_resumed_exactly": True,
        "highest_step": s["max_step"],
        "seconds": s["seconds"],
        "save_ms_median": 1e3 * pct(s["save_seconds"], 0.5),
        "save_ms_p99": 1e3 * pct(s["save_seconds"], 0.99),
        "step_ms_median": 1e3 * pct(s["step_seconds"], 0.5),
        "load_ms_median": 1e3 * pct(s["load_seconds"], 0.5),
        "versions_left": s["versions_left"],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{summary['kills']} SIGKILLs ({summary['killed_in_save']} during a save, {summary['killed_in_step']} "
              f"during a step, {summary['killed_before_first_checkpoint']} before the first checkpoint) in "
              f"{summary['seconds']:.1f} s: after every one the newest checkpoint loaded and training from it "
              f"matched the uninterrupted run bit for bit (highest step {summary['highest_step']})")
        print(f"save {summary['save_ms_median']:.1f} ms median, {summary['save_ms_p99']:.1f} ms p99; "
              f"step {summary['step_ms_median']:.1f} ms; load {summary['load_ms_median']:.1f} ms; "
              f"{summary['versions_left']} version directories left (one per tag, plus the last kill's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
