//! The transfer engine: the handle users hold, the state it shares with its reactor thread,
//! and the queue between them.
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
//! every domain of the engine; callers reach it through one queue. Control requests
//! (registration, peers) travel the same queue, so their order relative to operations is
//! the order the caller issued them in.

#[doc(hidden)]
pub mod bench_hooks;
pub(crate) mod op;
pub(crate) mod region;
mod transfer;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;

use crate::counter::{CounterCell, ImmCounter};
use crate::error::{Error, Result};
use crate::provider::{Domain, MemoryLocation, Registration, RemoteSlice};
use crate::pure::descriptor::{EngineAddress, RegionDescriptor};
use crate::pure::route::{PageLayout, TransferOpts};
use crate::reactor::{self, sys::EventFd};
use crate::sync::lock;
use std::sync::{Arc, Mutex};

pub use op::{ControlFuture, OpBatch, OpFuture};
pub use region::{MemoryRegion, RemoteRegion};
pub use transfer::{PeerGroup, ScatterEntry, Transfers};

use op::{BatchState, Notify, OpState, Reply};
use region::{Backing, RegionShared};

/// A peer of this engine: an index into its peer table. Only meaningful to the engine that
/// returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How the reactor thread waits for work. Chosen when the engine is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReactorMode {
    /// Sleep on the completion queue's wait fd and the submission eventfd when idle: about
    /// zero CPU while nothing happens; a wake-up costs a few microseconds. On providers with
    /// no wait fd (libfabric `shm`, EFA) the reactor cannot sleep on the NIC: for 1 ms after
    /// the last activity it keeps polling (so a transfer in progress, whose target side must
    /// poll for it to progress, is not paced by timer sleeps), then polls at an interval that
    /// backs off from 50 µs to `EngineBuilder::idle_poll_interval` (1 ms by default), so an
    /// arrival on an idle engine is seen within that interval.
    #[default]
    Event,
    /// Spin for `spin` after the last activity, then behave like `Event`.
    Adaptive {
        /// How long to keep spinning after the last completion or submission.
        spin: Duration,
    },
    /// Spin continuously (one core at 100%): the lowest latency, for MoE paths.
    BusyPoll,
}

/// One operation as the reactor will post it.
pub(crate) struct OpReq {
    pub(crate) domain: usize,
    pub(crate) peer: PeerId,
    pub(crate) kind: OpKind,
    /// Local address and length (`0, 0` for an imm-only write).
    pub(crate) local_addr: u64,
    pub(crate) len: usize,
    pub(crate) remote: RemoteSlice,
    pub(crate) imm: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Write,
    Read,
}

impl OpKind {
    pub(crate) fn name(self, imm: Option<u32>) -> &'static str {
        match (self, imm) {
            (OpKind::Write, Some(_)) => "write_imm",
            (OpKind::Write, None) => "write",
            (OpKind::Read, _) => "read",
        }
    }
}

