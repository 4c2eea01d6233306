"""torch CUDA tensors registered in place, moved between two processes over shm through
CUDA IPC and through the region's NIC path (staged where libfabric cannot register GPU
memory), every byte checked on the GPU; CPU tensors registered directly.

Skips (never fails) where torch or a CUDA device is missing, as on CI. With two GPUs the
writer uses cuda:0 and the target process cuda:1, else both use cuda:0.
"""

import asyncio
import gc
import time
import weakref

import numpy as np
import pytest

import fabric_rdma
import gpu_peers
import peers

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests move torch tensors)")

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
WRITER = "cuda:0"
TARGET = "cuda:1" if HAS_CUDA and torch.cuda.device_count() >= 2 else "cuda:0"
PROVIDER = "shm"
SIZE = 8 << 20
PAGE = 64 << 10
PATHS = ["cuda-ipc", "nic"]  # "nic": cuda_ipc=False, the target region's own path


pattern_t = gpu_peers.pattern_t


def expect(peer, imm, arrivals, pieces):
    """Has the target check its tensor (``gpu_peers.gpu_target``): ``(ok, total_arrived)``."""
    peer.send(("expect", imm, arrivals, pieces))
    return peer.recv(40)


def test_cpu_tensor_is_registered_in_place():
    engine = fabric_rdma.Engine("tcp")
    t = torch.zeros(1000, dtype=torch.bfloat16)  # no numpy dtype: registered as bytes
    region = engine.register(t)
    assert region.nbytes == 2000 and region.obj is t and region.device == "host"
    assert region.address == t.data_ptr(), "in place, not a copy"
    region.write(0, np.full(2, 0x3F80, dtype=np.uint16).tobytes())  # bfloat16 1.0, twice
    assert t[:2].tolist() == [1.0, 1.0] and t[2].item() == 0.0
    p = torch.nn.Parameter(torch.ones(64))  # requires grad: registered all the same
    assert engine.register(p).nbytes == 256
    with pytest.raises(ValueError, match="non-contiguous"):
        engine.register(torch.zeros(8, 8).t())


