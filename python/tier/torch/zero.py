"""ZeRO stages 1, 2 and 3 across data-parallel ranks, on torch.distributed.

Every rank runs one ``TierEngine`` over the same model. Each parameter, flattened, is split into
``world`` equal shards of ``ceil(numel / world)`` elements (the last ones padded, possibly empty):
rank ``r`` owns elements ``[r * shard, min(numel, (r + 1) * shard))``. A rank registers, homes and
offloads only what it owns:

- stage 1: the optimizer state (fp32 master, moments) of its shards; gradients are summed in full
  on each rank over the micro-steps and reduce-scattered once, at the accumulation boundary;
- stage 2: also the gradients: each micro-step's are reduce-scattered as backward finishes them,
  and only the rank's shards are summed;
- stage 3: also the parameters: the engine homes the rank's shard of each parameter, and a module's
  parameters are all-gathered when it is fetched (forward and backward) and dropped after.

In stages 1 and 2 every rank keeps the whole low-precision parameters; after a step the owners'
updated shards are all-gathered into them. Gradients are averaged over the ranks (as DeepSpeed
does); clipping uses the global norm and the fp16 overflow check agrees across ranks (the
optimizer all-reduces its sum of squares over ``ZeroGroup.comm``, a ``tier::Communicator`` whose
all-reduce is torch.distributed's).

The collectives run on a torch.distributed process group (the default one, or
``initialize(..., process_group=pg)``): NCCL for CUDA engines, Gloo for CPU ones. Gradients are
reduced in buckets of ``zero_optimization.reduce_bucket_size`` elements, in reverse registration
order (the order backward finishes them), each bucket as soon as all its gradients are in.
"""

import collections
import hashlib
import json
import os
import time
import weakref

import torch
import torch.distributed as dist

from .. import _tier

_RANK_NEUTRAL_KEYS = (("zero_optimization", "offload_param", "nvme_path"), ("zero_optimization", "offload_optimizer", "nvme_path"))


def default_group_active():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard_range(numel, world, rank):
    """(shard, start, count): the padded shard size and the elements rank ``rank`` owns, as
    tier::ShardMap lays them out (one definition for the C++ side, the C ABI and this). An empty
    parameter still gets a one-element shard: the engine holds no empty tensors."""
    shard, start, count = _tier.shard_range(numel, world, rank)
    return max(1, shard), start, count


def rank_paths(cfg, rank):
    """The config with every swap directory moved to ``<dir>/rank<N>`` (created), so that ranks on
    one machine never share files."""
    cfg = json.loads(json.dumps(cfg))
    mine = f"rank{rank}"

    def moved(path):  # idempotent: a config already moved stays as it is
        return path if os.path.basename(os.path.normpath(path)) == mine else os.path.join(path, mine)

    zero = cfg.get("zero_optimization") or {}
    for section in ("offload_param", "offload_optimizer"):
        sec = zero.get(section) or {}
        path = sec.get("nvme_path")
        if isinstance(path, str) and path:
            sec["nvme_path"] = moved(path)
            os.makedirs(sec["nvme_path"], exist_ok=True)
    tier = cfg.get("tier")
    swap = (tier or {}).get("swap_paths")
    if swap is None and os.environ.get("TIER_SWAP_PATHS"):
        swap = [p for p in os.environ["TIER_SWAP_PATHS"].split(",") if p]
    if swap:
        swap = [swap] if isinstance(swap, str) else list(swap)
        paths = [moved(p) for p in swap]
        for p in paths:
            os.makedirs(p, exist_ok=True)
        cfg.setdefault("tier", {})["swap_paths"] = paths
    return cfg


def _neutral(cfg):
    """The config without what differs between ranks legitimately (their swap directories)."""
    cfg = json.loads(json.dumps(cfg))
    for path in _RANK_NEUTRAL_KEYS:
        node = cfg
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            node.pop(path[-1], None)
    if isinstance(cfg.get("tier"), dict):
        cfg["tier"].pop("swap_paths", None)
    return cfg


def _flatten(node, prefix=""):
    """{"a.b": value} for every leaf of a JSON object."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, left or timed out."""


