"""RL weight streaming: a trainer pushes model versions to double-buffered inference workers.

The model is a list of parameters of uneven sizes, each registered in place. Version ``v``
goes to every worker's copy ``v % 2`` of the model (one ``write_imm`` per parameter,
immediate ``10 + v % 2``) while the worker could keep serving ``v - 1`` from the other; the
worker switches once its counter has seen every parameter's arrivals, checks that no
parameter is torn and acknowledges. Host memory (numpy arrays) by default; ``--device
cuda:N`` makes the parameters ``torch.nn.Parameter`` bfloat16 CUDA tensors, the workers' on
``--worker-device`` (default: the same device), every byte checked on the GPU. Exits non-zero
on any wrong byte.

    python python/examples/rl_weights.py --workers 2 --model-mib 16 --versions 3
    python python/examples/rl_weights.py --provider shm --device cuda:0 --worker-device cuda:1
"""

import argparse
import asyncio
import multiprocessing as mp
import sys
import time

import numpy as np

import fabric_rdma


def tensor_sizes(model_bytes, count):
    w = np.random.default_rng(7).uniform(0.2, 1.8, count)
    sizes = (w / w.sum() * model_bytes).astype(np.int64) // 64 * 64
    sizes[-1] += model_bytes - sizes.sum()
    return [int(s) for s in sizes]


def version_bytes(device, v, offset, n):
    """Version `v` of the model's bytes `offset .. offset + n` (uint8)."""
    if device == "host":
        return ((np.arange(offset, offset + n, dtype=np.int64) * 3 + v * 101) % 253).astype(np.uint8)
    import torch

    i = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    return ((i * 3 + v * 101) % 253).to(torch.uint8)


def new_params(device, sizes):
    """Zeroed parameters of `sizes` bytes: (the parameters, their bytes as uint8 views)."""
    if device == "host":
        params = [np.zeros(s, dtype=np.uint8) for s in sizes]
        return params, params
    import torch

    params = [torch.nn.Parameter(torch.zeros(s // 2, dtype=torch.bfloat16, device=device)) for s in sizes]
    return params, [p.detach().view(torch.uint8) for p in params]


def same(a, b):
    return bool((a == b).all()) if isinstance(a, np.ndarray) else bool(a.equal(b))


def sync(device):
    if device != "host":
        import torch

        torch.cuda.synchronize(device)


def worker(args, conn):
    engine = fabric_rdma.Engine(args.provider)
    sizes = tensor_sizes(args.model_mib << 20, args.tensors)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    copies = [new_params(args.worker_device, sizes) for _ in range(2)]  # double-buffered model
    regions = [[engine.register(p) for p in params] for params, _ in copies]  # in place
    conn.send((engine.address, [[r.descriptor for r in rs] for rs in regions]))
    trainer = engine.add_peer(conn.recv()).wait(timeout=30)

    async def serve():
        for v in range(1, args.versions + 1):
            _, msg = await engine.recv_from(trainer)
            arrivals = int(msg)
            await asyncio.wait_for(engine.imm_counter(10 + v % 2).wait_for(arrivals), 30)
            _, views = copies[v % 2]
            ok = all(same(b, version_bytes(args.worker_device, v, o, s)) for b, o, s in zip(views, offsets, sizes))
            await engine.send(trainer, b"ok" if ok else b"bad")  # no parameter torn or stale

    asyncio.run(serve())


async def trainer(args, conns):
    engine = fabric_rdma.Engine(args.provider)
    model = args.model_mib << 20
    sizes = tensor_sizes(model, args.tensors)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    params, views = new_params(args.device, sizes)
    srcs = [engine.register(p) for p in params]  # the parameters themselves, in place
    targets = []
    for c in conns:
        address, descs = c.recv()
        c.send(engine.address)
        targets.append([[await engine.remote_region(d) for d in copy] for copy in descs])
    bad = 0
    for v in range(1, args.versions + 1):
        for b, o, s in zip(views, offsets, sizes):  # the "training step"
            b[:] = version_bytes(args.device, v, o, s)
        sync(args.device)  # the engine reads what the GPU has written
        t = time.perf_counter()
        writes = []
        for copies in targets:
            dsts = copies[v % 2]
            n = sum(engine.write_arrivals(d, s) for d, s in zip(dsts, sizes))
            await engine.send(dsts[0].peer, str(n).encode())
            writes += [engine.write_imm(src, 0, d, 0, s, 10 + v % 2) for src, d, s in zip(srcs, dsts, sizes)]
        await asyncio.gather(*writes)
        acks = [await asyncio.wait_for(engine.recv_from(copies[0][0].peer), 60) for copies in targets]
        dt = time.perf_counter() - t
        bad += sum(a[1] != b"ok" for a in acks)
        print(
            f"version {v}: {len(targets)} workers updated in {dt * 1e3:.1f} ms, "
            f"{model / dt / 1e9:.2f} GB/s per worker ({args.device} -> {args.worker_device})"
        )
    return bad


def normal(device):
    return "cuda:0" if device == "cuda" else device


def cuda_missing(provider, devices):
    """Why the CUDA devices cannot be used here (torch, a device, fabric's CUDA), or None."""
    if not devices:
        return None
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    for d in sorted(devices):
        if not d.startswith("cuda:") or int(d[5:]) >= torch.cuda.device_count():
            return f"{d}: torch sees {torch.cuda.device_count()} CUDA device(s)"
        try:
            fabric_rdma.Engine(provider).alloc(4096, device=d)
        except fabric_rdma.Unsupported as e:
            return str(e)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model-mib", type=int, default=16)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--device", default="host", help='the trainer\'s parameters: "host" or "cuda:N" (torch)')
    ap.add_argument("--worker-device", default=None, help="the workers' parameters (default: --device)")
    args = ap.parse_args()
    args.device = normal(args.device)
    args.worker_device = normal(args.worker_device or args.device)
    why = cuda_missing(args.provider, {args.device, args.worker_device} - {"host"})
    if why:
        print(f"skipped: --device {args.device} --worker-device {args.worker_device}: {why}")
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
