#!/usr/bin/env python3
"""The same NIXL calls through several NIXL backends in one run: our FABRIC plugin, NIXL's UCX
and NIXL's LIBFABRIC, each between two processes (initiator, target) on loopback, and one
table of GB/s with the ratios FABRIC/UCX and FABRIC/LIBFABRIC (> 1: FABRIC moves more).

    target/nixl-venv/bin/python benches/nixl/compare.py                 # DRAM tcp+shm, VRAM cuda_ipc
    target/nixl-venv/bin/python benches/nixl/compare.py --quick         # CI smoke: 2 sizes, few iterations
    ... compare.py --backends UCX --mem DRAM --transports tcp --sizes 64K,1M --descs 1
    ... compare.py --json out.json                                      # the rows as JSON too
    ... compare.py --param FABRIC:mode=busy_poll                        # a backend param

(scripts/nixl-tests.sh makes target/nixl-venv: nixl-cu13 1.4.1, numpy; torch for VRAM.)

Rows: memory (DRAM, VRAM: torch CUDA tensors) x transport x op (WRITE, READ) x size (bytes
per descriptor: 64K,256K,1M,4M,16M,64M by default) x descriptors per request (1, 64). A
request of D descriptors moves D x size bytes; descriptor k sits at offset (k x size) modulo
the region (256 MiB at most), so large requests write some ranges more than once. Each cell:
one request made with initialize_xfer, posted twice to warm up (once if that post took more
than --seconds; the first post of a process also connects), then posted again N times
(transfer(), then check_xfer_state until DONE), N chosen so the cell takes about --seconds (at
least --min-iter posts unless they would take more than 3 x --seconds, then one; at most
--max-iter); the figure is the median post's GB/s (1e9 bytes per second). Two "many" rows per memory and transport: one WRITE request of 10,000
descriptors of 4 KiB laid out alike at both ends (descriptor k at slot k on both sides, as
KV blocks often are: a backend may merge them), and one with the target's slots shuffled
(nothing to merge); the median time from transfer() to DONE, and its GB/s.

Transports (default: tcp and shm for DRAM, cuda_ipc for VRAM):
    UCX        UCX_TLS pinned: tcp -> tcp,self; shm -> shm,self (posix, sysv, cma);
               cuda_ipc -> cuda_ipc,cuda_copy,shm,self (VRAM over tcp: tcp,cuda_copy,self).
               Over shm and cuda_ipc with the backend param ucx_error_handling_mode=none
               (UCX refuses those transports under the default "peer" mode). What UCX really
               used is read from UCX_PROTO_INFO=y (its protocol tables, in the initiator's
               log) and printed per memory and transport.
    FABRIC     backend param provider=tcp or shm (cuda_ipc -> shm: the plugin moves same-host
               GPU memory with CUDA IPC); FI_TCP_IFACE=lo. The backend's params as NIXL
               reports them after creation are printed.
    LIBFABRIC  FI_PROVIDER=tcp or shm, FI_TCP_IFACE=lo; the provider lines of its log (at
               NIXL_LOG_LEVEL=INFO) are printed. NIXL 1.4.1's plugin needs libfabric >= 1.21,
               libcudart and libcuda, so on a CPU machine it prints 'skipped: ...'.
A backend that cannot be made prints one 'skipped: <why>' line per row; the run goes on.
Everything stays on 127.0.0.1 (UCX_NET_DEVICES=lo, FI_TCP_IFACE=lo); every wait is bounded.
"""

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "fabric-c", "nixl", "tests"))
import nixl_peer as P  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
REGION_CAP = 256 * MiB
MANY, MANY_SIZE = 10_000, 4 * KiB


# ---------------------------------------------------------------------------------------------
# In the initiator's process (run as `compare.py --worker FD`)


def _post(h, timeout):
    """One post of h until DONE: seconds (raises on ERR or after `timeout` s)."""
    agent = P.S.agent
    t0 = time.perf_counter()
    st = agent.transfer(h)
    while st == "PROC":
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"request not DONE after {timeout:.0f} s")
        st = agent.check_xfer_state(h)
    if st != "DONE":
        raise RuntimeError(f"transfer state {st}")
    return time.perf_counter() - t0


