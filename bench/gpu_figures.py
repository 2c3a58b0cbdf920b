#!/usr/bin/env python3
"""The figures of a bench/gpu_check.sh run as one JSON line (copy rates and ratios beside
cudaMemcpyAsync, the Llama step time), read from its log directory: copy.json and llama.json.

    python3 bench/gpu_figures.py LOG_DIR            # the JSON line
    python3 bench/gpu_figures.py --llama-row LOG_DIR  # the Llama step's line of the summary table
"""

import json
import os
import sys


def llama(log_dir):
    with open(os.path.join(log_dir, "llama.json")) as f:
        out = f.read()
    j = json.loads(out[out.index("{\n"):])
    s, h = j["summary"], j["history"]
    later = sorted(x["seconds"] for x in h[1:]) or [h[0]["seconds"]]
    return s, later[len(later) // 2]


def figures(log_dir):
    fig = {}
    try:
        with open(os.path.join(log_dir, "copy.json")) as f:
            c = json.load(f)
        for k in ("h2d", "d2h"):
            fig[k + "_bytes_per_second"] = c[k + "_bytes_per_second"]
            fig[k + "_reference_bytes_per_second"] = c["reference_" + k + "_bytes_per_second"]
            fig[k + "_ratio"] = c[k + "_ratio"]
    except (OSError, ValueError, KeyError):
        pass
    try:
        s, step = llama(log_dir)
        fig.update(
            llama_parameters=s["parameters"],
            llama_device=s["device"],
            llama_step_seconds=step,
            llama_tokens_per_second=s["tokens_per_second"],
            llama_stall_seconds=s["stall_seconds"],
            llama_peak_rss_bytes=s["peak_rss_bytes"],
            llama_phase_seconds=s["phase_seconds"],
        )
    except (OSError, ValueError, KeyError):
        pass
    return fig


def main(argv):
    if len(argv) == 2 and argv[0] == "--llama-row":
        s, step = llama(argv[1])
        print(f"{s['parameters'] / 1e6:.0f}M params on {s['device']}: {step:.3f} s/step (median after the first), "
              f"{s['tokens_per_second']:.0f} tok/s, stall {s['stall_seconds']:.2f} s, "
              f"peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB")
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(figures(argv[0]), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
