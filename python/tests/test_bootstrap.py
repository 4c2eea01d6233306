"""Rendezvous through a torch.distributed-style store (fabric_rdma.bootstrap): real
transfers between processes that met through it, every byte checked."""

import multiprocessing

import numpy as np
import pytest

import fabric_rdma
from fabric_rdma.bootstrap import _pack, _unpack, store_all_gather
from peers import DictStore, store_rank


def test_three_ranks_meet_through_a_store_and_write_to_each_other(provider, spawn):
    manager = multiprocessing.get_context("spawn").Manager()
    try:
        store = DictStore(manager.dict())
        world = 3
        ranks = [spawn(store_rank, provider, store, r, world) for r in range(world)]
        assert [p.recv(timeout=45) for p in ranks] == [True] * world
        for p in ranks:
            p.send("done")
    finally:
        manager.shutdown()


def test_store_all_gather_and_its_errors():
    store = DictStore({})
    store.set("k/1", b"one")
    assert store_all_gather(store, "k", b"zero", 0, 2) == [b"zero", b"one"]
    with pytest.raises(ValueError):
        store_all_gather(store, "k", b"x", 2, 2)
    assert _unpack(_pack([b"", b"ab", bytes(300)])) == [b"", b"ab", bytes(300)]
    with pytest.raises(ValueError, match="truncated"):
        _unpack(_pack([b"abc"])[:-1])


def test_torch_tcpstore_rendezvous(provider):
    torch = pytest.importorskip("torch")
    from datetime import timedelta

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tcp_store = torch.distributed.TCPStore
    store = tcp_store("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    other = tcp_store("127.0.0.1", port, 2, False, timedelta(seconds=30))
    a, b = fabric_rdma.Engine(provider), fabric_rdma.Engine(provider)
    try:
        from fabric_rdma.bootstrap import connect
        import threading

        ma, mb = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
        ra, rb = a.register(ma), b.register(mb)
        got = {}
        t = threading.Thread(target=lambda: got.update(b=connect(b, [rb], store=other, rank=1, world_size=2)))
        t.start()
        got["a"] = connect(a, [ra], store=store, rank=0, world_size=2)
        t.join(30)
        src = a.register(np.full(4096, 9, dtype=np.uint8))
        a.write_imm(src, 0, got["a"][1][0], 0, 4096, 4).wait(timeout=20)
        b.imm_counter(4).wait_for(1).wait(timeout=20)
        assert (mb == 9).all() and got["b"][0] is not None and got["b"][1] is None
    finally:
        a.shutdown()
        b.shutdown()
