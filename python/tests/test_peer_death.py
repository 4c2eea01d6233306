"""A peer process killed with SIGKILL: operations to it and waits on it raise, never hang."""

import asyncio
import time

import pytest

import fabric_rdma
import peers


def test_killed_peer_raises_peer_unreachable(provider, spawn):
    peer = spawn(peers.holder, provider, 1 << 20)
    address, desc = peer.recv()

    async def main():
        engine = fabric_rdma.Engine(provider)
        dst = await engine.remote_region(desc)
        src = engine.alloc(1 << 20)
        await asyncio.wait_for(engine.write(src, 0, dst, 0, 1 << 20), 20)
        events = engine.peer_events()
        assert (await asyncio.wait_for(events.__anext__(), 5)).kind == "up"
        receive = asyncio.ensure_future(engine.recv_from(dst.peer))
        # A counter wait tied to the peer (nothing will arrive): fails once it is down.
        tied = asyncio.ensure_future(engine.imm_counter(40).wait_for(1, peers=[dst.peer]))
        peer.kill()
        t = time.monotonic()
        down = await asyncio.wait_for(events.__anext__(), 15)
        assert (down.kind, down.peer) == ("down", dst.peer) and down.reason
        with pytest.raises(fabric_rdma.PeerUnreachable) as e:
            await asyncio.wait_for(receive, 15)
        assert e.value.peer == dst.peer and e.value.retryable is True  # once the peer is back
        with pytest.raises(fabric_rdma.PeerUnreachable) as e:
            await asyncio.wait_for(tied, 15)
        assert e.value.peer == dst.peer
        # Writes fail with a typed error (PeerUnreachable once the engine saw the death).
        with pytest.raises(fabric_rdma.PeerUnreachable):
            await asyncio.wait_for(engine.write_imm(src, 0, dst, 0, 4096, 1), 15)
        assert time.monotonic() - t < 15
        # The engine still works: a fresh peer.
        other = spawn(peers.holder, provider, 4096)
        _, desc2 = other.recv()
        dst2 = await engine.remote_region(desc2)
        await asyncio.wait_for(engine.write(src, 0, dst2, 0, 4096), 20)
        other.send("stop")

    asyncio.run(main())
