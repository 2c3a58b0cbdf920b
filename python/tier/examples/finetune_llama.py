"""Fine-tune a small Llama-architecture model with everything offloaded: tier's main job.

The model is built from a ``transformers`` LlamaConfig (random init, nothing downloaded) and
trained, byte by byte, on text shipped with tier (its own documentation). Parameters and
optimizer state live on NVMe in a folder of tier's own (``tier-<pid>-<random>``) inside
``--swap-dir``, removed at the end; nothing else in ``--swap-dir`` is touched. The device (a GPU,
or the emulated device when there is none) gets a budget smaller than the model, so layers
stream in and out every step.

    python -m tier.examples.finetune_llama [--steps 30] [--config ds_config.json] [--json]

Each step prints the loss, tokens/s, the bytes moved on every link and the memory per tier; a
summary ends the run.
"""

import argparse
import contextlib
import glob
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time

import torch
import transformers

import tier
import tier.torch
from tier import _tier
from tier.torch import footprint

LINKS = [("nvme_to_host", "nvme>host"), ("host_to_device", "host>dev"), ("device_to_host", "dev>host"),
         ("host_to_nvme", "host>nvme")]


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"


def corpus_bytes(where):
    """Text shipped with tier: the Markdown files of its docs folder (``--corpus``), else the
    package's own docstrings."""
    texts = []
    for root in (where, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "docs")):
        if root and os.path.isdir(root):
            for path in sorted(glob.glob(os.path.join(root, "*.md"))):
                with open(path, "rb") as f:
                    texts.append(f.read())
            if texts:
                break
    if not texts:
        import tier.torch.engine as e

        texts = [(__doc__ or "").encode(), (e.__doc__ or "").encode(), (tier.__doc__ or "").encode()]
    data = b"\n\n".join(texts)
    return torch.tensor(list(data), dtype=torch.long)


