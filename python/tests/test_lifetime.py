"""A registered buffer outlives the transfers that use it, whatever its Python names do."""

import asyncio
import gc
import sys
import time
import weakref

import numpy as np

import fabric_rdma
import peers


def test_deleted_source_still_sends_every_byte(provider, spawn):
    size = 32 << 20
    peer = spawn(peers.checker, provider, size, 7, 6)
    address, desc = peer.recv()

    async def main():
        engine = fabric_rdma.Engine(provider)
        dst = await engine.remote_region(desc)
        arr = peers.pattern(size, 6)
        probe = weakref.ref(arr)
        before = sys.getrefcount(arr)
        src = engine.register(arr)
        assert sys.getrefcount(arr) > before, "the region holds the array"
        peer.send(engine.write_arrivals(dst, size))
        # The peer stopped, the write cannot complete (tcp and shm need the target's
        # progress): it is surely in flight while the array loses its last name.
        peer.stop()
        write = asyncio.ensure_future(engine.write_imm(src, 0, dst, 0, size, 7))
        await asyncio.sleep(0.2)
        del arr, src
        gc.collect()
        engine.stats()  # runs deferred decrefs, if any were due
        assert not write.done(), "the write completed at a stopped peer"
        assert probe() is not None, "freed while a write from it was in flight"
        peer.cont()
        await asyncio.wait_for(write, 30)
        assert peer.recv() is True, "the peer saw different bytes"
        # Once nothing uses it, the engine lets go (the reactor drops the owner; the decref
        # runs at the next call into fabric).
        deadline = time.monotonic() + 10
        while probe() is not None:
            assert time.monotonic() < deadline, "the array was never released"
            engine.stats()
            gc.collect()
            await asyncio.sleep(0.01)
        peer.send("done")

    asyncio.run(main())
    peer.finish()


def test_registered_bytearray_is_pinned():
    engine = fabric_rdma.Engine("tcp")
    buf = bytearray(4096)
    region = engine.register(buf)
    try:
        buf.extend(b"x")  # would move the memory the NICs use
        raise AssertionError("a registered bytearray was resized")
    except BufferError:
        pass
    region.write(10, b"abc")
    assert bytes(buf[10:13]) == b"abc" and region.read(10, 3) == b"abc", "one memory, not a copy"
    view = np.frombuffer(region, dtype=np.uint8)
    assert view[11] == ord("b")
    del region, view
    gc.collect()
    deadline = time.monotonic() + 10
    while True:  # released once the engine closed the registration
        engine.stats()
        try:
            buf.extend(b"x")
            break
        except BufferError:
            assert time.monotonic() < deadline, "the bytearray stayed pinned"
            time.sleep(0.01)
