"""Prefill/decode disaggregation: paged KV-cache blocks from a prefill process to decode workers.

The prefill process holds a paged KV cache (layers x blocks); each request's blocks of every
layer go to a decode worker in one ``write_paged`` with one immediate per request, then a
small message says which blocks. The worker awaits that request's counter with a deadline,
retires it, checks every block and acknowledges. Host memory (numpy) by default;
``--device cuda:N`` puts the caches in GPU memory (needs a CUDA driver). Exits non-zero on
any wrong byte or missing arrival.

    python python/examples/kv_transfer.py --decoders 2 --requests 40 --provider shm
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

import fabric


def block_bytes(req, layer, i, n):
    return ((np.arange(n, dtype=np.uint32) + req * 131 + layer * 17 + i * 7) % 251).astype(np.uint8)


def new_cache(engine, nbytes, device):
    if device == "host":
        return engine.register(np.zeros(nbytes, dtype=np.uint8))  # the cache itself, in place
    return engine.alloc(nbytes, device=device)


def decoder(args, conn):
    engine = fabric.Engine(args.provider)
    nb = args.block_kib << 10
    cache = new_cache(engine, args.layers * args.blocks * nb, args.device)
    conn.send((engine.address, cache.descriptor))
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
            ok = True
            for layer in range(args.layers):
                for i, b in enumerate(req["blocks"]):
                    got = cache.read((layer * args.blocks + b) * nb, nb)
                    ok &= got == block_bytes(req["id"], layer, i, nb).tobytes()
            await engine.send(prefill, json.dumps({"id": req["id"], "ok": ok}).encode())

    asyncio.run(serve())


async def prefill(args, workers):
    engine = fabric.Engine(args.provider)
    nb = args.block_kib << 10
    per_req = args.blocks_per_request
    src = new_cache(engine, args.layers * per_req * nb, "host" if args.device == "host" else args.device)
    peers, dsts = [], []
    for w in workers:
        address, desc = w.recv()
        w.send(engine.address)
        dst = await engine.remote_region(desc)
        peers.append(dst.peer)
        dsts.append(dst)
    layout = fabric.PageLayout(nb)
    latencies, failed = [], 0
    lock = asyncio.Lock()  # one request at a time uses the source blocks

    async def request(r):
        nonlocal failed
        w = r % len(workers)
        blocks = [int(x) for x in np.random.default_rng(r).choice(args.blocks, per_req, replace=False)]
        t = time.perf_counter()
        async with lock:
            for layer in range(args.layers):
                for i in range(per_req):
                    src.write((layer * per_req + i) * nb, block_bytes(r, layer, i, nb).tobytes())
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
        f"kv_transfer: {args.requests} requests to {len(workers)} decoders over {args.provider} ({args.device}): "
        f"p50 {statistics.median(ms):.2f} ms, p99 {ms[int(len(ms) * 0.99) - 1 if len(ms) > 1 else 0]:.2f} ms, "
        f"{moved / elapsed / 1e9:.2f} GB/s, {failed} failed"
    )
    return failed


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
    ap.add_argument("--device", default="host", help='"host" or "cuda:N"')
    args = ap.parse_args()
    if args.device != "host":
        try:
            fabric.Engine(args.provider).alloc(4096, device=args.device)
        except fabric.Unsupported as e:
            print(f"skipped: --device {args.device}: {e}")
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
