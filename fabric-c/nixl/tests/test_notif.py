"""Notifications: standalone (send_notif) and attached to a WRITE (notif_msg), each delivered
exactly once, and a WRITE's notification seen only once its bytes are there."""

from collections import Counter

import numpy as np

import nixl_peer as P
from conftest import MiB, SIZES


def payloads(n, seed):
    """n distinct payloads: a counter, then 0-200 random bytes (NUL bytes included)."""
    rng = np.random.default_rng(seed)
    return [b"n%04d:" % k + rng.bytes(int(rng.integers(0, 200))) for k in range(n)]


def assert_exactly_once(got, sender, msgs):
    senders = {a for a, _ in got}
    assert senders <= {sender}, f"notifications from {senders}, expected {sender}"
    c = Counter(m for _, m in got)
    want = set(msgs)
    lost = [m[:8] for m in msgs if c[m] == 0]
    dup = [m[:8] for m in msgs if c[m] > 1]
    extra = [m[:8] for m in c if m not in want]
    assert not lost and not dup and not extra, f"lost {lost[:5]}, duplicated {dup[:5]}, unexpected {extra[:5]}"


def test_standalone_notifs(pair):
    """200 send_notif with distinct payloads one way, then 200 the other way."""
    pair.drain()
    msgs = payloads(200, 1)
    pair.init.call("send_notifs", "target", msgs)
    n = pair.target.call("collect_notifs", len(msgs), timeout=10.0, quiet=0.5)
    assert_exactly_once(n["msgs"], "initiator", msgs)
    print(f"200 notifications arrived within {n['secs']:.3f} s, in order: {[m for _, m in n['msgs']] == msgs}")
    # The other way: the target needs the initiator's metadata first.
    assert pair.target.call("load_remote", pair.i) == "initiator"
    back = payloads(200, 2)
    pair.target.call("send_notifs", "initiator", back)
    n = pair.init.call("collect_notifs", len(back), timeout=10.0, quiet=0.5)
    assert_exactly_once(n["msgs"], "target", back)


def test_notif_sizes(pair):
    """Payloads of 1 byte to 64 KiB, all bytes values."""
    pair.drain()
    msgs = [b"#%d:" % k + bytes(range(256)) * (k // 256) + bytes(k % 256) for k in (0, 1, 255, 4096, 65536)]
    refused = {}
    for m in msgs:
        try:
            pair.init.call("send_notifs", "target", [m])
        except P.PeerError as e:
            refused[len(m)] = str(e).strip().splitlines()[-1]
    n = pair.target.call("collect_notifs", len(msgs) - len(refused), timeout=10.0)
    assert not refused, f"send_notif refused payloads of these sizes: {refused}"
    assert_exactly_once(n["msgs"], "initiator", msgs)


def test_write_notifs_after_bytes(pair):
    """50 WRITE requests in flight at once, each with its own notif_msg; the target checks
    the request's bytes the moment its notification shows up."""
    pair.drain()
    iseed, tseed = 71, 72
    pair.fill(iseed, tseed)
    rows = P.random_rows(np.random.default_rng(50), 50, SIZES, SIZES, dst_regs=[0])
    msgs = [b"w%03d" % k for k in range(len(rows))]
    verify = {m: (rows[k : k + 1][:, [2, 3, 0, 1, 4]], tseed, iseed, pair.i["sizes"]) for k, m in enumerate(msgs)}
    pair.target.start("collect_notifs", len(msgs), 20.0, 0.5, verify)
    states = pair.init.call("xfer_batch", "WRITE", "target", [(rows[k : k + 1], m) for k, m in enumerate(msgs)])
    n = pair.target.wait(60.0)
    assert states == ["DONE"] * len(msgs), states
    assert_exactly_once(n["msgs"], "initiator", msgs)
    late = {m: b for m, b in n["bad"].items() if b}
    assert not late, f"notification seen before its bytes: {late}"
    print(f"{len(rows)} WRITEs, {int(rows[:, 4].sum()) / MiB:.1f} MiB, all notified after their bytes")


def test_notif_at_post_and_repost(pair):
    """notif_msg given at initialize_xfer is sent again by each post that names none;
    transfer(h, msg) replaces it from then on."""
    pair.drain()
    pair.fill(81, 82)
    rows = P.random_rows(np.random.default_rng(3), 8, SIZES, SIZES)
    r = pair.init.call("xfer", "WRITE", "target", rows, notif=b"created", post_notif=[b"", b"", b"post-2", b""], posts=4)
    assert r["state"] == "DONE", r
    n = pair.target.call("collect_notifs", 4, timeout=10.0, quiet=0.5)
    got = Counter(m for _, m in n["msgs"])
    assert got == Counter({b"created": 2, b"post-2": 2}), got
