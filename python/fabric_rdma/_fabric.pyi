"""Type stubs of the extension module ``fabric_rdma._fabric`` (re-exported by ``fabric_rdma``)."""

from collections.abc import Generator, Sequence
from typing import Any, Generic, Literal, TypeVar

from typing_extensions import Buffer, Self

T = TypeVar("T")

__version__: str

class Pending(Generic[T]):
    """An engine operation in progress: ``await`` it in a running asyncio loop (the engine
    completes it), or ``wait(timeout)``. Cancelling the await, a timed-out or interrupted
    ``wait``, or dropping it unawaited drops the Rust future: a write still happens, a
    counter wait consumes nothing (docs/python.md, "Cancel safety")."""

    def __await__(self) -> Generator[Any, None, T]: ...
    def wait(self, timeout: float | None = None) -> T:
        """Blocks (GIL released) until done; raises ``Timeout`` after ``timeout`` seconds."""

class Region:
    """Registered memory: ``Engine.alloc`` (the engine's) or ``Engine.register`` (yours, in
    place). Host regions support the buffer protocol (``numpy.frombuffer(region, dtype)``)."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def descriptor(self) -> bytes:
        """What a peer passes to ``Engine.remote_region``."""
    @property
    def address(self) -> int: ...
    @property
    def device(self) -> str:
        """``"host"`` or ``"cuda:N"``."""
    @property
    def gpu_path(self) -> Literal["gpudirect", "staged"] | None:
        """GPU memory: how the NICs reach it; None for host memory."""
    @property
    def obj(self) -> Any | None:
        """The object registered in place, or None."""
    @property
    def is_view(self) -> bool:
        """A range of an earlier registration of host memory that contains it (no registration
        of its own); its offsets and descriptor are its own."""
    def read(self, offset: int = 0, n: int | None = None) -> bytes: ...
    def write(self, offset: int, data: Buffer) -> None: ...

class RemoteRegion:
    """A peer's region (``Engine.remote_region``)."""

    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def peer(self) -> int: ...
    @property
    def is_revoked(self) -> bool: ...
    @property
    def gpu_path(self) -> Literal["cuda-ipc", "gpudirect", "staged"] | None:
        """GPU memory: the path a write from this engine takes; None for host memory."""
    @property
    def descriptor(self) -> bytes: ...

class PageLayout:
    """Page geometry of ``write_paged``; strides default to ``page_len``."""

    def __init__(
        self,
        page_len: int,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
    ) -> None: ...
    page_len: int
    src_stride: int
    dst_stride: int
    src_offset: int
    dst_offset: int

class ImmCounter:
    """Arrivals of one immediate value (``Engine.imm_counter``)."""

    @property
    def imm(self) -> int: ...
    @property
    def available(self) -> int: ...
    @property
    def total_arrived(self) -> int: ...
    def wait_for(self, n: int) -> Pending[None]:
        """Waits for ``n`` arrivals and consumes them; cancel safe (consumes nothing)."""
    def try_consume(self, n: int) -> bool: ...
    def wait_on_stream(self, stream: Any, n: int, device: int = 0) -> None:
        """Queues a wait on ``stream`` (a ``torch.cuda.Stream``, ``__cuda_stream__``/``cuda_stream``
        object or raw ``CUstream`` int of ``device``) for the next ``n`` arrivals: kernels queued
        after it see their bytes. The calling thread does not wait."""

class PeerEvent:
    kind: Literal["up", "down", "removed"]
    peer: int
    reason: str | None

class PeerEvents:
    """Async iterator of ``PeerEvent`` (``Engine.peer_events``)."""

    def __aiter__(self) -> Self: ...
    def __anext__(self) -> Pending[PeerEvent]: ...
    def next(self, timeout: float | None = None) -> PeerEvent | None:
        """Blocking: the next event, None at shutdown."""

class PeerGroup:
    def __len__(self) -> int: ...
    @property
    def peers(self) -> list[int]: ...