/// What callers hand the reactor.
pub(crate) enum Submission {
    Op { req: OpReq, keep: Option<Arc<RegionShared>>, notify: Notify },
    Send { peer: PeerId, data: Bytes, notify: Notify },
    Register { backing: Backing, location: MemoryLocation, reply: Reply<(Vec<Registration>, Backing)> },
    Deregister { regs: Vec<Registration>, backing: Backing },
    AddPeer { address: EngineAddress, reply: Reply<PeerId> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueState {
    Open,
    /// Shutdown requested: no new submissions; the reactor is draining.
    Closing,
    /// The reactor has closed every NIC object; memory may be freed directly.
    Closed,
}

pub(crate) struct Queue {
    pub(crate) state: QueueState,
    pub(crate) items: Vec<Submission>,
    /// The reactor is (about to be) asleep and must be woken through the eventfd.
    pub(crate) sleeping: bool,
    /// Memory of regions dropped while the reactor was closing: freed once it has closed
    /// the registrations.
    pub(crate) graveyard: Vec<Backing>,
}

/// Received two-sided messages and the tasks waiting for them.
#[derive(Default)]
pub(crate) struct Inbox {
    pub(crate) msgs: VecDeque<(Option<PeerId>, Bytes)>,
    waiters: Vec<(u64, Waker)>,
    next_id: u64,
    pub(crate) closed: bool,
}

impl Inbox {
    pub(crate) fn push(&mut self, m: (Option<PeerId>, Bytes)) -> Option<Waker> {
        self.msgs.push_back(m);
        self.pop_waiter()
    }

    pub(crate) fn pop_waiter(&mut self) -> Option<Waker> {
        if self.waiters.is_empty() {
            None
        } else {
            Some(self.waiters.remove(0).1)
        }
    }

    pub(crate) fn take_waiters(&mut self) -> Vec<Waker> {
        self.waiters.drain(..).map(|(_, w)| w).collect()
    }
}

/// Every immediate value's counter, created on first use (an arrival or a call).
#[derive(Default)]
pub(crate) struct CounterTable {
    map: HashMap<u32, Arc<CounterCell>>,
    /// The engine has shut down: counters are born closed.
    closed: bool,
}

/// State shared by the engine handle, its futures and its reactor thread.
pub(crate) struct Shared {
    pub(crate) transport: String,
    pub(crate) address: EngineAddress,
    pub(crate) max_msg_size: usize,
    pub(crate) queue: Mutex<Queue>,
    /// Hint that `queue.items` is non-empty, so a spinning reactor need not take the lock.
    pub(crate) has_items: AtomicBool,
    pub(crate) wake: EventFd,
    pub(crate) counters: Mutex<CounterTable>,
    /// Number of peers added so far (peer ids are `0..npeers`).
    pub(crate) npeers: AtomicU32,
    pub(crate) inbox: Mutex<Inbox>,
    /// Number of NICs (domains).
    pub(crate) nics: usize,
    /// Routing and arrival defaults of the engine's own transfer methods.
    pub(crate) default_opts: TransferOpts,
    /// Where the next sharded transfer starts (round-robin over NICs).
    pub(crate) rotation: AtomicUsize,
    /// Every NIC's write completions are delivery-complete ([`Domain::delivery_complete`]).
    pub(crate) delivery_complete: bool,
}

impl Shared {
    /// The state of a new engine: an open, empty queue and no peers or counters.
    pub(crate) fn new(
        transport: String,
        address: EngineAddress,
        max_msg_size: usize,
        nics: usize,
        default_opts: TransferOpts,
        delivery_complete: bool,
    ) -> Result<Shared> {
        Ok(Shared {
            transport,
            address,
            max_msg_size,
            queue: Mutex::new(Queue {
                state: QueueState::Open,
                items: Vec::with_capacity(1024),
                sleeping: false,
                graveyard: Vec::new(),
            }),
            has_items: AtomicBool::new(false),
            wake: EventFd::new()?,
            counters: Mutex::new(CounterTable::default()),
            npeers: AtomicU32::new(0),
            inbox: Mutex::new(Inbox::default()),
            nics,
            default_opts,
            rotation: AtomicUsize::new(0),
            delivery_complete,
        })
    }

    /// Hands every submission to the reactor under one lock. Gives them back if the engine
    /// is shutting down (then none was queued).
    pub(crate) fn submit_all(&self, mut s: Vec<Submission>) -> std::result::Result<(), Vec<Submission>> {
        let mut q = lock(&self.queue);
        if q.state != QueueState::Open {
            return Err(s);
        }
        q.items.append(&mut s);
        let wake = std::mem::take(&mut q.sleeping);
        self.has_items.store(true, Ordering::Release);
        drop(q);
        if wake {
            self.wake.notify();
        }
        Ok(())
    }

    /// The NIC the next transfer starts on.
    pub(crate) fn next_start(&self) -> usize {
        if self.nics <= 1 {
            0
        } else {
            self.rotation.fetch_add(1, Ordering::Relaxed) % self.nics
        }
    }

    /// Hands `s` to the reactor. Gives it back if the engine is shutting down.
    pub(crate) fn submit(&self, s: Submission) -> std::result::Result<(), Submission> {
        let mut q = lock(&self.queue);
        if q.state != QueueState::Open {
            return Err(s);
        }
        q.items.push(s);
        let wake = std::mem::take(&mut q.sleeping);
        self.has_items.store(true, Ordering::Release);
        drop(q);
        if wake {
            self.wake.notify();
        }
        Ok(())
    }

    /// Asks the reactor to stop.
    pub(crate) fn request_shutdown(&self) {
        let mut q = lock(&self.queue);
        if q.state == QueueState::Open {
            q.state = QueueState::Closing;
        }
        drop(q);
        self.has_items.store(true, Ordering::Release);
        self.wake.notify();
    }

    /// Called when a region is dropped: its registrations must be closed before its memory
    /// is freed, and only the reactor may close them while it runs.
    pub(crate) fn retire(&self, regs: Vec<Registration>, backing: Backing) {
        let mut q = lock(&self.queue);
        match q.state {
            QueueState::Open => {
                q.items.push(Submission::Deregister { regs, backing });
                let wake = std::mem::take(&mut q.sleeping);
                self.has_items.store(true, Ordering::Release);
                drop(q);
                if wake {
                    self.wake.notify();
                }
            }
            QueueState::Closing => q.graveyard.push(backing),
            // Every NIC object is closed: nothing can touch the memory any more.
            QueueState::Closed => {
                drop(q);
                drop(backing);
            }
        }
    }

    pub(crate) fn counter_cell(&self, imm: u32) -> Arc<CounterCell> {
        let mut t = lock(&self.counters);
        let closed = t.closed;
        t.map
            .entry(imm)
            .or_insert_with(|| {
                let c = CounterCell::new(imm);
                if closed {
                    c.close();
                }
                Arc::new(c)
            })
            .clone()
    }

    /// Shutdown: every counter, present and future, stops waiting for arrivals.
    pub(crate) fn close_counters(&self) {
        let cells: Vec<Arc<CounterCell>> = {
            let mut t = lock(&self.counters);
            t.closed = true;
            t.map.values().cloned().collect()
        };
        for c in cells {
            c.close();
        }
    }
}

/// Settings of an engine. Start from [`Engine::builder`].
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    pub(crate) provider: String,
    pub(crate) mode: ReactorMode,
    pub(crate) pin_core: Option<usize>,
    pub(crate) idle_poll_interval: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) recv_depth: usize,
    pub(crate) send_depth: usize,
    pub(crate) max_msg_size: usize,
    pub(crate) node: Option<String>,
    pub(crate) op_timeout: Option<Duration>,
    pub(crate) nics: Vec<String>,
    pub(crate) domains: Option<usize>,
    pub(crate) transfer: TransferOpts,
    pub(crate) verbs_port: Option<u8>,
    pub(crate) verbs_gid_index: Option<u32>,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        EngineBuilder {
            provider: std::env::var("FABRIC_PROVIDER").unwrap_or_else(|_| "tcp".into()),
            mode: ReactorMode::Event,
            pin_core: None,
            idle_poll_interval: Duration::from_millis(1),
            shutdown_grace: Duration::from_secs(2),
            recv_depth: 64,
            send_depth: 64,
            max_msg_size: 8192,
            node: None,
            op_timeout: Some(Duration::from_secs(30)),
            nics: Vec::new(),
            domains: None,
            transfer: TransferOpts::default(),
            verbs_port: None,
            verbs_gid_index: None,
        }
    }
}

