"""Counters, cancellation and timeouts (two engines of this process on a real transport)."""

import asyncio
import time

import pytest

import fabric_rdma


# Two engines of one process, on every test provider (tcp and shm): a pair per test, made
# after the previous test's pair was dropped.
@pytest.fixture
def pair(provider):
    """(sender, receiver, source region, the receiver's region as the sender sees it)."""
    a, b = fabric_rdma.Engine(provider), fabric_rdma.Engine(provider)
    dst = b.alloc(1 << 16)
    src = a.alloc(1 << 16)
    remote = a.remote_region(dst.descriptor).wait(timeout=20)
    yield a, b, src, remote
    a.shutdown()
    b.shutdown()


def test_counters_count_consume_and_retire(pair):
    a, b, src, dst = pair

    async def main():
        c = b.imm_counter(11)
        assert (c.imm, c.available, c.total_arrived) == (11, 0, 0)
        await asyncio.gather(*(a.write_imm(src, i * 64, dst, i * 64, 64, 11) for i in range(10)))
        await asyncio.gather(*(a.imm(dst, 11) for _ in range(2)))
        await asyncio.wait_for(c.wait_for(5), 10)
        await asyncio.wait_for(b.imm_counter(11).wait_for(3), 10)  # one count per value
        assert not c.try_consume(100)
        await asyncio.wait_for(c.wait_for(4), 10)
        assert (c.available, c.total_arrived) == (0, 12)
        await a.imm(dst, 11)
        for _ in range(1000):  # the arrival is counted shortly after the sender's completion
            if c.available:
                break
            await asyncio.sleep(0.005)
        assert c.try_consume(1) and c.available == 0
        await a.imm(dst, 11)
        assert await asyncio.wait_for(b.retire_counter(11), 10) in (0, 1)
        with pytest.raises(fabric_rdma.CounterRetired):
            await asyncio.wait_for(c.wait_for(1), 10)

    asyncio.run(main())


def test_cancelled_wait_consumes_nothing_and_the_engine_still_works(pair):
    a, b, src, dst = pair

    async def main():
        c = b.imm_counter(21)
        waiter = asyncio.ensure_future(c.wait_for(1))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert b.stats()["counters"][0]["waiters"] == 0, "the cancelled wait left the queue"
        await a.imm(dst, 21)
        await asyncio.wait_for(c.wait_for(1), 10)  # the arrival went to this wait, not the cancelled one
        # A cancelled write still happens (dropping its future does not recall it).
        write = asyncio.ensure_future(a.write_imm(src, 0, dst, 0, 4096, 22))
        await asyncio.sleep(0)
        write.cancel()
        await asyncio.wait_for(b.imm_counter(22).wait_for(1), 10)
        await asyncio.wait_for(a.write_imm(src, 0, dst, 0, 4096, 23), 10)
        await asyncio.wait_for(b.imm_counter(23).wait_for(1), 10)

    asyncio.run(main())


def test_a_wait_tied_to_peers_cancelled_or_timed_out_consumes_nothing(pair):
    a, b, src, dst = pair

    async def main():
        c = b.imm_counter(24)
        waiter = asyncio.ensure_future(c.wait_for(2, peers=[12345]))  # a peer never added
        await asyncio.sleep(0.05)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await a.imm(dst, 24)
        for _ in range(1000):
            if c.available:
                break
            await asyncio.sleep(0.005)
        assert c.available == 1, "the cancelled wait took nothing"
        with pytest.raises(fabric_rdma.Timeout):
            c.wait_for(2, peers=[12345]).wait(timeout=0.1)
        assert c.available == 1, "nor did the timed-out one"
        await a.imm(dst, 24)
        await asyncio.wait_for(c.wait_for(2, peers=[12345]), 10)
        assert c.available == 0

    asyncio.run(main())


def test_timeouts_async_and_blocking(pair):
    a, b, src, dst = pair

    async def main():
        c = b.imm_counter(31)
        t = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.wait_for(1), 0.2)
        assert 0.15 < time.monotonic() - t < 5
        await a.imm(dst, 31)
        await asyncio.wait_for(c.wait_for(1), 10)  # the timed-out wait consumed nothing

    asyncio.run(main())
    c = b.imm_counter(32)
    t = time.monotonic()
    with pytest.raises(fabric_rdma.Timeout) as e:
        c.wait_for(1).wait(timeout=0.2)
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, fabric_rdma.FabricError)
    assert 0.15 < time.monotonic() - t < 5
    a.imm(dst, 32).wait(timeout=10)
    c.wait_for(1).wait(timeout=10)
    with pytest.raises(ValueError):
        c.wait_for(1).wait(timeout=-1)


def test_many_awaits_in_flight_complete(pair):
    a, b, src, dst = pair

    async def main():
        c = b.imm_counter(41)
        waits = [asyncio.ensure_future(c.wait_for(1)) for _ in range(50)]
        await asyncio.gather(*(a.write_imm(src, (i % 16) * 4096, dst, (i % 16) * 4096, 4096, 41) for i in range(50)))
        await asyncio.wait_for(asyncio.gather(*waits), 10)

    asyncio.run(main())


def test_peer_events_async_iterator(pair):
    a, b, src, dst = pair

    async def main():
        events = a.peer_events()
        first = await asyncio.wait_for(events.__anext__(), 5)
        assert (first.kind, first.peer, first.reason) == ("up", dst.peer, None)
        await a.remove_peer(dst.peer)
        async for ev in events:
            assert (ev.kind, ev.peer) == ("removed", dst.peer)
            break
        with pytest.raises(fabric_rdma.PeerUnreachable):
            await a.write(src, 0, dst, 0, 8)

    assert a.peer_events().next(timeout=5).kind == "up"
    asyncio.run(main())
