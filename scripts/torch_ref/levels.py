"""The levels benchmark, PyTorch side: the task of benches/src/bin/levels.rs written at PyTorch's levels, one JSON
line on rank 0 with the same keys ("framework": "pytorch").

    python levels.py --model mlp --level torch                                          # plain loop, 1 process
    python -m torch.distributed.run --standalone --nproc_per_node 2 levels.py --model mlp --level ddp
    python -m torch.distributed.run --standalone --nproc_per_node 2 levels.py --model gpt --level accelerate
    python -m torch.distributed.run --standalone --nproc_per_node 2 levels.py --model mlp --level trainer

Levels: `torch` — a plain single-process loop (seeded randperm, tensor indexing, torch.optim.AdamW); `ddp` —
init_process_group("gloo") + DistributedSampler + DataLoader + DistributedDataParallel (world size 1 under
torchrun with one process); `accelerate` — Accelerator(cpu=True), prepare / backward / step; `trainer` —
transformers.Trainer with TrainingArguments(use_cpu=True), no saving, no evaluation during training, no
reporting, no progress bar, dataloader_num_workers 0, logging every 500 steps (HF's default), optim "adamw_torch".
AdamW: lr 1e-3, PyTorch's defaults otherwise (weight decay 0.01) at the first three levels; the Trainer's defaults
(linear decay, clipping at 1.0, weight decay 0) at the Trainer level — exactly as the Rust side.

Threads: torch.set_num_threads(--threads) (default 1) and one inter-op thread per process. Timing as in
levels.rs: the clock starts at the training loop and stamps the end of each optimizer step (at the Trainer level:
on_train_begin / on_step_end of a callback); throughput over every step but the first; `wall_s` from LEVELS_T0_NS
(set by the benchmark script just before the command) or from this interpreter's start.
"""

import argparse
import json
import os
import sys
import time

T_IMPORT = time.time_ns()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--level", choices=["torch", "ddp", "accelerate", "trainer"], default="torch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--hidden", default="512,512")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--text", default=None)
    p.add_argument("--tag", default=None, help="free text copied into the JSON line as `tag` (as levels.rs)")
    a = p.parse_args()
    a.batch = a.batch or (64 if a.model == "mlp" else 16)
    a.hidden = [int(h) for h in a.hidden.split(",") if h]
    if a.level == "torch" and int(os.environ.get("WORLD_SIZE", "1")) != 1:
        p.error("--level torch is a plain single-process loop: run it without torchrun")
    return a


class Clock:
    def __init__(self):
        self.start = time.perf_counter()
        self.ends = []
        self.samples = []

    def step_done(self, global_samples):
        self.ends.append(time.perf_counter())
        self.samples.append(global_samples)


