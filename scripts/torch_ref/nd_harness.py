"""The harness that scripts/torch_ref/nd_gpt.py and nd_llama.py share: each builds its model at a layout of PyTorch's
N-D stack on gloo and hands this module one `Job`; the launch under torchrun, the data, the clipping, the pipeline
cut and schedule, the timed loop and the output lines are the same for both, written once here.

- `training_args(p, lr)`: the flags both take (--layout, --steps, --global-batch, --microbatches, --lr, --pp-dp, …).
- `main(name, a, run)`: threads (cores / world, at least 1), the gloo process group, and the layout's fate: `run`
  raising `Unsupported` (or any other exception) prints `unsupported: <layout>: <reason>` and exits 0; an
  AssertionError (the model disagrees with ours) prints `error: <layout>: …` and exits 1.
- `parse_layout`: ddp | fsdp-full | … (the script's own names), tpN[-dpD], ppP[-dpD]-gpipe|1f1b|interleaved.
- `Batches`: accel's loader over non-overlapping windows (shuffled per epoch with seed + epoch, dealt to the dp
  ranks, drop_last).
- `grad_norm_and_clip`, `average_gradients`, `all_params`, `mean_cross_entropy`.
- `Pipeline` (torch.distributed.pipelining: the stages cut by layers as accel's pipeline_stages, the schedule, DDP
  or a hand all-reduce over dp), and the step functions `plain_step` / `pipeline_step`.
- `train(name, a, job)`: the loop and the output, as accel's examples print them (rank 0): `step k/n: loss L,
  T tokens/s, S s` every --log-every steps (the loss: the mean over the interval's batches and the data-parallel
  replicas; `warm-up` instead of tokens/s for the first interval), `<name> done: …`, one line per rank
  `rank r (pp a dp b tp c): peak RSS X MiB` (VmHWM of /proc/self/status) and `<name> result: {json}` (with
  `import_rss_mib`, the peak right after `import torch`) — tokens/s over all replicas over the steps after the
  first logged interval, final loss, first loss, every rank's peak RSS, the parameter count.
"""

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F


