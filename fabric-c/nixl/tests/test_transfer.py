"""WRITE and READ of host memory between two processes, every byte checked; requests of many
descriptors; transfers inside one agent; agents made and torn down again."""

import numpy as np
import pytest

import nixl_peer as P
from conftest import MiB, SIZES


def move_and_check(pair, op, rows, iseed, tseed, **kw):
    """Fill both sides, move rows (src_reg, src_off, dst_reg, dst_off, len) with `op` (WRITE:
    initiator -> target, READ: target -> initiator), then check every byte of every region
    on the receiving side. Returns the xfer result."""
    pair.fill(iseed, tseed)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    r = pair.init.call("xfer", op, "target", P.as_local_remote(op, rows), **kw)
    assert r["state"] == "DONE", r
    dst_view = rows[:, [2, 3, 0, 1, 4]]  # (my_reg, my_off, peer_reg, peer_off, len)
    if op == "WRITE":
        c = pair.target.call("check", dst_view, tseed, iseed, pair.i["sizes"], regions=list(range(len(SIZES))))
    else:
        c = pair.init.call("check", dst_view, iseed, tseed, pair.t["sizes"], regions=list(range(len(SIZES))))
    assert c["bad"] == 0, f"{c['bad']} bytes differ, first at (region, offset) {c['first']}"
    return r


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("size", [1, 4097, MiB + 3, 16 * MiB])
def test_one_descriptor(pair, op, size):
    big = SIZES[0]
    src_off = (big - size) // 3
    dst_off = (big - size) // 2
    move_and_check(pair, op, [(0, src_off, 0, dst_off, size)], 11 + size % 7, 23)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("n", [1, 64, 1000, 10_000])
def test_many_descriptors(pair, op, n):
    rng = np.random.default_rng(n)
    rows = P.random_rows(rng, n, SIZES, SIZES)
    r = move_and_check(pair, op, rows, 31, 47, timeout=60.0)
    print(f"{op} of {n} descriptors ({int(rows[:, 4].sum())} bytes): {r['secs'][0] * 1e3:.1f} ms")


def test_repost(pair):
    """One request posted three times (NIXL allows a repost once a request is DONE)."""
    rows = P.random_rows(np.random.default_rng(5), 64, SIZES, SIZES)
    r = move_and_check(pair, "WRITE", rows, 3, 4, posts=3)
    assert len(r["secs"]) == 3


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_local(pair, op):
    """A transfer inside one agent (remote agent = its own name; NIXL makes the target side
    with the backend's loadLocalMD at registration and calls connect(own name) when the
    backend is made). UCX: DONE, every byte right, and a WRITE's notification comes back to
    the agent itself under its own name."""
    init = pair.init
    sizes = pair.i["sizes"]
    rows = P.random_rows(np.random.default_rng(9), 64, sizes, sizes, src_regs=[0, 1], dst_regs=[2, 3])
    init.call("fill", 61)
    notif = b"local-write" if op == "WRITE" else b""
    r = init.call("xfer", op, "initiator", P.as_local_remote(op, rows), notif=notif)
    assert r["state"] == "DONE", r
    c = init.call("check", rows[:, [2, 3, 0, 1, 4]], 61, 61, sizes, regions=[0, 1, 2, 3])
    assert c["bad"] == 0, c
    if notif:
        n = init.call("collect_notifs", 1, timeout=5.0)
        assert n["msgs"] == [("initiator", notif)], n


def test_rounds_in_process(peers, spec):
    """Five rounds, in one process, of: two agents made, a backend each, memory registered,
    metadata swapped, a WRITE with a notification and a READ back, deregistered, deleted."""
    p = peers.start("rounds")
    out = p.call("rounds_in_process", spec[0], spec[1], rounds=5, limit=300.0)
    for k, r in enumerate(out):
        assert r["states"] == {"WRITE": "DONE", "READ": "DONE"}, (k, r)
        assert r["ok"], (k, r)
        assert r["notifs"] == [("round-a", b"round-w")], (k, r)
    print("round seconds:", " ".join(f"{r['secs']:.3f}" for r in out))


def test_rounds_against_peer(peers, spec):
    """Five incarnations of the initiator (same name, a new agent each time, the previous one
    torn down) against one target, which forgets and reloads it each round: a WRITE with a
    notification one way, a notification the other way, exactly once each."""
    backend, transport = spec
    sizes = [4 * MiB, 1 * MiB]
    target = peers.start("target")
    init = peers.start("initiator")
    t = target.call("setup", "target", backend, transport, sizes=sizes)
    for k in range(5):
        i = init.call("setup", "initiator", backend, transport, sizes=sizes)
        assert init.call("load_remote", t) == "target"
        assert target.call("load_remote", i) == "initiator"
        init.call("fill", 200 + k)
        target.call("fill", 300 + k)
        rows = P.random_rows(np.random.default_rng(k), 64, sizes, sizes)
        msg = b"round-%d" % k
        target.start("collect_notifs", 1, 10.0, 0.3, {msg: (rows[:, [2, 3, 0, 1, 4]], 300 + k, 200 + k, sizes)})
        r = init.call("xfer", "WRITE", "target", rows, notif=msg)
        n = target.wait(30.0)
        assert r["state"] == "DONE", (k, r)
        assert n["msgs"] == [("initiator", msg)] and n["bad"] == {msg: 0}, (k, n)
        c = target.call("check", rows[:, [2, 3, 0, 1, 4]], 300 + k, 200 + k, sizes, regions=[0, 1])
        assert c["bad"] == 0, (k, c)
        target.call("send_notifs", "initiator", [b"back-%d" % k])
        n = init.call("collect_notifs", 1, timeout=10.0)
        assert n["msgs"] == [("target", b"back-%d" % k)], (k, n)
    assert init.call("teardown") == []
    assert target.call("teardown") == []