def report(args, clock, world, train_loss, quality, parameters, samples_per_epoch=None):
    ends = clock.ends
    gaps = sorted((b - a) * 1e3 for a, b in zip(ends, ends[1:]))
    per_s = sum(clock.samples[1:]) / max(ends[-1] - ends[0], 1e-12) if len(ends) > 1 else float("nan")
    t0 = int(os.environ.get("LEVELS_T0_NS", T_IMPORT))
    out = {
        "framework": "pytorch",
        "model": args.model,
        "level": args.level,
        "nproc": world,
        "threads": torch.get_num_threads(),
        "batch_per_process": args.batch,
        "step_ms": gaps[len(gaps) // 2] if gaps else float("nan"),
        "first_step_ms": (ends[0] - clock.start) * 1e3,
        "wall_s": (time.time_ns() - t0) * 1e-9,
        "train_loss": train_loss,
        "steps": len(ends),
        "parameters": parameters,
        "samples_seen": sum(clock.samples),
        "torch": torch.__version__,
    }
    if args.tag is not None:
        out["tag"] = args.tag
    if args.model == "mlp":
        out["samples_per_s"] = per_s
        out["test_accuracy"] = quality
        out["samples_per_epoch"] = samples_per_epoch
    else:
        out["tokens_per_s"] = per_s * models.GPT_BLOCK
        out["val_loss"] = quality
    for mod in ("accelerate", "transformers"):
        if mod in sys.modules:
            out[mod] = sys.modules[mod].__version__
    print(json.dumps(out), flush=True)


def count(model):
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def test_accuracy(model, args):
    x, y = models.load_mnist("t10k", args.data_dir)
    model.eval()
    correct = sum(int((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum()) for i in range(0, len(y), 1000))
    return correct / len(y)


@torch.no_grad()
def val_loss(model, val):
    n = models.num_windows(val)
    total = 0.0
    for i in range(0, n, 64):
        idx = list(range(i, min(i + 64, n)))
        x, y = models.windows(val, idx)
        total += float(model.loss(x, y)) * len(idx)
    return total / max(n, 1)


def build(args):
    torch.manual_seed(args.seed)
    if args.model == "mlp":
        model = models.Mlp(args.hidden)
        assert count(model) == models.mlp_num_parameters(args.hidden)
        return model, None
    train, val, vocab = models.shakespeare(path=args.text)
    return models.CharGpt(models.GptConfig(len(vocab))), (train, val)


def mlp_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def gpt_step(model, opt, x, y):
    loss = model.loss(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


# ------------------------------------------------------------------------------------------------ plain loop


def run_torch(args):
    model, text = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    clock = Clock()
    if args.model == "mlp":
        x_all, y_all = models.load_mnist("train10k", args.data_dir)
        first = 0
        for epoch in range(args.epochs):
            perm = torch.randperm(len(y_all), generator=g)
            for i in range(0, len(perm), args.batch):
                idx = perm[i : i + args.batch]
                losses.append(mlp_step(model, opt, x_all[idx], y_all[idx]))
                clock.step_done(len(idx))
                first += len(idx) if epoch == 0 else 0
        report(args, clock, 1, sum(losses) / len(losses), test_accuracy(model, args), count(model), first)
    else:
        train, val = text
        n = models.num_windows(train)
        while len(clock.ends) < args.steps:
            perm = torch.randperm(n, generator=g)
            for i in range(0, n - args.batch + 1, args.batch):
                x, y = models.windows(train, perm[i : i + args.batch])
                losses.append(gpt_step(model, opt, x, y))
                clock.step_done(args.batch)
                if len(clock.ends) >= args.steps:
                    break
        report(args, clock, 1, sum(losses) / len(losses), val_loss(model, val), count(model))


# ------------------------------------------------------------------------------------------------- DDP (gloo)


def run_ddp(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    if "RANK" not in os.environ:
        sys.exit("--level ddp runs under torchrun: python -m torch.distributed.run --nproc_per_node N levels.py ...")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, text = build(args)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    losses = []
    if args.model == "mlp":
        ds = TensorDataset(*models.load_mnist("train10k", args.data_dir))
        sampler = DistributedSampler(ds, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch, sampler=sampler)
        first = 0
        clock = Clock()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                losses.append(mlp_step(ddp, opt, x, y))
                clock.step_done(len(y) * world)
                first += len(y) * world if epoch == 0 else 0
        quality = test_accuracy(model, args)
    else:
        train, val = text
        ds = models.TextWindows(train)
        sampler = DistributedSampler(ds, seed=args.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True)
        clock, epoch = Clock(), 0
        while len(clock.ends) < args.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                logits = ddp(x)  # the forward through the DDP wrapper, the loss outside it
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                clock.step_done(len(y) * world)
                if len(clock.ends) >= args.steps:
                    break
            epoch += 1
        quality = val_loss(model, val)
        first = None
    if rank == 0:
        report(args, clock, world, sum(losses) / len(losses), quality, count(model), first)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- Accelerate


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator(cpu=True)
    set_seed(args.seed)
    world = acc.num_processes
    model, text = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    if args.model == "mlp":
        ds = TensorDataset(*models.load_mnist("train10k", args.data_dir))
        loader = DataLoader(ds, batch_size=args.batch, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        first = 0
        clock = Clock()
        for epoch in range(args.epochs):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                acc.backward(loss)
                opt.step()
                losses.append(loss.item())
                clock.step_done(len(y) * world)
                first += len(y) * world if epoch == 0 else 0
        quality = test_accuracy(acc.unwrap_model(model), args)
    else:
        train, val = text
        loader = DataLoader(models.TextWindows(train), batch_size=args.batch, shuffle=True, drop_last=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        clock = Clock()
        while len(clock.ends) < args.steps:
            for x, y in loader:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                acc.backward(loss)
                opt.step()
                losses.append(loss.item())
                clock.step_done(len(y) * world)
                if len(clock.ends) >= args.steps:
                    break
        quality = val_loss(acc.unwrap_model(model), val)
        first = None
    if acc.is_main_process:
        report(args, clock, world, sum(losses) / len(losses), quality, count(acc.unwrap_model(model)), first)
    acc.end_training()


# ------------------------------------------------------------------------------------------------ HF Trainer


class _MlpForTrainer(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, pixel_values, labels=None):
        logits = self.mlp(pixel_values)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class _GptForTrainer(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels=None):
        logits = self.gpt(input_ids)
        return {"loss": F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)), "logits": logits}


class _MnistDicts(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def run_trainer(args):
    import tempfile

    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, text = build(args)
    holder = {}

    class StepClock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            holder["clock"] = Clock()

        def on_step_end(self, a, state, control, **kw):
            holder["clock"].step_done(a.per_device_train_batch_size * a.world_size)

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="levels-hf-"),
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        seed=args.seed,
        use_cpu=True,
        save_strategy="no",
        eval_strategy="no",
        logging_steps=500,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        optim="adamw_torch",
        ddp_backend="gloo" if world > 1 else None,
    )
    if args.model == "mlp":
        x, y = models.load_mnist("train10k", args.data_dir)
        targs = TrainingArguments(num_train_epochs=args.epochs, **common)
        wrapped, ds = _MlpForTrainer(model), _MnistDicts(x, y)
    else:
        train, val = text
        targs = TrainingArguments(max_steps=args.steps, dataloader_drop_last=True, **common)
        wrapped, ds = _GptForTrainer(model), models.TextWindows(train, as_dict=True)
    trainer = Trainer(model=wrapped, args=targs, train_dataset=ds, callbacks=[StepClock()])
    out = trainer.train()
    clock = holder["clock"]
    if args.model == "mlp":
        quality = test_accuracy(model, args)
        first = len(clock.ends) // max(args.epochs, 1) * args.batch * world
    else:
        quality, first = val_loss(model, text[1]), None
    if trainer.is_world_process_zero():
        report(args, clock, world, out.training_loss, quality, count(model), first)


def main():
    args = parse()
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (a launcher imported torch's parallel runtime first)
    {"torch": run_torch, "ddp": run_ddp, "accelerate": run_accelerate, "trainer": run_trainer}[args.level](args)


if __name__ == "__main__":
    main()
