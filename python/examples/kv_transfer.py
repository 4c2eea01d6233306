"""Prefill/decode disaggregation: paged KV-cache blocks from a prefill process to decode workers.

The prefill process holds a paged KV cache (layers x blocks); each request's blocks of every
layer go to a decode worker in one ``write_paged`` with one immediate per request, then a
small message says which blocks. The worker awaits that request's counter with a deadline,
retires it, checks every block and acknowledges. Host memory (numpy) by default;
``--device cuda:N`` makes every cache a torch CUDA tensor (bfloat16, layers x blocks x
elements, as a vLLM connector sees its KV cache) registered in place, the decoders' on
``--decode-device`` (default: the same device), every block checked on the GPU. Exits
non-zero on any wrong byte or missing arrival.

    python python/examples/kv_transfer.py --decoders 2 --requests 40 --provider shm
    python python/examples/kv_transfer.py --provider shm --device cuda:0 --decode-device cuda:1
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

import fabric_rdma


def expected(device, req, layers, count, nb):
    """The bytes of a request's blocks, (layers, count, nb) uint8: block i of layer l."""
    if device == "host":
        j = np.arange(nb, dtype=np.int64)[None, None, :]
        lay = np.arange(layers, dtype=np.int64)[:, None, None]
        i = np.arange(count, dtype=np.int64)[None, :, None]
        return ((j + req * 131 + lay * 17 + i * 7) % 251).astype(np.uint8)
    import torch

    j = torch.arange(nb, dtype=torch.int64, device=device)[None, None, :]
    lay = torch.arange(layers, dtype=torch.int64, device=device)[:, None, None]
    i = torch.arange(count, dtype=torch.int64, device=device)[None, :, None]
    return ((j + req * 131 + lay * 17 + i * 7) % 251).to(torch.uint8)


def new_cache(engine, device, layers, blocks, nb):
    """A KV cache of `layers` x `blocks` blocks of `nb` bytes, registered in place: the
    region, and the cache as uint8 (layers, blocks, nb) to write and check blocks with."""
    if device == "host":
        cache = np.zeros((layers, blocks, nb), dtype=np.uint8)
        return engine.register(cache), cache
    import torch

    cache = torch.zeros((layers, blocks, nb // 2), dtype=torch.bfloat16, device=device)
    return engine.register(cache), cache.view(torch.uint8)


def same(a, b):
    return bool((a == b).all()) if isinstance(a, np.ndarray) else bool(a.equal(b))


def sync(device):
    if device != "host":
        import torch

        torch.cuda.synchronize(device)


def decoder(args, conn):
    engine = fabric_rdma.Engine(args.provider)
    nb = args.block_kib << 10
    region, cache = new_cache(engine, args.decode_device, args.layers, args.blocks, nb)
    conn.send((engine.address, region.descriptor))
    prefill = engine.add_peer(conn.recv()).wait(timeout=30)

    async def serve():
        while True:
            _, msg = await engine.recv_from(prefill)
            req = json.loads(msg)
            if req.get("stop"):
                return
            imm = req["imm"]
            await asyncio.wait_for(engine.imm_counter(imm).wait_for(req["arrivals"]), args.deadline)
            await engine.retire_counter(imm)
            # Every block of every layer, in one comparison (on the GPU for a tensor).
            want = expected(args.decode_device, req["id"], args.layers, len(req["blocks"]), nb)
            ok = same(cache[:, req["blocks"]], want)
            await engine.send(prefill, json.dumps({"id": req["id"], "ok": ok}).encode())

    asyncio.run(serve())


async def prefill(args, workers):
    engine = fabric_rdma.Engine(args.provider)
    nb = args.block_kib << 10
    per_req = args.blocks_per_request
    src, blocks_u8 = new_cache(engine, args.device, args.layers, per_req, nb)
    peers, dsts = [], []
    for w in workers:
        address, desc = w.recv()
        w.send(engine.address)
        dst = await engine.remote_region(desc)
        peers.append(dst.peer)
        dsts.append(dst)
    layout = fabric_rdma.PageLayout(nb)
    latencies, failed = [], 0
    lock = asyncio.Lock()  # one request at a time uses the source blocks

    async def request(r):
        nonlocal failed
        w = r % len(workers)
        blocks = [int(x) for x in np.random.default_rng(r).choice(args.blocks, per_req, replace=False)]
        t = time.perf_counter()
        async with lock:
            blocks_u8[:] = expected(args.device, r, args.layers, per_req, nb)  # "prefill"
            sync(args.device)  # the engine reads what the GPU has written
            src_pages = [layer * per_req + i for layer in range(args.layers) for i in range(per_req)]
            dst_pages = [layer * args.blocks + b for layer in range(args.layers) for b in blocks]
            imm = 1000 + r
            await engine.write_paged(src, dsts[w], layout, src_pages, dst_pages, imm=imm)
        arrivals = engine.paged_arrivals(dsts[w], len(src_pages))
        meta = {"id": r, "imm": imm, "blocks": blocks, "arrivals": arrivals}
        await engine.send(peers[w], json.dumps(meta).encode())
        _, ack = await asyncio.wait_for(engine.recv_from(peers[w]), args.deadline + 5)
        ack = json.loads(ack)
        latencies.append(time.perf_counter() - t)
        if not (ack["id"] == r and ack["ok"]):
            failed += 1

    t0 = time.perf_counter()
    # One request in flight per worker at a time (its acknowledgement is matched by peer).
    for start in range(0, args.requests, len(workers)):
        await asyncio.gather(*(request(r) for r in range(start, min(start + len(workers), args.requests))))
    elapsed = time.perf_counter() - t0
    for p in peers:
        await engine.send(p, json.dumps({"stop": True}).encode())
    moved = args.requests * args.layers * per_req * nb
    ms = sorted(x * 1e3 for x in latencies)
    print(
        f"kv_transfer: {args.requests} requests to {len(workers)} decoders over {args.provider} "
        f"({args.device} -> {args.decode_device}): "
        f"p50 {statistics.median(ms):.2f} ms, p99 {ms[int(len(ms) * 0.99) - 1 if len(ms) > 1 else 0]:.2f} ms, "
        f"{moved / elapsed / 1e9:.2f} GB/s, {failed} failed"
    )
    return failed


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
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per layer in each decoder's cache")
    ap.add_argument("--blocks-per-request", type=int, default=8)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=10.0, help="seconds a decoder waits for a request's blocks")
    ap.add_argument("--device", default="host", help='the prefill cache: "host" or "cuda:N" (a torch tensor)')
    ap.add_argument("--decode-device", default=None, help="the decoders' caches (default: --device)")
    args = ap.parse_args()
    args.device = normal(args.device)
    args.decode_device = normal(args.decode_device or args.device)
    why = cuda_missing(args.provider, {args.device, args.decode_device} - {"host"})
    if why:
        print(f"skipped: --device {args.device} --decode-device {args.decode_device}: {why}")
        return 0
    ctx = mp.get_context("spawn")
    workers, procs = [], []
    for _ in range(args.decoders):
        a, b = ctx.Pipe()
        p = ctx.Process(target=decoder, args=(args, b), daemon=True)
        p.start()
        workers.append(a)
        procs.append(p)
    failed = asyncio.run(prefill(args, workers))
    for p in procs:
        p.join(30)
        failed += p.exitcode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
