"""Bandwidth from Python: fabric against NIXL's Python API, same sizes, same machine, same run.

fabric: a writer process keeps ``--window`` (16) ``write_imm`` of SIZE bytes in flight
(each posted when the previous oldest completes) into a peer process's registered region,
every block at offset 0; a burst ends when the receiver, having counted every arrival,
answers with an 8 B ``write_imm``. NIXL (UCX backend): two agents in two processes that
exchange metadata through a pipe; the initiator posts one transfer request of ``--window``
blocks of SIZE bytes (all at offset 0) at a time, polls ``check_xfer_state`` until DONE,
then posts the next. Both move about ``--bytes`` per burst; each figure is the median of
``--rounds`` bursts after a warm-up, and ``--passes`` sweeps alternate the two libraries
(the ratio: the median of the passes' ratios, their range beside it). Host memory by
default; ``--device cuda`` uses torch CUDA tensors registered in place, GPU0 -> GPU1 when
there are two GPUs (else GPU0 -> GPU0).

    python python/bench/bw.py --provider shm
    python python/bench/bw.py --provider shm --device cuda

NIXL comes from the nixl-cu13 wheel (module ``nixl_cu13``) or ``nixl``, found on
PYTHONPATH; without it the table says why NIXL was skipped. Build the extension in
release for meaningful figures (``maturin build --release``).
"""

import argparse
import asyncio
import mmap
import multiprocessing as mp
import statistics
import sys
import time
from collections import deque

import fabric_rdma

KIB, MIB = 1 << 10, 1 << 20
PIPE_SECONDS = 120  # the longest any process waits for the other


def recv(conn, what):
    if not conn.poll(PIPE_SECONDS):
        raise TimeoutError(f"no {what} within {PIPE_SECONDS} s")
    return conn.recv()


def plan(args):
    """[(size, ops)]: ops a multiple of the window, about --bytes per burst."""
    out = []
    for size in args.sizes:
        ops = max(args.window, args.bytes // size // args.window * args.window)
        out.append((size, ops))
    return out


def devices(args):
    """(source, destination): "host" twice, or CUDA devices."""
    if args.device == "host":
        return "host", "host"
    import torch

    return "cuda:0", "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


def buffer(device, n):
    """n bytes to register: (the object, its address). Host: an anonymous mapping, every
    page touched; CUDA: a torch tensor."""
    if device == "host":
        import ctypes

        mm = mmap.mmap(-1, n)
        for off in range(0, n, MIB):
            mm[off : off + min(MIB, n - off)] = b"\x5a" * min(MIB, n - off)
        return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))
    import torch

    t = torch.full((n,), 0x5A, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    return t, t.data_ptr()


# -------------------------------------------------------------------------------------------
# fabric


def fabric_receiver(args, conn, device):
    engine = fabric_rdma.Engine(args.provider, args.mode)
    keep, _ = buffer(device, max(args.sizes))
    region = engine.register(memoryview(keep) if device == "host" else keep)
    ack = engine.alloc(4096)
    conn.send((engine.address, region.descriptor))
    back = engine.remote_region(recv(conn, "the writer's descriptor")).wait(timeout=30)
    counter = engine.imm_counter(1)

    async def serve():
        while True:
            msg = recv(conn, "a burst")
            if msg is None:
                return
            arrivals, bursts = msg
            for _ in range(bursts):
                await asyncio.wait_for(counter.wait_for(arrivals), PIPE_SECONDS)
                await engine.write_imm(ack, 0, back, 0, 8, 2)

    asyncio.run(serve())


def fabric_side(args, src_dev, dst_dev):
    """{size: GB/s}"""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=fabric_receiver, args=(args, child, dst_dev), daemon=True)
    p.start()
    try:
        engine = fabric_rdma.Engine(args.provider, args.mode)
        keep, _ = buffer(src_dev, max(args.sizes))
        src = engine.register(memoryview(keep) if src_dev == "host" else keep)
        acks = engine.alloc(4096)
        _, desc = recv(conn, "the receiver's descriptor")
        dst = engine.remote_region(desc).wait(timeout=30)
        conn.send(acks.descriptor)
        done = engine.imm_counter(2)
        w = args.window
        out = {}

        async def burst(size, ops):
            t0 = time.perf_counter()
            inflight = deque()
            for _ in range(ops):
                if len(inflight) == w:
                    await inflight.popleft()
                inflight.append(engine.write_imm(src, 0, dst, 0, size, 1))  # posted here
            while inflight:
                await inflight.popleft()
            await asyncio.wait_for(done.wait_for(1), PIPE_SECONDS)  # the receiver counted all
            return time.perf_counter() - t0

        async def run():
            for size, ops in plan(args):
                conn.send((engine.write_arrivals(dst, size) * ops, args.rounds + 1))
                await burst(size, ops)  # warm-up
                secs = [await burst(size, ops) for _ in range(args.rounds)]
                out[size] = size * ops / statistics.median(secs) / 1e9

        asyncio.run(run())
        conn.send(None)
        p.join(30)
        return out
    finally:
        if p.is_alive():
            p.kill()


