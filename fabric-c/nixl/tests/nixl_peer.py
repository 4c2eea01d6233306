"""Peer processes for the NIXL plugin tests: each NIXL agent lives in a process of its own,
started by `Peer` and driven by the test through a socket pair (pickled calls with a time
limit each). The test process itself never imports NIXL, so a crash in a backend fails one
test instead of the session.

    peer = Peer("target", env)                     # python nixl_peer.py FD, with that env
    info = peer.call("setup", "target", "UCX", "tcp", sizes=[1 << 20])
    peer.call("fill", seed=7)
    peer.close()                                   # or peer.kill() (SIGKILL)

The functions a peer runs are `cmd_*` below; every poll loop in them is bounded in time.

Plugin folder: NIXL lists only the plugins of $NIXL_PLUGIN_DIR when it is set, so
`plugin_dir` makes a temporary folder of symbolic links to the wheel's libplugin_UCX.so and
libplugin_LIBFABRIC.so and to our libplugin_FABRIC.so. The wheel's plugins find their
libraries through $ORIGIN, which a link moves, so the peers' environment puts the wheel's library
folders on LD_LIBRARY_PATH (`base_env`; it must be set before a process starts, one more
reason for processes).
"""

import gc
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection

import numpy as np

# Where the FABRIC plugin is built (fabric-c/nixl/build.sh); NIXL_FABRIC_PLUGIN overrides.
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FABRIC_PLUGIN = os.environ.get(
    "NIXL_FABRIC_PLUGIN", os.path.join(REPO, "target", "nixl-plugin", "libplugin_FABRIC.so")
)


# ---------------------------------------------------------------------------------------------
# Test-process side: where NIXL is, the plugin folder, the environment of a backend


def find_nixl():
    """(module name, [library folders]) of the installed NIXL wheel, found without importing
    it; (None, []) when there is none."""
    for mod in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            continue
        site = os.path.dirname(os.path.dirname(spec.origin))
        libs = [os.path.join(site, f".{mod}.mesonpy.libs"), os.path.join(site, f"{mod}.libs")]
        return mod, [d for d in libs if os.path.isdir(d)]
    return None, []


def wheel_plugin(name):
    """Path of the wheel's libplugin_<name>.so, or None."""
    _, libs = find_nixl()
    for d in libs:
        for sub in ("plugins", "nixl"):
            p = os.path.join(d, sub, f"libplugin_{name}.so")
            if os.path.exists(p):
                return p
    return None


def plugin_path(name):
    return FABRIC_PLUGIN if name == "FABRIC" else wheel_plugin(name)


def plugin_dir(names, root=None):
    """A temporary folder with a link to the plugin of each backend in `names` that exists;
    (folder, {name: why it is missing})."""
    d = tempfile.mkdtemp(prefix="nixl-plugins-", dir=root)
    missing = {}
    for n in names:
        p = plugin_path(n)
        if p and os.path.exists(p):
            os.symlink(p, os.path.join(d, f"libplugin_{n}.so"))
        else:
            missing[n] = f"{p or 'libplugin_' + n + '.so'} not found"
    return d, missing


