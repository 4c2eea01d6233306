//! The transfer engine: the handle users hold, its settings, and the futures it returns.
//!
//! ```text
//!  task ──write_imm()──► submission queue ──(eventfd if asleep)──► reactor thread
//!   ▲                                                               │ post
//!   │ Waker::wake                                                   ▼
//!  OpFuture ◄── OpState ◄── completion ◄── CQ ◄── NIC ◄──────── Domain (libfabric / verbs)
//!                                           │
//!  ImmCounter::wait_for ◄── CounterCell ◄───┘ (remote immediates)
//! ```
//!
//! libfabric domains are single-threaded (`FI_THREAD_DOMAIN`), so the reactor thread owns
//! every domain of the engine; callers reach it through one queue (`shared::queue`).
//! Control requests (registration, peers) travel the same queue, so their order relative
//! to operations is the order the caller issued them in.
//!
//! Files: `builder.rs` (settings, opening the NICs), `op.rs` (operation futures),
//! `region.rs` (local and remote regions), `transfer.rs` (transfer shapes and routing),
//! `recv.rs` (two-sided receive). The engine depends on `shared/` and starts the reactor
//! (`reactor/`); the reactor never depends on the engine.

mod batch;
mod builder;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "metrics")]
mod metrics;
pub(crate) mod op;
mod recv;
pub(crate) mod region;
pub(crate) mod stats;
mod transfer;
mod wakeups;

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::Bytes;

use crate::counter::ImmCounter;
use crate::error::{Error, Result};
use crate::provider::{Domain, MemoryLocation};
use crate::pure::control::{MsgKind, HEADER_LEN};
use crate::pure::descriptor::{EngineAddress, RegionDescriptor};
use crate::pure::revoke::RegionKey;
use crate::pure::route::PageLayout;
use crate::reactor;
use crate::shared::events::PeerEvents;
use crate::shared::memory::{Backing, RegionShared};
use crate::shared::notify::{BatchState, Notify, OpState};
use crate::shared::queue::{OpReq, Submission};
use crate::shared::Shared;
use crate::sync::Driver;

pub use crate::reactor::ReactorMode;
pub use crate::shared::PeerId;
pub use batch::{BatchEntry, BatchOp};
pub use builder::{EngineBuilder, LatencyProfile};
#[cfg(feature = "cuda")]
pub use gpu::signal::GpuCounter;
pub use op::{ControlFuture, OpBatch, OpFuture};
pub use recv::RecvFuture;
pub use region::{MemoryRegion, RemoteRegion, WeakMemoryRegion};
pub use stats::{CounterStats, EngineSettings, EngineStats, GpuStats, OpStats, ReactorStats};
pub use transfer::{PeerGroup, ScatterEntry, Transfers};
pub use wakeups::CompletionWakeups;

/// The smallest message slot: room for the engine's control messages (a PULL names one
/// source per NIC and the sender's address).
const CONTROL_SLOT: usize = 2048;

struct EngineInner {
    shared: Arc<Shared>,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// The reactor pass that callers run (cloned into futures): `ReactorMode::Inline`, or
    /// `EngineBuilder::await_spin`.
    driver: Option<Driver>,
    /// `ReactorMode::Inline`: operations posted on the submitting thread.
    submitter: Option<Arc<dyn crate::shared::queue::SubmitHere>>,
    /// A reactor pass for other threads (direct posting, `completion_wakeups`), where
    /// every NIC has a wait fd; `Shared` holds it weakly.
    direct: Option<Arc<dyn crate::sync::DirectPost>>,
    /// Registrations on the caller's thread (`register_raw`).
    registrar: Arc<dyn crate::sync::RegisterHere>,
    /// The latency settings, as the builder resolved them (`stats`).
    settings: stats::EngineSettings,
    mode: ReactorMode,
    /// The pinned words of `gpu_counter`s.
    #[cfg(feature = "cuda")]
    gpu_counters: gpu::signal::GpuCounters,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        tracing::debug!(transport = %self.shared.transport, "last engine handle dropped; shutting down");
        self.shared.request_shutdown();
        let t = match self.thread.get_mut() {
            Ok(t) => t.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(t) = t {
            if t.join().is_err() {
                tracing::error!("fabric reactor thread panicked");
            }
        }
    }
}

