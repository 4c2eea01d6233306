#!/usr/bin/env python3
"""fabric-bench's peers: NIXL (UCX backend) and NCCL (torch.distributed) moving the bytes that
`fabric-bench bw` moves, two processes on this host. fabric-bench writes this file to a
temporary folder and runs it (benches/src/peers/mod.rs); it is not meant to be run by hand,
though it can be:

    peers.py probe nixl [--cuda S,R] [--ucx-error-handling peer|none]
                                              one line: "ok <what>" or "skip <why>"
    peers.py probe nccl --cuda S,R
    peers.py nixl target    --rdv DIR --loc host|cuda:N --region BYTES [--huge]
                            [--ucx-error-handling peer|none]
    peers.py nixl initiator --rdv DIR --loc host|cuda:N --region BYTES [--huge]
                            [--ucx-error-handling peer|none]
                            --window W --rounds R --patterns hot,cold --points SIZE:OPS,...
    peers.py nccl --rank 0|1 --port P --loc cuda:N --region BYTES
                  --window W --rounds R --patterns cold --points SIZE:OPS,...

Each measured burst prints one line on stdout (the sender's process; NIXL's initiator, NCCL's
rank 0), which fabric-bench parses (`parse_line`):

    fabric-peer peer=nixl pattern=hot size=65536 ops=256 bytes=16777216 seconds=0.00123 gbps=109.1

A burst is OPS // W requests of W blocks of SIZE bytes each (NIXL: one transfer request of W
descriptors, posted, polled until DONE, then the next; NCCL: one batch_isend_irecv of W ops,
then the next), at the offsets of fabric-bench's --buffer pattern in a region of BYTES
(hot: every block at offset 0; cold: block i at (i mod (BYTES // SIZE)) x SIZE). One warm-up
request per size and pattern first. NCCL's burst ends when the receiver's 1-byte ack, sent
after its last receive, has arrived (as fabric-bench's engine burst ends at the receiver's
ack).

NIXL's UCX transports come from the environment: fabric-bench sets UCX_TLS to match its
engine's transport (tcp,self with UCX_NET_DEVICES=lo; sm,self; cuda_ipc,cuda_copy,tcp,self)
unless UCX_TLS is already set, and UCX_PROTO_INFO=y, so that UCX prints the protocols it
chose (the initiator's tables of "remote memory write by ucp_put*" name the transport of
each size range; fabric-bench reads them from its output). --ucx-error-handling none sets
the UCX backend's ucx_error_handling_mode: NIXL's default, peer, makes UCX refuse its
shared-memory transports for active messages ("no peer failure handler"), so a UCX_TLS
without tcp or an RDMA transport needs none.
"""

import argparse
import math
import mmap
import os
import sys
import time


