"""Kill -9 harness for tier.torch checkpoints, used by test_checkpoint_safety.py and
bench/checkpoint_kill.py.

A *zygote* process imports torch and tier once and forks one trainer per round, so each round
costs a fork, not an interpreter start. A trainer resumes from the newest checkpoint (if any),
then loops forever: STEPS_PER_SAVE optimizer steps, then a save under a tag from TAGS (the same tag twice
in a row, so ``latest``'s own tag is overwritten, and other existing tags). It logs
``ready``/``save-begin``/``saved`` lines with a monotonic timestamp to a progress file. The
driver kills it with SIGKILL at a random point of a save or of a training step, then checks in
its own process that:

- the newest checkpoint loads, and is no older than the last save the trainer reported done
  (and no newer than the save in flight, which may have completed);
- its client state (the step and the losses the trainer saw) matches an uninterrupted reference
  run, so every resumed trainer continued exactly where the saved one stopped;
- two steps trained from it give bit-identical losses, and then bit-identical fp32 master
  params, to the uninterrupted reference run.

The reference and the verifying engine live in the driver; the model is a small MLP with one
frozen layer (so frozen.bin is exercised), state homed in host memory, on the emulated device.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import torch

import tier.torch

SEED = 7
TAGS = ("rolling", "rolling", "a", "rolling", "b")
STEPS_PER_SAVE = 3  # so that a trainer spends about as long training as saving
LR = 1e-2
GAS = 2


def make_model(seed=SEED):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 48), torch.nn.Tanh(),
        torch.nn.Linear(48, 48), torch.nn.Tanh(),
        torch.nn.Linear(48, 4),
    )
    model[2].weight.requires_grad_(False)  # a frozen parameter: stored in frozen.bin
    return model


def config(swap_dir):
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                      "warmup_num_steps": 10, "warmup_type": "linear"}},
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "nvme_path": swap_dir},
            "offload_optimizer": {"device": "cpu", "nvme_path": swap_dir},
        },
        "tier": {"device": "emulated", "budgets": {"device": "64K", "host": "16M", "nvme": "16M"}},
    }


def new_engine(swap_dir, seed=SEED):
    return tier.torch.initialize(make_model(seed), config(swap_dir))[0]


def train_step(engine):
    """One optimizer step; the batches come from torch's global RNG, so resuming is exact only if
    the checkpoint restored it."""
    losses = []
    for _ in range(GAS):
        x = torch.randn(8, 16)
        y = torch.sin(x[:, :4] * 2.0)
        out = engine(x)
        loss = torch.nn.functional.mse_loss(out, y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


# ---------------------------------------------------------------------------- trainer (child)
def trainer(ckpt_dir, swap_dir, progress):
    fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def log(*words):
        os.write(fd, (" ".join(str(w) for w in (time.monotonic(),) + words) + "\n").encode())

    engine = new_engine(swap_dir)
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        engine.load_checkpoint(ckpt_dir)
    log("ready", engine.global_steps)
    while True:
        for _ in range(STEPS_PER_SAVE):
            losses = train_step(engine)
        k = engine.global_steps
        tag = TAGS[k % len(TAGS)]
        log("save-begin", k, tag)
        engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"step": k, "losses": losses})
        log("saved", k, tag)


def zygote():
    """Reads ``run <ckpt_dir> <swap_dir> <progress>`` lines; forks a trainer for each, answers
    ``pid <pid>``, waits for it and answers ``exit <status>``."""
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                torch.set_num_threads(1)
                trainer(*words[1:4])
            except BaseException as e:  # noqa: BLE001 - reported through the exit status
                sys.stderr.write(f"trainer: {type(e).__name__}: {e}\n")
                code = 3
            os._exit(code)
        print("pid", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)


# ---------------------------------------------------------------------------- driver
class Reference:
    """An uninterrupted run from the same start, extended on demand. Its RNG state is kept aside
    so it does not disturb the verifier's (both use torch's global generator)."""

    def __init__(self, swap_dir):
        self.engine = new_engine(swap_dir)
        self.rng = torch.get_rng_state()
        self.losses = []  # per step: the GAS micro-batch losses
        self.params = []  # per step: the fp32 masters after it

    def upto(self, steps):
        if len(self.losses) < steps:
            keep = torch.get_rng_state()
            torch.set_rng_state(self.rng)
            while len(self.losses) < steps:
                self.losses.append(train_step(self.engine))
                self.params.append(self.engine.state_dict_fp32())
            self.rng = torch.get_rng_state()
            torch.set_rng_state(keep)
        return self.losses[:steps]


def _read_progress(path):
    try:
        with open(path) as f:
            return [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _wait_for(path, pred, timeout, proc_pid):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        lines = _read_progress(path)
        if pred(lines):
            return lines
        time.sleep(0.001)
    raise TimeoutError(f"trainer {proc_pid}: no progress in {timeout} s (log: {lines[-3:]})")


def run_kills(kills, workdir, seed=0, log=None, timeout=60.0):
    """Runs ``kills`` SIGKILL rounds; returns a summary dict. Raises AssertionError on the first
    round whose checkpoint does not load or does not continue exactly."""
    rnd = random.Random(seed)
    log = log or (lambda *a: None)
    ckpt = os.path.join(workdir, "ckpt")
    for d in ("ref-swap", "verify-swap"):
        os.makedirs(os.path.join(workdir, d), exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here] + [p for p in sys.path if p]))
    zyg = subprocess.Popen([sys.executable, os.path.abspath(__file__), "zygote"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
    summary = {"kills": 0, "in_save": 0, "in_train": 0, "no_checkpoint_yet": 0, "resumed": 0, "max_step": 0,
               "load_seconds": [], "save_seconds": [], "step_seconds": [], "versions_left": None}
    try:
        ref = Reference(os.path.join(workdir, "ref-swap"))
        verifier = new_engine(os.path.join(workdir, "verify-swap"), seed=SEED + 1)
        durable = None  # the newest step any trainer reported saved
        save_est, step_est = 0.02, 0.01
        t0 = time.monotonic()
        for round_ in range(kills):
            swap = os.path.join(workdir, f"swap-{round_}")
            os.makedirs(swap)
            progress = os.path.join(workdir, f"progress-{round_}.log")
            zyg.stdin.write(f"run {ckpt} {swap} {progress}\n")
            zyg.stdin.flush()
            answer = zyg.stdout.readline().split()
            assert answer and answer[0] == "pid", f"zygote answered {answer!r}"
            pid = int(answer[1])
            lines = _wait_for(progress, lambda ls: any(w[1] == "ready" for w in ls), timeout, pid)
            # Random, but leaning towards the phase hit less so far (a kill aimed at a step may still
            # land in the next save), so both are covered whatever the timing of the machine.
            if summary["in_save"] == summary["in_train"]:
                phase = rnd.choice(("save", "train"))
            else:
                phase = "save" if summary["in_save"] < summary["in_train"] else "train"
            if phase == "save":
                # Wait for a save to start, then kill somewhere inside it.
                _wait_for(progress, lambda ls: ls[-1][1] == "save-begin", timeout, pid)
                time.sleep(rnd.uniform(0, save_est * 1.2))
            else:
                # Wait for a step to start (after ready or a finished save), then kill inside it.
                n = len(lines)
                _wait_for(progress, lambda ls: len(ls) > n and ls[-1][1] == "saved", timeout, pid)
                time.sleep(rnd.uniform(0, step_est * STEPS_PER_SAVE * 0.9))
            os.kill(pid, signal.SIGKILL)
            answer = zyg.stdout.readline().split()
            assert answer and answer[0] == "exit", f"zygote answered {answer!r}"
            status = int(answer[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"round {round_}: the trainer ended by itself (status {status}) before the kill")
            shutil.rmtree(swap, ignore_errors=True)
            lines = _read_progress(progress)
            summary["kills"] += 1
            summary["in_save" if lines[-1][1] == "save-begin" else "in_train"] += 1
            # Duration estimates for the next kills, from this trainer's own log.
            for a, b in zip(lines, lines[1:]):
                dt = float(b[0]) - float(a[0])
                if a[1] == "save-begin" and b[1] == "saved":
                    summary["save_seconds"].append(dt)
                elif b[1] == "save-begin":
                    summary["step_seconds"].append(dt / STEPS_PER_SAVE)
            if summary["save_seconds"]:
                save_est = sorted(summary["save_seconds"])[len(summary["save_seconds"]) // 2]
            if summary["step_seconds"]:
                step_est = sorted(summary["step_seconds"])[len(summary["step_seconds"]) // 2]
            acked = [int(w[2]) for w in lines if w[1] == "saved"]
            begun = [int(w[2]) for w in lines if w[1] == "save-begin"]
            if acked:
                durable = max(acked + ([durable] if durable is not None else []))
            if not os.path.exists(os.path.join(ckpt, "latest")):
                assert durable is None, f"round {round_}: 'latest' is gone although step {durable} was saved"
                summary["no_checkpoint_yet"] += 1
                continue

            t_load = time.monotonic()
            _, client = verifier.load_checkpoint(ckpt)
            summary["load_seconds"].append(time.monotonic() - t_load)
            k = verifier.global_steps
            low = durable if durable is not None else 1
            high = max(begun + [durable or 0])
            assert low <= k <= high, (
                f"round {round_}: loaded step {k}, but step {durable} was the last reported saved and {high} the "
                f"newest begun (killed in {lines[-1][1]})")
            expected = ref.upto(k + 2)
            assert client["step"] == k
            assert client["losses"] == expected[k - 1], (
                f"round {round_}: the trainer's losses at step {k} differ from the uninterrupted run")
            got = [train_step(verifier), train_step(verifier)]
            assert got == expected[k:k + 2], (
                f"round {round_}: training continued from step {k} gives {got}, "
                f"the uninterrupted run {expected[k:k + 2]}")
            params = verifier.state_dict_fp32()
            for name, want in ref.params[k + 1].items():
                assert torch.equal(params[name], want), (
                    f"round {round_}: two steps from step {k} give other values of {name} than the uninterrupted run")
            summary["resumed"] += 1
            summary["max_step"] = max(summary["max_step"], k)
            if durable is None or k > durable:
                durable = k
            log(f"kill {round_ + 1}/{kills}: in {'save' if lines[-1][1] == 'save-begin' else 'train'}, "
                f"loaded step {k} (last reported saved {max(acked) if acked else '-'})")
        summary["seconds"] = time.monotonic() - t0
        summary["versions_left"] = sum(1 for n in os.listdir(ckpt) if "~" in n)
        summary["entries_left"] = sorted(os.listdir(ckpt))
        return summary
    finally:
        zyg.stdin.close()
        try:
            zyg.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zyg.kill()
            zyg.wait()
        torch.set_num_threads(threads)


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        sys.exit("usage: ckpt_kill_child.py zygote (driven by run_kills)")