def llama_config(args):
    """The Llama config of the main job's arguments (a bench passes its own through
    with_job_defaults)."""
    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or (args.hidden * 8 // 3 // 64 * 64 or 64),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or max(1, args.heads // 2),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )


def _dtype(args):
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def _esize(args):
    return torch.empty(0, dtype=_dtype(args)).element_size()


def _lora_targets(args):
    return [t for t in args.lora_targets.split(",") if t]


def model_shape(args):
    """(parameters, bytes of the largest module's own parameters, bytes of one layer's, trainable
    parameters), in the model's dtype, from a model built on the meta device: nothing allocated.
    With LoRA the trainable ones are the adapters' (r x (in + out) per targeted projection)."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(args))
    esize = _esize(args)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * esize
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * esize
    n_params = sum(p.numel() for p in model.parameters())
    trainable = n_params
    if args.lora_r:
        targets = set(_lora_targets(args))
        adapters = sum(args.lora_r * (m.in_features + m.out_features) for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
        n_params += adapters
        trainable = adapters
    return n_params, largest, layer, trainable


class BuildProgress:
    """Prints, every few seconds while the model is built into the engine, the bytes written so far
    and the rate (a 7B model is minutes of writing)."""

    def __init__(self, store, total_bytes, say, every=10.0):
        self.store, self.total, self.say, self.every = store, total_bytes, say, every
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def _line(self):
        done = self.store.written_bytes
        dt = max(time.perf_counter() - self.t0, 1e-9)
        # With --init torch each weight is written when its module is built and again by
        # transformers' init; with tier's generator once.
        return (f"building: {self.store.count} tensors staged, {fmt_bytes(done)} written (model "
                f"{fmt_bytes(self.total)}), {fmt_bytes(done / dt)}/s")

    def _run(self):
        while not self._stop.wait(self.every):
            self.say(self._line(), flush=True)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.t0
        self.written = self.store.written_bytes
        if exc[0] is None:
            self.say(self._line() + f" in {time.perf_counter() - self.t0:.1f} s", flush=True)
        return False


def _fast_init(args):
    return getattr(args, "init", "torch") == "tier"


def make_model(args, config, say=print, build=None):
    """The model, built under tier.torch.init: each module's parameters go into the engine as it
    is constructed, so the model never exists whole in host memory (the same weights as an eager
    build with the same seed, under tier.torch.fast_random for --init tier). In bf16 with --dtype
    bf16; with --lora-r, wrapped by PEFT's LoRA inside the same context (the adapters are staged
    like the rest, the base is frozen). ``build`` (a dict), when given, gets the build's seconds
    and bytes written."""
    torch.manual_seed(args.seed)
    n_params = model_shape(args)[0]
    esize = _esize(args)
    previous = torch.get_default_dtype()
    fast = _fast_init(args)
    ctx = tier.torch.init(config, fast_random=fast, seed=args.seed)  # creates the engine
    # The build's time ends after init's exit, which waits for the last writes home.
    with BuildProgress(ctx.store, n_params * esize, say) as progress, ctx:
        torch.set_default_dtype(_dtype(args))
        try:
            model = transformers.LlamaForCausalLM(llama_config(args))
            if args.lora_r:
                import peft

                lora = peft.LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                       target_modules=_lora_targets(args))
                # Adapters in the model's dtype (tier keeps their fp32 masters): PEFT's fp32
                # upcast would make new tensors of the staged ones, without their values.
                model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
        finally:
            torch.set_default_dtype(previous)
    if build is not None:
        build.update(build_seconds=progress.seconds, build_bytes_written=progress.written)
    return model


PROBE_FILE = "tier_probe.pt"


def probe_ids(args, length=32):
    """The fixed token ids the adapter's round trip is judged on (bytes, from the run's seed)."""
    g = torch.Generator().manual_seed(args.seed + 7)
    return torch.randint(0, 256, (1, min(length, args.seq)), generator=g)


def held_out_batch(args, data):
    """A fixed batch of the corpus (its own generator, apart from the training draws): the loss on
    it before the first step and after the last one says whether the model learned, where the
    training losses are each on other windows and so go up and down by the batch."""
    g = torch.Generator().manual_seed(args.seed + 99)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
    return torch.stack([data[s:s + args.seq] for s in starts])


def held_out_loss(engine, ids):
    engine.module.eval()  # no dropout, as an evaluation scores
    try:
        with torch.no_grad():
            return engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss.item()
    finally:
        engine.module.train()


def plain_peft_logits(args, adapter_dir, ids, timings=None):
    """The logits of ``ids`` through plain transformers + PEFT, without tier: the base built
    eagerly with the run's seed, dtype and generator (the same weights tier.torch.init made), the adapter
    loaded by ``peft.PeftModel.from_pretrained`` in the model's dtype, as the run trained it.
    Holds the whole base in host memory (13.5 GB at the 7b-lora preset). ``timings`` (a dict), when
    given, gets ``init_seconds``: the eager build alone, torch's init without tier."""
    import peft

    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(_dtype(args))
    t0 = time.perf_counter()
    try:
        with tier.torch.fast_random(args.seed) if _fast_init(args) else contextlib.nullcontext():
            base = transformers.LlamaForCausalLM(llama_config(args))
    finally:
        torch.set_default_dtype(previous)
    if timings is not None:
        timings["init_seconds"] = time.perf_counter() - t0
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir), autocast_adapter_dtype=False)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _state_bytes_per_element(config, esize):
    """Bytes of optimizer state per trained element on NVMe, as the config (a dict or a JSON file's
    path) resolves it: master, m and v (12), in one slot or two (tier.optimizer.state_copies);
    m and v only (8) when an fp32 model's parameters are its masters (state once,
    tier.optimizer.params_are_masters)."""
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    resolved = json.loads(_tier.Config.from_json(json.dumps(config)).to_json())
    if footprint.params_are_masters(resolved, "fp32" if esize == 4 else "16-bit"):
        return 8
    return 12 * int(resolved["tier"]["optimizer"]["state_copies"])


