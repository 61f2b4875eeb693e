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

Output (rank 0, as accel_gpt; scripts/torch_ref/nd_harness.py runs the loop and prints it, as for nd_llama.py):
`step k/n: loss L, T tokens/s` every --log-every steps (the loss: the mean over the interval's batches and the
data-parallel replicas), then one line per rank `rank r (pp a dp b tp c): peak RSS X MiB` (VmHWM of
/proc/self/status) and `nd_gpt result: {json}` (with `import_rss_mib`, the peak right after `import torch`) —
tokens/s over all replicas over the steps after the first logged interval (warm-up), final loss, first loss, the
peak RSS of every rank, the parameter count. A layout that PyTorch cannot run here prints
`unsupported: <layout>: <reason>` (every rank that failed) and exits 0.
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from nd_harness import (
    Batches,
    Job,
    Pipeline,
    Unsupported,
    adamw,
    banner,
    finish_args,
    first_line,
    main,
    mean_cross_entropy,
    parse_layout,
    pipeline_step,
    plain_step,
    train,
    training_args,
)

PLAIN_LAYOUTS = ("ddp", "fsdp-full", "fsdp-grad-op", "hsdp", "hsdp-full", "ds-zero1", "ds-zero2", "ds-zero3")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    training_args(p, lr=2e-3)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tie-embeddings", action="store_true")
    return finish_args(p.parse_args())


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


# -------------------------------------------------------------------------------------------------------- data


def load_text(a):
    with open(os.path.join(a.data_dir, "shakespeare8.txt"), encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64), vocab


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


def run(a, rank, world, threads):
    from torch.distributed.device_mesh import init_device_mesh

    kind, sizes = parse_layout(a.layout, PLAIN_LAYOUTS)
    tokens, vocab = load_text(a)
    cfg = Cfg(a, len(vocab))
    torch.manual_seed(a.seed)
    model = Gpt(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == cfg.num_parameters(), f"{n_params} parameters, GptConfig::num_parameters says {cfg.num_parameters()}"
    if a.expect_parameters is not None:
        assert n_params == a.expect_parameters, f"{n_params} parameters, accel_gpt reports {a.expect_parameters}"

    pp, dp, tp = 1, world, 1
    pp_rank, dp_rank, tp_rank = 0, rank, 0
    extra = {}

    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_module = DDP(model)
        opt = adamw(model.parameters(), a)
        step = plain_step(train_module, opt, list(model.parameters()), a.max_grad_norm)
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
        opt = adamw(model.parameters(), a)
        step = plain_step(model, opt, list(model.parameters()), a.max_grad_norm)
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
        if dp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            train_module = DDP(model, device_mesh=mesh["dp"])
        else:
            train_module = model
        opt = adamw(model.parameters(), a)
        step = plain_step(train_module, opt, list(model.parameters()), a.max_grad_norm, loss_parallel=loss_parallel)
        desc = (f"DTensor TP plan (Colwise q/k/v/c_fc, Rowwise c_proj, Rowwise(input Replicate) wte, Colwise head + "
                f"loss_parallel) on mesh['tp'] of {tp}" + (f", DDP(device_mesh=mesh['dp']) over {dp}" if dp > 1 else ""))
    elif kind == "pp":
        if cfg.tie:
            raise Unsupported("tied embeddings across pipeline stages: torch.distributed.pipelining has no shared-weight support between stages")
        import copy

        pipe = Pipeline(a, sizes, world, cfg.n_layer,
                        lambda s, layers, first, last: copy.deepcopy(model).keep_stage(layers, first, last))
        del model
        pp, dp, pp_rank, dp_rank = pipe.pp, pipe.dp, pipe.pp_rank, pipe.dp_rank
        opt = adamw(pipe.params, a)
        step = pipeline_step(pipe, opt, a.max_grad_norm)
        desc = pipe.desc
    elif kind.startswith("ds-"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: gloo and its CPU accelerator
        try:
            import deepspeed
        except Exception as e:  # noqa: BLE001
            raise Unsupported(f"import deepspeed failed: {first_line(e)}")
        stage = int(kind[-1])
        opt = adamw(model.parameters(), a)
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

        def step(x, y):
            loss = mean_cross_entropy(ds_engine(x), y)
            ds_engine.backward(loss)
            ds_engine.step()
            return float(loss.detach())

        desc = f"DeepSpeed {deepspeed.__version__} ZeRO-{stage}, accelerator {deepspeed.get_accelerator()._name}"
        extra["deepspeed"] = deepspeed.__version__
    else:
        raise SystemExit(f"unknown layout kind {kind}")

    per_replica = a.global_batch // dp
    if per_replica * dp != a.global_batch:
        raise Unsupported(f"--global-batch {a.global_batch} does not split over dp {dp}")
    batches = iter(Batches(tokens, cfg.block_size, per_replica, dp_rank, dp, a.seed))
    tokens_per_step = a.global_batch * cfg.block_size
    train("nd_gpt", a, Job(step, batches, tokens_per_step, pp=pp, dp=dp, tp=tp, pp_rank=pp_rank, dp_rank=dp_rank,
                           tp_rank=tp_rank, n_params=n_params, desc=desc, extra=extra,
                           banner=banner(a, n_params, cfg.describe(), per_replica, tokens_per_step, threads)))


if __name__ == "__main__":
    main("nd_gpt", parse(), run)