def base_env(pdir):
    """The environment of every peer: the plugin folder, the wheel's libraries, loopback only."""
    _, libs = find_nixl()
    env = dict(os.environ)
    env["NIXL_PLUGIN_DIR"] = pdir
    env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env["FI_TCP_IFACE"] = "lo"
    env.setdefault("UCX_NET_DEVICES", "lo")
    # UCX's ib module pulls in the wheel's libnl-route, whose destructor segfaults at process
    # exit (seen with nixl-cu13 1.4.1); the tests need no ib.
    env.setdefault("UCX_MODULES", "^ib")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def backend_config(backend, transport, mem="DRAM"):
    """(environment additions, backend params) for `backend` on `transport` (tcp, shm,
    cuda_ipc) with memory `mem` (DRAM, VRAM)."""
    env, params = {}, {}
    if backend == "UCX":
        # shm = posix, sysv and cma; cuda_ipc needs a host transport for NIXL's notifications
        # (active messages) and cuda_copy for staging.
        tls = {"tcp": "tcp", "shm": "shm", "cuda_ipc": "cuda_ipc,cuda_copy,shm"}[transport]
        if mem == "VRAM" and transport == "tcp":
            tls += ",cuda_copy"
        elif mem == "VRAM" and transport == "shm":
            tls += ",cuda_ipc,cuda_copy"
        env["UCX_TLS"] = tls + ",self"
        if transport != "tcp":
            # shm/cma/cuda_ipc have no peer-failure handling: UCX refuses the endpoint with
            # the default error mode "peer" ("no peer failure handler").
            params["ucx_error_handling_mode"] = "none"
    elif backend == "FABRIC":
        params["provider"] = "shm" if transport == "cuda_ipc" else transport
        env["FI_TCP_IFACE"] = "lo"
    elif backend == "LIBFABRIC":
        env["FI_PROVIDER"] = "shm" if transport == "cuda_ipc" else transport
        # NIXL 1.4.1's LIBFABRIC backend does not come up on lo ("Unsupported address
        # format"): NIXL_LIBFABRIC_IFACE names an interface of a network namespace of the
        # caller's own (scripts/nixl-gpu-run.sh makes one with a dummy interface).
        env["FI_TCP_IFACE"] = os.environ.get("NIXL_LIBFABRIC_IFACE", "lo")
    return env, params


def parse_specs(s):
    """'FABRIC,UCX:shm' -> [('FABRIC', 'tcp'), ('UCX', 'shm')]"""
    out = []
    for item in s.split(","):
        item = item.strip()
        if item:
            b, _, t = item.partition(":")
            out.append((b.strip(), (t or "tcp").strip()))
    return out


class PeerError(RuntimeError):
    """A call raised in the peer; the message carries its traceback."""


