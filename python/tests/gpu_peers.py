"""What the peer processes of the GPU tests run (importable by multiprocessing's spawn).

torch is imported inside each function: this module is imported by test_gpu.py only after
it checked that torch and a CUDA device are there.
"""

import asyncio

import fabric_rdma


def pattern_t(n, seed, device):
    """``peers.pattern(n, seed)`` as a torch uint8 tensor made on ``device``."""
    import torch

    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * 2654435761 + seed * 97 + (i >> 13)) % 251).to(torch.uint8)


def gpu_target(provider, conn, device, size):
    """Registers two torch CUDA tensors in place on ``device``: ``dst`` (written into,
    zeroed) and ``src`` (pattern 9, read from). Then answers ``("expect", imm, arrivals,
    pieces)``: waits for ``arrivals`` of ``imm`` (None: nothing to wait for), checks on the
    GPU that ``dst`` is zero except ``dst[d:d+n] == pattern(seed)[s:s+n]`` for every
    ``(d, seed, s, n)`` of ``pieces``, zeroes it again and answers ``(ok, total_arrived)``.
    ``("stop",)`` ends it."""
    import torch

    engine = fabric_rdma.Engine(provider)
    dst = torch.zeros(size, dtype=torch.uint8, device=device)
    src = pattern_t(size, 9, device)
    torch.cuda.synchronize(device)
    dst_region = engine.register(dst)
    src_region = engine.register(src)
    assert dst_region.device == device and dst_region.obj is dst and dst_region.address == dst.data_ptr()
    conn.send((engine.address, dst_region.descriptor, src_region.descriptor, dst_region.gpu_path))

    async def serve():
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            _, imm, arrivals, pieces = cmd
            total = None
            if imm is not None:
                counter = engine.imm_counter(imm)
                await asyncio.wait_for(counter.wait_for(arrivals), 30)
                total = counter.total_arrived
            want = torch.zeros(size, dtype=torch.uint8, device=device)
            for d, seed, s, n in pieces:
                want[d : d + n] = pattern_t(s + n, seed, device)[s:]
            ok = bool(torch.equal(dst, want))
            dst.zero_()
            torch.cuda.synchronize(device)
            conn.send((ok, total))

    asyncio.run(serve())
