"""fabric_rdma: RDMA point-to-point transfers for LLM systems, as asyncio awaitables.

The Python package of the ``fabric`` project (distribution ``fabric-rdma``; not ``fabric``,
which on PyPI is the SSH library): the Rust engine (``fabric-async``), with every operation an
awaitable that the engine's reactor completes (no polling thread in Python, the GIL released
while waiting), or a blocking call (``.wait(timeout=None)`` on the same object)::

    import asyncio, fabric_rdma, numpy as np

    async def main(peer_descriptor: bytes):
        engine = fabric_rdma.Engine(provider="tcp")
        src = engine.register(np.arange(1 << 20, dtype=np.float32))  # in place, no copy
        dst = await engine.remote_region(peer_descriptor)            # adds the peer
        await engine.write_imm(src, 0, dst, 0, src.nbytes, 7)        # bytes, then imm 7
        # at the peer: await engine.imm_counter(7).wait_for(1)

See ``docs/python.md`` for the guide: memory and ownership, cancel safety, errors.
"""

from ._fabric import (
    ConfigError,
    ConnectionLost,
    CompletionError,
    CounterLimit,
    CounterRetired,
    CudaError,
    Engine,
    FabricError,
    Foreign,
    ImmCounter,
    Malformed,
    MessageTooLarge,
    NoRemoteCqData,
    NotDeviceMemory,
    OutOfBounds,
    PageLayout,
    PeerEvent,
    PeerEvents,
    PeerGroup,
    PeerUnreachable,
    Pending,
    ProviderError,
    ProviderNotFound,
    Region,
    RegisterMemory,
    RemoteAccess,
    RemoteRegion,
    Shutdown,
    Stale,
    Timeout,
    TopologyError,
    UnknownPeer,
    Unsupported,
    __version__,
)

__all__ = [
    "Engine",
    "Region",
    "RemoteRegion",
    "PageLayout",
    "ImmCounter",
    "PeerEvent",
    "PeerEvents",
    "PeerGroup",
    "Pending",
    "FabricError",
    "OutOfBounds",
    "UnknownPeer",
    "PeerUnreachable",
    "RemoteAccess",
    "ConnectionLost",
    "Malformed",
    "Stale",
    "Foreign",
    "NoRemoteCqData",
    "ProviderNotFound",
    "CompletionError",
    "ProviderError",
    "RegisterMemory",
    "MessageTooLarge",
    "Shutdown",
    "CounterLimit",
    "CounterRetired",
    "Unsupported",
    "CudaError",
    "NotDeviceMemory",
    "ConfigError",
    "TopologyError",
    "Timeout",
    "__version__",
]