impl EngineBuilder {
    /// The transport: `"tcp"` (default; loopback unless `node` says otherwise), `"shm"`,
    /// `"udp"` (slow, for small tests), `"efa"`, or any libfabric provider name; or
    /// `"verbs"` / `"verbs:DEVICE"` for the ibverbs backend (cargo feature `verbs`). The
    /// environment variable `FABRIC_PROVIDER` sets the default.
    pub fn provider(mut self, name: impl Into<String>) -> Self {
        self.provider = name.into();
        self
    }

    /// How the reactor waits (see [`ReactorMode`]). Default: `Event`.
    pub fn mode(mut self, mode: ReactorMode) -> Self {
        self.mode = mode;
        self
    }

    /// Pins the reactor thread to this CPU core (any mode; most useful with `BusyPoll`).
    pub fn pin_core(mut self, core: usize) -> Self {
        self.pin_core = Some(core);
        self
    }

    /// Longest poll interval of an idle `Event`-mode reactor on a provider without a wait fd.
    pub fn idle_poll_interval(mut self, d: Duration) -> Self {
        self.idle_poll_interval = d;
        self
    }

    /// How long shutdown waits for in-flight operations to complete before cancelling them.
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// Largest two-sided message, in bytes (default 8192), and how many receives are kept
    /// posted (default 64).
    pub fn messages(mut self, max_msg_size: usize, recv_depth: usize) -> Self {
        self.max_msg_size = max_msg_size;
        self.recv_depth = recv_depth;
        self
    }

