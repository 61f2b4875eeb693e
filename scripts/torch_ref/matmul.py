"""The matrix products of one MLP training step in PyTorch — the twin of benches/src/bin/matmul_time.rs (same
products, flags and JSON keys, "impl": "pytorch").

    python matmul.py --threads 1 --json
"""

import argparse
import json
import statistics
import time

import torch

PRODUCTS = [("fc1 forward", 128, 784, 512), ("fc2 forward", 128, 512, 512), ("fc1 weight gradient", 512, 128, 784)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for name, m, k, n in PRODUCTS:
        x, w = torch.randn(m, k), torch.randn(k, n)
        times = []
        for i in range(a.warmup + a.reps):
            t0 = time.perf_counter()
            c = x @ w
            dt = time.perf_counter() - t0
            del c
            if i >= a.warmup:
                times.append(dt)
        us = statistics.median(times) * 1e6
        gflops = 2 * m * k * n / (us * 1e-6) / 1e9
        rec = {"impl": "pytorch", "product": name, "m": m, "k": k, "n": n, "threads": torch.get_num_threads(),
               "us": us, "gflops": gflops}
        print(json.dumps(rec) if a.json else f"pytorch {name:20} {m}×{k}·{k}×{n}: {us:8.1f} µs, {gflops:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