def check_disk(args, shape, swap_dir, config):
    """Refuses, before anything is written, a run whose NVMe files cannot fit the swap folder's
    disk: the parameters in their dtype and the optimizer's fp32 state for the trainable ones."""
    n_params, _, _, trainable = shape
    esize = _esize(args)
    state = _state_bytes_per_element(config, esize) * trainable
    footprint.check_nvme_room([swap_dir], {"parameters": n_params * esize, "optimizer state": state})


def peak_rss_bytes():
    """This process's peak resident set size (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_config(args, shape):
    n_params, largest, layer, _ = shape
    total = n_params * _esize(args)
    device_budget = max(int(total * args.device_fraction), 3 * largest)
    if getattr(args, "checkpoint_activations", False):
        # A layer's recompute keeps its weights until their backward (and the next is prefetched).
        device_budget = max(device_budget, 2 * layer + 3 * largest)
    if args.device_budget:
        device_budget = args.device_budget
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                      "warmup_num_steps": max(1, args.steps // 10), "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.swap_dir, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.swap_dir, "pin_memory": True},
        },
        "aio": {"block_size": 1048576, "queue_depth": 16},
        # Host memory is bounded by this budget, not by the model (params, gradients and optimizer
        # state live on NVMe); a few layers' worth is enough. The NVMe budget caps the swap files,
        # which grow with what they hold: params and gradients (and room to stage the next) and
        # the optimizer's fp32 state in the same files (12 bytes per parameter, once, and a few
        # spare chunks; room for two copies, so that tier.optimizer.state_copies 2 fits too: the
        # budget is a cap, not an allocation).
        "tier": {"budgets": {"device": device_budget, "host": max(64 << 20, 4 * largest, min(2 * total, 1 << 30)),
                             "nvme": max(256 << 20, 3 * total) + 24 * n_params + (512 << 20)}},
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def claim_swap_dir(swap_dir):
    """The folder tier may fill and delete: a new ``tier-<pid>-<random>`` folder (0700) inside
    ``swap_dir``, which is created (0700) if it does not exist. Returns (own folder, whether
    ``swap_dir`` itself was created), for release_swap_dir. Nothing else in ``swap_dir`` is ever
    touched: it may be a folder of the user's."""
    created = False
    if not os.path.isdir(swap_dir):
        try:
            os.makedirs(swap_dir, mode=0o700)
            created = True
        except FileExistsError:
            pass
    own = tempfile.mkdtemp(prefix=f"tier-{os.getpid()}-", dir=swap_dir)
    return own, created


def release_swap_dir(own, swap_dir, created):
    """Removes tier's own folder, and ``swap_dir`` only if this run created it and it is empty."""
    shutil.rmtree(own, ignore_errors=True)
    if created:
        try:
            os.rmdir(swap_dir)
        except OSError:
            pass  # not empty: something else put files there meanwhile


# Larger shapes for scale runs (bench/scale.py): a few steps at a learning rate that does not
# diverge at once.
PRESETS = {
    "737m": {"hidden": 2048, "layers": 16, "heads": 16, "lr": 3e-4, "batch": 1, "seq": 64, "steps": 3, "gas": 1, "device_budget": 768 << 20},
    "1.5b": {"hidden": 2560, "layers": 20, "heads": 20, "lr": 2e-4, "batch": 1, "seq": 64, "steps": 3, "gas": 1, "device_budget": 768 << 20},
    "3b": {"hidden": 3072, "layers": 26, "heads": 24, "lr": 2e-4, "batch": 1, "seq": 64, "steps": 3, "gas": 1, "device_budget": 768 << 20},
}
# Llama-2-7B's shape (tier's byte-level corpus maps into its vocabulary) in bf16, with gradient
# checkpointing; the device budget is what one layer's recompute and the largest module need.
# "7b" is the full fine-tune (its optimizer state alone is 162 GB: refused where the disk lacks
# it; --layers K runs K of its 32 layers); "7b-lora" trains LoRA adapters (r=16 on the attention
# projections) over the frozen base streamed from NVMe.
_7B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32, "intermediate": 11008, "vocab": 32000,
       "dtype": "bf16", "checkpoint_activations": True, "batch": 1, "seq": 128, "steps": 3, "gas": 1,
       "device_fraction": 0.0, "init": "tier"}
