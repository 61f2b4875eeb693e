"""One training step of the benchmark models in PyTorch, split into forward, backward and optimizer — the twin of
benches/src/bin/step_time.rs (same flags, same JSON keys, "impl": "pytorch").

    python step.py --model mlp --batch 128 --threads 1 --json
    python step.py --model gpt --batch 16 --threads 2 --json

MLP: models.Mlp (784-hidden-10), cross entropy, torch.optim.AdamW(lr 1e-3); GPT: models.CharGpt (GptConfig::small
of the Shakespeare vocabulary, context 64), `--batch` sequences. Batches are real data (the MNIST training images,
the Shakespeare training windows), cycled. Each phase is timed on its own (forward = model + loss; backward =
loss.backward(); optimizer = step + zero_grad); medians over `--steps` steps after `--warmup`. faults_per_step:
minor page faults of the process (getrusage) over the timed steps, per step.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--hidden", default="512,512")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=int(os.environ.get("RAYON_NUM_THREADS", "1")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON line (the default output is the same line)")
    a = p.parse_args()
    a.batch = a.batch or (128 if a.model == "mlp" else 16)
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(a.seed)

    if a.model == "mlp":
        hidden = [int(h) for h in a.hidden.split(",") if h]
        model = models.Mlp(hidden)
        x_all, y_all = models.load_mnist("train10k")
        n = len(y_all) // a.batch
        batches = [(x_all[i * a.batch : (i + 1) * a.batch], y_all[i * a.batch : (i + 1) * a.batch]) for i in range(n)]

        def loss_of(x, y):
            return F.cross_entropy(model(x), y)

    else:
        train, _, vocab = models.shakespeare()
        model = models.CharGpt(models.GptConfig(len(vocab)))
        n = models.num_windows(train) // a.batch
        batches = [models.windows(train, range(i * a.batch, (i + 1) * a.batch)) for i in range(min(n, 64))]
        loss_of = model.loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd, bwd, optim, step = [], [], [], []
    faults0 = 0
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = loss_of(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= a.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            optim.append(t3 - t2)
            step.append(t3 - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
    print(
        json.dumps(
            {
                "impl": "pytorch",
                "model": a.model,
                "batch": a.batch,
                "threads": torch.get_num_threads(),
                "forward_ms": ms(fwd),
                "backward_ms": ms(bwd),
                "optimizer_ms": ms(optim),
                "step_ms": ms(step),
                "faults_per_step": faults / max(a.steps, 1),
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