/// A transfer engine: one reactor thread driving the NIC(s) of one GPU (or process).
///
/// Cheap to clone. When the last clone is dropped (or [`Engine::shutdown`] is called), the
/// reactor stops taking work, gives in-flight operations up to the builder's
/// `shutdown_grace` to complete, fails the rest with [`Error::Shutdown`], closes the NIC
/// objects and exits; dropping the last clone waits for that.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("transport", &self.inner.shared.transport)
            .field("peers", &self.inner.shared.npeers.load(Ordering::Relaxed))
            .finish()
    }
}

/// The largest host range [`Engine`] registers on the caller's thread (`register_raw`): a
/// verbs NIC pins every page of a registration, which for a large range would hold an async
/// caller's executor thread for long.
const REGISTER_HERE_MAX: usize = 4 << 20;

impl Engine {
    /// Settings for a new engine.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// Starts a reactor thread over already opened domains.
    pub(crate) fn start<D: Domain>(domains: Vec<D>, cfg: EngineBuilder) -> Result<Engine> {
        cfg.transfer.validate(domains.len())?;
        let transport = domains[0].transport().to_string();
        let address = EngineAddress {
            transport: transport.clone(),
            domains: domains.iter().map(|d| d.address()).collect(),
            incarnation: crate::pure::descriptor::new_incarnation(),
        };
        // Every message carries a kind byte (user or engine control, `pure::control`); a slot
        // also fits the engine's control messages.
        let domain_max = domains.iter().map(|d| d.max_msg_size()).min().unwrap_or(0);
        let max_msg_size = domain_max.saturating_sub(HEADER_LEN).min(cfg.max_msg_size);
        let msg_slot = (max_msg_size + HEADER_LEN).max(CONTROL_SLOT).min(domain_max);
        let delivery_complete = domains.iter().all(|d| d.delivery_complete());
        let mut shared =
            Shared::new(transport, address, max_msg_size, domains.len(), cfg.transfer, delivery_complete)?;
        #[cfg(feature = "cuda")]
        {
            let (slots, chunk) = cfg.staging_slots()?;
            shared.gpu.chunk = chunk;
            shared.gpu.slots = slots;
            shared.gpu.ipc_enabled = cfg.cuda_ipc;
            shared.gpu.streams = cfg.cuda_streams;
        }
        shared.huge_pages = cfg.huge_pages;
        shared.vouch = domains.iter().any(|d| d.refuses_bad_keys_silently());
        shared.set_max_counters(cfg.max_counters);
        let shared = Arc::new(shared);
        let settings = cfg.settings();
        // The defaults of some of these depend on the machine's CPUs: say what was chosen.
        tracing::debug!(%settings, "latency settings");
        let mut rcfg = cfg.reactor_config();
        rcfg.msg_slot = msg_slot;
        let mode = rcfg.mode;
        let nics = domains.len();
        let started = reactor::spawn(domains, shared.clone(), rcfg)?;
        tracing::debug!(transport = %shared.transport, nics, ?mode, max_msg_size, "engine started");
        Ok(Engine {
            inner: Arc::new(EngineInner {
                shared,
                thread: std::sync::Mutex::new(Some(started.thread)),
                driver: started.driver,
                submitter: started.submitter,
                direct: started.direct,
                registrar: started.registrar,
                settings,
                mode,
                #[cfg(feature = "cuda")]
                gpu_counters: Default::default(),
            }),
        })
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// The pass that awaiting callers run (`ReactorMode::Inline`, a spin before parking with
    /// `EngineBuilder::await_spin`, a `BusyPoll` engine's spinning callers), or how futures
    /// linger (`EngineBuilder::await_linger`).
    pub(crate) fn driver(&self) -> Option<&Driver> {
        self.inner.driver.as_ref()
    }

    /// Hands one operation to the reactor: on an `Inline` engine posted at once on this
    /// thread when no other thread is in a pass (`SubmitHere::submit_here`), else queued.
    /// Gives it back if the engine is shutting down.
    pub(crate) fn submit_op(&self, s: Submission) -> std::result::Result<(), Submission> {
        let s = match &self.inner.submitter {
            Some(d) => match d.submit_here(s) {
                Ok(()) => return Ok(()),
                Err(s) => s,
            },
            None => s,
        };
        self.shared().submit(s)
    }

    /// Whether awaiting this engine's futures drives its NICs on the caller's thread
    /// ([`ReactorMode::Inline`]).
    pub fn is_inline(&self) -> bool {
        self.inner.mode == ReactorMode::Inline
    }

    /// Runs one pass of the reactor on the calling thread (post what is queued, poll the
    /// completion queues, complete): what awaiting a future of an [`ReactorMode::Inline`]
    /// engine does. Returns whether anything happened. Never blocks; returns `false` at once
    /// when the engine is not inline or another thread is driving its NICs right now.
    pub fn progress(&self) -> bool {
        self.is_inline() && self.inner.driver.as_ref().is_some_and(|d| d.progress())
    }

    /// Stops the engine now (see the type's docs). Operations after this fail with
    /// [`Error::Shutdown`]. Does not wait for the reactor thread; dropping the last clone does.
    pub fn shutdown(&self) {
        tracing::debug!(transport = %self.shared().transport, "engine shutdown requested");
        self.shared().request_shutdown();
    }

    /// The transport every NIC of this engine speaks (for example `"tcp;ofi_rxm"`).
    pub fn transport(&self) -> &str {
        &self.shared().transport
    }

    /// This engine's address: bytes to give to peers (by any means) for [`Engine::add_peer`].
    pub fn address(&self) -> Vec<u8> {
        self.shared().address.to_bytes()
    }

    /// Whether a write's local completion means its data has landed at the target on every
    /// NIC of this engine (verbs: yes; libfabric: where the provider granted
    /// `FI_DELIVERY_COMPLETE`, as `tcp` does). Without it, `Arrivals::One` transfers with
    /// `Route::Sharded` over several NICs are refused with [`Error::Unsupported`] (see
    /// [`TransferOpts::check_one_arrival`](crate::TransferOpts::check_one_arrival)).
    pub fn delivery_complete(&self) -> bool {
        self.shared().delivery_complete
    }

    /// The largest message [`Engine::send`] accepts.
    pub fn max_msg_size(&self) -> usize {
        self.shared().max_msg_size
    }

    /// Makes the engine at `address` (bytes from its [`Engine::address`]) a peer. Adding the
    /// same address twice returns the same id.
    ///
    /// Adding the address of a peer marked down (same incarnation) brings it back if it
    /// answers: the same id, and [`PeerEvent::Up`](crate::PeerEvent::Up). On tcp and shm that
    /// is known at once; on verbs it takes a handshake with the peer's process, which this
    /// call waits for (up to 2 s, `VerbsConfig::revive_timeout`) without holding up the
    /// engine's other work, while operations to the peer keep failing as for any peer down.
    /// A peer that does not answer stays down: [`Error::Stale`] ("peer N is gone: ... (and
    /// does not answer: ...)"). `docs/faults.md`, "A live peer can be recovered".
    ///
    /// # Cancel safety
    ///
    /// If dropped before completion the peer may still be added (or, if it was down and
    /// answers, brought back); adding it again is cheap and returns the same id.
    pub async fn add_peer(&self, address: &[u8]) -> Result<PeerId> {
        let address = EngineAddress::from_bytes(address)?;
        address.check_transport(&self.shared().transport)?;
        let ours = self.shared().address.domains.len();
        if address.domains.len() != ours {
            return Err(Error::Foreign {
                what: "engine address",
                found: format!("{} with {} NIC(s)", address.transport, address.domains.len()),
                expected: format!("{} with {ours} NIC(s)", self.shared().transport),
            });
        }
        let (tx, rx) = futures::channel::oneshot::channel();
        match self.shared().submit(Submission::AddPeer { address, reply: tx }) {
            Ok(()) => ControlFuture::new(rx).await,
            Err(_) => Err(Error::Shutdown),
        }
    }

    /// Removes a peer: operations waiting for it fail with [`Error::PeerUnreachable`] ("removed
    /// by Engine::remove_peer"), its NIC resources are given back, and its id is never used
    /// again: later operations through it, or through descriptors of its regions, fail the
    /// same way. Adding its address again makes a new peer with a new id (a restarted peer
    /// has a new address anyway). Removing a removed peer is a no-op.
    ///
    /// Errors: [`Error::UnknownPeer`] for an id this engine never gave.
    ///
    /// # Cancel safety
    ///
    /// If dropped before completion the peer may still be removed.
    pub async fn remove_peer(&self, peer: PeerId) -> Result<()> {
        let (tx, rx) = futures::channel::oneshot::channel();
        match self.shared().submit(Submission::RemovePeer { peer, reply: tx }) {
            Ok(()) => ControlFuture::new(rx).await,
            Err(_) => Err(Error::Shutdown),
        }
    }

    /// Whether `peer` is up, without waiting: `Ok(())` while it is,
    /// [`Error::PeerUnreachable`] with the reason once it was found down (as
    /// [`Engine::peer_events`] reports) or removed, [`Error::UnknownPeer`] for an id this
    /// engine never gave. One atomic load while no peer has gone.
    pub fn peer_status(&self, peer: PeerId) -> Result<()> {
        if peer.0 >= self.shared().npeers.load(Ordering::Acquire) {
            return Err(Error::UnknownPeer { peer: peer.0 });
        }
        match self.shared().peer_events.gone(peer) {
            Some(message) => Err(Error::PeerUnreachable { peer: peer.0, message }),
            None => Ok(()),
        }
    }

    /// A stream of peer changes: [`PeerEvent::Up`](crate::PeerEvent::Up) when a peer is
    /// added, [`PeerEvent::Down`](crate::PeerEvent::Down)
    /// when it is found gone (shm: its process exited; tcp: its connection failed; verbs:
    /// its queue pair went to error; any transport: an operation outlived `op_timeout`),
    /// [`PeerEvent::Removed`](crate::PeerEvent::Removed) after [`Engine::remove_peer`]. It starts with the current
    /// state of every peer, so nothing is missed by subscribing late, and ends at shutdown.
    /// Each call makes an independent stream. How fast each transport notices a dead peer:
    /// `docs/faults.md`.
    pub fn peer_events(&self) -> PeerEvents {
        self.shared().peer_events.subscribe()
    }

    /// Registers a **copy** of `data` with every NIC of the engine (in place, without a copy:
    /// [`Engine::register_host`]). The bytes are copied into memory of the region's own (a mapping whose address range is
    /// never reused once the region is freed, so stale descriptors of it cannot reach new
    /// memory: `docs/security.md`). From 2 MiB up that memory uses transparent huge pages
    /// where the kernel allows, as [`Engine::alloc`]'s does. An empty `data` is
    /// [`Error::Config`].
    ///
    /// # Cancel safety
    ///
    /// If dropped before completion, a registration that completes anyway is closed again
    /// and the memory freed by the reactor.
    pub async fn register_copy(&self, data: Vec<u8>) -> Result<MemoryRegion> {
        self.register_backing(Backing::from_vec(data, self.shared().huge_pages)?, MemoryLocation::Host).await
    }

    /// Registers `len` bytes of host memory at `ptr` that the caller owns (a NumPy array, a
    /// tensor, a buffer of another library) with every NIC, without copying: transfers read
    /// and write that memory. `owner` is whatever keeps it allocated; the engine drops it
    /// only after every registration of the memory has been closed, which is after the
    /// returned region and all its clones are dropped **and** every operation that uses it
    /// has completed (on shm, also after the peers acknowledged the region's revocation, at
    /// most 1 s later: a peer's write racing the free still lands in this memory until
    /// then, `docs/security.md`). The Python package registers buffer-protocol objects this
    /// way.
    ///
    /// Unlike [`Engine::alloc`]'s memory, the range is not reserved once the region is
    /// freed (it is not the engine's): a write through a stale descriptor that races the
    /// region's revocation may land in whatever the owner puts there next on providers that
    /// address memory by virtual address without checking keys (`docs/security.md`).
    ///
    /// Errors: [`Error::Config`] for `len == 0`, a null `ptr` or a range that overflows the
    /// address space; [`Error::RegisterMemory`] if a NIC refuses the range.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be valid, writable host memory for as long as `owner` lives,
    /// and the caller must not free or move it by other means meanwhile (remote peers write
    /// into it at any time).
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register_copy`]: a registration that completes after the future was
    /// dropped is closed again, and `owner` dropped after that.
    pub async unsafe fn register_host(
        &self,
        ptr: u64,
        len: usize,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<MemoryRegion> {
        // SAFETY: the caller's contract is `Backing::external`'s.
        let backing = unsafe { Backing::external(ptr, len, Box::new(owner)) }?;
        self.register_backing(backing, MemoryLocation::Host).await
    }

    /// Allocates `len` zeroed bytes aligned to 4096 and registers them.
    ///
    /// From 2 MiB up the memory is aligned to 2 MiB and asks the kernel for transparent huge
    /// pages (`madvise(MADV_HUGEPAGE)`; on by default, see
    /// [`EngineBuilder::huge_pages`]): walks over its pages (shm's copy, a verbs NIC's
    /// pinning, the TLB) then cost one step per 2 MiB instead of per 4 KiB. Where THP is off
    /// (`never`) or no huge page is free, it is ordinary memory.
    ///
    /// `len == 0` is [`Error::Config`]; a `len` larger than the machine's physical memory or
    /// than the kernel will map is [`Error::RegisterMemory`] (never an abort).
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register_copy`].
    pub async fn alloc(&self, len: usize) -> Result<MemoryRegion> {
        self.alloc_in(len, MemoryLocation::Host).await
    }

