"""Bad input raises a clear exception: never a crash, a hang or corrupted memory."""

import asyncio
import gc
import os
import time
import weakref

import numpy as np
import pytest

import fabric_rdma


# Two engines of one process, on every test provider (tcp and shm): a pair per test, made
# after the previous test's pair was dropped.
@pytest.fixture
def pair(provider):
    a, b = fabric_rdma.Engine(provider), fabric_rdma.Engine(provider)
    dst = b.alloc(8192)
    src = a.alloc(4096)
    remote = a.remote_region(dst.descriptor).wait(timeout=20)
    yield a, b, src, remote
    a.shutdown()
    b.shutdown()


def test_out_of_bounds(pair):
    a, b, src, dst = pair

    async def main():
        with pytest.raises(fabric_rdma.OutOfBounds) as e:
            await a.write(src, 0, dst, 8000, 1000)
        assert (e.value.side, e.value.offset, e.value.len, e.value.region_len) == ("remote", 8000, 1000, 8192)
        assert "out of bounds" in str(e.value) and e.value.retryable is False
        with pytest.raises(fabric_rdma.OutOfBounds) as e:
            await a.write_imm(src, 4000, dst, 0, 200, 1)
        assert e.value.side == "local"
        with pytest.raises(fabric_rdma.OutOfBounds):
            await a.read(src, 0, dst, 2**63, 8)
        with pytest.raises(fabric_rdma.OutOfBounds):
            src.read(4090, 10)
        with pytest.raises(fabric_rdma.OutOfBounds):
            src.write(4090, b"0123456789")
        with pytest.raises(fabric_rdma.FabricError):  # a page outside the region
            await a.write_paged(src, dst, fabric_rdma.PageLayout(4096), [0], [5], imm=1)

    asyncio.run(main())


def test_unknown_peer_malformed_and_foreign(pair):
    a, b, src, dst = pair
    with pytest.raises(fabric_rdma.UnknownPeer) as e:
        a.send(99, b"x").wait(timeout=5)
    assert e.value.peer == 99 and e.value.retryable is False
    with pytest.raises(fabric_rdma.UnknownPeer):
        a.recv_from(99).wait(timeout=5)
    with pytest.raises(fabric_rdma.Malformed):
        a.remote_region(b"not a descriptor").wait(timeout=5)
    with pytest.raises(fabric_rdma.Malformed):
        a.remote_region(bytes(dst.descriptor)[:-3]).wait(timeout=5)
    with pytest.raises(fabric_rdma.Malformed):
        a.add_peer(b"\x00" * 40).wait(timeout=5)
    other = "shm" if a.transport.startswith("tcp") else "tcp"
    c = fabric_rdma.Engine(other)
    with pytest.raises((fabric_rdma.Foreign, fabric_rdma.Malformed)):
        c.remote_region(dst.descriptor).wait(timeout=5)
    with pytest.raises(fabric_rdma.MessageTooLarge):
        a.send(dst.peer, bytes(a.max_msg_size + 1)).wait(timeout=5)


def test_bad_memory_and_arguments(pair):
    a, b, src, dst = pair
    with pytest.raises(TypeError, match="read-only"):
        a.register(b"bytes are read-only")
    with pytest.raises(ValueError, match="contiguous"):
        a.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError):
        a.register(12345)
    with pytest.raises(fabric_rdma.ConfigError):
        a.register(bytearray())
    with pytest.raises(fabric_rdma.ConfigError):
        a.alloc(0)
    with pytest.raises(ValueError):
        a.alloc(10, device="tpu:0")
    with pytest.raises(fabric_rdma.Unsupported):  # no GPU on the CI machines; with one, a region
        r = a.alloc(4096, device="cuda:0")
        r.device == "cuda:0" and pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="mode"):
        fabric_rdma.Engine("tcp", mode="sometimes")
    with pytest.raises(ValueError):
        fabric_rdma.Engine("tcp", op_timeout=-1.0)
    with pytest.raises(fabric_rdma.ProviderNotFound):
        fabric_rdma.Engine("no-such-provider")
    with pytest.raises(OverflowError):
        a.write(src, -1, dst, 0, 8)


