"""Rendezvous through what a PyTorch job already has: a ``torch.distributed`` store
(``TCPStore``, ``FileStore``, the default group's ``c10d`` store) or an initialized process
group. No separate rendezvous service, no descriptors passed by hand.

    import torch.distributed as dist, fabric_rdma
    from fabric_rdma.bootstrap import connect

    dist.init_process_group("nccl")                      # or gloo; or pass store=...
    engine = fabric_rdma.Engine("tcp")
    kv = engine.register(kv_cache)                       # this rank's region
    remotes = connect(engine, [kv])                      # remotes[r][0]: rank r's kv
    engine.write_imm(src, 0, remotes[peer][0], 0, n, 7).wait()

Every rank calls ``connect`` with the same number of regions; the result, for each rank,
is the list of its regions as ``RemoteRegion``s of this engine (``None`` for this rank's
own entry). The peers are added on the way (``Engine.remote_region``).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["store_all_gather", "all_gather", "connect"]


def store_all_gather(store: Any, key: str, value: bytes, rank: int, world_size: int) -> list[bytes]:
    """Every rank's ``value`` under ``key``, in rank order, through a store: any object with
    ``set(key, bytes)`` and a ``get(key)`` that waits for the key (``torch.distributed.Store``
    does, up to the store's timeout). Use a fresh ``key`` per exchange."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size}")
    store.set(f"{key}/{rank}", bytes(value))
    return [bytes(value) if r == rank else bytes(store.get(f"{key}/{r}")) for r in range(world_size)]


def all_gather(value: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``value``, in rank order, through an initialized ``torch.distributed``
    process group (``all_gather_object``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group, or pass a store")
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, bytes(value), group=group)
    return [bytes(v) for v in out]


def _pack(items: Sequence[bytes]) -> bytes:
    return b"".join(len(i).to_bytes(4, "little") + i for i in items)


def _unpack(blob: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(blob):
        if at + 4 > len(blob):
            raise ValueError("a truncated descriptor list")
        n = int.from_bytes(blob[at : at + 4], "little")
        at += 4
        if at + n > len(blob):
            raise ValueError("a truncated descriptor list")
        out.append(blob[at : at + n])
        at += n
    return out


def connect(
    engine: Any,
    regions: Sequence[Any],
    *,
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    key: str = "fabric_rdma",
    group: Any = None,
    timeout: float = 60.0,
) -> list[list[Any] | None]:
    """Exchanges every rank's region descriptors and returns them as ``RemoteRegion``s of
    ``engine``: ``result[r][i]`` is rank ``r``'s ``regions[i]`` (``result[rank]`` is None).

    With ``store`` (and ``rank``, ``world_size``), through it; else through the initialized
    ``torch.distributed`` group (``group``: the default one). Each rank must pass the same
    number of regions. Blocks until every remote region is ready (``timeout`` seconds each).
    """
    mine = _pack([r.descriptor for r in regions])
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("with a store, pass rank and world_size too")
        everyone = store_all_gather(store, key, mine, rank, world_size)
    else:
        import torch.distributed as dist

        everyone = all_gather(mine, group)
        rank = dist.get_rank(group)
    out: list[list[Any] | None] = []
    for r, blob in enumerate(everyone):
        if r == rank:
            out.append(None)
            continue
        descs = _unpack(blob)
        if len(descs) != len(regions):
            raise ValueError(f"rank {r} published {len(descs)} regions, this rank {len(regions)}")
        out.append([engine.remote_region(d).wait(timeout=timeout) for d in descs])
    return out