    /// Allocates and registers `len` zeroed bytes in `location`.
    ///
    /// [`MemoryLocation::Cuda`] (cargo feature `cuda`, a CUDA driver): device memory of that
    /// ordinal, registered GPUDirect where every NIC can, else staged through the engine's
    /// pool of pinned bounce slots (see [`MemoryRegion::gpu_path`] and `docs/gpu.md`). Without a driver:
    /// [`Error::Unsupported`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register_copy`].
    pub async fn alloc_in(&self, len: usize, location: MemoryLocation) -> Result<MemoryRegion> {
        match location {
            MemoryLocation::Host => {
                self.register_backing(Backing::host(len, self.shared().huge_pages)?, location).await
            }
            #[cfg(feature = "cuda")]
            MemoryLocation::Cuda { ordinal } => self.alloc_cuda(len, ordinal).await,
            #[allow(unreachable_patterns)]
            _ => Err(Error::Unsupported(format!(
                "registering {location} memory (cargo feature `cuda` is off)"
            ))),
        }
    }

    /// Registers `backing` with every NIC; the registrations and the backing back.
    pub(crate) async fn register_raw(
        &self,
        backing: Backing,
        location: MemoryLocation,
    ) -> Result<(Vec<crate::provider::Registration>, Backing)> {
        // Host memory up to `REGISTER_HERE_MAX`, when no pass of the reactor is running (an
        // `Event` reactor asleep, say): registered on this thread, with no round trip through
        // the reactor thread (two thread wake-ups: most of a registration's cost on tcp and
        // shm, whose registrations pin nothing). Larger ranges (whose pinning on verbs can
        // take milliseconds) and GPU memory stay off the caller's thread.
        if location == MemoryLocation::Host && backing.len() <= REGISTER_HERE_MAX {
            if let Some(r) = self.inner.registrar.register_now(backing.addr(), backing.len(), location) {
                return r.map(|regs| (regs, backing));
            }
        }
        let (tx, rx) = futures::channel::oneshot::channel();
        if self.shared().submit(Submission::Register { backing, location, reply: tx }).is_err() {
            return Err(Error::Shutdown);
        }
        ControlFuture::new(rx).await
    }