@needs_cuda
def test_cuda_tensor_registration_and_refusals():
    engine = fabric_rdma.Engine("tcp")
    t = torch.arange(1 << 20, dtype=torch.float32, device=TARGET)
    region = engine.register(t)
    assert region.device == TARGET and region.nbytes == 4 << 20 and region.address == t.data_ptr()
    assert region.obj is t and region.gpu_path in ("staged", "gpudirect")
    torch.cuda.synchronize()
    got = np.frombuffer(region.read(4 * 1000, 16), dtype=np.float32)
    assert got.tolist() == [1000.0, 1001.0, 1002.0, 1003.0], "the tensor's own memory"
    region.write(0, np.array([-1.0], dtype=np.float32).tobytes())
    assert t[0].item() == -1.0
    with pytest.raises(ValueError, match="non-contiguous"):
        engine.register(torch.zeros(64, 64, device=WRITER).t())
    # A slice is contiguous: its own range inside the allocation.
    part = engine.register(t[1000:2000])
    assert part.nbytes == 4000 and part.address == t.data_ptr() + 4000
    # Any __cuda_array_interface__ object: the device comes from the driver.
    class Cai:
        def __init__(self, tensor, readonly=False):
            self.t = tensor
            cai = dict(tensor.__cuda_array_interface__)
            cai["data"] = (cai["data"][0], readonly)
            self.__cuda_array_interface__ = cai

    wrapped = Cai(t)
    r = engine.register(wrapped)
    assert r.device == TARGET and r.nbytes == t.nbytes and r.obj is wrapped and r.address == t.data_ptr()
    with pytest.raises(TypeError, match="read-only"):
        engine.register(Cai(t, readonly=True))
    with pytest.raises(ValueError, match="non-contiguous"):
        engine.register(Cai(torch.zeros(64, 64, device=WRITER).t()))


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
def test_tensors_between_processes(path, spawn):
    peer = spawn(gpu_peers.gpu_target, PROVIDER, TARGET, SIZE)
    address, dst_desc, src_desc, target_path = peer.recv(timeout=60)

    async def main():
        engine = fabric_rdma.Engine(PROVIDER, cuda_ipc=path == "cuda-ipc")
        dst = await engine.remote_region(dst_desc)
        remote_src = await engine.remote_region(src_desc)
        if path == "cuda-ipc":
            assert dst.gpu_path == "cuda-ipc", "a process on this host is written through CUDA IPC"
        else:
            assert dst.gpu_path == target_path and target_path in ("staged", "gpudirect")
        src_t = pattern_t(SIZE, 1, WRITER)
        torch.cuda.synchronize()
        src = engine.register(src_t)
        assert src.obj is src_t and src.device == WRITER

        # write_imm of the whole tensor; the counter sees exactly write_arrivals.
        n = engine.write_arrivals(dst, SIZE)
        await asyncio.wait_for(engine.write_imm(src, 0, dst, 0, SIZE, 1), 30)
        ok, total = expect(peer, 1, n, [(0, 1, 0, SIZE)])
        assert ok, "write_imm: bytes differ"
        assert total == n, f"write_imm: {total} arrivals, expected {n}"

        # write (no immediate) of an odd range at odd offsets: landed once it completes.
        await asyncio.wait_for(engine.write(src, 4099, dst, 77, (1 << 20) + 3), 30)
        ok, _ = expect(peer, None, 0, [(77, 1, 4099, (1 << 20) + 3)])
        assert ok, "write: bytes differ"

        # write_paged: every other page, into mirrored slots, one immediate.
        pages = SIZE // PAGE
        src_pages = list(range(0, pages, 2))
        dst_pages = [pages - 1 - p for p in src_pages]
        n = engine.paged_arrivals(dst, len(src_pages))
        layout = fabric_rdma.PageLayout(PAGE)
        await asyncio.wait_for(engine.write_paged(src, dst, layout, src_pages, dst_pages, imm=2), 30)
        ok, total = expect(peer, 2, n, [(d * PAGE, 1, s * PAGE, PAGE) for s, d in zip(src_pages, dst_pages)])
        assert ok and total == n, f"write_paged: bytes ok {ok}, {total} arrivals of {n}"

        # read the target's tensor into host memory, and into a tensor here.
        host = np.zeros(SIZE, dtype=np.uint8)
        await asyncio.wait_for(engine.read(engine.register(host), 0, remote_src, 0, SIZE), 30)
        assert (host == peers.pattern(SIZE, 9)).all(), "read into host memory: bytes differ"
        into_t = torch.zeros(SIZE, dtype=torch.uint8, device=WRITER)
        into = engine.register(into_t)
        if into.gpu_path == "staged" and target_path == "staged":
            with pytest.raises(fabric_rdma.Unsupported, match="staged"):
                await engine.read(into, 0, remote_src, 0, SIZE)
        else:
            await asyncio.wait_for(engine.read(into, 0, remote_src, 0, SIZE), 30)
            assert torch.equal(into_t, pattern_t(SIZE, 9, WRITER)), "read into a tensor: bytes differ"

        stats = engine.stats()
        assert stats["total"]["errors"] == 0, stats["total"]
        peer.send(("stop",))

    asyncio.run(main())
    peer.finish()


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
def test_deleted_tensor_still_sends_every_byte(path, spawn):
    """The tensor's every name is deleted while a write from it is in flight: the region
    keeps it (its memory is not handed to the next tensor), and lets it go afterwards.

    Staged (`nic`), a stopped target keeps the write in flight (it cannot pull), and the
    tensor with it. Through CUDA IPC the writer's copy engine needs nothing of the target: the
    copy is done within microseconds and the source is let go then, while the write's
    imm-only signal may still wait on the stopped target; so there the test checks that the
    bytes are right whatever the allocator did with the memory after, and that the tensor is
    released."""
    size = 64 << 20
    peer = spawn(gpu_peers.gpu_target, PROVIDER, TARGET, size)
    address, dst_desc, _, _ = peer.recv(timeout=60)

    async def main():
        engine = fabric_rdma.Engine(PROVIDER, cuda_ipc=path == "cuda-ipc")
        dst = await engine.remote_region(dst_desc)
        t = pattern_t(size, 6, WRITER)
        torch.cuda.synchronize()
        probe = weakref.ref(t)
        src = engine.register(t)
        n = engine.write_arrivals(dst, size)
        # A stopped target cannot pull (staged) nor count: the write stays in flight while
        # the tensor loses its last name.
        peer.stop()
        write = asyncio.ensure_future(engine.write_imm(src, 0, dst, 0, size, 7))
        await asyncio.sleep(0.2)
        in_flight = not write.done()
        del t, src
        gc.collect()
        engine.stats()  # runs deferred decrefs, if any were due
        if in_flight and path == "nic":
            assert probe() is not None, "freed while a write from it was in flight"
        # Were the memory freed, the caching allocator would hand it to this tensor.
        junk = torch.zeros(size, dtype=torch.uint8, device=WRITER)
        torch.cuda.synchronize()
        peer.cont()
        await asyncio.wait_for(write, 30)
        ok, total = expect(peer, 7, n, [(0, 6, 0, size)])
        assert ok and total == n, f"bytes ok {ok}, {total} arrivals of {n}"
        if path == "nic":
            assert in_flight, "a write into a stopped process's GPU memory completed"
        deadline = time.monotonic() + 10
        while probe() is not None:
            assert time.monotonic() < deadline, "the tensor was never released"
            engine.stats()
            gc.collect()
            await asyncio.sleep(0.01)
        del junk
        peer.send(("stop",))

    asyncio.run(main())
    peer.finish()


