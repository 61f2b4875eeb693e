#!/usr/bin/env python3
"""All-reduce bandwidth of PyTorch's gloo backend, printed like ddp-core's `allreduce_bw` (nccl-tests style).

    python scripts/bench_allreduce_gloo.py --nproc 2

Same method as benches/src/bin/allreduce_bw.rs: for each size from --min-bytes to --max-bytes (doubling),
warm-up iterations, a barrier, then `iters` back-to-back all_reduce calls (float32, SUM, in place) with
iters = clamp(volume / size, min_iters, max_iters); the slowest rank's mean time is reported with
algbw = size / time and busbw = algbw * 2 (P - 1) / P, in GB/s (1e9 bytes/s).
"""
import argparse
import os
import time


def parse_size(s: str) -> int:
    s = s.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1].lower(), 1)
    return int(s[:-1] if mult != 1 else s) * mult


def human(b: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def worker(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        print(f"# torch {torch.__version__} gloo all_reduce, {world} processes, f32 SUM in place", flush=True)
        print(f"# {'size':>10} {'count':>12} {'type':>6} {'iters':>6} {'time(us)':>12} {'algbw(GB/s)':>10} {'busbw(GB/s)':>10}", flush=True)
    size = max(args.min_bytes, 4)
    while size <= args.max_bytes:
        count = size // 4
        buf = torch.full((count,), 1e-3, dtype=torch.float32)
        iters = min(max(args.volume // size, args.min_iters), args.max_iters)
        for _ in range(max(iters // 10, 2)):
            dist.all_reduce(buf)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        if rank == 0:
            t = mean.item()
            algbw = size / t / 1e9
            busbw = algbw * 2 * (world - 1) / world
            print(f"  {human(size):>10} {count:>12} {'f32':>6} {iters:>6} {t * 1e6:>12.1f} {algbw:>10.3f} {busbw:>10.3f}", flush=True)
        size *= 2
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--min-bytes", type=parse_size, default=parse_size("1K"))
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("--volume", type=parse_size, default=parse_size("512M"))
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--pin", action="store_true", help="pin rank r to CPU r mod #CPUs")
    args = p.parse_args()

    import socket
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
