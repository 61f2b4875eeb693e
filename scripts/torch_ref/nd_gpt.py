"""The char-GPT of examples/src/gpt.rs trained with PyTorch's native N-D parallel stack (the engine under Hugging
Face Accelerate's ND-Parallel) on the CPU over gloo — the PyTorch side of scripts/bench-torch-nd.sh, the twin of
`accel_gpt --nproc 4` at each layout.

    torchrun --standalone --nproc_per_node 4 scripts/torch_ref/nd_gpt.py --layout fsdp-full --steps 30
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 scripts/torch_ref/nd_gpt.py --layout ds-zero2

Layouts (`--layout`; accel_gpt's flags for the same layout in brackets; N = the torchrun world, 4 in the bench):
  ddp              DistributedDataParallel over N                                     [--nproc N]
  fsdp-full        FSDP2 fully_shard per block + root, 1-D mesh of N,
                   reshard_after_forward=True (FULL_SHARD, ZeRO-3)    [--dp-shard-size N --sharding-strategy FULL_SHARD]
  fsdp-grad-op     the same with reshard_after_forward=False (SHARD_GRAD_OP, ZeRO-2)
                                                                   [--dp-shard-size N --sharding-strategy SHARD_GRAD_OP]
  hsdp, hsdp-full  FSDP2 on a 2-D mesh (dp_replicate N/2 × dp_shard 2), reshard_after_forward False / True
                                                [--dp-shard-size 2 (--sharding-strategy SHARD_GRAD_OP | FULL_SHARD)]
  tpN              DTensor tensor parallelism over N: parallelize_module with ColwiseParallel on attn.q/k/v and
                   mlp.c_fc, RowwiseParallel on attn.c_proj and mlp.c_proj, RowwiseParallel(input_layouts=
                   Replicate()) on the token embedding (vocabulary rows sharded, as VocabParallelEmbedding), the
                   head ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) under loss_parallel()
                   (the logits are never gathered, as vocab_parallel_cross_entropy)              [--tp-size N]
  tpT-dpD          2-D mesh (dp D × tp T, tp innermost = consecutive ranks, as ours): the tp plan on mesh["tp"],
                   DistributedDataParallel(device_mesh=mesh["dp"]) over it                        [--tp-size T]
  ppP-dpD-SCHED    torch.distributed.pipelining: the model cut by blocks into P stages (embeddings on the first,
                   ln_f + head on the last; 2 stages per rank, looped, for interleaved), PipelineStage + ScheduleGPipe
                   | Schedule1F1B | ScheduleInterleaved1F1B over --microbatches; when D > 1, DDP(device_mesh=
                   mesh["dp"]) around each stage module (--pp-dp ddp, the stage's own DDP support) or the gradients
                   averaged by one all-reduce after the schedule (--pp-dp allreduce: in torch 2.15 DDP under GPipe
                   and interleaved 1F1B fails DDP's reducer assert "rebuilt parameter indices size is not same as
                   original model parameters size" at the second step); SCHED = gpipe | 1f1b | interleaved
                                         [--pp-size P --pp-schedule GPipe|1F1B|Interleaved1F1B --microbatches M]
  ppP-SCHED        the same with D = 1
  ds-zero1|2|3     DeepSpeed ZeRO stage 1/2/3 (deepspeed.initialize; DS_ACCELERATOR=cpu: gloo, plus its JIT-built
                   shared-memory all-reduce op, deepspeed_shm_comm, which needs ninja on PATH and a C++ compiler),
                   torch.optim.AdamW as the client optimizer, gradient clipping in DeepSpeed's config
                                                           [--dp-shard-size N --sharding-strategy SHARD_OPTIM|...]

The model (examples/src/gpt.rs): learned token and position embeddings, pre-LN blocks (LayerNorm eps 1e-5),
separate q/k/v linears with bias, causal softmax(q kᵀ/√hd) v, c_proj; MLP c_fc → GELU (tanh) → c_proj; ln_f; a
head without bias, untied unless --tie-embeddings; dropout (off by default) after the embedding, on both residual
branches and on the MLP's hidden activation; GPT-2's initialisation (Normal(0, 0.02), the residual projections
0.02/√(2·n_layer), zero biases, layer norms 1/0). The parameter count is printed and asserted equal to
GptConfig::num_parameters's formula.

Training as accel_gpt's defaults: the whole of data/shakespeare/shakespeare8.txt, vocabulary = its sorted distinct
characters, non-overlapping windows of --block-size with targets shifted by one, shuffled each epoch (seed + epoch)
and dealt to the data-parallel ranks, drop_last; --global-batch sequences per optimizer step over all replicas
(--global-batch / dp per replica, the tp and pp peers reading the same rows); mean cross entropy; gradient norm
clipped to --max-grad-norm (1.0; each parameter counted once over dp × tp × pp); torch.optim.AdamW(lr 2e-3,
betas (0.9, 0.999), eps 1e-8, weight_decay 0.1) on every parameter; fp32; torch.set_num_threads(cores / world).

Output (rank 0, as accel_gpt): `step k/n: loss L, T tokens/s` every --log-every steps (the loss: the mean over the
interval's batches and the data-parallel replicas), then one line per rank `rank r (pp a dp b tp c): peak RSS X MiB`
(VmHWM of /proc/self/status) and `nd_gpt result: {json}` (with `import_rss_mib`, the peak right after `import torch`) — tokens/s over all replicas over the steps after the
first logged interval (warm-up), final loss, first loss, the peak RSS of every rank, the parameter count. A layout
that PyTorch cannot run here prints `unsupported: <layout>: <reason>` (every rank that failed) and exits 0.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
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


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=None, help="default: steps / 3 (the first interval is warm-up)")
    p.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step over all replicas")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(REPO, "data", "shakespeare"))
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--pp-dp", choices=["ddp", "allreduce"], default="ddp",
                   help="data parallelism over pipeline stages: DDP around each stage module (the pipelining stage's "
                        "DDP support), or one all-reduce of the gradients after the schedule")
    p.add_argument("--threads", type=int, default=None, help="default: cores / world size, at least 1")
    p.add_argument("--pg-timeout", type=int, default=300, help="seconds before a stuck collective fails")
    p.add_argument("--expect-parameters", type=int, default=None, help="accel_gpt's count: asserted equal")
    a = p.parse_args()
    if a.log_every is None:
        a.log_every = max(a.steps // 3, 1)
    return a


# ------------------------------------------------------------------------------------------------------- model


class Cfg:
    def __init__(self, a, vocab_size):
        self.vocab_size, self.block_size, self.n_layer = vocab_size, a.block_size, a.n_layer
        self.n_head, self.d_model, self.d_ff = a.n_head, a.d_model, a.d_ff
        self.dropout, self.tie = a.dropout, a.tie_embeddings

    def num_parameters(self):
        """GptConfig::num_parameters of examples/src/gpt.rs."""
        v, d, f = self.vocab_size, self.d_model, self.d_ff
        ln = 2 * d
        block = ln + 3 * (d * d + d) + (d * d + d) + ln + (d * f + f) + (f * d + d)
        return v * d + self.block_size * d + self.n_layer * block + ln + (0 if self.tie else v * d)

    def describe(self):
        return (
            f"d_model {self.d_model}, {self.n_head} heads, {self.n_layer} layers, context {self.block_size}, "
            f"d_ff {self.d_ff}, vocabulary {self.vocab_size}, dropout {self.dropout}, tied {self.tie}"
        )


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.q, self.k, self.v, self.c_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.head_dim, self.p = d // cfg.n_head, cfg.dropout

    def forward(self, x, mask):
        b, s, _ = x.shape

        def heads(t):  # -1: the heads this rank holds (all of them, or n_head / tp under tensor parallelism)
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        y = (torch.softmax(scores + mask, dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)
        return F.dropout(self.c_proj(y), self.p, self.training)


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        self.p = cfg.dropout

    def forward(self, x):
        h = F.dropout(F.gelu(self.c_fc(x), approximate="tanh"), self.p, self.training)
        return F.dropout(self.c_proj(h), self.p, self.training)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.d_model, eps=1e-5), Attention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.d_model, eps=1e-5), Mlp(cfg)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """The whole model, or (after `keep_stage`) one pipeline stage of it under the same parameter names:
    `wte.weight`, `wpe.weight`, `h.{i}.…`, `ln_f.*`, `lm_head.weight` — gpt.rs's names."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Parameter(torch.zeros(cfg.block_size, cfg.d_model))
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.wte.weight
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, residual_std)
                elif "ln_" in name:
                    continue  # LayerNorm: weight 1, bias 0 (PyTorch's init = ours)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)  # wte, wpe, q/k/v, c_fc, lm_head
        mask = torch.full((cfg.block_size, cfg.block_size), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        self.first, self.last = True, True

    def keep_stage(self, layers, first, last):
        """Drops every part outside pipeline stage (`layers`, first, last)."""
        for i in list(self.h.keys()):
            if int(i) not in layers:
                del self.h[i]
        self.first, self.last = first, last
        if not first:
            self.wte, self.wpe = None, None
        if not last:
            self.ln_f, self.lm_head = None, None
        return self

    def forward(self, x):
        if self.first:
            s = x.shape[1]
            x = F.dropout(self.wte(x) + self.wpe[:s], self.cfg.dropout, self.training)
        s = x.shape[1]
        mask = self.mask[:s, :s]
        for block in self.h.values():
            x = block(x, mask)
        if not self.last:
            return x
        return self.lm_head(self.ln_f(x))


def mean_cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


# -------------------------------------------------------------------------------------------------------- data


def load_text(a):
    with open(os.path.join(a.data_dir, "shakespeare8.txt"), encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64), vocab


class Batches:
    """accel_gpt's loader: windows i·block .. i·block + block (+1 for the targets), shuffled per epoch with seed +
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


class Unsupported(Exception):
    pass


# ------------------------------------------------------------------------------------------------------ layouts


def tp_plan(model, with_head_and_embedding=True):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in model.h.keys():
        for name in ("q", "k", "v"):
            plan[f"h.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"h.{i}.mlp.c_proj"] = RowwiseParallel()
    if with_head_and_embedding:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def parse_layout(name, world):
    """(kind, sizes dict) of a layout name."""
    import re

    if name in ("ddp", "fsdp-full", "fsdp-grad-op", "hsdp", "hsdp-full", "ds-zero1", "ds-zero2", "ds-zero3"):
        return name, {}
    m = re.fullmatch(r"tp(\d+)(?:-dp(\d+))?", name)
    if m:
        return "tp", {"tp": int(m.group(1)), "dp": int(m.group(2) or 1)}
    m = re.fullmatch(r"pp(\d+)(?:-dp(\d+))?-(gpipe|1f1b|interleaved)", name)
    if m:
        return "pp", {"pp": int(m.group(1)), "dp": int(m.group(2) or 1), "schedule": m.group(3)}
    raise SystemExit(f"--layout {name}: not a layout (see --help)")


def main():
    a = parse()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    kind, sizes = parse_layout(a.layout, world)
    if kind.startswith("ds-"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        sys.exit("nd_gpt.py runs under torchrun: torchrun --standalone --nproc_per_node 4 nd_gpt.py --layout …")
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    except Exception as e:  # noqa: BLE001
        print(f"unsupported: {a.layout}: init_process_group(gloo) failed: {first_line(e)}", flush=True)
        return
    try:
        run(a, kind, sizes, rank, world, threads)
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


def run(a, kind, sizes, rank, world, threads):
    from torch.distributed.device_mesh import init_device_mesh

    tokens, vocab = load_text(a)
    cfg = Cfg(a, len(vocab))
    torch.manual_seed(a.seed)
    model = Gpt(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == cfg.num_parameters(), f"{n_params} parameters, GptConfig::num_parameters says {cfg.num_parameters()}"
    if a.expect_parameters is not None:
        assert n_params == a.expect_parameters, f"{n_params} parameters, accel_gpt reports {a.expect_parameters}"

    pp, dp, tp = 1, world, 1
    pp_group = None
    dp_group = None  # set when the gradients are averaged by hand (--pp-dp allreduce)
    stages_here = []  # (stage index, PipelineStage) this rank holds under pp
    schedule = None
    loss_parallel_ctx = None
    ds_engine = None
    pp_rank, dp_rank, tp_rank = 0, rank, 0
    desc = ""

    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_module = DDP(model)
        params = list(model.parameters())
        desc = "DistributedDataParallel"
    elif kind in ("fsdp-full", "fsdp-grad-op", "hsdp", "hsdp-full"):
        from torch.distributed.fsdp import fully_shard

        reshard = kind in ("fsdp-full", "hsdp-full")
        if kind.startswith("hsdp"):
            if world % 2:
                raise Unsupported(f"HSDP here is dp_replicate {world}/2 × dp_shard 2: the world ({world}) must be even")
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in model.h.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        train_module = model
        params = list(model.parameters())
        desc = f"FSDP2 fully_shard per block + root, mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, reshard_after_forward={reshard}"
    elif kind == "tp":
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        tp, dp = sizes["tp"], sizes["dp"]
        if tp * dp != world:
            raise Unsupported(f"tp {tp} × dp {dp} needs {tp * dp} processes, the job has {world}")
        if cfg.tie:
            raise Unsupported("tied embeddings under tensor parallelism: parallelize_module re-creates wte and lm_head's weights separately (the tie is lost)")
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
        parallelize_module(model, mesh["tp"], tp_plan(model))
        loss_parallel_ctx = loss_parallel
        if dp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            train_module = DDP(model, device_mesh=mesh["dp"])
        else:
            train_module = model
        params = list(model.parameters())
        desc = (f"DTensor TP plan (Colwise q/k/v/c_fc, Rowwise c_proj, Rowwise(input Replicate) wte, Colwise head + "
                f"loss_parallel) on mesh['tp'] of {tp}" + (f", DDP(device_mesh=mesh['dp']) over {dp}" if dp > 1 else ""))
    elif kind == "pp":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        pp, dp = sizes["pp"], sizes["dp"]
        if pp * dp != world:
            raise Unsupported(f"pp {pp} × dp {dp} needs {pp * dp} processes, the job has {world}")
        if cfg.tie:
            raise Unsupported("tied embeddings across pipeline stages: torch.distributed.pipelining has no shared-weight support between stages")
        per_rank = 2 if sizes["schedule"] == "interleaved" else 1
        n_stages = pp * per_rank
        if cfg.n_layer < n_stages:
            raise Unsupported(f"{cfg.n_layer} layers cannot fill {n_stages} stages (pp {pp} × {per_rank} per rank)")
        if a.global_batch // dp % a.microbatches:
            raise Unsupported(f"per-replica batch {a.global_batch // dp} does not split into {a.microbatches} micro-batches")
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        pp_group = mesh["pp"].get_group()
        # Blocks cut as evenly as possible, earlier stages taking the extra ones (accel's pipeline_stages).
        base, extra = divmod(cfg.n_layer, n_stages)
        bounds, start = [], 0
        for s in range(n_stages):
            n = base + (1 if s < extra else 0)
            bounds.append(range(start, start + n))
            start += n
        import copy

        modules = []
        for s in [pp_rank + k * pp for k in range(per_rank)]:  # looped assignment: rank r holds r, r + pp, …
            m = copy.deepcopy(model).keep_stage(bounds[s], s == 0, s == n_stages - 1)
            modules.append(m)
            if dp > 1 and a.pp_dp == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                m_wrapped = DDP(m, device_mesh=mesh["dp"])
            else:
                m_wrapped = m
            stages_here.append((s, PipelineStage(m_wrapped, s, n_stages, torch.device("cpu"), group=pp_group)))
        del model
        stage_objs = [st for _, st in stages_here]
        if sizes["schedule"] == "gpipe":
            schedule = ScheduleGPipe(stage_objs[0], a.microbatches, loss_fn=mean_cross_entropy)
        elif sizes["schedule"] == "1f1b":
            schedule = Schedule1F1B(stage_objs[0], a.microbatches, loss_fn=mean_cross_entropy)
        else:
            schedule = ScheduleInterleaved1F1B(stage_objs, a.microbatches, loss_fn=mean_cross_entropy)
        params = all_params(modules)
        if dp > 1 and a.pp_dp == "allreduce":
            dp_group = mesh["dp"].get_group()
        train_module = None
        desc = (f"torch.distributed.pipelining {type(schedule).__name__}, {n_stages} stages over pp {pp}, "
                f"{a.microbatches} micro-batches, stages here {[s for s, _ in stages_here]}"
                + ((f", DDP(device_mesh=mesh['dp']) per stage over {dp}" if a.pp_dp == "ddp" else
                    f", gradients averaged over dp {dp} by one all-reduce of a flat buffer after the schedule "
                    f"(--pp-dp allreduce)") if dp > 1 else ""))
    elif kind.startswith("ds-"):
        try:
            import deepspeed
        except Exception as e:  # noqa: BLE001
            raise Unsupported(f"import deepspeed failed: {first_line(e)}")
        stage = int(kind[-1])
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
        ds_config = {
            "train_batch_size": a.global_batch,
            "train_micro_batch_size_per_gpu": a.global_batch // world,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": a.max_grad_norm,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        try:
            ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        except Exception as e:  # noqa: BLE001
            raise Unsupported(f"deepspeed.initialize (ZeRO-{stage}, accelerator "
                              f"{deepspeed.get_accelerator()._name}): {type(e).__name__}: {first_line(e)}")
        train_module = ds_engine
        params = list(model.parameters())
        desc = f"DeepSpeed {deepspeed.__version__} ZeRO-{stage}, accelerator {deepspeed.get_accelerator()._name}"
    else:
        raise SystemExit(f"unknown layout kind {kind}")

    if ds_engine is None:
        opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)

    per_replica = a.global_batch // dp
    if per_replica * dp != a.global_batch:
        raise Unsupported(f"--global-batch {a.global_batch} does not split over dp {dp}")
    batches = iter(Batches(tokens, cfg.block_size, per_replica, dp_rank, dp, a.seed))
    tokens_per_step = a.global_batch * cfg.block_size
    if rank == 0:
        print(f"nd_gpt: {a.layout}: {world} processes = pp {pp} × dp {dp} × tp {tp}; {desc}; model {n_params} "
              f"parameters ({cfg.describe()}); global batch {a.global_batch} sequences = {tokens_per_step} tokens "
              f"per optimizer step ({per_replica} per replica); torch {torch.__version__}, {threads} thread(s) per "
              f"process, AdamW(lr {a.lr}, betas (0.9, 0.999), eps 1e-8, weight decay {a.weight_decay}), clip "
              f"{a.max_grad_norm}", flush=True)

    is_last = (pp == 1) or any(s == pp * (2 if sizes.get("schedule") == "interleaved" else 1) - 1 for s, _ in stages_here)
    holds_first = (pp == 1) or any(s == 0 for s, _ in stages_here)
    start = time.perf_counter()
    measured = None
    loss_sum, loss_count = 0.0, 0
    first_loss, last_loss = None, float("nan")
    step = 0
    while step < a.steps:
        x, y = next(batches)
        if kind == "pp":
            opt.zero_grad(set_to_none=True)
            losses = []
            args = (x,) if holds_first else ()
            if is_last:
                schedule.step(*args, target=y, losses=losses)
                loss_sum += float(torch.stack([l.detach() for l in losses]).mean())
                loss_count += 1
            else:
                schedule.step(*args)
            if dp_group is not None:
                average_gradients(params, dp_group, dp)
            grad_norm_and_clip(params, a.max_grad_norm, pp_group)
            opt.step()
        elif ds_engine is not None:
            loss = mean_cross_entropy(ds_engine(x), y)
            ds_engine.backward(loss)
            ds_engine.step()
            loss_sum += float(loss.detach())
            loss_count += 1
        else:
            opt.zero_grad(set_to_none=True)
            if loss_parallel_ctx is not None:
                with loss_parallel_ctx():
                    loss = mean_cross_entropy(train_module(x), y)
                    loss.backward()
                value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            else:
                loss = mean_cross_entropy(train_module(x), y)
                loss.backward()
                value = loss
            grad_norm_and_clip(params, a.max_grad_norm)
            opt.step()
            loss_sum += float(value.detach())
            loss_count += 1
        step += 1
        if step % a.log_every == 0 or step == a.steps:
            # The mean over the interval's batches and the replicas: every rank that computed a loss adds its mean,
            # divided by how many ranks hold the same replica's loss (the tp peers; under pp only the last stage).
            holders = tp if kind != "pp" else 1
            mine = loss_sum / max(loss_count, 1) if (kind != "pp" or is_last) else 0.0
            t = torch.tensor([mine / holders / dp], dtype=torch.float64)
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
    coords = {"rank": rank, "pp": pp_rank, "dp": dp_rank, "tp": tp_rank, "rss": rss}
    everyone = [None] * world
    dist.all_gather_object(everyone, coords)
    if rank == 0:
        print(f"nd_gpt done: {step} steps in {elapsed:.1f} s, final loss {last_loss:.4f}, {throughput:.0f} tokens/s "
              f"(pp {pp} × dp {dp} × tp {tp})", flush=True)
        for c in everyone:
            print(f"rank {c['rank']} (pp {c['pp']} dp {c['dp']} tp {c['tp']}): peak RSS {c['rss']:.1f} MiB", flush=True)
        result = {
            "framework": "pytorch",
            "layout": a.layout,
            "nproc": world,
            "pp": pp,
            "dp": dp,
            "tp": tp,
            "steps": step,
            "measured_steps": step - s0,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": throughput,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "peak_rss_mib": [c["rss"] for c in everyone],
            "parameters": n_params,
            "threads": torch.get_num_threads(),
            "import_rss_mib": IMPORT_RSS_MIB,
            "torch": torch.__version__,
        }
        if ds_engine is not None:
            import deepspeed

            result["deepspeed"] = deepspeed.__version__
        print("nd_gpt result: " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