    async fn register_backing(&self, backing: Backing, location: MemoryLocation) -> Result<MemoryRegion> {
        let (regs, backing) = self.register_raw(backing, location).await?;
        Ok(MemoryRegion {
            inner: Arc::new(RegionShared::new(backing, regs, location, self.shared().clone())),
        })
    }

    /// Turns a peer's descriptor bytes (from [`RegionDescriptor::to_bytes`]) into a remote
    /// region, adding the owning engine as a peer if it is not one yet.
    ///
    /// On a transport whose target refuses a bad key without telling the writer (libfabric
    /// 1.17's `shm`), the owner is asked first whether the descriptor names a live region of
    /// its own that covers its whole range: **one control round trip** (answered by the
    /// owner's reactor thread, whatever its application is doing), paid once per descriptor
    /// while a `RemoteRegion` of it lives in this engine, not per operation. On tcp and verbs
    /// the target reports a bad key itself, and nothing is asked. `docs/faults.md`, "A bad
    /// remote access fails that operation, and only it".
    ///
    /// Errors: [`Error::Malformed`] for bytes that are not a descriptor, [`Error::Foreign`]
    /// for a descriptor of another transport or NIC count, [`Error::Stale`] for the
    /// descriptor of a region its owner revoked (freed) or of a peer that is gone, and, where
    /// the owner is asked, [`Error::RemoteAccess`] (`op` `"descriptor"`) when it does not know
    /// the key or the range leaves the key's region (a forged or corrupt descriptor, or one
    /// of a region freed so long ago that its revocation is forgotten), and
    /// [`Error::PeerUnreachable`] when the owner goes down before it answers or does not
    /// answer within `op_timeout` (30 s without one; it is then marked down, as for an
    /// operation that outlived it).
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::add_peer`]. A question already sent to the owner is answered and the
    /// answer dropped.
    pub async fn remote_region(&self, descriptor: &[u8]) -> Result<RemoteRegion> {
        let desc = RegionDescriptor::from_bytes(descriptor)?;
        desc.check_transport(&self.shared().transport)?;
        desc.check_domains(self.shared().address.domains.len())?;
        let owner = EngineAddress {
            transport: desc.transport.clone(),
            domains: desc.domains.iter().map(|d| d.address.clone()).collect(),
            incarnation: desc.incarnation,
        };
        let peer = self.add_peer(&owner.to_bytes()).await?;
        let key =
            RegionKey { incarnation: desc.incarnation, base: desc.domains[0].base, key: desc.domains[0].key };
        let revoked = self.shared().revoked.flag(key).ok_or_else(|| region::revoked_error(peer))?;
        // A staged GPU region is written through its owner's pull protocol, which checks the
        // destination itself: no NIC ever uses its key.
        #[cfg(feature = "cuda")]
        let staged = desc.gpu.as_ref().is_some_and(|g| g.staged);
        #[cfg(not(feature = "cuda"))]
        let staged = false;
        if self.shared().vouch && !staged {
            let nics: Vec<(u64, u64)> = desc.domains.iter().map(|d| (d.base, d.key)).collect();
            if !self.shared().revoked.is_vouched(key, peer, &nics, desc.len) {
                let (tx, rx) = futures::channel::oneshot::channel();
                let s = Submission::Vouch {
                    peer,
                    incarnation: desc.incarnation,
                    len: desc.len,
                    regions: nics.clone(),
                    reply: tx,
                };
                if self.shared().submit(s).is_err() {
                    return Err(Error::Shutdown);
                }
                ControlFuture::new(rx).await?;
                self.shared().revoked.vouched(key, peer, &nics, desc.len);
            }
        }
        #[cfg(feature = "cuda")]
        let ipc = desc.gpu.as_ref().and_then(|g| gpu::ipc_usable(self.shared(), g));
        Ok(RemoteRegion {
            peer,
            engine: Arc::as_ptr(self.shared()) as usize,
            desc: Arc::new(desc),
            revoked,
            #[cfg(feature = "cuda")]
            ipc,
        })
    }

    /// The arrival counter of immediate `imm`. Arrivals that landed before this call are
    /// counted too; every call for the same `imm` shares one count. Always created (it
    /// counts toward [`EngineBuilder::max_counters`] but is never refused); if arrivals of
    /// `imm` were refused before it existed, its waits fail with [`Error::CounterLimit`].
    pub fn imm_counter(&self, imm: u32) -> ImmCounter {
        ImmCounter::from_cell(self.shared().counter_cell(imm)).driven_by(self.driver().cloned())
    }

    /// Gives back the counter of immediate `imm`, for applications that use an immediate per
    /// request: the counter leaves the engine's table (making room under
    /// [`EngineBuilder::max_counters`]) and its arrivals not consumed yet are discarded;
    /// returns how many (0 if `imm` had no counter). Any record that arrivals of `imm` were
    /// refused is forgotten too. The next arrival of `imm`, or the next `imm_counter(imm)`,
    /// starts a new counter from zero.
    ///
    /// Handles of the old counter keep what their waits already consumed; their waits not
    /// granted yet, and later ones, fail with [`Error::CounterRetired`]. The reactor
    /// retires the counter between two completions: an arrival it counted before goes to
    /// the old counter, one after to the new, so retire a value once its writes have all
    /// landed (its waits succeeded).
    ///
    /// # Cancel safety
    ///
    /// If dropped before completion the counter may still be retired (its arrivals not
    /// consumed discarded), and how many is then not known.
    pub async fn retire_counter(&self, imm: u32) -> Result<u64> {
        let (tx, rx) = futures::channel::oneshot::channel();
        match self.shared().submit(Submission::RetireCounter { imm, reply: tx }) {
            Ok(()) => ControlFuture::new(rx).await,
            Err(_) => Err(Error::Shutdown),
        }
    }

    /// Writes `len` bytes of `src` at `src_off` into `dst` at `dst_off`, routed by the
    /// engine's [`TransferOpts`](crate::TransferOpts) (see [`Transfers::write`]). Both ranges are bounds-checked
    /// before anything is posted.
    ///
    /// # Cancel safety
    ///
    /// See [`OpFuture`]: dropping the future does not cancel the write, and the source stays
    /// registered and allocated until the NIC is done with it.
    pub fn write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
    ) -> OpFuture {
        self.transfers().write(src, src_off, dst, dst_off, len)
    }

    /// Like [`Engine::write`], and the target counts arrivals of `imm` once the bytes have
    /// landed (see [`ImmCounter`]): one with a single NIC; with several, as many as
    /// [`Engine::write_arrivals`] says (one per shard by default).
    ///
    /// GPU memory (`docs/gpu.md`): a staged GPU source is copied into pinned bounce slots
    /// chunk by chunk, each chunk written as soon as its copy is done; into a staged GPU
    /// destination the owner pulls the bytes and counts exactly one arrival once they are
    /// in GPU memory (the future completes on its ACK); into a GPU region of a process on this host the copy engine
    /// writes it through CUDA IPC, then one imm-only write is posted.
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::write`]: the write and its immediate still happen. Staged and IPC
    /// writes hold the source region (and the IPC mapping) until their last step (the last
    /// copy, the ACK, or the imm-only write), so nothing a copy engine or NIC still uses is
    /// freed.
    #[allow(clippy::too_many_arguments)]
    pub fn write_imm(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: u32,
    ) -> OpFuture {
        self.transfers().write_imm(src, src_off, dst, dst_off, len, imm)
    }

    /// Arrivals of the immediate that [`Engine::write_imm`] of `len` bytes into `dst`
    /// produces at its owner (see [`Transfers::write_arrivals`]).
    pub fn write_arrivals(&self, dst: &RemoteRegion, len: u64) -> Result<u64> {
        self.transfers().write_arrivals(dst, len)
    }

    /// Arrivals of the immediate that [`Engine::write_paged`] of `pages` pages into `dst`
    /// produces at its owner (see [`Transfers::paged_arrivals`]).
    pub fn paged_arrivals(&self, dst: &RemoteRegion, pages: usize) -> Result<u64> {
        self.transfers().paged_arrivals(dst, pages)
    }

    /// Arrivals of the immediate that [`Engine::scatter`] with `entries` produces at each
    /// member of `group` (see [`Transfers::scatter_arrivals`]).
    pub fn scatter_arrivals(&self, group: &PeerGroup, entries: &[ScatterEntry]) -> Result<Vec<u64>> {
        self.transfers().scatter_arrivals(group, entries)
    }

    /// An imm-only write: zero bytes, one arrival of `imm` at the owner of `dst`.
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::write`].
    pub fn imm(&self, dst: &RemoteRegion, imm: u32) -> OpFuture {
        self.transfers().imm(dst, imm)
    }

    /// Reads `len` bytes of the remote region `src` at `src_off` into `dst` at `dst_off`
    /// (see [`Transfers::read`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not cancel the read: `dst` keeps being written until the
    /// NIC completes it (the region stays allocated until then).
    pub fn read(
        &self,
        dst: &MemoryRegion,
        dst_off: u64,
        src: &RemoteRegion,
        src_off: u64,
        len: u64,
    ) -> OpFuture {
        self.transfers().read(dst, dst_off, src, src_off, len)
    }

    /// Paged write with the engine's options; see [`Transfers::write_paged`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::write`].
    pub fn write_paged(
        &self,
        src: &MemoryRegion,
        dst: &RemoteRegion,
        layout: &PageLayout,
        src_pages: &[u32],
        dst_pages: &[u32],
        imm: Option<u32>,
    ) -> OpFuture {
        self.transfers().write_paged(src, dst, layout, src_pages, dst_pages, imm)
    }

    /// Scatter with the engine's options; see [`Transfers::scatter`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::write`].
    pub fn scatter(
        &self,
        src: &MemoryRegion,
        group: &PeerGroup,
        entries: &[ScatterEntry],
        imm: Option<u32>,
    ) -> OpFuture {
        self.transfers().scatter(src, group, entries, imm)
    }

    /// Many writes or many reads between any local and remote regions as one transfer;
    /// see [`Transfers::batch`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::write`].
    pub fn batch(&self, op: BatchOp, entries: &[BatchEntry<'_>]) -> OpFuture {
        self.transfers().batch(op, entries)
    }

    /// One imm-only write to every member of `group`; see [`Transfers::barrier`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::write`].
    pub fn barrier(&self, group: &PeerGroup, imm: u32) -> OpFuture {
        self.transfers().barrier(group, imm)
    }

    /// Sends a small two-sided message (at most [`Engine::max_msg_size`] bytes) to `peer`,
    /// which gets it from [`Engine::recv`]. The bytes are copied; the caller's buffer is free
    /// at once.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not cancel the send.
    pub fn send(&self, peer: PeerId, msg: &[u8]) -> OpFuture {
        let shared = self.shared();
        if peer.0 >= shared.npeers.load(Ordering::Acquire) {
            return OpFuture::failed(Error::UnknownPeer { peer: peer.0 });
        }
        if msg.len() > shared.max_msg_size {
            return OpFuture::failed(Error::MessageTooLarge { len: msg.len(), max: shared.max_msg_size });
        }
        let state = Arc::new(OpState::default());
        let mut data = Vec::with_capacity(HEADER_LEN + msg.len());
        data.push(MsgKind::User as u8);
        data.extend_from_slice(msg);
        let s = Submission::Send { peer, data: Bytes::from(data), notify: Notify::Future(state.clone()) };
        match shared.submit(s) {
            Ok(()) => OpFuture::pending(state).driven_by(self.driver()),
            Err(_) => OpFuture::failed(Error::Shutdown),
        }
    }

    /// Waits for the next two-sided message from any peer. Gives the sender's id when the
    /// engine knows it as a peer and the transport reports it. Messages are kept in arrival
    /// order, without a limit, until received; after shutdown, waiting `recv`s resolve with
    /// [`Error::Shutdown`] once the inbox is empty.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a message is only taken out of the inbox by the `poll` that returns it,
    /// so dropping the future loses nothing.
    pub fn recv(&self) -> RecvFuture {
        RecvFuture::new(self.shared().clone(), self.driver().cloned())
    }

    /// Waits for the next two-sided message from `peer`; messages of other peers stay in the
    /// inbox for [`Engine::recv`] and their own `recv_from`. Resolves with `(Some(peer),
    /// bytes)`. Only messages whose sender the transport reports are matched (`recv` shows
    /// which: `Some(id)`); on tcp, shm and verbs it does, once `peer` was added here.
    ///
    /// Unlike `recv`, which waits for anyone, this fails when the peer cannot send any more:
    /// [`Error::PeerUnreachable`] once `peer` is found down (as
    /// [`Engine::peer_events`] reports, so within the times of `docs/faults.md`) or removed,
    /// after its messages that arrived before are taken; [`Error::UnknownPeer`] for an id this
    /// engine never gave; [`Error::Shutdown`] after shutdown, once its messages are taken.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a message is only taken out of the inbox by the `poll` that returns it,
    /// so dropping the future loses nothing (a message it was woken for goes to another
    /// waiting receive).
    pub fn recv_from(&self, peer: PeerId) -> RecvFuture {
        RecvFuture::from_peer(self.shared().clone(), self.driver().cloned(), peer)
    }

    /// Synchronous fast path: posts a write with immediate that completes into `batch`
    /// instead of a future. No waker, no allocation, and (with a spinning reactor) no
    /// syscall per operation. Errors that can be seen before posting are returned here;
    /// completion errors are counted in the batch. Never sharded: one call is one operation
    /// on one NIC (the pinned one, or the next in rotation), one completion and one arrival.
    #[allow(clippy::too_many_arguments)]
    pub fn post_write_imm(
        &self,
        batch: &OpBatch,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: u32,
    ) -> Result<()> {
        let (req, keep) = self.transfers().single(Some((src, src_off)), dst, dst_off, len, Some(imm))?;
        self.post_batch(batch, req, keep)
    }

    /// Synchronous fast path for an imm-only write; see [`Engine::post_write_imm`].
    pub fn post_imm(&self, batch: &OpBatch, dst: &RemoteRegion, imm: u32) -> Result<()> {
        let (req, keep) = self.transfers().single(None, dst, 0, 0, Some(imm))?;
        self.post_batch(batch, req, keep)
    }

    fn post_batch(&self, batch: &OpBatch, req: OpReq, keep: Option<Arc<RegionShared>>) -> Result<()> {
        if let Some(d) = self.driver() {
            // The batch's spin drives this engine (the first engine it is used with).
            let _ = batch.state.driver.set(d.clone());
        }
        let notify = Notify::Batch(Arc::<BatchState>::clone(&batch.state));
        self.submit_op(Submission::Op { req, keep, notify }).map_err(|_| Error::Shutdown)
    }
}
