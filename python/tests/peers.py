"""What the peer processes of the tests run (importable by multiprocessing's spawn).

Each gets the provider and a pipe; it answers with descriptors and with what it checked.
"""

import asyncio

import numpy as np

import fabric_rdma


def pattern(n, seed):
    """Bytes that differ per offset and per seed."""
    i = np.arange(n, dtype=np.uint64)
    return ((i * 2654435761 + seed * 97 + (i >> 13)) % 251).astype(np.uint8)


def target(provider, conn, size, page_len, pages):
    """Registers a numpy array (the write target) and a bytearray (the read source); checks
    what lands, counted by immediates 1 (write_imm), 2 (write_paged) and 3 (scatter)."""
    engine = fabric_rdma.Engine(provider)
    dst = np.zeros(size, dtype=np.uint8)
    src = bytearray(pattern(size, 9).tobytes())
    dst_region = engine.register(dst)
    src_region = engine.register(src)
    conn.send((engine.address, dst_region.descriptor, src_region.descriptor))

    async def serve():
        n1 = conn.recv()  # arrivals the sender computed
        await asyncio.wait_for(engine.imm_counter(1).wait_for(n1), 20)
        ok_write = bool((dst == pattern(size, 1)).all())
        dst[:] = 0
        conn.send(("write_imm", ok_write))
        n2, src_pages, dst_pages = conn.recv()
        await asyncio.wait_for(engine.imm_counter(2).wait_for(n2), 20)
        want = np.zeros(size, dtype=np.uint8)
        sent = pattern(size, 2)
        for s, d in zip(src_pages, dst_pages):
            want[d * page_len : (d + 1) * page_len] = sent[s * page_len : (s + 1) * page_len]
        conn.send(("write_paged", bool((dst == want).all())))
        n3, entries = conn.recv()
        await asyncio.wait_for(engine.imm_counter(3).wait_for(n3), 20)
        sent = pattern(size, 3)
        ok = all((dst[d : d + n] == sent[s : s + n]).all() for _, s, d, n in entries)
        conn.send(("scatter", ok))
        peer, msg = await asyncio.wait_for(engine.recv(), 20)
        await engine.send(peer, msg[::-1])
        conn.recv()  # done

    asyncio.run(serve())


def holder(provider, conn, size):
    """Registers `size` bytes, hands out its address and descriptor, then idles until
    told to stop (or killed)."""
    engine = fabric_rdma.Engine(provider)
    region = engine.alloc(size)
    conn.send((engine.address, region.descriptor))
    conn.poll(60)


def checker(provider, conn, size, imm, seed):
    """Waits for one write_imm of `size` bytes (imm `imm`) and checks every byte."""
    engine = fabric_rdma.Engine(provider)
    arr = np.zeros(size, dtype=np.uint8)
    region = engine.register(arr)
    conn.send((engine.address, region.descriptor))
    n = conn.recv()
    engine.imm_counter(imm).wait_for(n).wait(timeout=30)
    conn.send(bool((arr == pattern(size, seed)).all()))
    conn.recv()


def echo(provider, conn):
    """Answers every message with its bytes reversed until it receives b"stop"."""
    engine = fabric_rdma.Engine(provider)
    conn.send(engine.address)
    # A sender is named only once it is a peer of ours.
    parent = engine.add_peer(conn.recv()).wait(timeout=20)
    while True:
        peer, msg = engine.recv_from(parent).wait(timeout=30)
        if msg == b"stop":
            return
        engine.send(peer, msg[::-1]).wait(timeout=10)


class DictStore:
    """The part of a ``torch.distributed.Store`` that ``fabric_rdma.bootstrap`` uses (``set``,
    and a ``get`` that waits for the key), over a ``multiprocessing.Manager`` dict: the
    rendezvous of the bootstrap tests on machines without torch."""

    def __init__(self, shared):
        self.shared = shared

    def set(self, key, value):
        self.shared[key] = bytes(value)

    def get(self, key, timeout=30.0):
        import time

        deadline = time.monotonic() + timeout
        while key not in self.shared:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key!r} in the store within {timeout} s")
            time.sleep(0.005)
        return self.shared[key]


def store_rank(provider, conn, store, rank, world):
    """A rank of the bootstrap test: registers 64 KiB, meets the others through `store`
    (fabric_rdma.bootstrap.connect), then waits for every other rank's write_imm (imm 50)
    and reports whether each wrote its pattern into its own 64 KiB slice."""
    from fabric_rdma.bootstrap import connect

    engine = fabric_rdma.Engine(provider)
    mem = np.zeros(world * 65536, dtype=np.uint8)
    region = engine.register(mem)
    src = engine.register(pattern(65536, rank).copy())
    remotes = connect(engine, [region], store=store, rank=rank, world_size=world, key="bootstrap-test")

    async def run():
        for r, regions in enumerate(remotes):
            if regions is not None:
                await engine.write_imm(src, 0, regions[0], rank * 65536, 65536, 50)
        await asyncio.wait_for(engine.imm_counter(50).wait_for(world - 1), 20)

    asyncio.run(run())
    ok = all((mem[r * 65536 : (r + 1) * 65536] == pattern(65536, r)).all() for r in range(world) if r != rank)
    conn.send(ok)
    conn.poll(30)  # stay up until the others are done