    /// The local address to bind (for `tcp`/`udp`: an IP address; default `127.0.0.1`).
    pub fn node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    /// verbs: the port of every device to use. Default: the first ACTIVE port. Building an
    /// engine on another provider with this set is an [`Error::Config`].
    pub fn verbs_port(mut self, port: u8) -> Self {
        self.verbs_port = Some(port);
        self
    }

    /// verbs: the GID index to use on every device, instead of the one chosen by type and
    /// address (RoCEv2 with an IPv4 address first, then RoCEv2 IPv6, then RoCEv1/IB; never a
    /// fixed index). For setups whose routable GID is not the first of its kind, such as a
    /// RoCE VLAN interface. `FABRIC_VERBS_GID_INDEX` sets it from the environment (the
    /// builder method wins). An index outside the port's GID table, or one naming an empty
    /// entry, fails the build with [`Error::Config`]. Building an engine on another provider
    /// with this set is an [`Error::Config`].
    pub fn verbs_gid_index(mut self, index: u32) -> Self {
        self.verbs_gid_index = Some(index);
        self
    }

    /// How long an operation may go without a completion before it fails with
    /// [`Error::PeerUnreachable`] and its peer is marked failed (default 30 s; `None`: wait
    /// forever). This is what turns a dead peer into an error instead of a hang on
    /// transports that never report one (libfabric `tcp` keeps retrying a vanished peer).
    /// The operation's memory stays pinned until the NIC lets go of it or the engine shuts
    /// down, so a late completion can never touch freed memory.
    pub fn op_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.op_timeout = timeout;
        self
    }

    /// The NICs to drive, by name, in order (NIC `i` of every descriptor and of
    /// [`Route::Pinned`](crate::Route::Pinned) is the `i`-th name): verbs device names
    /// (`"mlx5_0"`, `"rxe1"`) for `verbs`, libfabric domain names (`"rdmap16s27-rdm"`) for
    /// libfabric providers. `provider("verbs:mlx5_0,mlx5_1")` says the same for verbs.
    /// Memory is registered on every NIC, and peers must have the same number of NICs.
    /// Default: the provider's first NIC.
    pub fn nics<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.nics = names.into_iter().map(Into::into).collect();
        self
    }

    /// Opens `n` domains (endpoints) on the one NIC of the provider, as if it were `n` NICs:
    /// the loopback stand-in for a multi-NIC machine (each `tcp` domain is its own endpoint
    /// and connections), and a way to spread traffic over more queue pairs of one real NIC.
    /// With [`EngineBuilder::nics`], `n` must equal the number of names.
    pub fn domains(mut self, n: usize) -> Self {
        self.domains = Some(n);
        self
    }

    /// How the engine's transfer methods spread transfers over NICs and what the target
    /// counts (default: [`TransferOpts::default`], 1 MiB shards round-robin, one arrival per
    /// shard). [`Engine::with`] overrides it for some calls.
    pub fn transfer(mut self, opts: TransferOpts) -> Self {
        self.transfer = opts;
        self
    }

    /// The NICs and reactor core that `topology` plans for GPU `gpu` (see
    /// `docs/topology.md`): sets the provider (`verbs` for ConnectX and software RoCE NICs,
    /// `efa` for EFA, whose libfabric domains are named `<device>-rdm`), the NIC list, and
    /// pins the reactor thread to the plan's reactor core. A later [`EngineBuilder::pin_core`]
    /// or [`EngineBuilder::nics`] overrides what this set.
    ///
    /// Errors ([`Error::Config`]): no such GPU, or no RDMA NIC for it (a machine without
    /// one: use a libfabric provider such as `tcp` instead).
    pub fn for_gpu(mut self, topology: &crate::topology::Topology, gpu: usize) -> Result<Self> {
        use crate::topology::NicKind;
        let plan = topology.plan(gpu).ok_or_else(|| {
            Error::Config(format!("GPU {gpu} is not in the topology ({} GPU(s))", topology.plans().len()))
        })?;
        if plan.nics.is_empty() {
            return Err(Error::Config(format!("the topology has no RDMA NIC for GPU {gpu} ({})", plan.pci)));
        }
        let kinds: Vec<NicKind> =
            plan.nics.iter().map(|n| topology.nic(n).map_or(NicKind::Verbs, |nic| nic.kind)).collect();
        if kinds.contains(&NicKind::Efa) {
            if kinds.iter().any(|k| *k != NicKind::Efa) {
                return Err(Error::Config(format!(
                    "GPU {gpu}'s NICs {:?} mix EFA and verbs devices; one engine speaks one transport",
                    plan.nics
                )));
            }
            self.provider = "efa".into();
            self.nics = plan.nics.iter().map(|n| format!("{n}-rdm")).collect();
        } else {
            self.provider = "verbs".into();
            self.nics = plan.nics.clone();
        }
        if let Some(core) = plan.reactor_core {
            self.pin_core = Some(core as usize);
        }
        Ok(self)
    }

    /// The provider this builder will open.
    pub fn provider_name(&self) -> &str {
        &self.provider
    }

    /// The NIC names set by [`EngineBuilder::nics`] or [`EngineBuilder::for_gpu`] (empty:
    /// the provider's first NIC).
    pub fn nic_names(&self) -> &[String] {
        &self.nics
    }

    /// The core the reactor thread will be pinned to, if any.
    pub fn reactor_core(&self) -> Option<usize> {
        self.pin_core
    }

    /// The NIC names to open (`None`: the provider's default NIC), checked against
    /// `domains(n)`.
    fn nic_list(&self, names: Vec<String>) -> Result<Vec<Option<String>>> {
        let list: Vec<Option<String>> =
            if names.is_empty() { vec![None] } else { names.into_iter().map(Some).collect() };
        match self.domains {
            None => Ok(list),
            Some(0) => Err(Error::Config("domains(0): an engine needs at least one NIC".into())),
            Some(n) if list.len() == 1 => Ok(vec![list[0].clone(); n]),
            Some(n) if n == list.len() => Ok(list),
            Some(n) => Err(Error::Config(format!("domains({n}) with {} NIC names", list.len()))),
        }
    }

    /// Opens the NIC(s) and starts the reactor thread.
    pub fn build(self) -> Result<Engine> {
        if self.max_msg_size == 0 || self.recv_depth == 0 || self.send_depth == 0 {
            return Err(Error::Config("message size and queue depths must be non-zero".into()));
        }
        let verbs = self.provider == "verbs" || self.provider.starts_with("verbs:");
        if !verbs && (self.verbs_port.is_some() || self.verbs_gid_index.is_some()) {
            return Err(Error::Config(format!(
                "verbs_port / verbs_gid_index apply to the verbs provider, not {:?}",
                self.provider
            )));
        }
        if verbs {
            #[cfg(feature = "verbs")]
            {
                let gid_index = match (self.verbs_gid_index, std::env::var("FABRIC_VERBS_GID_INDEX")) {
                    (Some(i), _) => Some(i),
                    (None, Ok(v)) => Some(v.trim().parse().map_err(|_| {
                        Error::Config(format!("FABRIC_VERBS_GID_INDEX={v:?} is not a GID index"))
                    })?),
                    (None, Err(_)) => None,
                };
                let names: Vec<String> = match self.provider.strip_prefix("verbs:") {
                    Some(_) if !self.nics.is_empty() => {
                        return Err(Error::Config(format!(
                            "provider {:?} names devices and nics() names {:?}: use one",
                            self.provider, self.nics
                        )));
                    }
                    Some(list) => list.split(',').map(|d| d.trim().to_owned()).collect(),
                    None => self.nics.clone(),
                };
                if names.iter().any(String::is_empty) {
                    return Err(Error::Config(format!("bad verbs provider name {:?}", self.provider)));
                }
                let mut domains = Vec::new();
                for device in self.nic_list(names)? {
                    let cfg = crate::provider::verbs::VerbsConfig {
                        device,
                        port: self.verbs_port,
                        gid_index,
                        max_msg_size: self.max_msg_size,
                        ..Default::default()
                    };
                    domains.push(crate::provider::verbs::VerbsDomain::open(&cfg)?);
                }
                return Engine::start(domains, self);
            }
            #[cfg(not(feature = "verbs"))]
            return Err(Error::ProviderNotFound {
                provider: self.provider,
                reason: "fabric-runtime was built without the `verbs` feature".into(),
            });
        }
        #[cfg(feature = "libfabric")]
        {
            let mut domains = Vec::new();
            for domain in self.nic_list(self.nics.clone())? {
                let cfg = crate::provider::libfabric::LibfabricConfig {
                    provider: self.provider.clone(),
                    node: self.node.clone(),
                    max_msg_size: self.max_msg_size,
                    domain,
                    ..Default::default()
                };
                domains.push(crate::provider::libfabric::LibfabricDomain::open(&cfg)?);
            }
            Engine::start(domains, self)
        }
        #[cfg(not(feature = "libfabric"))]
        Err(Error::ProviderNotFound {
            provider: self.provider,
            reason: "fabric-runtime was built without the `libfabric` feature".into(),
        })
    }
}