PRESETS["7b"] = dict(_7B, lr=1e-5)
PRESETS["7b-lora"] = dict(_7B, lr=2e-4, lora_r=16)
# Fewer steps than this do not say whether the model learns: the loss is reported, not judged.
JUDGE_LOSS_FROM_STEPS = 10


def bar(frac, width=24):
    n = int(round(frac * width))
    return "[" + "#" * n + "." * (width - n) + "]"


def with_job_defaults(args):
    """`args` (a bench's argparse Namespace) with the main job's defaults for the options it lacks,
    so that the helpers here (llama_config, model_shape, default_config, ...) can read them."""
    for key, value in vars(parser().parse_args([])).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    return args


def parser():
    """The main job's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a larger model shape (sets --hidden, --layers, --heads, "
                   "--lr, --batch, --seq, --steps and --gas unless given)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--gas", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: heads / 2)")
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default: 8/3 of hidden)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (the corpus is bytes: at least 256)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the model's dtype (bf16: bf16 weights and compute, fp32 optimizer state)")
    p.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank over a frozen base "
                   "(0: full fine-tune)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                   help="the projections LoRA adapts (comma-separated module names)")
    p.add_argument("--save-adapter", metavar="DIR", help="with --lora-r: save the trained adapter to DIR with "
                   "PEFT's save_pretrained (loads with peft.PeftModel.from_pretrained), and beside it "
                   f"{PROBE_FILE}, the trained model's logits on a fixed probe")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=["torch", "tier"], default="torch",
                   help="random weights from PyTorch's generator (one core), or from tier's counter-based one on "
                   "every core, each weight written to NVMe once (tier.torch.fast_random; the 7b presets' default)")
    p.add_argument("--device-fraction", type=float, default=0.4, help="device budget as a fraction of the model")
    p.add_argument("--device-budget", type=int, default=0,
                   help="device budget in bytes (instead of --device-fraction); the presets use 768 MiB, like a "
                   "fixed GPU, so that host memory is compared at the same device size (the emulated device is RAM)")
    p.add_argument("--swap-dir", default=os.path.join(os.getcwd(), "tier-swap"))
    p.add_argument("--config", help="a DeepSpeed-format JSON config instead of the built-in one")
    p.add_argument("--corpus", default="docs", help="folder of Markdown files to train on (default: ./docs)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="gradient checkpointing: each layer's activations are recomputed in backward from its input")
    p.add_argument("--offload-activations", choices=["none", "host", "nvme"], default="none",
                   help="keep the checkpointed layer inputs in host memory or on NVMe between forward and backward "
                        "(needs --checkpoint-activations)")
    p.add_argument("--trace", metavar="FILE", help="write the run's timeline (transfers per link, stalls, "
                   "forward/backward/optimizer spans) to FILE as Chrome trace JSON (ui.perfetto.dev)")
    return p


def resolve_args(argv=None, p=None):
    """The job's arguments as ``argv`` gives them, a preset's values filling what it does not."""
    args = (p or parser()).parse_args(argv)
    if args.preset:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for key, value in PRESETS[args.preset].items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    return args


def main(argv=None):
    p = parser()
    args = resolve_args(argv, p)
    if args.vocab < 256:
        p.error("--vocab must be at least 256: the corpus is bytes")
    if args.save_adapter and not args.lora_r:
        p.error("--save-adapter needs --lora-r")
    if args.offload_activations != "none" and not args.checkpoint_activations:
        p.error("--offload-activations needs --checkpoint-activations (only checkpointed layer inputs are offloaded)")

    own, created = claim_swap_dir(args.swap_dir)
    try:
        return run(args, own)
    except tier.NoSpace as e:  # refused before anything was written: say why, no traceback
        print(f"tier: {e}", file=sys.stderr)
        return 2
    finally:
        release_swap_dir(own, args.swap_dir, created)
        _end_distributed()


_OWN_PROCESS_GROUP = []  # set when _distributed() created the default process group


def _distributed():
    """(rank, world): under torchrun (WORLD_SIZE > 1) the default process group is created here,
    NCCL with a GPU, else Gloo, and tier partitions over it (docs/distributed.md)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        _OWN_PROCESS_GROUP.append(True)
    return dist.get_rank(), dist.get_world_size()