# -------------------------------------------------------------------------------------------
# NIXL


def import_nixl():
    """(nixl_agent, nixl_agent_config, version): nixl-cu13's module nixl_cu13, else nixl."""
    errs = []
    for mod, dist in (("nixl_cu13", "nixl-cu13"), ("nixl", "nixl")):
        try:
            api = __import__(f"{mod}._api", fromlist=["nixl_agent", "nixl_agent_config"])
        except ModuleNotFoundError as e:
            if e.name not in (mod, f"{mod}._api"):
                errs.append(f"{mod}: {e}")
            continue
        except Exception as e:  # a library of the wheel missing, a wrong Python version
            errs.append(f"{mod}: {type(e).__name__}: {e}")
            continue
        try:
            from importlib.metadata import version

            ver = version(dist)
        except Exception:
            ver = "?"
        return api.nixl_agent, api.nixl_agent_config, ver
    raise ImportError(errs[0] if errs else "no module nixl_cu13 nor nixl (put NIXL's site folder on PYTHONPATH)")


def nixl_agent_with(name, device, n):
    nixl_agent, nixl_agent_config, _ = import_nixl()
    keep, addr = buffer(device, n)
    mem, dev = ("DRAM", 0) if device == "host" else ("VRAM", int(device[5:]))
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend (libplugin_UCX.so not found or failed to load)")
    agent.register_memory([(addr, n, dev, "")], mem, backends=["UCX"])
    return agent, keep, (addr, n, dev, mem)


def nixl_target(args, conn, device):
    try:
        agent, keep, desc = nixl_agent_with("bw-target", device, max(args.sizes))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send((agent.get_agent_metadata(), desc))
    agent.add_remote_agent(recv(conn, "the initiator's metadata"))
    deadline = time.monotonic() + PIPE_SECONDS * 4
    while time.monotonic() < deadline:  # the initiator writes; this side waits for "done"
        if any(b"done" in v for v in agent.get_new_notifs().values()):
            return
        time.sleep(0.001)