class Peer:
    """One NIXL process; call() runs a command in it and waits a bounded time for the answer."""

    def __init__(self, label, env, start_timeout=60.0, script=None, args=(), log=None):
        """Start `script` (default: this file) with the socket's fd as its last argument;
        its stdout and stderr go to file object `log` if given."""
        self.label = label
        parent, child = socket.socketpair()
        script = os.path.abspath(script or __file__)
        self.proc = subprocess.Popen(
            [sys.executable, script, *args, str(child.fileno())],
            env=env,
            pass_fds=[child.fileno()],
            cwd=os.path.dirname(script),
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.pid = self.proc.pid
        try:
            self.call("ping", limit=start_timeout)
        except BaseException:
            self.close()
            raise

    def start(self, cmd, *args, **kw):
        self._cmd = cmd
        self.conn.send((cmd, args, kw))

    def wait(self, timeout=60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.label}: {self._cmd} gave no answer within {timeout:.0f} s")
        try:
            tag, val = self.conn.recv()
        except EOFError:
            rc = self.proc.poll()
            raise PeerError(f"{self.label}: process ended during {self._cmd} (rc {rc})") from None
        if tag == "err":
            raise PeerError(f"{self.label}: {self._cmd}: {val}")
        return val

    def call(self, cmd, *args, limit=None, **kw):
        """Run cmd_<cmd>(*args, **kw) in the peer; wait at most `limit` s (default: the
        command's own `timeout` argument plus 60 s)."""
        self.start(cmd, *args, **kw)
        return self.wait(limit if limit is not None else float(kw.get("timeout", 0.0)) + 60.0)

    def alive(self):
        return self.proc.poll() is None

    def kill(self, timeout=10.0):
        """SIGKILL; True when the process is gone within `timeout`."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self, timeout=10.0):
        if self.proc.poll() is None:
            try:
                self.conn.send(("exit", (), {}))
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.conn.close()


# ---------------------------------------------------------------------------------------------
# Data: seeded region contents and random descriptor sets (both processes compute them)


def pattern(seed, idx, n):
    """The contents of region `idx` filled with `seed`: n random bytes."""
    return np.frombuffer(np.random.default_rng([seed, idx]).bytes(n), dtype=np.uint8)


def random_rows(rng, n, src_sizes, dst_sizes, src_regs=None, dst_regs=None, max_len=None):
    """n descriptors (src_reg, src_off, dst_reg, dst_off, len) of random sizes and offsets:
    destination ranges never overlap (each lies in a slot of its region), sources may."""
    src_regs = list(range(len(src_sizes))) if src_regs is None else src_regs
    dst_regs = list(range(len(dst_sizes))) if dst_regs is None else dst_regs
    total = sum(dst_sizes[r] for r in dst_regs)
    # Slots per destination region, in proportion to its size (at least one each when n allows).
    per = [max(0, dst_sizes[r] * n // total) for r in dst_regs]
    i = 0
    while sum(per) < n:
        per[i % len(per)] += 1
        i += 1
    rows = []
    for r, k in zip(dst_regs, per):
        if k == 0:
            continue
        slot = dst_sizes[r] // k
        assert slot >= 1, f"region {r} of {dst_sizes[r]} bytes cannot hold {k} descriptors"
        for j in range(k):
            cap = min(slot, max_len or slot)
            ln = int(rng.integers(1, cap + 1))
            doff = j * slot + int(rng.integers(0, slot - ln + 1))
            s = src_regs[int(rng.integers(0, len(src_regs)))]
            ln = min(ln, src_sizes[s])
            soff = int(rng.integers(0, src_sizes[s] - ln + 1))
            rows.append((s, soff, r, doff, ln))
    perm = rng.permutation(len(rows))
    return np.array(rows, dtype=np.int64)[perm]


def as_local_remote(op, rows):
    """Rows (src..., dst...) -> rows (local_reg, local_off, remote_reg, remote_off, len) of
    the initiator: WRITE moves local -> remote, READ remote -> local."""
    rows = np.asarray(rows, dtype=np.int64)
    if op == "WRITE":
        return rows
    return rows[:, [2, 3, 0, 1, 4]]


# ---------------------------------------------------------------------------------------------
# Peer-process side


class _State:
    def __init__(self):
        self.nixl = None  # the nixl module (imported in the peer only)
        self.agent = self.name = self.backend = None
        self.mem, self.dev = "DRAM", 0
        self.regions = []  # numpy arrays or torch tensors
        self.reg_descs = []
        self.remotes = {}  # agent name -> dict(addrs, sizes, mem, dev)
        self.handles = []  # requests whose release failed, released again at teardown


S = _State()


def _import_nixl():
    if S.nixl is None:
        mod, _ = find_nixl()
        if mod is None:
            raise ImportError("no NIXL Python package (nixl_cu13, nixl_cu12 or nixl)")
        S.nixl = importlib.import_module(mod)
    return S.nixl


def _addr(t):
    return t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data


def _alloc(n, mem, dev):
    if mem == "VRAM":
        import torch

        return torch.zeros(n, dtype=torch.uint8, device=f"cuda:{dev}")
    return np.zeros(n, dtype=np.uint8)


def _host(t):
    """Region contents as a numpy array (a copy for GPU memory)."""
    if hasattr(t, "data_ptr"):
        import torch

        torch.cuda.synchronize()
        return t.cpu().numpy()
    return t


def _store(t, data):
    if hasattr(t, "data_ptr"):
        import torch

        t.copy_(torch.from_numpy(np.array(data)))  # a writable copy (from_numpy warns otherwise)
        torch.cuda.synchronize()
    else:
        t[:] = data


def cmd_ping():
    return os.getpid()


def cmd_setup(name, backend, transport="tcp", sizes=(1 << 20,), mem="DRAM", dev=0, params=None,
              env_mem=None):
    """A fresh agent `name` (the previous one torn down first) with `backend` only, and one
    registration per region size. `env_mem`: the memory the backend's environment is chosen
    for (default `mem`; VRAM when the peer's is). Returns what the other side needs: md,
    addrs, sizes, mem."""
    cmd_teardown()
    if "VRAM" in (mem, env_mem):
        # torch first: it loads libcudart, which UCX's cuda transports link but the wheel
        # does not carry; and a CUDA context exists before the backend looks for one.
        import torch

        torch.cuda.set_device(dev)
        torch.zeros(1, device=f"cuda:{dev}")
    nixl = _import_nixl()
    env, bparams = backend_config(backend, transport, env_mem or mem)
    os.environ.update(env)  # UCX reads UCX_TLS when its context is made
    bparams.update(params or {})
    cfg = nixl.nixl_agent_config(backends=[])
    agent = nixl.nixl_agent(name, cfg)
    if backend not in agent.get_plugin_list():
        raise RuntimeError(f"plugin {backend} not listed: {agent.get_plugin_list()}")
    try:
        agent.create_backend(backend, bparams)
    except Exception as e:
        raise RuntimeError(f"create_backend({backend!r}, {bparams}) failed: {_err(e)}{_dlerror(backend)}") from None
    S.agent, S.name, S.backend, S.mem, S.dev = agent, name, backend, mem, dev
    S.regions = [_alloc(int(n), mem, dev) for n in sizes]
    S.reg_descs = [
        agent.register_memory([(_addr(t), int(n), dev, "")], mem, backends=[backend])
        for t, n in zip(S.regions, sizes)
    ]
    return dict(
        name=name,
        md=agent.get_agent_metadata(),
        addrs=[_addr(t) for t in S.regions],
        sizes=[int(n) for n in sizes],
        mem=mem,
        dev=dev,
        pid=os.getpid(),
        params=agent.get_backend_params(backend),
        mems=agent.get_backend_mem_types(backend),
    )


def _dlerror(backend):
    """Why the plugin does not load, if it does not (NIXL logs that only at INFO level)."""
    import ctypes

    path = os.path.join(os.environ.get("NIXL_PLUGIN_DIR", ""), f"libplugin_{backend}.so")
    try:
        ctypes.CDLL(path)
    except OSError as e:
        return f"; dlopen: {e}"
    return ""


def cmd_teardown():
    """Release handles, deregister, forget remotes, delete the agent. Returns what failed."""
    errs = []
    if S.agent is None:
        return errs
    for h in S.handles:
        try:
            S.agent.release_xfer_handle(h)
        except Exception as e:
            errs.append(f"release: {type(e).__name__}: {e}")
    S.handles = []
    for r in S.reg_descs:
        try:
            S.agent.deregister_memory(r, backends=[S.backend])
        except Exception as e:
            errs.append(f"deregister: {type(e).__name__}: {e}")
    for n in list(S.remotes):
        if n == S.name:
            continue
        try:
            S.agent.remove_remote_agent(n)
        except Exception as e:
            errs.append(f"remove_remote_agent({n}): {type(e).__name__}: {e}")
    S.agent = None
    S.reg_descs, S.remotes = [], {}
    gc.collect()  # the agent's destructor runs here
    S.regions = []
    gc.collect()
    return errs


def cmd_fill(seed):
    for i, t in enumerate(S.regions):
        _store(t, pattern(seed, i, t.shape[0]))


def cmd_load_remote(info, replace=True):
    """add_remote_agent(info['md']); with `replace`, a known agent of that name is removed
    first (a new incarnation has new connection info). Returns the name NIXL reports."""
    name = info["name"]
    if replace and name in S.remotes:
        S.agent.remove_remote_agent(name)
        del S.remotes[name]
    got = S.agent.add_remote_agent(info["md"])
    got = got.decode() if isinstance(got, bytes) else got
    S.remotes[got] = dict(addrs=info["addrs"], sizes=info["sizes"], mem=info["mem"], dev=info["dev"])
    return got


def cmd_forget(name):
    S.agent.remove_remote_agent(name)
    S.remotes.pop(name, None)


def _peer(name):
    if name == S.name:
        return dict(addrs=[_addr(t) for t in S.regions], sizes=[t.shape[0] for t in S.regions],
                    mem=S.mem, dev=S.dev)
    return S.remotes[name]


def _descs(rows, peer):
    """(local, remote) nixlXferDLists for rows (lreg, loff, rreg, roff, len)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    p = _peer(peer)
    la = np.array([_addr(t) for t in S.regions], dtype=np.uint64)
    ra = np.array(p["addrs"], dtype=np.uint64)
    n = rows.shape[0]
    loc = np.empty((n, 3), dtype=np.uint64)
    rem = np.empty((n, 3), dtype=np.uint64)
    loc[:, 0] = la[rows[:, 0]] + rows[:, 1].astype(np.uint64)
    loc[:, 1] = rows[:, 4]
    loc[:, 2] = S.dev
    rem[:, 0] = ra[rows[:, 2]] + rows[:, 3].astype(np.uint64)
    rem[:, 1] = rows[:, 4]
    rem[:, 2] = p["dev"]
    return S.agent.get_xfer_descs(loc, S.mem), S.agent.get_xfer_descs(rem, p["mem"])


def _err(e):
    return f"{type(e).__name__}: {e}"


def _state(fn, *a):
    """fn(*a) as (state, error): a NIXL error raised is state 'ERR' with its text."""
    try:
        return fn(*a), None
    except Exception as e:
        return "ERR", _err(e)


def _wait(h, timeout):
    """Poll check_xfer_state until it leaves PROC or `timeout` s pass: (state, error, secs)."""
    t0 = time.monotonic()
    st, err = "PROC", None
    while time.monotonic() - t0 < timeout:
        st, err = _state(S.agent.check_xfer_state, h)
        if st != "PROC":
            break
    return st, err, time.monotonic() - t0


def cmd_xfer(op, peer, rows, notif=b"", post_notif=b"", timeout=20.0, posts=1, release=True):
    """One request of `rows` (lreg, loff, rreg, roff, len) to `peer`: initialize_xfer (with
    `notif` as notif_msg), then `posts` times transfer(h, post_notif) and poll until done
    (`post_notif` a list: one per post).
    Returns dict(state, error, secs: time of each post until done)."""
    t0 = time.monotonic()
    try:
        loc, rem = _descs(rows, peer)
        h = S.agent.initialize_xfer(op, loc, rem, peer, notif)
    except Exception as e:
        return dict(state="ERR", error=_err(e), stage="initialize_xfer", secs=[time.monotonic() - t0])
    out = dict(state=None, error=None, stage="transfer", secs=[])
    for k in range(posts):
        t1 = time.monotonic()
        pn = post_notif[k] if isinstance(post_notif, list) else post_notif
        st, err = _state(S.agent.transfer, h, pn)
        if st == "PROC":
            st, err, _ = _wait(h, timeout)
        out["secs"].append(time.monotonic() - t1)
        out["state"], out["error"] = st, err
        if st != "DONE":
            break
    if release:
        try:
            S.agent.release_xfer_handle(h)
        except Exception as e:
            out["release_error"] = _err(e)
            S.handles.append(h)
    else:
        S.handles.append(h)
    return out


def cmd_xfer_batch(op, peer, reqs, timeout=30.0):
    """Post several requests [(rows, notif)] back to back, then poll them all to the end.
    Returns the list of final states."""
    hs = []
    for rows, notif in reqs:
        loc, rem = _descs(rows, peer)
        hs.append(S.agent.initialize_xfer(op, loc, rem, peer, notif))
    states = [_state(S.agent.transfer, h)[0] for h in hs]
    t0 = time.monotonic()
    while "PROC" in states and time.monotonic() - t0 < timeout:
        for i, h in enumerate(hs):
            if states[i] == "PROC":
                states[i] = _state(S.agent.check_xfer_state, h)[0]
    for h in hs:
        try:
            S.agent.release_xfer_handle(h)
        except Exception:
            S.handles.append(h)
    return states


def _check(rows, my_seed, peer_seed, peer_sizes, regions=None, only_rows=False):
    """Compare own regions with what they must hold: pattern(my_seed) everywhere except the
    rows (my_reg, my_off, peer_reg, peer_off, len), which hold pattern(peer_seed) of the peer's
    region at peer_off. `only_rows`: compare the rows' bytes alone. Returns (bad bytes, first
    bad as (region, offset) or None)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    regs = sorted(set(rows[:, 0].tolist())) if regions is None else regions
    src = {}
    bad, first = 0, None
    for r in regs:
        got = _host(S.regions[r])
        mine = rows[rows[:, 0] == r].tolist()
        for pr in {row[2] for row in mine} - set(src):
            src[pr] = pattern(peer_seed, pr, peer_sizes[pr])
        if only_rows:
            pairs = [(got[mo : mo + ln], src[pr][po : po + ln], mo) for _, mo, pr, po, ln in mine]
        else:
            exp = pattern(my_seed, r, S.regions[r].shape[0]).copy()
            for _, mo, pr, po, ln in mine:
                exp[mo : mo + ln] = src[pr][po : po + ln]
            pairs = [(got, exp, 0)]
        for g, e, base in pairs:
            diff = np.flatnonzero(g != e)
            if diff.size:
                bad += int(diff.size)
                first = first or (r, base + int(diff[0]))
    return bad, first


def cmd_check(rows, my_seed, peer_seed, peer_sizes, regions=None):
    """Every byte of the regions `regions` (default: those the rows touch); see _check."""
    bad, first = _check(rows, my_seed, peer_seed, peer_sizes, regions)
    return dict(bad=bad, first=first)


def cmd_send_notifs(peer, msgs, backend=False):
    """send_notif of each message. (`backend`: name the backend; nixl-cu13 1.4.1's
    send_notif(..., backend=) passes a handle where genNotif wants a list: TypeError.)"""
    for m in msgs:
        S.agent.send_notif(peer, m, backend=S.backend if backend else None)
    return len(msgs)


def cmd_collect_notifs(count, timeout=10.0, quiet=0.3, verify=None):
    """get_new_notifs until `count` messages arrived (or `timeout` s), then `quiet` s more
    to catch duplicates. `verify`: {msg: (rows, my_seed, peer_seed, peer_sizes)}, checked
    the moment that message is first seen. Returns dict(msgs=[(agent, msg)], bad={msg: n},
    secs: until the count-th arrived, or None)."""
    got, bad, full = [], {}, None
    t0 = time.monotonic()
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        for agent, msgs in S.agent.get_new_notifs().items():
            for m in msgs:
                got.append((agent, bytes(m)))
                if verify and m in verify and m not in bad:
                    rows, ms, ps, psz = verify[m]
                    bad[m] = _check(rows, ms, ps, psz, only_rows=True)[0]
        if len(got) >= count:
            if full is None:
                full = time.monotonic() - t0
                deadline = min(deadline, time.monotonic() + quiet)
        else:
            time.sleep(0.0005)
    return dict(msgs=got, bad=bad, secs=full)


def cmd_kill_in_flight(op, peer, rows, pid, timeout=20.0, attempts=20):
    """Post `rows` to `peer` and SIGKILL process `pid` (the peer) while the request is in
    progress; then poll it to its end. If a request ends before the kill could be sent, post
    another (at most `attempts`). Returns dict(in_flight, state, error, secs since the kill)."""
    loc, rem = _descs(rows, peer)
    h = S.agent.initialize_xfer(op, loc, rem, peer)
    S.handles.append(h)
    for _ in range(attempts):
        st, err = _state(S.agent.transfer, h)
        if st == "PROC":
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            st, err, _ = _wait(h, timeout)
            return dict(in_flight=True, state=st, error=err, secs=time.monotonic() - t0)
        if st != "DONE":
            return dict(in_flight=False, state=st, error=err, secs=0.0)
    os.kill(pid, signal.SIGKILL)
    return dict(in_flight=False, state="DONE", error=None, secs=0.0)


def cmd_release_in_flight(op, peer, rows, rounds=10, timeout=20.0):
    """`rounds` times: initialize_xfer, transfer, and release_xfer_handle at once while the
    request is (probably) still in progress. A release that raises is retried after the
    request ends. Returns dict(in_flight: releases made in PROC, raised: [errors], ok)."""
    in_flight, raised = 0, []
    loc, rem = _descs(rows, peer)
    for _ in range(rounds):
        h = S.agent.initialize_xfer(op, loc, rem, peer)
        st, err = _state(S.agent.transfer, h)
        if st == "PROC":
            in_flight += 1
        try:
            S.agent.release_xfer_handle(h)
        except Exception as e:
            raised.append(_err(e))
            st, err, _ = _wait(h, timeout)
            S.agent.release_xfer_handle(h)  # must work once the request ended
    return dict(in_flight=in_flight, raised=raised)


def cmd_rounds_in_process(backend, transport, rounds=5, size=1 << 20):
    """`rounds` times, in this one process: two agents made (same names every round), a
    backend each, a region each registered, metadata swapped, a WRITE with a notification and
    a READ back, every byte checked, then deregistered, forgotten and deleted. Returns a list
    of per-round dicts (secs, ok, notif)."""
    nixl = _import_nixl()
    env, params = backend_config(backend, transport)
    os.environ.update(env)
    out = []
    for r in range(rounds):
        t0 = time.monotonic()
        a = nixl.nixl_agent("round-a", nixl.nixl_agent_config(backends=[]))
        b = nixl.nixl_agent("round-b", nixl.nixl_agent_config(backends=[]))
        a.create_backend(backend, dict(params))
        b.create_backend(backend, dict(params))
        src = pattern(100 + r, 0, size).copy()
        dst = np.zeros(size, dtype=np.uint8)
        back = np.zeros(size, dtype=np.uint8)
        ra = a.register_memory([(src.ctypes.data, size, 0, ""), (back.ctypes.data, size, 0, "")], "DRAM")
        rb = b.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        res = {}
        for op, l, msg in (("WRITE", src, b"round-w"), ("READ", back, b"")):
            h = a.initialize_xfer(
                op,
                a.get_xfer_descs([(l.ctypes.data, size, 0)], "DRAM"),
                a.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM"),
                "round-b",
                msg,
            )
            st = a.transfer(h)
            t1 = time.monotonic()
            while st == "PROC" and time.monotonic() - t1 < 20:
                st = a.check_xfer_state(h)
            a.release_xfer_handle(h)
            res[op] = st
        notifs = []
        t1 = time.monotonic()
        while not notifs and time.monotonic() - t1 < 10:
            for k, v in b.get_new_notifs().items():
                notifs += [(k, bytes(m)) for m in v]
        ok = bool((dst == src).all() and (back == src).all())
        a.deregister_memory(ra)
        b.deregister_memory(rb)
        a.remove_remote_agent("round-b")
        b.remove_remote_agent("round-a")
        del a, b
        gc.collect()
        out.append(dict(states=res, ok=ok, notifs=notifs, secs=time.monotonic() - t0))
    return out


def serve(fd, commands=None):
    """Answer calls on socket `fd` with the cmd_* functions of `commands` (default: this
    module's) until 'exit' or the socket closes; then os._exit."""
    commands = commands or globals()
    conn = Connection(fd)
    while True:
        try:
            cmd, args, kw = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "exit":
            break
        try:
            val = commands["cmd_" + cmd](*args, **kw)
            conn.send(("ok", val))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    # Without teardown: a process ends with os._exit (C++ static destructors of the wheel's
    # libraries are not what these tests check; teardown is cmd_teardown's job).
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