def _end_distributed():
    """Destroys the process group _distributed() created, while the interpreter is still whole.
    Left to its exit (the engine's reference cycles keep the group alive until the final garbage
    collection), a Gloo worker thread could still be dropping a finished collective's tensors when
    finalization began; needing the GIL then, it was made to exit inside a destructor and the
    process aborted after a finished run ("terminate called without an active exception", about one
    run in 12 of two ranks here, and once in CI)."""
    if _OWN_PROCESS_GROUP:
        import gc

        import torch.distributed as dist

        gc.collect()  # the engine's cycles, and with them its references to the group
        if dist.is_initialized():
            dist.destroy_process_group()
        _OWN_PROCESS_GROUP.clear()


def run(args, swap_dir):
    """Trains as the options say, with tier's files in ``swap_dir`` (removed by the caller)."""
    rank, world = _distributed()
    # Launched by torchrun: every rank trains on its own batches; rank 0 reports.
    say = print if rank == 0 else (lambda *a, **k: None)
    args = argparse.Namespace(**dict(vars(args), swap_dir=swap_dir))
    shape = model_shape(args)
    n_params = shape[0]
    config = args.config or default_config(args, shape)
    check_disk(args, shape, swap_dir, config)
    if args.trace:
        if isinstance(config, str):
            raise SystemExit("--trace with --config: set \"tier\": {\"trace_file\": ...} in the config instead")
        config.setdefault("tier", {})["trace_file"] = os.path.abspath(args.trace)
    build = {}
    model = make_model(args, config, say, build)
    acts = {}
    if args.checkpoint_activations:
        acts = {"checkpoint_activations": True, "offload_activations": args.offload_activations}
    engine, *_ = tier.torch.initialize(model, config, **acts)
    s0 = engine.stats()
    esize = _esize(args)
    trained = f", {shape[3] / 1e6:.2f} M of them trained (LoRA r={args.lora_r})" if args.lora_r else ""
    say(f"tier {tier.__version__}: Llama with {n_params / 1e6:.2f} M parameters ({fmt_bytes(n_params * esize)} "
          f"{args.dtype}){trained}, "
          f"{args.layers} layers; device: {s0['info'].get('device', '?')}, budget "
          f"{fmt_bytes(s0['tiers']['device']['budget_bytes'])}; params and optimizer state on NVMe in {args.swap_dir} "
          f"({s0['info'].get('io_engine', '?')})", flush=True)

    data = corpus_bytes(args.corpus)
    held_out = held_out_batch(args, data)
    held_out_before = held_out_loss(engine, held_out)
    g = torch.Generator().manual_seed(args.seed + 1000 * rank)
    tokens_per_step = args.batch * args.seq * args.gas
    history = []
    t_start = time.perf_counter()
    prev = engine.stats()
    prev_phases = dict(engine.timers())
    phases_at_start = dict(prev_phases)
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses = []
        for _ in range(args.gas):
            starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
            ids = torch.stack([data[s:s + args.seq] for s in starts]).to(engine.device)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        dt = time.perf_counter() - t0
        now = engine.stats()
        moved = {k: now["links"][k]["bytes"] - prev["links"][k]["bytes"] for k, _ in LINKS}
        prev = now
        phases = dict(engine.timers())
        phase_seconds = {k: phases[k] - prev_phases.get(k, 0.0) for k in phases}
        prev_phases = phases
        loss = sum(losses) / len(losses)
        if world > 1:  # the mean over every rank's batches
            t = torch.tensor([loss], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            loss = float(t) / world
        history.append({"step": step + 1, "loss": loss, "seconds": dt, "tokens_per_second": tokens_per_step / dt,
                        "bytes": moved, "phase_seconds": phase_seconds,
                        "grad_norm": (engine.last_report or {}).get("grad_norm")})
        tiers = now["tiers"]
        say(f"step {step + 1:>3}/{args.steps} {bar((step + 1) / args.steps)} loss {loss:6.3f} | "
              f"{tokens_per_step / dt:8.0f} tok/s | "
              + " ".join(f"{short} {fmt_bytes(moved[k])}" for k, short in LINKS)
              + f" | dev {fmt_bytes(tiers['device']['resident_bytes'])}/{fmt_bytes(tiers['device']['budget_bytes'])}"
              f" host {fmt_bytes(tiers['host']['resident_bytes'])} nvme {fmt_bytes(tiers['nvme']['resident_bytes'])}",
              flush=True)

    total = time.perf_counter() - t_start
    # The training steps' phases (the held-out forwards before and after are not theirs).
    train_phases = {k: v - phases_at_start.get(k, 0.0) for k, v in engine.timers().items()}
    held_out_after = held_out_loss(engine, held_out)
    if args.save_adapter:
        # Only the adapters are gathered from the engine, not the frozen base.
        engine.module.save_pretrained(args.save_adapter,
                                      state_dict=engine.module_state_dict(exclude_frozen_parameters=True))
        # The trained model's own logits on a fixed probe, beside the adapter: what a plain PEFT
        # load of it must reproduce (plain_peft_logits; bench/lora_roundtrip.py at 7B).
        ids = probe_ids(args)
        with torch.no_grad():
            logits = engine(input_ids=ids.to(engine.device)).logits.float().cpu()
        torch.save({"input_ids": ids, "logits": logits}, os.path.join(args.save_adapter, PROBE_FILE))
    s = engine.stats()
    summary = {
        "parameters": n_params,
        "steps": args.steps,
        **build,  # build_seconds, build_bytes_written
        "init": getattr(args, "init", "torch"),
        "seconds": total,
        "tokens_per_second": tokens_per_step * args.steps / total,
        "first_loss": history[0]["loss"],
        "last_loss": history[-1]["loss"],
        # The loss on one fixed batch, before the first step and after the last (held_out_batch).
        "held_out_loss_before": held_out_before,
        "held_out_loss_after": held_out_after,
        "device": s["info"].get("device"),
        "io_engine": s["info"].get("io_engine"),
        "links": {k: s["links"][k]["bytes"] for k, _ in LINKS},
        "peak_bytes": {t: s["tiers"][t]["peak_bytes"] for t in ("device", "host", "nvme")},
        "device_budget": s["tiers"]["device"]["budget_bytes"],
        "stall_seconds": s["metrics"].get("engine.stall_seconds", 0.0),
        "prefetch_hits": s["metrics"].get("prefetch.hits", 0.0),
        # Prefetched copies evicted before their use: room taken for nothing (a sign of thrash).
        "prefetch_dropped_unused": s["metrics"].get("prefetch.dropped_unused", 0.0),
        "acquires": s["metrics"].get("engine.acquires", 0.0),
        "optimizer_pinned_bytes": s["optimizer"]["pinned_bytes"],
        "host_budget": s["tiers"]["host"]["budget_bytes"],
        "peak_rss_bytes": peak_rss_bytes(),
        "host_bytes_per_param": peak_rss_bytes() / n_params,
        "phase_seconds": train_phases,
        "skipped_steps": engine.skipped_steps,
        # Checkpointed activations (--offload-activations): the most each tier held at once.
        "activation_peak_bytes": {t: s["metrics"].get(f"activations.{t}.peak_bytes", 0.0)
                                  for t in ("device", "host", "nvme")},
        "activations_offloaded": engine._activations.offloaded if engine._activations is not None else 0,
        # Blocks the swap files took on disk (they only grow): the engine's and the optimizer's.
        "nvme_allocated_peak_bytes": s["metrics"].get("nvme.swap.allocated_bytes", 0.0)
        + s["metrics"].get("optim.swap.allocated_bytes", 0.0),  # an optimizer with files of its own
    }
    summary["nvme_bytes_per_param"] = summary["nvme_allocated_peak_bytes"] / n_params
    if args.save_adapter:
        summary["adapter_dir"] = args.save_adapter
    if args.json:
        say(json.dumps({"summary": summary, "history": history}, indent=1))
    else:
        say()
        say("summary")
        say(f"  {args.steps} steps in {total:.1f} s, {summary['tokens_per_second']:.0f} tokens/s; "
              f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; on a fixed held-out batch "
              f"{held_out_before:.4f} -> {held_out_after:.4f}")
        say("  moved: " + ", ".join(f"{short} {fmt_bytes(summary['links'][k])}" for k, short in LINKS))
        say(f"  peak: device {fmt_bytes(summary['peak_bytes']['device'])} of a {fmt_bytes(summary['device_budget'])} "
              f"budget (model {fmt_bytes(n_params * esize)}), host {fmt_bytes(summary['peak_bytes']['host'])}, "
              f"nvme {fmt_bytes(summary['peak_bytes']['nvme'])}; optimizer pinned buffers "
              f"{fmt_bytes(summary['optimizer_pinned_bytes'])}")
        say(f"  prefetch: {summary['prefetch_hits']:.0f} hits of {summary['acquires']:.0f} acquires, "
              f"{summary['prefetch_dropped_unused']:.0f} prefetched copies dropped unused, "
              f"stalled {summary['stall_seconds']:.2f} s in total")
        ph = summary["phase_seconds"]
        say(f"  time: forward {ph['forward']:.1f} s, backward {ph['backward']:.1f} s, optimizer {ph['step']:.1f} s")
        if summary["activations_offloaded"]:
            ap = summary["activation_peak_bytes"]
            say(f"  activations: {summary['activations_offloaded']} layer checkpoints offloaded to "
                f"{args.offload_activations}; at most device {fmt_bytes(ap['device'])}, host {fmt_bytes(ap['host'])}, "
                f"nvme {fmt_bytes(ap['nvme'])} at once")
        if args.save_adapter:
            say(f"  adapter: saved to {args.save_adapter} (peft.PeftModel.from_pretrained loads it; "
                f"{PROBE_FILE} holds the trained model's logits on a probe)")
        say(f"  disk: swap files took {fmt_bytes(summary['nvme_allocated_peak_bytes'])} = "
            f"{summary['nvme_bytes_per_param']:.1f} bytes per parameter")
        say(f"  host memory: peak RSS {fmt_bytes(summary['peak_rss_bytes'])} = "
              f"{summary['host_bytes_per_param']:.1f} bytes per parameter (host budget "
              f"{fmt_bytes(summary['host_budget'])})")
    engine.close()
    del engine
    if args.steps < JUDGE_LOSS_FROM_STEPS:
        say(f"tier: {args.steps} steps are too few to judge the loss; not checked (from {JUDGE_LOSS_FROM_STEPS} "
              "steps on, the run fails if the loss did not go down)", file=sys.stderr)
        return 0
    if not history[-1]["loss"] < history[0]["loss"]:
        say("tier: the loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
