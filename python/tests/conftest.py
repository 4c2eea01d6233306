"""Shared fixtures: providers, a hard per-test time bound, and peer processes.

Every test is bounded: SIGALRM fires after ``TEST_SECONDS`` and raises in the main thread
(blocking waits take the GIL back every 50 ms to see it, asyncio loops see it at once), so a
hang fails the test instead of the CI job.
"""

import multiprocessing
import os
import signal
import time

import pytest

os.environ.setdefault("FI_TCP_IFACE", "lo")

TEST_SECONDS = 60
PROVIDERS = [p for p in os.environ.get("FABRIC_TEST_PROVIDERS", "tcp,shm").split(",") if p in ("tcp", "shm")]


class TestTimedOut(Exception):
    pass


@pytest.fixture(autouse=True)
def time_bound():
    def expire(signum, frame):
        raise TestTimedOut(f"test ran past {TEST_SECONDS} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(params=PROVIDERS or ["tcp"])
def provider(request):
    return request.param


@pytest.fixture
def engines(provider):
    """(sender, receiver): two engines of this process on the test's provider."""
    import fabric_rdma

    a, b = fabric_rdma.Engine(provider), fabric_rdma.Engine(provider)
    yield a, b
    a.shutdown()
    b.shutdown()


class PeerProcess:
    """A child process running ``target(provider, conn, *args)`` with a pipe to talk to."""

    def __init__(self, target, provider, *args):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(provider, child, *args), daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout=30.0):
        if not self.conn.poll(timeout):
            raise TestTimedOut(f"no message from the peer process within {timeout} s")
        return self.conn.recv()

    def send(self, msg):
        self.conn.send(msg)

    def stop(self):
        """SIGSTOP, returning once every thread of the process has stopped (kill only
        queues the signal)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for t in os.listdir(f"/proc/{self.proc.pid}/task"):
                try:
                    with open(f"/proc/{self.proc.pid}/task/{t}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:
                    pass
            if states and all(s in "Tt" for s in states):
                return
            time.sleep(0.001)
        raise TestTimedOut("the peer process did not stop")

    def cont(self):
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def finish(self, timeout=20.0):
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            raise TestTimedOut("peer process did not exit")
        assert self.proc.exitcode == 0, f"peer process exited with {self.proc.exitcode}"


@pytest.fixture
def spawn():
    peers = []

    def start(target, provider, *args):
        p = PeerProcess(target, provider, *args)
        peers.append(p)
        return p

    yield start
    for p in peers:
        if p.proc.is_alive():
            p.kill()