class Engine:
    """A transfer engine: one reactor thread driving the NIC(s) of this process."""

    def __init__(
        self,
        provider: str | None = None,
        mode: Literal["event", "adaptive", "busy_poll", "inline"] | None = None,
        *,
        profile: Literal["low_cpu", "balanced", "low_latency"] | None = None,
        nics: Sequence[str] | None = None,
        domains: int | None = None,
        op_timeout: float | None = 30.0,
        spin: float | None = None,
        pin_core: int | None = None,
        node: str | None = None,
        huge_pages: bool | None = None,
        max_counters: int | None = None,
        max_msg_size: int | None = None,
        cuda_ipc: bool | None = None,
    ) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    @property
    def address(self) -> bytes: ...
    @property
    def transport(self) -> str: ...
    @property
    def nics(self) -> int: ...
    @property
    def max_msg_size(self) -> int: ...
    @property
    def is_inline(self) -> bool: ...
    def add_peer(self, address: bytes) -> Pending[int]: ...
    def remove_peer(self, peer: int) -> Pending[None]: ...
    def peer_events(self) -> PeerEvents: ...
    def stats(self) -> dict[str, Any]: ...
    def alloc(self, n: int, device: str | None = None) -> Region: ...
    def register(self, obj: Buffer | Any) -> Region:
        """Registers in place: a writable, contiguous buffer (kept alive and pinned), a torch
        tensor (CPU or CUDA), a ``__cuda_array_interface__`` object or a DLPack tensor
        (``__dlpack__``) (kept alive). Host
        memory inside a live registration of this engine becomes a view of it (no new
        registration: ``Region.is_view``)."""
    def remote_region(self, descriptor: bytes) -> Pending[RemoteRegion]: ...
    def imm_counter(self, imm: int) -> ImmCounter: ...
    def retire_counter(self, imm: int) -> Pending[int]: ...
    def write(
        self, src: Region, src_off: int, dst: RemoteRegion, dst_off: int, n: int, *, after: Any = None
    ) -> Pending[None]:
        """``after``: a CUDA stream or ``torch.cuda.Event``; the write starts once it gets there."""
    def write_imm(
        self, src: Region, src_off: int, dst: RemoteRegion, dst_off: int, n: int, imm: int, *, after: Any = None
    ) -> Pending[None]: ...
    def imm(self, dst: RemoteRegion, imm: int) -> Pending[None]: ...
    def read(self, dst: Region, dst_off: int, src: RemoteRegion, src_off: int, n: int) -> Pending[None]: ...
    def write_arrivals(self, dst: RemoteRegion, n: int) -> int: ...
    def paged_arrivals(self, dst: RemoteRegion, pages: int) -> int: ...
    def write_paged(
        self,
        src: Region,
        dst: RemoteRegion,
        layout: PageLayout,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        imm: int | None = None,
        *,
        after: Any = None,
    ) -> Pending[None]: ...
    def peer_group(self, members: Sequence[RemoteRegion]) -> PeerGroup: ...
    def scatter(
        self, src: Region, group: PeerGroup, entries: Sequence[tuple[int, int, int, int]], imm: int | None = None
    ) -> Pending[None]: ...
    def scatter_arrivals(self, group: PeerGroup, entries: Sequence[tuple[int, int, int, int]]) -> list[int]: ...
    def barrier(self, group: PeerGroup, imm: int) -> Pending[None]: ...
    def write_many(
        self, entries: Sequence[tuple[Region, int, RemoteRegion, int, int]], imm: int | None = None
    ) -> Pending[None]:
        """``(src, src_off, dst, dst_off, n)`` entries as one batch; with ``imm``, each peer
        written to counts one arrival once all its bytes have landed."""
    def read_many(self, entries: Sequence[tuple[Region, int, RemoteRegion, int, int]]) -> Pending[None]:
        """``(dst, dst_off, src, src_off, n)`` entries as one batch of reads."""
    def send(self, peer: int, msg: Buffer) -> Pending[None]: ...
    def recv(self) -> Pending[tuple[int | None, bytes]]: ...
    def recv_from(self, peer: int) -> Pending[tuple[int, bytes]]: ...
    def shutdown(self) -> None: ...

class FabricError(Exception): ...
class OutOfBounds(FabricError):
    side: str
    offset: int
    len: int
    region_len: int
class UnknownPeer(FabricError):
    peer: int
class PeerUnreachable(FabricError):
    peer: int
class RemoteAccess(FabricError):
    peer: int
class ConnectionLost(FabricError):
    peer: int
class Malformed(FabricError): ...
class Stale(FabricError): ...
class Foreign(FabricError): ...
class NoRemoteCqData(FabricError): ...
class ProviderNotFound(FabricError): ...
class CompletionError(FabricError):
    errno: int
class ProviderError(FabricError):
    errno: int
class RegisterMemory(FabricError): ...
class MessageTooLarge(FabricError): ...
class Shutdown(FabricError): ...
class CounterLimit(FabricError):
    imm: int
class CounterRetired(FabricError):
    imm: int
class Unsupported(FabricError): ...
class CudaError(FabricError): ...
class NotDeviceMemory(FabricError): ...
class ConfigError(FabricError): ...
class TopologyError(FabricError): ...
class Timeout(FabricError, TimeoutError): ...