def _stream_pair():
    """Two engines of this process over tcp (no CUDA IPC within a process: the NIC path),
    a source tensor on WRITER, a target tensor on TARGET, registered, the target remote."""
    a = fabric_rdma.Engine("tcp", cuda_ipc=False)
    b = fabric_rdma.Engine("tcp", cuda_ipc=False)
    src = torch.zeros(SIZE, dtype=torch.uint8, device=WRITER)
    dst = torch.zeros(SIZE, dtype=torch.uint8, device=TARGET)
    rs, rd = a.register(src), b.register(dst)
    remote = a.remote_region(rd.descriptor).wait(timeout=20)
    return a, b, src, dst, rs, remote


def _wait_stream(stream, seconds):
    """Polls the stream (never blocks in the driver): whether it finished within `seconds`."""
    deadline = time.monotonic() + seconds
    while not stream.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


SLOW = 500_000_000  # torch.cuda._sleep cycles: a few hundred ms of GPU time


@needs_cuda
@pytest.mark.parametrize("point", ["stream", "event"])
def test_after_starts_a_write_once_its_stream_filled_the_source(point):
    a, b, src, dst, rs, remote = _stream_pair()
    try:
        s = torch.cuda.Stream(device=WRITER)
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLOW)  # the fill below runs only after this
            src.fill_(7)
            ev = torch.cuda.Event()
            ev.record(s)
        after = s if point == "stream" else ev
        t0 = time.monotonic()
        pending = a.write_imm(rs, 0, remote, 0, SIZE, 31, after=after)
        posted_in = time.monotonic() - t0
        assert not s.query(), "the stream finished too soon to tell whether the write waited"
        pending.wait(timeout=30)
        b.imm_counter(31).wait_for(a.write_arrivals(remote, SIZE)).wait(timeout=30)
        torch.cuda.synchronize()
        assert bool((dst == 7).all()), "the write read the source before its stream filled it"
        print(f"after={point}: the call returned in {posted_in * 1e6:.0f} us, the stream still busy")
    finally:
        a.shutdown()
        b.shutdown()


@needs_cuda
def test_wait_on_stream_holds_kernels_until_the_arrivals():
    a, b, src, dst, rs, remote = _stream_pair()
    try:
        counter = b.imm_counter(32)
        s = torch.cuda.Stream(device=TARGET)
        counter.wait_on_stream(s, 1)
        with torch.cuda.stream(s):
            seen = dst.clone()  # runs only once the arrival is counted
            seen_sum = seen.sum(dtype=torch.int64)
        time.sleep(0.3)
        assert not s.query(), "the stream ran past its wait with nothing written"
        src.fill_(9)
        torch.cuda.synchronize()
        n = a.write_arrivals(remote, SIZE)
        assert n == 1
        a.write_imm(rs, 0, remote, 0, SIZE, 32).wait(timeout=30)
        assert _wait_stream(s, 30), "the stream never passed its wait"
        assert seen_sum.item() == 9 * SIZE and bool((seen == 9).all())
        # The next wait is for the next arrival, not the one already counted.
        counter.wait_on_stream(s, 1)
        with torch.cuda.stream(s):
            again = dst.clone()
        time.sleep(0.2)
        assert not s.query(), "a second wait was satisfied by the first arrival"
        src.fill_(11)
        torch.cuda.synchronize()
        a.write_imm(rs, 0, remote, 0, SIZE, 32).wait(timeout=30)
        assert _wait_stream(s, 30)
        assert bool((again == 11).all())
        with pytest.raises(fabric_rdma.ConfigError):
            counter.wait_on_stream(s, 0)
    finally:
        a.shutdown()
        b.shutdown()