struct EngineInner {
    shared: Arc<Shared>,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
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
        };
        let max_msg_size = domains.iter().map(|d| d.max_msg_size()).min().unwrap_or(0).min(cfg.max_msg_size);
        let delivery_complete = domains.iter().all(|d| d.delivery_complete());
        let shared = Arc::new(Shared::new(
            transport,
            address,
            max_msg_size,
            domains.len(),
            cfg.transfer,
            delivery_complete,
        )?);
        let thread = reactor::spawn(domains, shared.clone(), cfg)?;
        Ok(Engine { inner: Arc::new(EngineInner { shared, thread: std::sync::Mutex::new(Some(thread)) }) })
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// Stops the engine now (see the type's docs). Operations after this fail with
    /// [`Error::Shutdown`]. Does not wait for the reactor thread; dropping the last clone does.
    pub fn shutdown(&self) {
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
    /// [`TransferOpts::check_one_arrival`]).
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
    /// # Cancel safety
    ///
    /// If dropped before completion the peer may still be added; adding it again is cheap
    /// and returns the same id.
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

    /// Registers `data` with every NIC of the engine; the region owns it from now on.
    ///
    /// # Cancel safety
    ///
    /// If dropped before completion, a registration that completes anyway is closed again
    /// and the memory freed by the reactor.
    pub async fn register(&self, data: Vec<u8>) -> Result<MemoryRegion> {
        self.register_backing(Backing::from_vec(data)?, MemoryLocation::Host).await
    }

    /// Allocates `len` zeroed bytes aligned to 4096 and registers them.
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register`].
    pub async fn alloc(&self, len: usize) -> Result<MemoryRegion> {
        self.alloc_in(len, MemoryLocation::Host).await
    }

    /// Allocates and registers `len` bytes in `location`. Only [`MemoryLocation::Host`] is
    /// implemented; GPU memory returns [`Error::Unsupported`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register`].
    pub async fn alloc_in(&self, len: usize, location: MemoryLocation) -> Result<MemoryRegion> {
        if location != MemoryLocation::Host {
            return Err(Error::Unsupported(format!("registering {location} memory")));
        }
        self.register_backing(Backing::zeroed(len, 4096)?, location).await
    }

    async fn register_backing(&self, backing: Backing, location: MemoryLocation) -> Result<MemoryRegion> {
        let (tx, rx) = futures::channel::oneshot::channel();
        if self.shared().submit(Submission::Register { backing, location, reply: tx }).is_err() {
            return Err(Error::Shutdown);
        }
        let (regs, backing) = ControlFuture::new(rx).await?;
        Ok(MemoryRegion {
            inner: Arc::new(RegionShared::new(backing, regs, location, self.shared().clone())),
        })
    }

    /// Turns a peer's descriptor bytes (from [`RegionDescriptor::to_bytes`]) into a remote
    /// region, adding the owning engine as a peer if it is not one yet.
    ///
    /// Errors: [`Error::Malformed`] for bytes that are not a descriptor, [`Error::Foreign`]
    /// for a descriptor of another transport or NIC count.
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::add_peer`].
    pub async fn remote_region(&self, descriptor: &[u8]) -> Result<RemoteRegion> {
        let desc = RegionDescriptor::from_bytes(descriptor)?;
        desc.check_transport(&self.shared().transport)?;
        desc.check_domains(self.shared().address.domains.len())?;
        let owner = EngineAddress {
            transport: desc.transport.clone(),
            domains: desc.domains.iter().map(|d| d.address.clone()).collect(),
        };
        let peer = self.add_peer(&owner.to_bytes()).await?;
        Ok(RemoteRegion { peer, engine: Arc::as_ptr(self.shared()) as usize, desc: Arc::new(desc) })
    }

    /// The arrival counter of immediate `imm`. Arrivals that landed before this call are
    /// counted too; every call for the same `imm` shares one count.
    pub fn imm_counter(&self, imm: u32) -> ImmCounter {
        ImmCounter::from_cell(self.shared().counter_cell(imm))
    }

    /// Writes `len` bytes of `src` at `src_off` into `dst` at `dst_off`, routed by the
    /// engine's [`TransferOpts`] (see [`Transfers::write`]). Both ranges are bounds-checked
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
    /// # Cancel safety
    ///
    /// As for [`Engine::write`]: the write and its immediate still happen.
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
        let s = Submission::Send {
            peer,
            data: Bytes::copy_from_slice(msg),
            notify: Notify::Future(state.clone()),
        };
        match shared.submit(s) {
            Ok(()) => OpFuture::pending(state),
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
        RecvFuture { shared: self.shared().clone(), id: None }
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
        let (req, keep) = self.transfers().single(Some((src, src_off)), dst, dst_off, len, imm)?;
        self.post_batch(batch, req, keep)
    }

    /// Synchronous fast path for an imm-only write; see [`Engine::post_write_imm`].
    pub fn post_imm(&self, batch: &OpBatch, dst: &RemoteRegion, imm: u32) -> Result<()> {
        let (req, keep) = self.transfers().single(None, dst, 0, 0, imm)?;
        self.post_batch(batch, req, keep)
    }

    fn post_batch(&self, batch: &OpBatch, req: OpReq, keep: Option<Arc<RegionShared>>) -> Result<()> {
        let notify = Notify::Batch(Arc::<BatchState>::clone(&batch.state));
        self.shared().submit(Submission::Op { req, keep, notify }).map_err(|_| Error::Shutdown)
    }
}

/// Future returned by [`Engine::recv`].
#[must_use = "futures do nothing unless polled"]
pub struct RecvFuture {
    shared: Arc<Shared>,
    id: Option<u64>,
}

impl fmt::Debug for RecvFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecvFuture")
    }
}

impl Future for RecvFuture {
    type Output = Result<(Option<PeerId>, Bytes)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let mut inbox = lock(&this.shared.inbox);
        if let Some(m) = inbox.msgs.pop_front() {
            if let Some(id) = this.id.take() {
                inbox.waiters.retain(|(i, _)| *i != id);
            }
            return Poll::Ready(Ok(m));
        }
        if inbox.closed {
            return Poll::Ready(Err(Error::Shutdown));
        }
        let id = match this.id {
            Some(id) => id,
            None => {
                let id = inbox.next_id;
                inbox.next_id += 1;
                this.id = Some(id);
                id
            }
        };
        match inbox.waiters.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => inbox.waiters.push((id, cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl Drop for RecvFuture {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut inbox = lock(&self.shared.inbox);
        let before = inbox.waiters.len();
        inbox.waiters.retain(|(i, _)| *i != id);
        // We may have been woken for a message we will never take: pass the wake-up on.
        let next =
            if before == inbox.waiters.len() && !inbox.msgs.is_empty() { inbox.pop_waiter() } else { None };
        drop(inbox);
        if let Some(w) = next {
            w.wake();
        }
    }
}
