"""pytest setup for the NIXL plugin tests: which backends, the plugin folder, peer processes.

NIXL_TEST_BACKENDS: comma list of BACKEND[:TRANSPORT] (transport tcp by default, or shm),
e.g. "FABRIC", "FABRIC,UCX", "FABRIC:shm,UCX:tcp". Default: FABRIC when
target/nixl-plugin/libplugin_FABRIC.so exists, else UCX. Every test runs once per entry.
"""

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import nixl_peer as P  # noqa: E402

MiB = 1 << 20


def _specs():
    default = "FABRIC" if os.path.exists(P.FABRIC_PLUGIN) else "UCX"
    return P.parse_specs(os.environ.get("NIXL_TEST_BACKENDS", default))


def pytest_generate_tests(metafunc):
    if "spec" in metafunc.fixturenames:
        specs = _specs()
        metafunc.parametrize("spec", specs, ids=[f"{b}-{t}" for b, t in specs], scope="module")


@pytest.fixture(scope="session")
def plugins(tmp_path_factory):
    """(plugin folder, {backend: why missing}) with every backend the session names."""
    if P.find_nixl()[0] is None:
        pytest.skip("no NIXL Python package (pip install nixl-cu13)")
    names = sorted({b for b, _ in _specs()})
    d, missing = P.plugin_dir(names, root=str(tmp_path_factory.mktemp("plugins")))
    yield d, missing
    shutil.rmtree(d, ignore_errors=True)


_loads = {}


def _probe(env, spec):
    """None if `spec`'s backend can be made in a peer, else why not (cached)."""
    if spec not in _loads:
        p = P.Peer("probe", env)
        try:
            p.call("setup", "probe", spec[0], spec[1], sizes=[4096])
            _loads[spec] = None
        except P.PeerError as e:
            _loads[spec] = str(e).strip().splitlines()[-1]
        finally:
            p.close()
    return _loads[spec]


@pytest.fixture(scope="module")
def env(plugins, spec):
    d, missing = plugins
    if spec[0] in missing:
        pytest.skip(f"{spec[0]}: {missing[spec[0]]}")
    e = P.base_env(d)
    # NIXL's own LIBFABRIC plugin needs libfabric >= 1.21, libcudart and libcuda: where it
    # does not load, its tests skip (the others fail if their backend cannot be made).
    if spec[0] == "LIBFABRIC":
        why = _probe(e, spec)
        if why:
            print(f"skipped: LIBFABRIC: {why}")
            pytest.skip(f"LIBFABRIC: {why}")
    return e


class Peers:
    """Starts peers and ends every one of them at teardown (SIGKILL if need be)."""

    def __init__(self, env):
        self.env = env
        self.all = []

    def start(self, label):
        p = P.Peer(label, self.env)
        self.all.append(p)
        return p

    def close(self):
        for p in self.all:
            p.close()


@pytest.fixture
def peers(env):
    ps = Peers(env)
    yield ps
    ps.close()


# Regions of the shared pair: a few sizes, odd ones included.
SIZES = [16 * MiB, 2 * MiB + 17, 1 * MiB, 64 * 1024 + 3]


class Pair:
    """Target and initiator with the same region sizes; the initiator has loaded the
    target's metadata."""

    def __init__(self, peers, spec, sizes=SIZES, imem="DRAM", tmem="DRAM", idev=0, tdev=0):
        backend, transport = spec
        self.spec = spec
        env_mem = "VRAM" if "VRAM" in (imem, tmem) else "DRAM"
        self.target = peers.start("target")
        self.init = peers.start("initiator")
        self.t = self.target.call(
            "setup", "target", backend, transport, sizes=sizes, mem=tmem, dev=tdev, env_mem=env_mem
        )
        self.i = self.init.call(
            "setup", "initiator", backend, transport, sizes=sizes, mem=imem, dev=idev, env_mem=env_mem
        )
        assert self.init.call("load_remote", self.t) == "target"

    def drain(self):
        """Drop notifications left over from earlier tests (the pair is shared)."""
        for p in (self.init, self.target):
            p.call("collect_notifs", 0, timeout=0.2, quiet=0.2)

    def fill(self, iseed, tseed):
        self.init.call("fill", iseed)
        self.target.call("fill", tseed)


@pytest.fixture(scope="module")
def pair(env, spec):
    ps = Peers(env)
    try:
        yield Pair(ps, spec)
    finally:
        ps.close()


@pytest.fixture(scope="session")
def cuda_devices(plugins):
    """How many CUDA devices torch sees in a peer's environment; skips the test with the
    reason when torch or CUDA is missing."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch") is None:
        pytest.skip("VRAM: torch is not installed")
    env = P.base_env(plugins[0])
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            env=env, capture_output=True, text=True, timeout=180,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("VRAM: torch.cuda.device_count() took more than 180 s")
    if out.returncode != 0:
        pytest.skip(f"VRAM: import torch failed: {out.stderr.strip().splitlines()[-1:]}")
    n = int(out.stdout.split()[-1])
    if n == 0:
        pytest.skip("VRAM: torch sees no CUDA device (torch.cuda.device_count() == 0)")
    return n
