"""Two processes over tcp and shm: every byte of numpy and bytearray memory checked."""

import asyncio

import numpy as np

import fabric_rdma
import peers

SIZE = (1 << 20) + 4096 * 3 + 17
PAGE = 4096


def test_write_read_paged_scatter_send_between_processes(provider, spawn):
    peer = spawn(peers.target, provider, SIZE, PAGE, SIZE // PAGE)
    address, dst_desc, src_desc = peer.recv()

    async def main():
        engine = fabric_rdma.Engine(provider)
        dst = await engine.remote_region(dst_desc)
        remote_src = await engine.remote_region(src_desc)
        assert len(dst) == SIZE and dst.peer == remote_src.peer

        # write_imm from a bytearray registered in place.
        data = bytearray(peers.pattern(SIZE, 1).tobytes())
        src = engine.register(data)
        assert src.obj is data and src.nbytes == SIZE
        peer.send(engine.write_arrivals(dst, SIZE))
        await asyncio.wait_for(engine.write_imm(src, 0, dst, 0, SIZE, 1), 20)
        assert peer.recv() == ("write_imm", True)

        # read the peer's bytearray into a numpy array registered in place.
        local = np.zeros(SIZE, dtype=np.uint8)
        into = engine.register(local)
        await asyncio.wait_for(engine.read(into, 0, remote_src, 0, SIZE), 20)
        assert (local == peers.pattern(SIZE, 9)).all(), "read: bytes differ"

        # write_paged: pages of an engine-allocated region, in a shuffled order.
        pages = SIZE // PAGE
        block = engine.alloc(SIZE)
        np.frombuffer(block, dtype=np.uint8)[:] = peers.pattern(SIZE, 2)
        src_pages = list(range(0, pages, 2))
        dst_pages = [pages - 1 - p for p in src_pages]
        layout = fabric_rdma.PageLayout(PAGE)
        peer.send((engine.paged_arrivals(dst, len(src_pages)), src_pages, dst_pages))
        await asyncio.wait_for(engine.write_paged(block, dst, layout, src_pages, dst_pages, imm=2), 20)
        assert peer.recv() == ("write_paged", True)

        # scatter to a one-member group.
        np.frombuffer(block, dtype=np.uint8)[:] = peers.pattern(SIZE, 3)
        group = engine.peer_group([dst])
        entries = [(0, 0, 100, 5000), (0, 70000, 200000, 123457)]
        n3 = engine.scatter_arrivals(group, entries)[0]
        peer.send((n3, entries))
        await asyncio.wait_for(engine.scatter(block, group, entries, imm=3), 20)
        assert peer.recv() == ("scatter", True)

        # two-sided messages.
        await engine.send(dst.peer, b"hello fabric")
        who, reply = await asyncio.wait_for(engine.recv_from(dst.peer), 20)
        assert (who, reply) == (dst.peer, b"cirbaf olleh")

        stats = engine.stats()
        assert stats["total"]["errors"] == 0 and stats["total"]["completed_ops"] >= 5
        peer.send("done")

    asyncio.run(main())
    peer.finish()


def test_blocking_api_between_processes(provider, spawn):
    size = 3 << 20
    peer = spawn(peers.checker, provider, size, 5, 4)
    address, desc = peer.recv()
    engine = fabric_rdma.Engine(provider)
    dst = engine.remote_region(desc).wait(timeout=20)
    src = engine.register(peers.pattern(size, 4).copy())
    peer.send(engine.write_arrivals(dst, size))
    engine.write_imm(src, 0, dst, 0, size, 5).wait(timeout=20)
    assert peer.recv() is True
    peer.send("done")
    peer.finish()


def test_messages_round_trip(provider, spawn):
    peer = spawn(peers.echo, provider)
    address = peer.recv()
    engine = fabric_rdma.Engine(provider)
    peer.send(engine.address)
    pid = engine.add_peer(address).wait(timeout=20)
    assert engine.add_peer(address).wait(timeout=20) == pid, "adding twice gives the same id"

    async def main():
        for i in range(20):
            msg = bytes([i]) * (i * 50 + 1)
            await engine.send(pid, msg)
            who, reply = await asyncio.wait_for(engine.recv_from(pid), 10)
            assert (who, reply) == (pid, msg[::-1])
        await engine.send(pid, bytearray(b"stop"))

    asyncio.run(main())
    peer.finish()