class ZeroGroup:
    """The ranks an engine is partitioned over and the collectives it runs on them."""

    def __init__(self, process_group, stage, reduce_bucket_size, device):
        self.pg = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.stage = stage
        self.bucket_elems = max(1, int(reduce_bucket_size))
        self.backend = str(dist.get_backend(process_group)).lower()
        if self.backend == "nccl" and device.type != "cuda":
            raise ValueError(
                "tier.torch.initialize: the process group's backend is NCCL, which carries CUDA tensors only, but "
                "this engine computes on the CPU; create the group with backend='gloo' "
                "(torch.distributed.init_process_group('gloo'))"
            )
        # NCCL carries device tensors; any other backend (Gloo) host tensors: a CUDA engine's
        # gradients and parameters then go through host memory (slower, and how several ranks
        # share one GPU, which NCCL refuses).
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        # tier's collectives (the step driver's gradient norm) over this group.
        # (Through a weak reference: the communicator is native, so the garbage collector could not
        # break a cycle through it.)
        ref = weakref.ref(self)
        self.comm = _tier.Communicator(
            self.rank,
            self.world,
            lambda array, op: ref()._all_reduce_array(array, op),
            name=f"torch.distributed ({self.backend})",
        )
        self.bytes_reduced = 0
        self.bytes_gathered = 0

    def release(self):
        """Lets go of the process group and the communicator (the engine is destroyed): nothing
        of tier's keeps the backend alive past the caller's ``destroy_process_group``. (torch 2.15
        itself still references a Gloo group after it, so its worker threads may meet the
        interpreter's finalization: "terminate called without an active exception".)"""
        self.pg = None
        self.comm = None

    def _run(self, what, fn):
        if self.pg is None:
            raise CollectiveError(f"tier: rank {self.rank} of {self.world}: {what}: the engine was destroyed")
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # gloo/nccl report a dead or hung peer as RuntimeError
            raise CollectiveError(
                f"tier: rank {self.rank} of {self.world}: {what} failed; another rank has probably died, left, "
                f"or stopped calling the same collectives (timeout), so this rank stops too: {e}"
            ) from e

    def check_same_config(self, cfg, model_digest):
        """Every rank must run the same config (swap directories aside) over the same model."""
        mine = {"config": _flatten(_neutral(cfg)), "model": hashlib.sha256(repr(model_digest).encode()).hexdigest()}
        got = [None] * self.world
        self._run("comparing configs", lambda: dist.all_gather_object(got, mine, group=self.pg))
        problems = []
        for r, theirs in enumerate(got):
            if r == 0 or theirs == got[0]:
                continue
            keys = sorted(
                k
                for k in set(theirs["config"]) | set(got[0]["config"])
                if theirs["config"].get(k) != got[0]["config"].get(k)
            )
            what = [f"{k}: {got[0]['config'].get(k)!r} on rank 0, {theirs['config'].get(k)!r} on rank {r}" for k in keys]
            if theirs["model"] != got[0]["model"]:
                what.append(f"the model's parameters (names, shapes, dtypes) differ between rank 0 and rank {r}")
            problems.append("; ".join(what))
        if problems:
            raise ValueError(
                "tier.torch.initialize: every rank must pass the same config and build the same model (swap "
                "directories aside), but " + " | ".join(problems)
            )

    def _all_reduce_array(self, array, op):
        """The all-reduce of ``comm``: ``array`` (numpy, host memory, valid during the call) is reduced
        over the ranks in place."""
        host = torch.from_numpy(array)
        t = host.to(self.device) if self.device.type != "cpu" else host
        what = f"all_reduce ({op}) of {host.numel()} {host.dtype} elements"
        self._run(what, lambda: dist.all_reduce(t, op=_REDUCE_OPS[op], group=self.pg))
        if t is not host:
            host.copy_(t)

    def broadcast(self, tensor, src):
        """``tensor`` (host memory) in place from group rank ``src``: its values on every rank."""
        t = tensor.to(self.device) if self.device.type != "cpu" else tensor
        self._run(f"broadcast of {tensor.numel()} elements from rank {src}",
                  lambda: dist.broadcast(t, src=dist.get_global_rank(self.pg, src), group=self.pg))
        if t is not tensor:
            tensor.copy_(t)

    def reduce_scatter(self, flat, async_op=False):
        """``flat`` holds ``world`` equal segments, segment ``q`` for rank ``q``: returns the sum over
        ranks of this rank's segment (with ``async_op``: (it, work), valid after ``wait(work)``)."""
        out = torch.empty(flat.numel() // self.world, dtype=flat.dtype, device=flat.device)
        work = self._run(
            "reduce_scatter of gradients",
            lambda: dist.reduce_scatter_tensor(out, flat, group=self.pg, async_op=async_op),
        )
        self.bytes_reduced += flat.numel() * flat.element_size()
        return (out, work) if async_op else out

    def all_gather(self, local, async_op=False):
        out = torch.empty(local.numel() * self.world, dtype=local.dtype, device=local.device)
        work = self._run(
            "all_gather", lambda: dist.all_gather_into_tensor(out, local.contiguous(), group=self.pg, async_op=async_op)
        )
        self.bytes_gathered += out.numel() * out.element_size()
        return (out, work) if async_op else out

    def wait(self, work, what):
        self._run(what, work.wait)



class GradReducer:
    """Reduce-scatters each micro-step's gradients in buckets and hands this rank's averaged shards
    to ``sink(slot, shard)``.

    Buckets are fixed at creation: trainable slots in reverse registration order, up to
    ``bucket_elems`` padded elements each (at least one slot), so every rank issues the same
    collectives in the same order. In stages 2 and 3 a bucket goes as soon as all its gradients
    of the micro-step are in and every earlier bucket has gone; ``flush`` sends the rest (a
    gradient that did not come counts as zeros). In stage 1 gradients are summed in full over the
    micro-steps and everything goes at the boundary's ``flush``.
    """

    MAX_INFLIGHT = 2  # buckets being reduced while backward goes on

    def __init__(self, group, slots, sink, note=None):
        self.group = group
        self.sink = sink
        self.inflight = collections.deque()  # (bucket index, its buffer, result, work)
        self.note = note  # note(bytes, seconds): this rank's reduced shards reached host memory
        self.buckets = []
        cur, size = [], 0
        for slot in reversed([s for s in slots if s.trainable]):
            padded = slot.zero_shard * group.world
            if cur and size + padded > group.bucket_elems:
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(slot)
            size += padded
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {id(s): b for b, bucket in enumerate(self.buckets) for s in bucket}
        self.pending = {}  # id(slot) -> fp32 full gradient (summed over micro-steps in stage 1)
        self.next_bucket = 0  # the first bucket of this micro-step not sent yet
        self.active = False  # a gradient came this micro-step

    def add(self, slot, grad):
        g = grad.detach().reshape(-1).to(self.group.device, torch.float32)
        held = self.pending.get(id(slot))
        if held is None:
            self.pending[id(slot)] = g.clone() if g.data_ptr() == grad.data_ptr() else g
        else:
            held.add_(g)
        self.active = True
        if self.group.stage >= 2:
            while self.next_bucket < len(self.buckets) and all(
                id(s) in self.pending for s in self.buckets[self.next_bucket]
            ):
                self._send(self.next_bucket)
                self.next_bucket += 1

    def flush(self, boundary):
        """End of a micro-step's backward: sends what is left (stage 1: only on the boundary)."""
        if not self.active or (self.group.stage < 2 and not boundary):
            return
        while self.next_bucket < len(self.buckets):
            self._send(self.next_bucket)
            self.next_bucket += 1
        while self.inflight:
            self._complete()
        self.next_bucket = 0
        self.active = False

    def clear(self):
        while self.inflight:  # every rank sent them: let them finish, drop the results
            _, _, _, work = self.inflight.popleft()
            self.group.wait(work, "reduce_scatter of gradients")
        self.pending.clear()
        self.next_bucket = 0
        self.active = False

    def _send(self, b):
        world = self.group.world
        bucket = self.buckets[b]
        width = sum(s.zero_shard for s in bucket)
        buf = torch.zeros(world, width, dtype=torch.float32, device=self.group.device)
        off = 0
        for s in bucket:
            g = self.pending.pop(id(s), None)
            if g is not None:
                padded = buf.new_zeros(world * s.zero_shard)
                padded[: s.numel].copy_(g)
                buf[:, off : off + s.zero_shard].copy_(padded.view(world, s.zero_shard))
            off += s.zero_shard
        # Asynchronous: backward goes on while the bucket is reduced (Gloo on its own thread, NCCL
        # on its stream); results are taken in order.
        mine, work = self.group.reduce_scatter(buf.view(-1), async_op=True)
        self.inflight.append((b, buf, mine, work))
        while len(self.inflight) > self.MAX_INFLIGHT:
            self._complete()

    def _complete(self):
        b, _buf, mine, work = self.inflight.popleft()
        self.group.wait(work, "reduce_scatter of gradients")
        bucket = self.buckets[b]
        mine.div_(self.group.world)
        t0 = time.perf_counter()
        if mine.device.type != "cpu":
            mine = mine.cpu()
        if self.note is not None:
            self.note(mine.numel() * mine.element_size(), time.perf_counter() - t0)
        off = 0
        for s in bucket:
            if s.zero_count > 0:
                self.sink(s, mine[off : off + s.zero_count])
            off += s.zero_shard


def gather_buckets(group, slots):
    """Slots in registration order, grouped into all-gather buckets of about ``bucket_elems``."""
    buckets, cur, size = [], [], 0
    for slot in slots:
        padded = slot.zero_shard * group.world
        if cur and size + padded > group.bucket_elems:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(slot)
        size += padded
    if cur:
        buckets.append(cur)
    return buckets


def gather_full(group, bucket, read_shard):
    """All-gathers the shards of ``bucket``'s slots (``read_shard(slot)`` gives this rank's, padded
    to the shard size) and returns ``{id(slot): full flat tensor of numel}``."""
    width = sum(s.zero_shard for s in bucket)
    local = torch.cat([read_shard(s).reshape(-1) for s in bucket])
    return _split(group, bucket, group.all_gather(local), width)


def _split(group, slots, gathered, width):
    """The whole flat values of ``slots`` from an all-gather of their concatenated shards."""
    full = gathered.view(group.world, width)
    out, off = {}, 0
    for s in slots:
        out[id(s)] = full[:, off : off + s.zero_shard].reshape(-1)[: s.numel]
        off += s.zero_shard
    return out


class GatherPrefetcher:
    """Stage 3: issues each module fetch's all-gather ahead of use.

    The fetches of a micro-step (forward and backward) are recorded as a sequence of parameter
    sets; in the next micro-step, at each fetch the gathers of the following recorded fetches are
    started (asynchronously) up to ``budget`` gathered elements, so that they travel while the
    current module computes. A fetch that differs from the record at its position (another path
    through the model) waits out and drops what was started and gathers on the spot, and nothing
    more is prefetched in that micro-step. Every rank runs the same model, so every rank records
    the same sequence and issues the same collectives in the same order.

    A micro-step that runs a prefix of the record and stops (an evaluation's forward between
    training steps) leaves the record as it was, so the training step after it is prefetched
    whole; a second one in a row ending at the same place makes that place the expected end, where
    the lookahead stops (a run of forwards, as generation makes, does not gather the backward's
    parameters each time) until a micro-step goes past it.
    """

    def __init__(self, group, budget, read_shard):
        self.group = group
        self.budget = max(0, int(budget))
        self.read_shard = read_shard  # slot -> this rank's shard (padded), on the group's device
        self.record = []  # the last micro-step's fetches: tuples of slots
        self.current = []
        self.inflight = collections.OrderedDict()  # position -> (slots, gathered, work, width)
        self.inflight_elems = 0
        self.diverged = False
        self.hits = 0
        self.misses = 0
        self.short_at = None  # where the last micro-step stopped, when it ran a prefix of the record
        self.end_hint = None  # the lookahead stops here (two such micro-steps in a row stopped here)

    def begin(self):
        """A micro-step starts (the outermost forward)."""
        self.drop()
        if self.current:
            n = len(self.current)
            if n < len(self.record) and self.record[:n] == self.current:
                if self.short_at == n:
                    self.end_hint = n
                self.short_at = n
            else:
                self.record = self.current
                self.short_at = self.end_hint = None
        self.current = []
        self.diverged = False
        self._prefetch(0)  # nothing changes the params from here to the end of backward

    def drop(self):
        """Waits out and forgets the gathers in flight (the params may change after this)."""
        while self.inflight:
            _, (_, _, work, _) = self.inflight.popitem(last=False)
            self.group.wait(work, "all_gather of parameters")
        self.inflight_elems = 0

    def _start(self, slots):
        width = sum(s.zero_shard for s in slots)
        local = torch.cat([self.read_shard(s).reshape(-1) for s in slots])
        gathered, work = self.group.all_gather(local, async_op=True)
        return gathered, work, width

    def gather(self, slots):
        """{id(slot): full flat value} for ``slots`` (a collective, maybe started earlier)."""
        slots = tuple(slots)
        pos = len(self.current)
        self.current.append(slots)
        if self.end_hint is not None and pos >= self.end_hint:
            self.end_hint = None  # this micro-step goes on past the expected end: look ahead again
        hit = self.inflight.pop(pos, None)
        if hit is not None and [id(s) for s in hit[0]] == [id(s) for s in slots]:
            _, gathered, work, width = hit
            self.inflight_elems -= width * self.group.world
            self.group.wait(work, "all_gather of parameters")
            self.hits += 1
            result = _split(self.group, slots, gathered, width)
        else:
            if hit is not None or (pos < len(self.record) and self.record[pos] != slots):
                if hit is not None:
                    self.group.wait(hit[2], "all_gather of parameters")
                self.drop()
                self.diverged = True
            self.misses += 1
            gathered, work, width = self._start(slots)
            self.group.wait(work, "all_gather of parameters")
            result = _split(self.group, slots, gathered, width)
        self._prefetch(pos + 1)
        return result

    def _prefetch(self, start):
        if self.diverged or not self.budget:
            return
        nxt = start
        while nxt in self.inflight:
            nxt += 1
        end = len(self.record) if self.end_hint is None else self.end_hint
        while nxt < end:
            slots = self.record[nxt]
            need = sum(s.zero_shard for s in slots) * self.group.world
            if self.inflight and self.inflight_elems + need > self.budget:
                break
            gathered, work, width = self._start(slots)
            self.inflight[nxt] = (slots, gathered, work, width)
            self.inflight_elems += need
            nxt += 1