def fail(msg):
    print(f"peers.py: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def points(s):
    """SIZE:OPS,SIZE:OPS -> [(size, ops)]"""
    out = []
    for p in s.split(","):
        size, ops = p.split(":")
        out.append((int(size), int(ops)))
    return out


def offsets(pattern, size, region, first, count):
    """Offsets of blocks first .. first + count - 1 (fabric-bench's pattern.rs)."""
    if pattern == "hot":
        return [0] * count
    slots = max(1, region // size)
    return [((first + k) % slots) * size for k in range(count)]


def requests(pattern, size, region, window, reqs):
    """The distinct requests of a burst, as lists of offsets: the offsets repeat every
    slots / gcd(slots, window) requests (hot: one request)."""
    if pattern == "hot":
        period = 1
    else:
        slots = max(1, region // size)
        period = slots // math.gcd(slots, window)
    n = min(period, reqs)
    return [offsets(pattern, size, region, j * window, window) for j in range(n)]


def result(peer, pattern, size, ops, nbytes, secs):
    print(
        f"fabric-peer peer={peer} pattern={pattern} size={size} ops={ops} bytes={nbytes} "
        f"seconds={secs:.9f} gbps={nbytes * 8 / secs / 1e9:.3f}",
        flush=True,
    )


def parse_loc(s):
    """host -> None; cuda:N -> N"""
    if s == "host":
        return None
    if s.startswith("cuda:"):
        return int(s[5:])
    fail(f"bad --loc {s!r}")


# ---------------------------------------------------------------------------------------------
# NIXL


def import_nixl():
    """nixl_agent and the distribution's version: nixl-cu13 (module nixl_cu13), else nixl."""
    errs = []
    for mod, dist in (("nixl_cu13", "nixl-cu13"), ("nixl", "nixl")):
        try:
            api = __import__(f"{mod}._api", fromlist=["nixl_agent", "nixl_agent_config"])
        except ModuleNotFoundError as e:
            errs.append((e.name in (mod, f"{mod}._api"), f"{mod}: {e}"))
            continue
        except Exception as e:  # a library of the wheel missing, a wrong Python version
            errs.append((False, f"{mod}: {type(e).__name__}: {e}"))
            continue
        try:
            from importlib.metadata import version

            ver = version(dist)
        except Exception:
            ver = getattr(sys.modules.get(mod), "__version__", "?")
        return api.nixl_agent, api.nixl_agent_config, ver
    # Neither module there: say so briefly; else the error of the one that is there.
    real = [m for absent, m in errs if not absent]
    raise ImportError(
        real[0] if real else "no module nixl_cu13 (nor nixl): put the nixl-cu13 wheel's folder on PYTHONPATH"
    )


def host_buffer(n, huge):
    """n bytes of anonymous memory (transparent huge pages with `huge`), every page touched;
    (keep-alive object, address)."""
    import ctypes

    mm = mmap.mmap(-1, n)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    chunk = b"\x5a" * (1 << 20)
    for off in range(0, n, len(chunk)):
        k = min(len(chunk), n - off)
        mm[off : off + k] = chunk[:k]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return mm, addr


def gpu_buffer(n, ordinal):
    import torch

    torch.cuda.set_device(ordinal)
    t = torch.empty(n, dtype=torch.uint8, device=f"cuda:{ordinal}")
    t.fill_(0x5A)
    torch.cuda.synchronize()
    return t, t.data_ptr()


def ucx_agent(nixl_agent, nixl_agent_config, name, err_mode):
    """An agent with the UCX backend only, its ucx_error_handling_mode `err_mode` (NIXL's
    default when empty); RuntimeError if the backend does not start. Its start connects the
    agent to itself already, so a UCX_TLS that NIXL cannot use fails here."""
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    if "UCX" not in getattr(agent, "plugin_list", ["UCX"]):
        raise RuntimeError("NIXL has no UCX backend (libplugin_UCX.so not found or failed to load)")
    params = {}
    if err_mode:
        if "ucx_error_handling_mode" not in agent.get_plugin_params("UCX"):
            raise RuntimeError(f"NIXL's UCX backend takes no ucx_error_handling_mode ({err_mode})")
        params["ucx_error_handling_mode"] = err_mode
    tls = os.environ.get("UCX_TLS", "UCX's choice")
    try:
        agent.create_backend("UCX", params)
    except Exception as e:
        raise RuntimeError(
            f"NIXL's UCX backend did not start (UCX_TLS={tls}, {params or 'default parameters'}): "
            f"{type(e).__name__}: {e}"
        ) from None
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend (libplugin_UCX.so not found or failed to load)")
    return agent


def nixl_setup(name, loc, region, huge, err_mode=""):
    """An agent with the UCX backend (its ucx_error_handling_mode `err_mode`, when given) and
    `region` bytes registered at `loc`."""
    nixl_agent, nixl_agent_config, _ = import_nixl()
    ordinal = parse_loc(loc)
    if ordinal is None:
        keep, addr = host_buffer(region, huge)
        mem, dev = "DRAM", 0
    else:
        keep, addr = gpu_buffer(region, ordinal)
        mem, dev = "VRAM", ordinal
    try:
        agent = ucx_agent(nixl_agent, nixl_agent_config, name, err_mode)
    except RuntimeError as e:
        fail(str(e))
    agent.register_memory([(addr, region, dev, "")], mem, backends=["UCX"])
    return agent, keep, addr, mem, dev


def put_file(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def get_file(path, limit=120.0):
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > limit:
            fail(f"{path} did not appear within {limit:.0f} s")
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()


def nixl_target(a):
    agent, keep, addr, mem, dev = nixl_setup(
        "fabric-peer-target", a.loc, a.region, a.huge, a.ucx_error_handling
    )
    put_file(os.path.join(a.rdv, "target.meta"), agent.get_agent_metadata())
    put_file(os.path.join(a.rdv, "target.desc"), f"{addr} {a.region} {dev} {mem}".encode())
    agent.add_remote_agent(get_file(os.path.join(a.rdv, "initiator.meta")))
    # The initiator writes; this side only waits for its "done" notification.
    t0 = time.monotonic()
    while True:
        notifs = agent.get_new_notifs()
        if any(b"done" in v for v in notifs.values()):
            break
        if time.monotonic() - t0 > a.limit:
            fail(f"no 'done' from the initiator within {a.limit:.0f} s")
        time.sleep(0.001)
    del keep


def nixl_initiator(a):
    agent, keep, addr, mem, dev = nixl_setup(
        "fabric-peer-initiator", a.loc, a.region, a.huge, a.ucx_error_handling
    )
    put_file(os.path.join(a.rdv, "initiator.meta"), agent.get_agent_metadata())
    remote = agent.add_remote_agent(get_file(os.path.join(a.rdv, "target.meta")))
    raddr, rlen, rdev, rmem = get_file(os.path.join(a.rdv, "target.desc")).decode().split()
    raddr, rlen, rdev = int(raddr), int(rlen), int(rdev)
    if rlen < a.region or rmem != mem:
        fail(f"the target registered {rlen} bytes of {rmem}, not {a.region} of {mem}")
    w = a.window
    for pattern in a.patterns.split(","):
        for size, ops in points(a.points):
            reqs = max(1, ops // w)
            handles = []
            for offs in requests(pattern, size, a.region, w, reqs):
                local = agent.get_xfer_descs([(addr + o, size, dev) for o in offs], mem)
                far = agent.get_xfer_descs([(raddr + o, size, rdev) for o in offs], rmem)
                handles.append(agent.initialize_xfer("WRITE", local, far, remote, b"", ["UCX"]))

            def post(h):
                st = agent.transfer(h)
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                if st != "DONE":
                    fail(f"transfer of {w} x {size} B ({pattern}): state {st}")

            post(handles[0])  # warm-up (and the first connection)
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                for j in range(reqs):
                    post(handles[j % len(handles)])
                secs = time.perf_counter() - t0
                result("nixl", pattern, size, reqs * w, reqs * w * size, secs)
            for h in handles:
                agent.release_xfer_handle(h)
    agent.send_notif(remote, b"done")
    # The notification leaves with the next progress of the worker: give it a moment.
    time.sleep(0.5)
    del keep


# ---------------------------------------------------------------------------------------------
# NCCL


def nccl(a):
    # NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs
    # out of service (the GPU machines set this; a bare environment may not).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    ordinal = parse_loc(a.loc)
    if ordinal is None:
        fail("NCCL is GPU-only")
    torch.cuda.set_device(ordinal)
    device = torch.device("cuda", ordinal)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{a.port}",
        rank=a.rank,
        world_size=2,
        device_id=device,
    )
    other = 1 - a.rank
    buf = torch.empty(a.region, dtype=torch.uint8, device=device)
    buf.fill_(0x5A)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    w = a.window
    op = dist.isend if a.rank == 0 else dist.irecv

    def batch(offs, size):
        return [dist.P2POp(op, buf.narrow(0, o, size), other) for o in offs]

    def run(batches, reqs):
        for j in range(reqs):
            for work in dist.batch_isend_irecv(batches[j % len(batches)]):
                work.wait()

    for pattern in a.patterns.split(","):
        for size, ops in points(a.points):
            reqs = max(1, ops // w)
            batches = [batch(offs, size) for offs in requests(pattern, size, a.region, w, reqs)]
            run(batches, 1)  # warm-up (and the first connection)
            torch.cuda.synchronize()
            for _ in range(a.rounds):
                dist.barrier(device_ids=[ordinal])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(batches, reqs)
                if a.rank == 0:
                    dist.recv(ack, other)
                else:
                    dist.send(ack, other)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                if a.rank == 0:
                    result("nccl", pattern, size, reqs * w, reqs * w * size, secs)
    dist.barrier(device_ids=[ordinal])
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Probes: can this peer run here? One line, exit status 0 either way.


def gpus_needed(cuda):
    s, r = (int(x) for x in cuda.split(","))
    return s, r


def probe_torch_cuda(cuda):
    try:
        import torch
    except Exception as e:
        return None, f"import torch failed: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} without CUDA (torch.cuda.is_available() is False)"
    s, r = gpus_needed(cuda)
    n = torch.cuda.device_count()
    if max(s, r) >= n:
        return None, f"cuda:{s},{r} asked for, torch sees {n} GPU(s)"
    return torch, None


def probe(a):
    if a.peer == "nixl":
        try:
            nixl_agent, nixl_agent_config, ver = import_nixl()
        except Exception as e:
            return f"skip import nixl failed: {e}"
        if a.cuda:
            torch, why = probe_torch_cuda(a.cuda)
            if why:
                return f"skip {why}"
        try:
            name, err = "fabric-peer-probe", a.ucx_error_handling
            agent = ucx_agent(nixl_agent, nixl_agent_config, name, err)
        except RuntimeError as e:
            return f"skip {e}"
        mems = agent.get_backend_mem_types("UCX")
        if a.cuda and "VRAM_SEG" not in mems:
            return f"skip NIXL's UCX backend has no VRAM here (memory types {mems})"
        return f"ok NIXL {ver} UCX"
    torch, why = probe_torch_cuda(a.cuda or "0,1")
    if why:
        return f"skip {why}"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return f"skip torch {torch.__version__} without NCCL"
    s, r = gpus_needed(a.cuda or "0,1")
    if s == r:
        return f"skip NCCL needs two GPUs (cuda:{s},{r} asked for)"
    v = torch.cuda.nccl.version()
    v = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return f"ok NCCL {v} (torch {torch.__version__.split('+')[0]})"


def main():
    p = argparse.ArgumentParser(prog="peers.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("peer", choices=["nixl", "nccl"])
    pr.add_argument("--cuda", default="")
    pr.add_argument("--ucx-error-handling", choices=["peer", "none"], default="")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--loc", default="host")
    common.add_argument("--region", type=int, required=True)
    common.add_argument("--window", type=int, default=16)
    common.add_argument("--rounds", type=int, default=3)
    common.add_argument("--patterns", default="hot")
    common.add_argument("--points", default="")
    common.add_argument("--huge", action="store_true")
    common.add_argument("--limit", type=float, default=600.0)
    nx = sub.add_parser("nixl", parents=[common])
    nx.add_argument("role", choices=["target", "initiator"])
    nx.add_argument("--rdv", required=True)
    nx.add_argument("--ucx-error-handling", choices=["peer", "none"], default="")
    nc = sub.add_parser("nccl", parents=[common])
    nc.add_argument("--rank", type=int, choices=[0, 1], required=True)
    nc.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    if a.cmd == "probe":
        try:
            print(probe(a), flush=True)
        except Exception as e:
            print(f"skip {a.peer} probe failed: {type(e).__name__}: {e}", flush=True)
    elif a.cmd == "nixl":
        (nixl_target if a.role == "target" else nixl_initiator)(a)
    else:
        nccl(a)
    # Out at once: NIXL 1.5.1's agent can crash in the interpreter's teardown (SIGSEGV after
    # the work is done), which would read as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