def nixl_initiator(args, conn, device, target_meta, target_desc):
    try:
        agent, keep, (addr, _, dev, mem) = nixl_agent_with("bw-initiator", device, max(args.sizes))
        conn.send(agent.get_agent_metadata())
        remote = agent.add_remote_agent(target_meta)
        raddr, _, rdev, rmem = target_desc
        out = {}
        for size, ops in plan(args):
            local = agent.get_xfer_descs([(addr, size, dev)] * args.window, mem)
            far = agent.get_xfer_descs([(raddr, size, rdev)] * args.window, rmem)
            h = agent.initialize_xfer("WRITE", local, far, remote, b"", ["UCX"])

            def post():
                st = agent.transfer(h)
                deadline = time.monotonic() + PIPE_SECONDS
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"a NIXL transfer of {args.window} x {size} B ran past {PIPE_SECONDS} s")
                if st != "DONE":
                    raise RuntimeError(f"NIXL transfer of {args.window} x {size} B: state {st}")

            post()  # warm-up (and the connection)
            secs = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(ops // args.window):
                    post()
                secs.append(time.perf_counter() - t0)
            out[size] = size * ops / statistics.median(secs) / 1e9
            agent.release_xfer_handle(h)
        agent.send_notif(remote, b"done")
        time.sleep(0.5)  # the notification leaves with the worker's next progress
        conn.send(("ok", out))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def nixl_side(args, src_dev, dst_dev):
    """({size: GB/s}, None) or (None, why NIXL was skipped)."""
    try:
        _, _, ver = import_nixl()
    except Exception as e:
        return None, f"not importable: {e}"
    ctx = mp.get_context("spawn")
    tc, tchild = ctx.Pipe()
    ic, ichild = ctx.Pipe()
    t = ctx.Process(target=nixl_target, args=(args, tchild, dst_dev), daemon=True)
    t.start()
    procs = [t]
    try:
        first = recv(tc, "the NIXL target's metadata")
        if first[0] == "error":
            return None, f"NIXL {ver}: target: {first[1]}"
        meta, desc = first
        i = ctx.Process(target=nixl_initiator, args=(args, ichild, src_dev, meta, desc), daemon=True)
        i.start()
        procs.append(i)
        msg = recv(ic, "the NIXL initiator's metadata")
        if isinstance(msg, tuple) and msg[0] == "error":
            return None, f"NIXL {ver}: initiator: {msg[1]}"
        tc.send(msg)
        status, out = recv(ic, "NIXL's figures")
        if status == "error":
            return None, f"NIXL {ver}: {out}"
        for p in procs:
            p.join(30)
        return out, None
    except Exception as e:
        return None, f"NIXL {ver}: {type(e).__name__}: {e}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


# -------------------------------------------------------------------------------------------


def human(n):
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def size_arg(s):
    s = s.strip().lower()
    for suffix, mult in (("kib", KIB), ("k", KIB), ("mib", MIB), ("m", MIB)):
        if s.endswith(suffix):
            return int(s[: -len(suffix)]) * mult
    return int(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--mode", default="event", help="fabric's reactor: event, adaptive, busy_poll, inline")
    ap.add_argument("--device", default="host", choices=["host", "cuda"])
    ap.add_argument("--sizes", default="64KiB,1MiB,4MiB,16MiB,64MiB", help="comma-separated, e.g. 64KiB,1MiB")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--bytes", type=size_arg, default=1 << 30, help="bytes per burst (about)")
    ap.add_argument("--rounds", type=int, default=2, help="bursts per size and pass (the median)")
    ap.add_argument("--passes", type=int, default=3, help="sweeps per library, alternating")
    ap.add_argument("--no-nixl", action="store_true")
    args = ap.parse_args()
    args.sizes = [size_arg(s) for s in args.sizes.split(",")]
    if args.device == "cuda":
        try:
            import torch
        except ImportError as e:
            print(f"skipped: --device cuda: torch is not importable ({e})")
            return 0
        if not torch.cuda.is_available():
            print("skipped: --device cuda: no CUDA device (torch.cuda.is_available() is False)")
            return 0
    src_dev, dst_dev = devices(args)
    # Passes alternate the two libraries (fabric, NIXL, fabric, ...), each a sweep of every
    # size with fresh processes: host-memory figures here move by a third between runs, so
    # the ratio is the median of each pass's ratio, taken side by side.
    ours, theirs, why = [], [], None
    for _ in range(args.passes):
        ours.append(fabric_side(args, src_dev, dst_dev))
        if args.no_nixl:
            why = "--no-nixl"
        elif why is None:
            t, why = nixl_side(args, src_dev, dst_dev)
            if t is not None:
                theirs.append(t)
    print(
        f"bandwidth from Python, {src_dev} -> {dst_dev}, window {args.window}, about "
        f"{human(args.bytes)} per burst, median of {args.rounds} per pass, {args.passes} passes "
        f"alternating: fabric over {args.provider} ({args.mode}, write_imm) against NIXL (UCX, "
        f"one request of {args.window} blocks at a time)"
    )
    print(f"{'size':>8} {'fabric GB/s':>12} {'NIXL GB/s':>10} {'fabric/NIXL':>12}  per-pass ratios")
    for size in args.sizes:
        f = statistics.median(o[size] for o in ours)
        if len(theirs) == len(ours):
            n = statistics.median(t[size] for t in theirs)
            ratios = sorted(o[size] / t[size] for o, t in zip(ours, theirs))
            r = statistics.median(ratios)
            span = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            print(f"{human(size):>8} {f:12.2f} {n:10.2f} {r:11.2f}x  {span}")
        else:
            print(f"{human(size):>8} {f:12.2f} {'-':>10} {'-':>12}")
    if why:
        print(f"NIXL skipped: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
