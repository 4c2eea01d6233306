#!/usr/bin/env python3
"""The baseline of examples/moe_gpu.rs: NCCL's all_to_all_single of the same bytes.

Each of --ranks processes (one GPU each) sends --ranks x --tokens rows of --hidden bf16
(--tokens rows to every rank, itself included: 2 x 128 x 7168 bf16 = 3.5 MiB per rank by
default, what a decode step of DeepSeek-V3 dispatches when every token has experts on both
ranks) with torch.distributed.all_to_all_single over NCCL, --steps times after --warmup,
each timed between CUDA events after a barrier (as moe_gpu times its stages between GPU
clocks after a GPU barrier), then again back to back in batches of 64 with no host wait
(as moe_gpu's headline pass). Prints p50/p90 per rank in the same shape as moe_gpu.

    python3 examples/moe_gpu_nccl.py [--ranks 2] [--tokens 128] [--hidden 7168] [--steps 200]

Without torch, or with fewer GPUs than ranks (NCCL needs one GPU per rank), it prints one
"skipped:" line and exits 0.
"""

import argparse
import os
import socket
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(v, q):
    v = sorted(v)
    return v[round((len(v) - 1) * q)] if v else 0.0


def worker(rank, args, port, queue):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.ranks, device_id=torch.device("cuda", rank))
    rows = args.ranks * args.tokens
    x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start.record()
        dist.all_to_all_single(out, x)
        end.record()
        end.synchronize()
        if step >= args.warmup:
            times.append(start.elapsed_time(end) * 1000.0)
    # Back to back, as examples/moe_gpu.rs's headline pass: batches of 64 calls with no
    # host wait between them, each timed between its own CUDA events.
    b2b = []
    step = 0
    while step < args.warmup + args.steps:
        n = min(64, args.warmup + args.steps - step)
        dist.barrier()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in evs:
            s.record()
            dist.all_to_all_single(out, x)
            e.record()
        evs[-1][1].synchronize()
        b2b += [s.elapsed_time(e) * 1000.0 for i, (s, e) in enumerate(evs) if step + i >= args.warmup]
        step += n
    # Every rank got every rank's block for it: block r of `out` is block `rank` of rank r's x.
    every = [torch.empty_like(x) for _ in range(args.ranks)]
    dist.all_gather(every, x)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    ok = all(torch.equal(out[r * args.tokens:(r + 1) * args.tokens], every[r][mine]) for r in range(args.ranks))
    mib = rows * args.hidden * 2 / (1 << 20)
    queue.put((rank, f"nccl all_to_all_single: rank {rank} (cuda:{rank}): back to back: p50 {pct(b2b, 0.5):7.1f} us  "
                     f"p90 {pct(b2b, 0.9):7.1f} us   ({rows} rows = {mib:.2f} MiB per rank per step, "
                     f"{'checked' if ok else 'WRONG BYTES'})\n"
                     f"nccl all_to_all_single: rank {rank} (cuda:{rank}): barrier each: p50 {pct(times, 0.5):7.1f} us  "
                     f"p90 {pct(times, 0.9):7.1f} us", ok))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"nccl all_to_all_single: skipped: torch is not installed ({e})")
        return 0
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.ranks:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"nccl all_to_all_single: skipped: NCCL needs one GPU per rank, {n} for {args.ranks} ranks")
        return 0
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    print(f"nccl all_to_all_single: {args.ranks} ranks ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, "
          f"NCCL {nccl}, {args.steps} steps (+{args.warmup} warm-up)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    results = []
    for _ in procs:
        try:
            results.append(queue.get(timeout=120))
        except Exception:
            break
    for pr in procs:
        pr.join(timeout=30)
        if pr.is_alive():
            pr.kill()
    for _, line, _ in sorted(results):
        print(line)
    ok = len(results) == args.ranks and all(r[2] for r in results) and all(pr.exitcode == 0 for pr in procs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