class CudaArray:
    """A stand-in for a CuPy/Numba array: only ``__cuda_array_interface__`` (version 3)."""

    def __init__(self, ptr, shape=(1 << 20,), strides=None, readonly=False):
        self.__cuda_array_interface__ = {
            "data": (ptr, readonly),
            "shape": shape,
            "typestr": "<f4",
            "strides": strides,
            "version": 3,
        }


def test_cuda_array_interface_objects(pair):
    a = pair[0]
    with pytest.raises(TypeError, match="read-only"):
        a.register(CudaArray(1 << 40, readonly=True))
    with pytest.raises(ValueError, match="non-contiguous"):
        a.register(CudaArray(1 << 40, shape=(64, 64), strides=(4, 256)))
    try:
        a.alloc(4096, device="cuda:0")
        refused = (fabric_rdma.NotDeviceMemory, fabric_rdma.CudaError)  # a driver that knows no such memory
    except fabric_rdma.Unsupported:
        refused = fabric_rdma.Unsupported  # no CUDA driver, as on CI
    obj = CudaArray(1 << 40, shape=(1024, 1024), strides=(4096, 4))  # C-contiguous strides
    probe = weakref.ref(obj)
    with pytest.raises(refused):
        a.register(obj)
    del obj
    deadline = time.monotonic() + 10
    while probe() is not None:  # a refused object is not kept
        assert time.monotonic() < deadline, "a refused object was kept"
        a.stats()
        gc.collect()
        time.sleep(0.01)


def test_awaitable_misuse(pair):
    a, b, src, dst = pair
    op = a.imm(dst, 1)
    with pytest.raises(RuntimeError, match="asyncio"):
        next(op.__await__())  # no running loop
    op.wait(timeout=10)
    with pytest.raises(RuntimeError, match="already"):
        op.wait()

    async def twice():
        p = a.imm(dst, 1)
        await p
        with pytest.raises(RuntimeError, match="already"):
            await p

    asyncio.run(twice())
    b.imm_counter(1).wait_for(2).wait(timeout=10)


def test_shutdown(pair):
    a, b, src, dst = pair
    a.shutdown()
    with pytest.raises(fabric_rdma.Shutdown):
        a.write(src, 0, dst, 0, 8).wait(timeout=10)
    with pytest.raises(fabric_rdma.Shutdown):
        a.imm_counter(1).wait_for(1).wait(timeout=10)
    with fabric_rdma.Engine(b.transport.split(";")[0]) as e:
        assert e.alloc(10).nbytes == 10
    with pytest.raises(fabric_rdma.Shutdown):
        e.alloc(10)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a CUDA driver is present: test_gpu.py covers stream order")
def test_stream_order_without_a_cuda_driver_is_unsupported(pair):
    a, b, src, dst = pair
    with pytest.raises(fabric_rdma.Unsupported):
        b.imm_counter(3).wait_on_stream(0, 1)
    with pytest.raises(fabric_rdma.Unsupported):
        a.write_imm(src, 0, dst, 0, 8, 3, after=0)
    with pytest.raises(TypeError, match="not a CUDA stream"):
        a.write(src, 0, dst, 0, 8, after="stream")
    a.write(src, 0, dst, 0, 8).wait(timeout=10)  # and the engine still works


def test_latency_profiles_and_what_the_engine_runs_with(provider):
    with fabric_rdma.Engine(provider, profile="low_cpu") as e:
        s = e.stats()["settings"]
        assert (s["mode"], s["await_linger"], s["poll_window"]) == ("Event", 0.0, 0.0) and s["cpus"] >= 1
    with fabric_rdma.Engine(provider, "event", profile="low_latency") as e:  # the mode given wins
        s = e.stats()["settings"]
        assert (s["mode"], s["await_linger"]) == ("Event", 200e-6)
    with pytest.raises(ValueError, match="unknown profile"):
        fabric_rdma.Engine(provider, profile="fastest")
