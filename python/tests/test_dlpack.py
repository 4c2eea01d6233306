"""DLPack tensors (only `__dlpack__`, no buffer protocol) registered in place: real transfers,
every byte checked, and the capsule keeping the producer's memory alive."""

import asyncio

import numpy as np
import pytest


class DlpackOnly:
    """A tensor of another framework: only the DLPack protocol, no buffer protocol."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, stream=None):
        return self.arr.__dlpack__()

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()



def test_dlpack_tensors_are_registered_in_place(engines):
    a, b = engines
    dst_arr = np.zeros((64, 1024), dtype=np.float32)
    dst = b.register(DlpackOnly(dst_arr))
    assert len(dst) == dst_arr.nbytes and dst.address == dst_arr.ctypes.data
    src_arr = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    src = a.register(DlpackOnly(src_arr))

    async def main():
        remote = await a.remote_region(dst.descriptor)
        await a.write_imm(src, 0, remote, 0, src_arr.nbytes, 12)
        await asyncio.wait_for(b.imm_counter(12).wait_for(a.write_arrivals(remote, src_arr.nbytes)), 20)

    asyncio.run(main())
    assert (dst_arr == src_arr).all()
    with pytest.raises(ValueError, match="non-contiguous"):
        a.register(DlpackOnly(src_arr[:, ::2]))


def test_a_dlpack_export_keeps_its_memory_alive(engines):
    a, b = engines
    arr = np.zeros(1 << 20, dtype=np.uint8)
    region = b.register(DlpackOnly(arr))
    addr = arr.ctypes.data
    del arr  # the capsule the region holds keeps the array's memory
    src = a.register(np.full(1 << 20, 5, dtype=np.uint8))

    async def main():
        remote = await a.remote_region(region.descriptor)
        await a.write_imm(src, 0, remote, 0, 1 << 20, 13)
        await asyncio.wait_for(b.imm_counter(13).wait_for(a.write_arrivals(remote, 1 << 20)), 20)

    asyncio.run(main())
    assert region.address == addr and region.read(0, 16) == bytes([5] * 16)
