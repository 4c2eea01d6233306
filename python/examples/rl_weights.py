"""RL weight streaming: a trainer pushes model versions to double-buffered inference workers.

The model is a list of tensors of uneven sizes in one registered buffer. Version ``v`` goes
to every worker's buffer ``v % 2`` (one ``write_imm`` per tensor, immediate ``10 + v % 2``)
while the worker could keep serving ``v - 1`` from the other; the worker switches once its
counter has seen every tensor's arrivals, checks that no tensor is torn and acknowledges.
Host memory (numpy) by default; ``--device cuda:N`` puts the buffers in GPU memory (needs a
CUDA driver). Exits non-zero on any wrong byte.

    python python/examples/rl_weights.py --workers 2 --model-mib 16 --versions 3
"""

import argparse
import asyncio
import multiprocessing as mp
import sys
import time

import numpy as np

import fabric


def tensor_sizes(model_bytes, count):
    w = np.random.default_rng(7).uniform(0.2, 1.8, count)
    sizes = (w / w.sum() * model_bytes).astype(np.int64) // 64 * 64
    sizes[-1] += model_bytes - sizes.sum()
    return [int(s) for s in sizes]


def version_bytes(v, n):
    return ((np.arange(n, dtype=np.uint32) * 3 + v * 101) % 253).astype(np.uint8)


def worker(args, conn):
    engine = fabric.Engine(args.provider)
    model = args.model_mib << 20
    if args.device == "host":
        bufs = [np.zeros(model, dtype=np.uint8) for _ in range(2)]
        regions = [engine.register(b) for b in bufs]  # the weights themselves, in place
    else:
        regions = [engine.alloc(model, device=args.device) for _ in range(2)]
    conn.send((engine.address, [r.descriptor for r in regions]))
    trainer = engine.add_peer(conn.recv()).wait(timeout=30)

    async def serve():
        for v in range(1, args.versions + 1):
            _, msg = await engine.recv_from(trainer)
            arrivals = int(msg)
            await asyncio.wait_for(engine.imm_counter(10 + v % 2).wait_for(arrivals), 30)
            got = np.frombuffer(regions[v % 2].read(), dtype=np.uint8)
            ok = bool((got == version_bytes(v, model)).all())  # no tensor torn or stale
            await engine.send(trainer, b"ok" if ok else b"bad")

    asyncio.run(serve())


async def trainer(args, conns):
    engine = fabric.Engine(args.provider)
    model = args.model_mib << 20
    sizes = tensor_sizes(model, args.tensors)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    weights = np.zeros(model, dtype=np.uint8)
    src = engine.register(weights)
    targets = []
    for c in conns:
        address, descs = c.recv()
        c.send(engine.address)
        targets.append([await engine.remote_region(d) for d in descs])
    bad = 0
    for v in range(1, args.versions + 1):
        weights[:] = version_bytes(v, model)  # the "training step"
        t = time.perf_counter()
        writes = []
        for bufs in targets:
            dst = bufs[v % 2]
            n = sum(engine.write_arrivals(dst, s) for s in sizes)
            await engine.send(dst.peer, str(n).encode())
            writes += [engine.write_imm(src, o, dst, o, s, 10 + v % 2) for o, s in zip(offsets, sizes)]
        await asyncio.gather(*writes)
        acks = [await asyncio.wait_for(engine.recv_from(bufs[0].peer), 60) for bufs in targets]
        dt = time.perf_counter() - t
        bad += sum(a[1] != b"ok" for a in acks)
        print(f"version {v}: {len(targets)} workers updated in {dt * 1e3:.1f} ms, {model / dt / 1e9:.2f} GB/s per worker")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model-mib", type=int, default=16)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--device", default="host", help='"host" or "cuda:N"')
    args = ap.parse_args()
    if args.device != "host":
        try:
            fabric.Engine(args.provider).alloc(4096, device=args.device)
        except fabric.Unsupported as e:
            print(f"skipped: --device {args.device}: {e}")
            return 0
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for _ in range(args.workers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker, args=(args, b), daemon=True)
        p.start()
        conns.append(a)
        procs.append(p)
    bad = asyncio.run(trainer(args, conns))
    for p in procs:
        p.join(30)
        bad += p.exitcode != 0
    print("rl_weights: every tensor of every version verified" if not bad else f"rl_weights: {bad} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
