"""Registration cost from Python: fabric's ``Engine.register`` beside NIXL's ``register_memory``
of the same memory, in the same run.

Rows (host memory; ``--device cuda`` uses torch CUDA tensors for the last two):

- **views**: ``--views`` (10,000) slices of ``--view-kib`` (200) KiB each of one allocation
  that is registered first. For fabric each is a view of that registration (a range lookup);
  NIXL registers each slice (``register_memory`` of the slice).
- **model**: ``--params`` (1,000) separate tensors of ``--param-kib`` (64) KiB each, as a
  model's parameters, registered one by one (each needs the NIC: separate allocations).
- **per tensor**: the model row's time per tensor, the figure NIXL's issue trackers quote.

Each figure is the median of ``--rounds`` (3) rounds; every registration of a round is
released before the next. The ratio is fabric / NIXL (below 1.0: fabric is faster).

    python python/bench/register.py --provider shm
    python python/bench/register.py --provider tcp --device cuda

NIXL comes from the nixl-cu13 wheel (``nixl_cu13``) or ``nixl`` on PYTHONPATH; without it
fabric's rows print alone. Build the extension in release for meaningful figures.
"""

import argparse
import gc
import statistics
import time

import numpy as np

import fabric_rdma

KIB = 1 << 10


def import_nixl():
    for mod in ("nixl_cu13", "nixl"):
        try:
            api = __import__(f"{mod}._api", fromlist=["nixl_agent", "nixl_agent_config"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError:
            continue
    return None


def tensors(args, n, kib, device):
    """n separate allocations of kib KiB (numpy, or torch on a CUDA device)."""
    if device == "host":
        return [np.ones(kib * KIB, dtype=np.uint8) for _ in range(n)]
    import torch

    return [torch.ones(kib * KIB, dtype=torch.uint8, device=device) for _ in range(n)]


def pool_and_views(args, device):
    n, kib = args.views, args.view_kib
    if device == "host":
        pool = np.ones(n * kib * KIB, dtype=np.uint8)
        return pool, [pool[i * kib * KIB : (i + 1) * kib * KIB] for i in range(n)]
    import torch

    pool = torch.ones(n * kib * KIB, dtype=torch.uint8, device=device)
    return pool, [pool[i * kib * KIB : (i + 1) * kib * KIB] for i in range(n)]


def nixl_register(agent, obj, device):
    """NIXL's register_memory of one array (host: its address range) or torch tensor."""
    if device == "host":
        return agent.register_memory([(obj.ctypes.data, obj.nbytes, 0, "")], "DRAM")
    return agent.register_memory(obj)


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fabric_rows(args, engine, device):
    views, model = [], []
    for _ in range(args.rounds):
        pool, slices = pool_and_views(args, device)
        whole = engine.register(pool)
        got = []
        views.append(timed(lambda: got.extend(engine.register(s) for s in slices)))
        assert all(r.is_view for r in got) or device != "host"
        del got, whole
        params = tensors(args, args.params, args.param_kib, device)
        regs = []
        model.append(timed(lambda: regs.extend(engine.register(p) for p in params)))
        del regs, params, pool, slices
        gc.collect()
    return statistics.median(views), statistics.median(model)


def nixl_rows(args, device):
    found = import_nixl()
    if found is None:
        return None
    nixl_agent, nixl_agent_config = found
    agent = nixl_agent("register-bench", nixl_agent_config(backends=["UCX"]))
    views, model = [], []
    for _ in range(args.rounds):
        pool, slices = pool_and_views(args, device)
        whole = nixl_register(agent, pool, device)
        descs = []
        views.append(timed(lambda: descs.extend(nixl_register(agent, s, device) for s in slices)))
        for d in descs:
            agent.deregister_memory(d)
        agent.deregister_memory(whole)
        params = tensors(args, args.params, args.param_kib, device)
        descs = []
        model.append(timed(lambda: descs.extend(nixl_register(agent, p, device) for p in params)))
        for d in descs:
            agent.deregister_memory(d)
        del params, pool, slices
        gc.collect()
    return statistics.median(views), statistics.median(model)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--device", default="host", help="host, or cuda:N for torch tensors")
    ap.add_argument("--views", type=int, default=10_000)
    ap.add_argument("--view-kib", type=int, default=200)
    ap.add_argument("--params", type=int, default=1_000)
    ap.add_argument("--param-kib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = fabric_rdma.Engine(args.provider)
    f = fabric_rows(args, engine, args.device)
    n = nixl_rows(args, args.device)
    print(f"registration, {args.device}, fabric on {engine.transport}" + (", NIXL UCX beside it" if n else ", NIXL not found"))
    print(f"| row | fabric | NIXL | fabric / NIXL |\n|---|---:|---:|---:|")
    rows = [
        (f"{args.views} views of one registration, per view", f[0] / args.views, n and n[0] / args.views),
        (f"{args.params}-tensor model in place, total", f[1], n and n[1]),
        ("per tensor of the model", f[1] / args.params, n and n[1] / args.params),
    ]
    for name, ours, theirs in rows:
        unit, scale = ("ms", 1e3) if "total" in name else ("us", 1e6)
        t = f"{theirs * scale:.2f} {unit}" if theirs else "-"
        r = f"{ours / theirs:.2f}x" if theirs else "-"
        print(f"| {name} | {ours * scale:.2f} {unit} | {t} | {r} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
