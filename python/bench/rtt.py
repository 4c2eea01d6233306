"""One awaited 8 B write_imm round trip from Python, as `fabric-bench rtt` measures it in Rust.

A ping process and an echo process: ping awaits ``write_imm(8 B, imm 1)`` then its own
counter 2; echo awaits counter 1 and answers with ``write_imm(8 B, imm 2)``. Prints the median
and p99 of the round trip, and the same loop with the blocking API. Compare with
``cargo run --release -p fabric-bench -- rtt --provider shm`` on the same machine, same run
(docs/python.md, "Cost"). Build the extension in release first for meaningful figures:
``VIRTUAL_ENV=target/pyenv target/pyenv/bin/maturin develop --release -m python/Cargo.toml``.

    python python/bench/rtt.py --provider shm --mode busy_poll --iters 20000
"""

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import fabric_rdma


def echo(args, conn):
    engine = fabric_rdma.Engine(args.provider, args.mode)
    region = engine.alloc(4096)
    conn.send(region.descriptor)
    dst = engine.remote_region(conn.recv()).wait(timeout=30)
    ping, total = engine.imm_counter(1), args.warmup + 2 * args.iters

    async def run():
        for _ in range(total):
            await ping.wait_for(1)
            await engine.write_imm(region, 0, dst, 0, 8, 2)

    asyncio.run(run())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--mode", default="busy_poll", help="event, adaptive, busy_poll, inline")
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=echo, args=(args, b), daemon=True)
    p.start()
    engine = fabric_rdma.Engine(args.provider, args.mode)
    region = engine.alloc(4096)
    a.send(region.descriptor)
    dst = engine.remote_region(a.recv()).wait(timeout=30)
    pong = engine.imm_counter(2)

    async def run(n):
        out = []
        for _ in range(n):
            t = time.perf_counter_ns()
            await engine.write_imm(region, 0, dst, 0, 8, 1)
            await pong.wait_for(1)
            out.append(time.perf_counter_ns() - t)
        return out

    asyncio.run(run(args.warmup))
    awaited = asyncio.run(run(args.iters))
    blocking = []
    for _ in range(args.iters):
        t = time.perf_counter_ns()
        engine.write_imm(region, 0, dst, 0, 8, 1).wait()
        pong.wait_for(1).wait()
        blocking.append(time.perf_counter_ns() - t)
    p.join(30)
    for name, xs in (("awaited", awaited), ("blocking", blocking)):
        xs = sorted(x / 1e3 for x in xs)
        print(
            f"python {name:8} 8 B write_imm round trip over {args.provider} ({args.mode}): "
            f"p50 {statistics.median(xs):.1f} us, p99 {xs[int(len(xs) * 0.99)]:.1f} us ({len(xs)} round trips)"
        )


if __name__ == "__main__":
    main()
