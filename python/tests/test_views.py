"""Views of registered host memory (no new registration) and many transfers in one call."""

import asyncio
import time

import numpy as np
import pytest

import fabric_rdma



def test_a_view_lands_its_bytes_in_its_range_only(engines):
    a, b = engines
    pool = np.zeros(1 << 20, dtype=np.uint8)
    whole = b.register(pool)
    assert not whole.is_view
    layer = b.register(pool[4096 : 4096 + 65536])  # a slice: a view of `whole`
    assert layer.is_view and len(layer) == 65536 and layer.address == whole.address + 4096
    src_pool = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
    src_whole = a.register(src_pool)
    src = a.register(src_pool[8192 : 8192 + 65536])
    assert src.is_view

    async def main():
        dst = await a.remote_region(layer.descriptor)
        assert len(dst) == 65536
        await a.write_imm(src, 0, dst, 0, 65536, 5)
        await asyncio.wait_for(b.imm_counter(5).wait_for(1), 20)
        with pytest.raises(fabric_rdma.OutOfBounds):
            await a.write(src, 0, dst, 1, 65536)  # one byte past the view at the peer
        with pytest.raises(fabric_rdma.OutOfBounds):
            await a.write(src, 1, dst, 0, 65536)  # one byte past the local view

    asyncio.run(main())
    assert (pool[4096 : 4096 + 65536] == src_pool[8192 : 8192 + 65536]).all()
    assert not pool[:4096].any() and not pool[4096 + 65536 :].any()
    assert bytes(memoryview(layer)) == pool[4096 : 4096 + 65536].tobytes()
    assert layer.read(0, 16) == pool[4096 : 4096 + 16].tobytes()
    with pytest.raises(fabric_rdma.OutOfBounds):
        layer.read(65530, 16)
    del src_whole


def test_views_are_not_registrations_and_keep_theirs_alive(engines):
    a, b = engines
    pool = np.zeros(1 << 20, dtype=np.uint8)
    whole = b.register(pool)
    t0 = time.perf_counter()
    views = [b.register(pool[i * 100 : i * 100 + 100]) for i in range(10_000)]
    per_view_us = (time.perf_counter() - t0) / 10_000 * 1e6
    print(f"10,000 views of one registration: {per_view_us:.2f} us per view")
    assert all(v.is_view for v in views)  # a range of `whole`, no registration of its own
    assert [v.address - whole.address for v in views[:3]] == [0, 100, 200]
    # The registration outlives the Region of the whole while a view lives.
    del whole
    view = views[77]
    del views
    src = a.alloc(100)
    src.write(0, bytes(range(100)))

    async def main():
        dst = await a.remote_region(view.descriptor)
        await a.write_imm(src, 0, dst, 0, 100, 9)
        await asyncio.wait_for(b.imm_counter(9).wait_for(1), 20)

    asyncio.run(main())
    assert pool[7700:7800].tobytes() == bytes(range(100))
    # Once the last region of it is gone, memory inside it is registered anew.
    del view
    fresh = b.register(pool[:100])
    assert not fresh.is_view


def test_memory_outside_every_registration_is_registered(engines):
    a, b = engines
    pool = np.zeros(1 << 16, dtype=np.uint8)
    half = b.register(pool[: 1 << 15])
    straddling = b.register(pool[(1 << 15) - 8 : (1 << 15) + 8])
    assert not straddling.is_view
    assert b.register(pool[100:200]).is_view
    other = b.register(np.zeros(4096, dtype=np.uint8))
    assert not other.is_view
    del half


def test_a_view_of_alloc_memory_and_paged_writes_from_a_view(engines):
    a, b = engines
    src_all = a.alloc(1 << 16)
    np.frombuffer(src_all, dtype=np.uint8)[:] = np.arange(1 << 16, dtype=np.uint32).astype(np.uint8)
    src = a.register(np.frombuffer(src_all, dtype=np.uint8)[1024 : 1024 + 8192])
    assert src.is_view
    dst_mem = np.zeros(8192, dtype=np.uint8)
    dst_region = b.register(dst_mem)
    layout = fabric_rdma.PageLayout(1024)

    async def main():
        dst = await a.remote_region(dst_region.descriptor)
        await a.write_paged(src, dst, layout, [0, 7], [1, 2], 3)
        await asyncio.wait_for(b.imm_counter(3).wait_for(a.paged_arrivals(dst, 2)), 20)
        with pytest.raises(fabric_rdma.OutOfBounds):
            await a.write_paged(src, dst, layout, [8], [0])  # page 8 ends past the view

    asyncio.run(main())
    s = np.frombuffer(src_all, dtype=np.uint8)
    assert (dst_mem[1024:2048] == s[1024 : 1024 + 1024]).all()
    assert (dst_mem[2048:3072] == s[1024 + 7 * 1024 : 1024 + 8 * 1024]).all()
    assert not dst_mem[:1024].any() and not dst_mem[3072:].any()


def test_write_many_one_arrival_per_peer_and_read_many(provider):
    a, b, c = (fabric_rdma.Engine(provider) for _ in range(3))
    try:
        rng = np.random.default_rng(7)
        # 2 x 16 per-layer tensors at the sender, into two regions at b and one at c.
        layers = [rng.integers(0, 256, 4096 + 512 * i, dtype=np.uint8) for i in range(32)]
        srcs = [a.register(t) for t in layers]
        b_k, b_v = np.zeros(1 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
        c_kv = np.zeros(1 << 20, dtype=np.uint8)
        regions = [b.register(b_k), b.register(b_v), c.register(c_kv)]
        homes = [b_k, b_v, c_kv]

        async def main():
            dsts = [await a.remote_region(r.descriptor) for r in regions]
            entries, placed, offs = [], [], [0, 0, 0]
            for i, (t, s) in enumerate(zip(layers, srcs)):
                which = i % 3
                entries.append((s, 0, dsts[which], offs[which], t.nbytes))
                placed.append((which, offs[which], t))
                offs[which] += t.nbytes + 64
            await a.write_many(entries, imm=40)
            await asyncio.wait_for(b.imm_counter(40).wait_for(1), 20)
            await asyncio.wait_for(c.imm_counter(40).wait_for(1), 20)
            for which, off, t in placed:
                assert (homes[which][off : off + t.nbytes] == t).all()
            await asyncio.sleep(0.2)  # nothing more arrives: one per peer
            assert b.imm_counter(40).available == 0 and c.imm_counter(40).available == 0
            # Read them all back into fresh memory, scrambled.
            back = [np.zeros_like(t) for t in layers]
            backs = [a.register(x) for x in back]
            order = rng.permutation(len(layers))
            await a.read_many([(backs[i], 0, dsts[placed[i][0]], placed[i][1], layers[i].nbytes) for i in order])
            for x, t in zip(back, layers):
                assert (x == t).all()
            # Checked whole before anything is posted.
            bad = entries[:3] + [(srcs[0], 0, dsts[0], (1 << 20) - 10, 4096)]
            with pytest.raises(fabric_rdma.OutOfBounds):
                await a.write_many(bad, imm=41)
            with pytest.raises(fabric_rdma.OutOfBounds):
                await a.write_many([(srcs[0], 1, dsts[0], 0, layers[0].nbytes)])
            await asyncio.sleep(0.1)
            assert b.imm_counter(41).available == 0

        asyncio.run(main())
    finally:
        for e in (a, b, c):
            e.shutdown()
