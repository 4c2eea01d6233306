"""GPU memory (torch CUDA tensors registered as VRAM): skipped, with the reason, where torch or
a CUDA device is missing. The target's tensors are on GPU 1 when there are two, else GPU 0."""

import numpy as np
import pytest

import nixl_peer as P
from conftest import MiB, Pair, Peers

SIZES = [8 * MiB, MiB + 5]
ALL = list(range(len(SIZES)))


@pytest.fixture(scope="module")
def vram_pair(env, spec, cuda_devices):
    """pair(imem, tmem): a Pair with those memories, made once per module (CUDA contexts and
    torch imports are slow to make)."""
    ps, made = Peers(env), {}

    def get(imem, tmem):
        if (imem, tmem) not in made:
            made[imem, tmem] = Pair(ps, spec, sizes=SIZES, imem=imem, tmem=tmem, idev=0,
                                    tdev=1 if cuda_devices > 1 else 0)
        return made[imem, tmem]

    try:
        yield get
    finally:
        ps.close()


@pytest.mark.parametrize("mems", [("VRAM", "VRAM"), ("DRAM", "VRAM"), ("VRAM", "DRAM")], ids=lambda m: "%s-%s" % m)
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_vram_transfer(vram_pair, op, mems):
    """One whole-region request, then one of 64 random descriptors; initiator memory
    mems[0], target memory mems[1]; every byte of the receiving side checked."""
    pair = vram_pair(*mems)
    whole = np.array([(0, 0, 0, 0, SIZES[0])])
    rand = P.random_rows(np.random.default_rng(7), 64, SIZES, SIZES)
    for k, rows in enumerate((whole, rand)):
        iseed, tseed = 10 + k, 20 + k
        pair.fill(iseed, tseed)
        r = pair.init.call("xfer", op, "target", P.as_local_remote(op, rows), timeout=60.0)
        assert r["state"] == "DONE", r
        view = rows[:, [2, 3, 0, 1, 4]]
        if op == "WRITE":
            c = pair.target.call("check", view, tseed, iseed, SIZES, regions=ALL)
        else:
            c = pair.init.call("check", view, iseed, tseed, SIZES, regions=ALL)
        assert c["bad"] == 0, c


def test_vram_write_notif(vram_pair):
    """VRAM -> VRAM WRITEs with notifications: each seen once, after its bytes."""
    pair = vram_pair("VRAM", "VRAM")
    pair.drain()
    pair.fill(31, 32)
    rows = P.random_rows(np.random.default_rng(8), 16, SIZES, SIZES, dst_regs=[0])
    msgs = [b"v%02d" % k for k in range(len(rows))]
    verify = {m: (rows[k : k + 1][:, [2, 3, 0, 1, 4]], 32, 31, SIZES) for k, m in enumerate(msgs)}
    pair.target.start("collect_notifs", len(msgs), 30.0, 0.5, verify)
    states = pair.init.call("xfer_batch", "WRITE", "target", [(rows[k : k + 1], m) for k, m in enumerate(msgs)])
    n = pair.target.wait(90.0)
    assert states == ["DONE"] * len(msgs), states
    assert sorted(m for _, m in n["msgs"]) == msgs, n["msgs"]
    assert not any(n["bad"].values()), n["bad"]


def test_vram_local(peers, spec, cuda_devices):
    """VRAM -> VRAM inside one agent (loadLocalMD path)."""
    p = peers.start("local")
    info = p.call("setup", "local", spec[0], spec[1], sizes=SIZES * 2, mem="VRAM", env_mem="VRAM")
    sizes = info["sizes"]
    rows = P.random_rows(np.random.default_rng(4), 64, sizes, sizes, src_regs=[0, 1], dst_regs=[2, 3])
    p.call("fill", 41)
    r = p.call("xfer", "WRITE", "local", rows)
    assert r["state"] == "DONE", r
    c = p.call("check", rows[:, [2, 3, 0, 1, 4]], 41, 41, sizes, regions=[0, 1, 2, 3])
    assert c["bad"] == 0, c