def peak_rss_mib():
    """VmHWM of this process (MiB), as accel_examples::peak_rss_mib."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


# What importing torch alone costs (the CUDA build of the wheel maps its libraries whether or not a GPU is used).
IMPORT_RSS_MIB = peak_rss_mib()
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class Unsupported(Exception):
    pass


def training_args(p, lr):
    """Adds the flags every N-D script takes to the argparse parser `p` (`lr`: the default learning rate)."""
    p.add_argument("--layout", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=None, help="default: steps / 3 (the first interval is warm-up)")
    p.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step over all replicas")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(REPO, "data", "shakespeare"))
    p.add_argument("--pp-dp", choices=["ddp", "allreduce"], default="ddp",
                   help="data parallelism over pipeline stages: DDP around each stage module (the pipelining stage's "
                        "DDP support), or one all-reduce of the gradients after the schedule")
    p.add_argument("--threads", type=int, default=None, help="default: cores / world size, at least 1")
    p.add_argument("--pg-timeout", type=int, default=300, help="seconds before a stuck collective fails")
    p.add_argument("--expect-parameters", type=int, default=None, help="our binary's count: asserted equal")


def finish_args(a):
    if a.log_every is None:
        a.log_every = max(a.steps // 3, 1)
    return a


def parse_layout(name, plain):
    """(kind, sizes dict) of a layout name; `plain`: the names without sizes that the script knows."""
    import re

    if name in plain:
        return name, {}
    m = re.fullmatch(r"tp(\d+)(?:-dp(\d+))?", name)
    if m:
        return "tp", {"tp": int(m.group(1)), "dp": int(m.group(2) or 1)}
    m = re.fullmatch(r"pp(\d+)(?:-dp(\d+))?-(gpipe|1f1b|interleaved)", name)
    if m:
        return "pp", {"pp": int(m.group(1)), "dp": int(m.group(2) or 1), "schedule": m.group(3)}
    raise SystemExit(f"--layout {name}: not a layout (see --help)")


def first_line(e):
    """The exception's first line, and its root cause's (`raise … from e`: pipelining wraps a stage's error)."""

    def line(x):
        s = str(x).strip().splitlines()
        return (s[0] if s else repr(x)).strip()[:400]

    root = e
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__
    if root is e:
        return line(e)
    return f"{line(e).rstrip(':')} ← {type(root).__name__}: {line(root)}"


def main(name, a, run):
    """Runs `run(a, rank, world, threads)` (which builds a `Job` and calls `train`) in the torchrun job."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if "RANK" not in os.environ:
        sys.exit(f"{name}.py runs under torchrun: torchrun --standalone --nproc_per_node 4 {name}.py --layout …")
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    except Exception as e:  # noqa: BLE001
        print(f"unsupported: {a.layout}: init_process_group(gloo) failed: {first_line(e)}", flush=True)
        return
    try:
        run(a, rank, world, threads)
    except AssertionError as e:  # the model disagrees with ours (parameter count): a failure, not a limitation
        print(f"error: {a.layout}: {e}", flush=True)
        os._exit(1)
    except Unsupported as e:
        print(f"unsupported: {a.layout}: {e}", flush=True)
        sys.stdout.flush()
        os._exit(0)  # peers may wait in a collective: do not hang in destroy_process_group
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        print(f"unsupported: {a.layout}: {type(e).__name__}: {first_line(e)}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


# -------------------------------------------------------------------------------------------------------- data


class Batches:
    """accel's loader: windows i·block .. i·block + block (+1 for the targets), shuffled per epoch with seed +
    epoch, dealt round-robin to the dp ranks, `per_replica` rows per batch, drop_last; epochs repeat forever."""

    def __init__(self, tokens, block, per_replica, dp_rank, dp, seed):
        self.tokens, self.block, self.b, self.dp_rank, self.dp, self.seed = tokens, block, per_replica, dp_rank, dp, seed
        t = tokens.numel()
        self.n = 0 if t <= block else (t - block - 1) // block + 1
        self.offs = torch.arange(block).view(1, -1)

    def __iter__(self):
        epoch = 0
        while True:
            g = torch.Generator().manual_seed(self.seed + epoch)
            mine = torch.randperm(self.n, generator=g)[self.dp_rank :: self.dp]
            for i in range(0, len(mine) - self.b + 1, self.b):
                starts = mine[i : i + self.b].view(-1, 1) * self.block
                yield self.tokens[starts + self.offs], self.tokens[starts + self.offs + 1]
            epoch += 1


def mean_cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


# --------------------------------------------------------------------------------------------------- utilities


def grad_norm_and_clip(params, max_norm, extra_group=None):
    """Clips the gradients of `params` (this rank's) to a total norm of `max_norm`, every parameter counted once
    over the whole job: a DTensor gradient (tensor parallel, FSDP) sums its local squares over the mesh dimensions
    it is sharded on, a DDP+TP localised parameter (`_st_info`) likewise, a replicated one counts once; the sum is
    then all-reduced over `extra_group` (the pipeline stages). Returns the total norm (float)."""
    from torch.distributed.tensor import DTensor

    groups = {}  # (mesh, sharded dims) → [sum of squares]
    plain = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        spec = None
        if isinstance(g, DTensor):
            spec, local = g._spec, g.to_local()
        else:
            spec, local = getattr(p, "_st_info", None), g
        sq = local.detach().double().pow(2).sum()
        dims = () if spec is None else tuple(i for i, pl in enumerate(spec.placements) if pl.is_shard())
        if not dims:
            plain += sq
        else:
            key = (id(spec.mesh), dims)
            if key not in groups:
                groups[key] = [spec.mesh, dims, torch.zeros((), dtype=torch.float64)]
            groups[key][2] += sq
    total = plain
    for mesh, dims, sq in groups.values():
        for d in dims:  # the shards along each sharded dimension add up (dims are independent mesh axes)
            dist.all_reduce(sq, group=mesh.get_group(d))
        total = total + sq
    if extra_group is not None:
        dist.all_reduce(total, group=extra_group)
    norm = float(total.sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)  # a DTensor scales its local shard
    return norm


def average_gradients(params, group, n):
    """The data-parallel mean of the gradients of `params`: one all-reduce of a flat buffer (what DDP does, in one
    bucket and after the backward pass instead of overlapped with it)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(n)
    for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(r)


def all_params(modules):
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def adamw(params, a):
    """AdamW as accel's examples: betas (0.9, 0.999), eps 1e-8, --weight-decay on every parameter."""
    return torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)


# ----------------------------------------------------------------------------------------------------- pipeline


class Pipeline:
    """torch.distributed.pipelining over a (pp, dp) mesh: the model cut by layers into pp (× 2 for interleaved, looped:
    rank r holds stages r, r + pp) stages as evenly as possible, earlier stages taking the extra ones (accel's
    pipeline_stages); `make_stage(stage, layers, first, last)` returns stage `stage`'s module (the first holds the
    input embedding, the last the head); DDP(device_mesh=mesh["dp"]) around each stage module (--pp-dp ddp) or the
    gradients averaged by `average_gradients` after the schedule (--pp-dp allreduce) when dp > 1."""

    def __init__(self, a, sizes, world, n_layer, make_stage, loss_fn=mean_cross_entropy):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        pp, dp = sizes["pp"], sizes["dp"]
        if pp * dp != world:
            raise Unsupported(f"pp {pp} × dp {dp} needs {pp * dp} processes, the job has {world}")
        per_rank = 2 if sizes["schedule"] == "interleaved" else 1
        n_stages = pp * per_rank
        if n_layer < n_stages:
            raise Unsupported(f"{n_layer} layers cannot fill {n_stages} stages (pp {pp} × {per_rank} per rank)")
        if a.global_batch // dp % a.microbatches:
            raise Unsupported(f"per-replica batch {a.global_batch // dp} does not split into {a.microbatches} micro-batches")
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        self.pp, self.dp = pp, dp
        self.pp_rank, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        base, extra = divmod(n_layer, n_stages)
        bounds, start = [], 0
        for s in range(n_stages):
            n = base + (1 if s < extra else 0)
            bounds.append(range(start, start + n))
            start += n
        self.modules, self.stages = [], []  # this rank's stage modules, (stage index, PipelineStage)
        for s in [self.pp_rank + k * pp for k in range(per_rank)]:  # looped assignment: rank r holds r, r + pp, …
            m = make_stage(s, bounds[s], s == 0, s == n_stages - 1)
            self.modules.append(m)
            if dp > 1 and a.pp_dp == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                wrapped = DDP(m, device_mesh=mesh["dp"])
            else:
                wrapped = m
            self.stages.append((s, PipelineStage(wrapped, s, n_stages, torch.device("cpu"), group=self.pp_group)))
        objs = [st for _, st in self.stages]
        if sizes["schedule"] == "gpipe":
            self.schedule = ScheduleGPipe(objs[0], a.microbatches, loss_fn=loss_fn)
        elif sizes["schedule"] == "1f1b":
            self.schedule = Schedule1F1B(objs[0], a.microbatches, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(objs, a.microbatches, loss_fn=loss_fn)
        self.dp_group = mesh["dp"].get_group() if dp > 1 and a.pp_dp == "allreduce" else None
        self.is_last = any(s == n_stages - 1 for s, _ in self.stages)
        self.holds_first = any(s == 0 for s, _ in self.stages)
        self.params = all_params(self.modules)
        self.desc = (f"torch.distributed.pipelining {type(self.schedule).__name__}, {n_stages} stages over pp {pp} "
                     f"(layers {[f'{b.start}-{b.stop - 1}' for b in bounds]}), {a.microbatches} micro-batches, "
                     f"stages here {[s for s, _ in self.stages]}"
                     + ((f", DDP(device_mesh=mesh['dp']) per stage over {dp}" if a.pp_dp == "ddp" else
                         f", gradients averaged over dp {dp} by one all-reduce of a flat buffer after the schedule "
                         f"(--pp-dp allreduce)") if dp > 1 else ""))


# ------------------------------------------------------------------------------------------------ steps, loop


def plain_step(forward, opt, params, max_norm, loss_fn=mean_cross_entropy, loss_parallel=None):
    """One optimizer step of a model that is not pipelined: `forward(x)` → logits, the loss, backward (under the
    `loss_parallel` context manager when given), clipping, AdamW. Returns the loss (float)."""

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        if loss_parallel is not None:
            with loss_parallel():
                loss = loss_fn(forward(x), y)
                loss.backward()
            value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        else:
            loss = loss_fn(forward(x), y)
            loss.backward()
            value = loss
        grad_norm_and_clip(params, max_norm)
        opt.step()
        return float(value.detach())

    return step


def pipeline_step(pipe, opt, max_norm):
    """One optimizer step through `pipe`'s schedule: the mean loss of the micro-batches on the rank holding the last
    stage, None elsewhere."""

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        losses = []
        args = (x,) if pipe.holds_first else ()
        if pipe.is_last:
            pipe.schedule.step(*args, target=y, losses=losses)
            value = float(torch.stack([l.detach() for l in losses]).mean())
        else:
            pipe.schedule.step(*args)
            value = None
        if pipe.dp_group is not None:
            average_gradients(pipe.params, pipe.dp_group, pipe.dp)
        grad_norm_and_clip(pipe.params, max_norm, pipe.pp_group)
        opt.step()
        return value

    return step


def banner(a, n_params, model_desc, per_replica, tokens_per_step, threads):
    """The banner's words after the layout: the model, the batch, the versions and the optimizer."""
    return (f"model {n_params} parameters ({model_desc}); global batch {a.global_batch} sequences = {tokens_per_step} "
            f"tokens per optimizer step ({per_replica} per replica); torch {torch.__version__}, {threads} thread(s) "
            f"per process, AdamW(lr {a.lr}, betas (0.9, 0.999), eps 1e-8, weight decay {a.weight_decay}), clip "
            f"{a.max_grad_norm}")


class Job:
    """What `train` runs: `step(x, y)` → this rank's loss (float) or None (a pipeline rank without the last stage),
    the layout's sizes and this rank's coordinates, the data, and the words of the banner line."""

    def __init__(self, step, batches, tokens_per_step, pp=1, dp=1, tp=1, pp_rank=0, dp_rank=0, tp_rank=0,
                 n_params=0, desc="", banner="", extra=None):
        self.step, self.batches, self.tokens_per_step = step, batches, tokens_per_step
        self.pp, self.dp, self.tp = pp, dp, tp
        self.pp_rank, self.dp_rank, self.tp_rank = pp_rank, dp_rank, tp_rank
        self.n_params, self.desc, self.banner, self.extra = n_params, desc, banner, extra or {}


def train(name, a, job):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{name}: {a.layout}: {world} processes = pp {job.pp} × dp {job.dp} × tp {job.tp}; {job.desc}; "
              f"{job.banner}", flush=True)
    tokens_per_step = job.tokens_per_step
    start = time.perf_counter()
    measured = None
    loss_sum, loss_count = 0.0, 0
    first_loss, last_loss = None, float("nan")
    step = 0
    while step < a.steps:
        x, y = next(job.batches)
        value = job.step(x, y)
        if value is not None:
            loss_sum += value
            loss_count += 1
        step += 1
        if step % a.log_every == 0 or step == a.steps:
            # The mean over the interval's batches and the replicas: every rank that computed a loss adds its mean,
            # divided by how many ranks hold the same replica's loss (the tp peers; under pp only the last stage).
            mine = loss_sum / loss_count if loss_count else 0.0
            t = torch.tensor([mine / job.tp / job.dp], dtype=torch.float64)
            dist.all_reduce(t)
            last_loss = float(t)
            if first_loss is None:
                first_loss = last_loss
            speed = "warm-up"
            if measured is not None:
                t0, s0 = measured
                speed = f"{(step - s0) * tokens_per_step / max(time.perf_counter() - t0, 1e-9):.0f} tokens/s"
            if rank == 0:
                print(f"step {step}/{a.steps}: loss {last_loss:.4f}, {speed}, {time.perf_counter() - start:.1f} s",
                      flush=True)
            if measured is None:
                measured = (time.perf_counter(), step)
            loss_sum, loss_count = 0.0, 0
    elapsed = time.perf_counter() - start
    t0, s0 = measured
    if step > s0:
        throughput = (step - s0) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
    else:
        throughput = step * tokens_per_step / max(elapsed, 1e-9)
    dist.barrier()
    rss = peak_rss_mib()
    coords = {"rank": rank, "pp": job.pp_rank, "dp": job.dp_rank, "tp": job.tp_rank, "rss": rss}
    everyone = [None] * world
    dist.all_gather_object(everyone, coords)
    if rank == 0:
        print(f"{name} done: {step} steps in {elapsed:.1f} s, final loss {last_loss:.4f}, {throughput:.0f} tokens/s "
              f"(pp {job.pp} × dp {job.dp} × tp {job.tp})", flush=True)
        for c in everyone:
            print(f"rank {c['rank']} (pp {c['pp']} dp {c['dp']} tp {c['tp']}): peak RSS {c['rss']:.1f} MiB", flush=True)
        result = {
            "framework": "pytorch",
            "layout": a.layout,
            "nproc": world,
            "pp": job.pp,
            "dp": job.dp,
            "tp": job.tp,
            "steps": step,
            "measured_steps": step - s0,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": throughput,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "peak_rss_mib": [c["rss"] for c in everyone],
            "parameters": job.n_params,
            "threads": torch.get_num_threads(),
            "import_rss_mib": IMPORT_RSS_MIB,
            "torch": torch.__version__,
            **job.extra,
        }
        print(f"{name} result: " + json.dumps(result), flush=True)