def cmd_bench(peer, cells, seconds, min_iter, max_iter, timeout=60.0):
    """cells: [(op, size, descs)]; returns [dict(op, size, descs, bytes, iters, secs, gbps) or
    dict(..., error)]."""
    agent = P.S.agent
    region = P.S.regions[0].shape[0]
    out = []
    for cell in cells:
        op, size, descs = cell[:3]
        slots = max(1, region // size)
        rows = [(0, (k % slots) * size, 0, (k % slots) * size, size) for k in range(descs)]
        if cell[3:] == ("shuffled",):
            order = list(range(descs))
            random.Random(descs).shuffle(order)
            rows = [(0, r[1], 0, rows[order[k]][3], size) for k, r in enumerate(rows)]
        res = dict(op=op, size=size, descs=descs, bytes=size * descs)
        h = None
        try:
            loc, rem = P._descs(rows, peer)
            h = agent.initialize_xfer(op, loc, rem, peer)
            warm = _post(h, timeout)  # the first post of a group also connects
            if warm < seconds:
                warm = _post(h, timeout)
            # Posts that take long get fewer repeats: a cell stays within about 3 x seconds.
            floor = min_iter if warm * min_iter <= 3 * seconds else 1
            n = int(min(max_iter, max(floor, round(seconds / max(warm, 1e-6)))))
            times = []
            t0 = time.perf_counter()
            for _ in range(n):
                times.append(_post(h, timeout))
                if len(times) >= floor and time.perf_counter() - t0 > 2 * seconds:
                    break
            med = statistics.median(times)
            res.update(iters=len(times), secs=med, gbps=size * descs / med / 1e9)
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
        if h is not None:
            try:
                agent.release_xfer_handle(h)
            except Exception:
                pass
        out.append(res)
        if "error" in res and "ERR" in res["error"]:
            break  # the peer is gone: the rest would fail the same way
    return out


COMMANDS = dict(cmd_bench=cmd_bench)


# ---------------------------------------------------------------------------------------------
# In the driving process


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def fmt_size(n):
    for unit, m in (("G", 1 << 30), ("M", MiB), ("K", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def cuda_probe(env):
    """(device count, why not) through torch in a child process."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return 0, "torch is not installed"
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            env=env, capture_output=True, text=True, timeout=180,
        )
        n = int(out.stdout.split()[-1]) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        n = 0
    return n, None if n else "torch sees no CUDA device"


PROTO = re.compile(r"\|\s*(ucp_context_\d+ .*?)\s*\|\s*$")
OPLINE = re.compile(r"\|\s*(remote memory (?:write|read) by [^|]*?)\s*\|")
ROW = re.compile(r"\|\s*[\d.]+(?:\.\.[\d.a-z]+)?\s*\|\s*[^|]*\|\s*(.*?)\s*\|\s*$")


def ucx_transports(log):
    """What UCX used for remote memory access between the two agents, from UCX_PROTO_INFO's
    tables (the tables of each agent's own 'self' endpoint left out): {operation: [configs]}."""
    found, ctx, op = {}, "", None
    for line in log.splitlines():
        m = PROTO.search(line)
        if m:
            ctx, op = m.group(1), None
            continue
        m = OPLINE.search(line)
        if m:
            op = m.group(1) if " self " not in f" {ctx} " else None
            continue
        m = ROW.search(line)
        if m and op and not line.rstrip().endswith("Config |"):
            cfg = m.group(1)
            if cfg and cfg != "Config":
                lst = found.setdefault(op, [])
                if cfg not in lst:
                    lst.append(cfg)
    return found


def run_group(args, backend, mem, transport, pdir, cells, gpus):
    """One backend on one memory and transport: start target and initiator, run the cells.
    Returns (results keyed by (op, size, descs) and 'many', notes, skip reason or None)."""
    env = P.base_env(pdir)
    # NIXL_COMPARE_ENV_<BACKEND>: "KEY=VALUE ..." for that backend's processes only
    # (LD_LIBRARY_PATH is put first, the rest replace): the LIBFABRIC plugin needs a libfabric
    # 2.x whose soname is the system 1.x's, so it cannot share a process with FABRIC.
    for word in os.environ.get(f"NIXL_COMPARE_ENV_{backend}", "").split():
        key, _, value = word.partition("=")
        if key == "LD_LIBRARY_PATH":
            env[key] = ":".join(p for p in [value, env.get(key)] if p)
        elif key:
            env[key] = value
    env["NIXL_LOG_LEVEL"] = "INFO" if backend == "LIBFABRIC" else env.get("NIXL_LOG_LEVEL", "WARN")
    if backend == "UCX":
        env["UCX_PROTO_INFO"] = "y"
    sizes = [c[1] * c[2] for c in cells] + [MANY * MANY_SIZE]
    region = max(MANY * MANY_SIZE, min(REGION_CAP, max(sizes)))
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
    peers = []
    notes = []
    try:
        try:
            t = P.Peer("target", env, script=__file__, args=["--worker"], log=logs[0])
            peers.append(t)
            i = P.Peer("initiator", env, script=__file__, args=["--worker"], log=logs[1])
            peers.append(i)
            extra = args.backend_params.get(backend, {})
            ti = t.call("setup", "target", backend, transport, sizes=[region], mem=mem, dev=gpus[1],
                        params=extra, limit=300)
            ii = i.call("setup", "initiator", backend, transport, sizes=[region], mem=mem, dev=gpus[0],
                        params=extra, limit=300)
            i.call("load_remote", ti)
        except Exception as e:
            why = str(e).strip().splitlines()[-1]
            if "; dlopen: " in why:
                why = "the plugin does not load: " + why.split("; dlopen: ", 1)[1]
            return {}, notes, why[:300]
        if backend == "FABRIC":
            notes.append(f"FABRIC params after creation: {ii['params']}")
        per_cell = 2 * args.seconds + 30
        res = {}
        try:
            out = i.call("bench", "target", cells, args.seconds, args.min_iter, args.max_iter,
                         limit=per_cell * len(cells) + 120)
            res.update({(r["op"], r["size"], r["descs"]): r for r in out})
            # The region holds 10,000 distinct 4 KiB slots: once laid out alike at both ends
            # (descriptor k at slot k on both sides: a backend may merge them), once with the
            # target's slots in a shuffled order (nothing to merge).
            out = i.call("bench", "target", [("WRITE", MANY_SIZE, MANY), ("WRITE", MANY_SIZE, MANY, "shuffled")],
                         args.seconds, args.min_iter, args.max_iter, limit=2 * per_cell + 120)
            res["many"], res["many_shuffled"] = out[0], out[1]
        except Exception as e:
            return res, notes, str(e).strip().splitlines()[-1][:300]
        return res, notes, None
    finally:
        for p in peers:
            p.close()
        logs[1].seek(0)
        text = logs[1].read()
        if backend == "UCX":
            used = ucx_transports(text)
            if used:
                for op, cfgs in used.items():
                    notes.append(f"UCX {op}: {'; '.join(cfgs)}")
            else:
                notes.append("UCX transports: no UCX_PROTO_INFO table in the initiator's log")
        if backend == "LIBFABRIC":
            prov = sorted({ln.strip()[-160:] for ln in text.splitlines() if re.search(r"provider", ln, re.I)})
            notes.append("LIBFABRIC provider lines: " + (" | ".join(prov[:4]) if prov else "none logged"))
        for f in logs:
            f.close()


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="FABRIC,UCX,LIBFABRIC")
    ap.add_argument("--mem", default="DRAM,VRAM")
    ap.add_argument("--transports", default=None, help="tcp,shm,cuda_ipc (default: tcp,shm for DRAM; cuda_ipc for VRAM)")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M", help="bytes per descriptor")
    ap.add_argument("--descs", default="1,64", help="descriptors per request")
    ap.add_argument("--seconds", type=float, default=0.5, help="target time per cell")
    ap.add_argument("--min-iter", type=int, default=3)
    ap.add_argument("--max-iter", type=int, default=500)
    ap.add_argument("--gpus", default=None, help="initiator,target GPU (default 0,1 with two GPUs, else 0,0)")
    ap.add_argument("--param", action="append", default=[], metavar="BACKEND:KEY=VALUE",
                    help="a backend param, e.g. FABRIC:mode=busy_poll (repeatable)")
    ap.add_argument("--quick", action="store_true", help="CI smoke: sizes 64K,1M, 1 and 64 descriptors, ~0.05 s a cell")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.seconds, args.min_iter, args.max_iter = "64K,1M", 0.05, 2, 20
    args.backend_params = {}
    for p in args.param:
        b, _, kv = p.partition(":")
        k, _, v = kv.partition("=")
        args.backend_params.setdefault(b, {})[k] = v
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    mems = [m.strip() for m in args.mem.split(",") if m.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    descs = [int(d) for d in args.descs.split(",")]
    cells = [(op, s, d) for op in ops for s in sizes for d in descs]

    if P.find_nixl()[0] is None:
        print("skipped: no NIXL Python package (nixl-cu13) in this Python:", sys.executable)
        return 0
    pdir, missing = P.plugin_dir(backends)
    env0 = P.base_env(pdir)
    ngpu, nogpu = cuda_probe(env0) if "VRAM" in mems else (0, None)
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else ([0, 1] if ngpu > 1 else [0, 0])

    groups = []
    for mem in mems:
        ts = args.transports.split(",") if args.transports else (["cuda_ipc"] if mem == "VRAM" else ["tcp", "shm"])
        for t in ts:
            t = t.strip()
            if t == "cuda_ipc" and mem != "VRAM":
                continue
            groups.append((mem, t))

    rows = []
    cols = backends + [f"FABRIC/{b}" for b in backends if b != "FABRIC" and "FABRIC" in backends]
    head = f"{'mem':4} {'transport':9} {'op':5} {'size':>5} {'descs':>5} | " + " ".join(f"{c:>13}" for c in cols)
    print(f"GB/s (1e9 bytes/s, median of each cell's posts); ratios > 1: FABRIC moves more. Python {sys.version.split()[0]}, NIXL module {P.find_nixl()[0]}")
    for mem, transport in groups:
        results, skip = {}, {}
        for b in backends:
            if b in missing:
                skip[b] = missing[b]
                continue
            if mem == "VRAM" and nogpu:
                skip[b] = f"VRAM: {nogpu}"
                continue
            t0 = time.monotonic()
            res, notes, why = run_group(args, b, mem, transport, pdir, cells, gpus)
            results[b] = res
            if why:
                skip[b] = why
            for n in notes:
                print(f"# {mem} {transport}: {n}")
            print(f"# {mem} {transport}: {b} took {time.monotonic() - t0:.1f} s", flush=True)
        print(head)
        keys = [(c, f"{c[0]:5} {fmt_size(c[1]):>5} {c[2]:>5}") for c in cells] + [
            ("many", f"{'WRITE':5} {'4K':>5} {MANY:>5}"),
            ("many_shuffled", f"{'WRITE':5} {'4K':>5} {MANY:>5} shuffled"),
        ]
        for key, label in keys:
            vals, line = {}, []
            for b in backends:
                r = results.get(b, {}).get(key)
                if r and "gbps" in r:
                    vals[b] = r["gbps"]
                    cell = f"{r['gbps']:.3f}"
                else:
                    cell = "-"
                line.append(f"{cell:>13}")
            for c in cols[len(backends):]:
                line.append(f"{ratio(vals.get('FABRIC'), vals.get(c.split('/')[1])):>13}")
            print(f"{mem:4} {transport:9} {label} | " + " ".join(line))
            if key in ("many", "many_shuffled"):
                ms = [f"{b} {results[b][key]['secs'] * 1e3:.1f} ms" for b in backends if b in vals]
                if ms:
                    print(f"    time from transfer() to DONE: {', '.join(ms)}")
            # One line per reason: backends that share it (VRAM without a GPU) are named together.
            whys = {}
            for b in backends:
                r = results.get(b, {}).get(key)
                if b in skip and not (r and "gbps" in r):
                    whys.setdefault(skip[b], []).append(b)
                elif r and "error" in r:
                    whys.setdefault(r["error"], []).append(b)
            for why, bs in whys.items():
                print(f"    skipped: {', '.join(bs)}: {why}")
            many = key in ("many", "many_shuffled")
            rows.append(dict(mem=mem, transport=transport, op="WRITE" if many else key[0],
                             size=MANY_SIZE if many else key[1], descs=MANY if many else key[2],
                             many=key if many else False, gbps={b: vals.get(b) for b in backends},
                             secs={b: (results.get(b, {}).get(key) or {}).get("secs") for b in backends}))
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backends=backends, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        P.serve(int(sys.argv[2]), {**vars(P), **COMMANDS})
    sys.exit(main())
