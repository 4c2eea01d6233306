//! [`EngineBuilder`]: an engine's settings, and opening its NICs.

use std::time::Duration;

use super::Engine;
use crate::env;
use crate::error::{Error, Result};
use crate::pure::route::TransferOpts;
use crate::reactor::{ReactorConfig, ReactorMode};

mod gpu;

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
    pub(crate) inline_spin: Duration,
    /// Not `Inline`: how long a pending future runs passes on its own thread before parking.
    pub(crate) await_spin: Duration,
    /// Not `Inline`, without `await_spin`: how long a pending future lingers before parking.
    pub(crate) await_linger: Duration,
    /// Post on the submitter's thread while the reactor sleeps.
    pub(crate) direct_post: bool,
    /// How long the reactor keeps polling after its last activity before it sleeps.
    pub(crate) poll_window: Duration,
    pub(crate) time_reactor: bool,
    pub(crate) huge_pages: bool,
    /// The most immediate counters arrivals may create.
    pub(crate) max_counters: usize,
    pub(crate) nics: Vec<String>,
    pub(crate) domains: Option<usize>,
    pub(crate) transfer: TransferOpts,
    pub(crate) verbs_port: Option<u8>,
    pub(crate) verbs_gid_index: Option<u32>,
    /// verbs keep-alive period (`Some(None)`: off); `None`: the backend's default.
    pub(crate) verbs_keepalive: Option<Option<Duration>>,
    /// Chunk size of staged GPU pulls.
    pub(crate) staging_chunk: u64,
    pub(crate) staging_pool: u64,
    /// Write same-host GPU destinations through CUDA IPC.
    pub(crate) cuda_ipc: bool,
    /// `libfabric_hmem`: `None` takes `FABRIC_LIBFABRIC_HMEM` (default off).
    pub(crate) libfabric_hmem: Option<bool>,
    /// CUDA streams per device for the engine's copies.
    pub(crate) cuda_streams: usize,
    /// Fault injection (tests only).
    #[cfg(feature = "faults")]
    pub(crate) faults: Option<crate::provider::faults::FaultPlan>,
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
            inline_spin: Duration::from_micros(20),
            await_spin: env::micros("FABRIC_AWAIT_SPIN_US").unwrap_or(Duration::ZERO),
            await_linger: env::micros("FABRIC_AWAIT_LINGER_US")
                .unwrap_or_else(|| with_many_cpus(LINGER_DEFAULT)),
            direct_post: env::switch("FABRIC_DIRECT_POST", true),
            poll_window: env::micros("FABRIC_POLL_WINDOW_US")
                .unwrap_or_else(|| with_many_cpus(POLL_WINDOW_DEFAULT)),
            time_reactor: false,
            huge_pages: env::switch("FABRIC_HUGE_PAGES", true),
            max_counters: env::count("FABRIC_MAX_COUNTERS").unwrap_or(MAX_COUNTERS_DEFAULT),
            nics: Vec::new(),
            domains: None,
            transfer: TransferOpts::default(),
            verbs_port: None,
            verbs_gid_index: None,
            verbs_keepalive: None,
            staging_chunk: 4 << 20,
            staging_pool: 64 << 20,
            cuda_ipc: true,
            libfabric_hmem: None,
            cuda_streams: DEFAULT_CUDA_STREAMS,
            #[cfg(feature = "faults")]
            faults: None,
        }
    }
}

/// [`EngineBuilder::max_counters`]' default.
/// `EngineBuilder::cuda_streams` by default.
pub(crate) const DEFAULT_CUDA_STREAMS: usize = 4;

pub(crate) const MAX_COUNTERS_DEFAULT: usize = crate::pure::counter_table::DEFAULT_LIMIT;

/// CPUs from which [`EngineBuilder::await_linger`] and [`EngineBuilder::poll_window`] are
/// on by default.
pub(crate) const LINGER_MIN_CPUS: usize = 8;

/// [`EngineBuilder::await_linger`]'s default budget where it is on.
pub(crate) const LINGER_DEFAULT: Duration = Duration::from_micros(200);

/// [`EngineBuilder::poll_window`]'s default where it is on.
pub(crate) const POLL_WINDOW_DEFAULT: Duration = Duration::from_micros(250);

/// `d` where this process may run on [`LINGER_MIN_CPUS`] or more CPUs (those online, capped
/// by a cgroup CPU quota), else zero: a thread that polls or spins must not take a core the
/// transfer itself needs. Not the building thread's own affinity: an engine built on a
/// thread pinned to one core (as a latency-critical loop is) would otherwise never linger
/// on a machine of many.
fn with_many_cpus(d: Duration) -> Duration {
    if crate::sys::machine_cpus() >= LINGER_MIN_CPUS {
        d
    } else {
        Duration::ZERO
    }
}

/// Named sets of the latency settings ([`EngineBuilder::latency_profile`]): a reactor mode
/// and the options that trade CPU for round-trip time (`docs/latency.md`), chosen together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LatencyProfile {
    /// Least CPU: `Event` mode, an idle reactor sleeps at once and every pending future parks
    /// at once (`await_linger`, `poll_window` and `await_spin` 0). Each hop of a round trip
    /// pays OS wake-ups. For many engines per machine, or a few cores shared with other work.
    LowCpu,
    /// `Event` mode with lingering futures (200 µs) and a poll window (250 µs): the defaults
    /// of a machine with 8 or more CPUs, whatever this one has. Busy cores only around
    /// activity; an idle engine sleeps.
    Balanced,
    /// `BusyPoll`: the reactor thread spins (one core per engine, always) and lingering
    /// futures (200 µs) drive the NICs themselves. Pin it with [`EngineBuilder::pin_core`].
    /// For latency-critical loops (MoE dispatch, decode steps) with a core to spare.
    LowLatency,
}

impl EngineBuilder {
    /// Sets the reactor mode and every latency option at once from a named profile
    /// (`docs/latency.md`, "Choosing a path"); options set after this call override the
    /// profile's. Without a profile the defaults depend on the machine: `await_linger` and
    /// `poll_window` are on with 8 or more CPUs (counting a cgroup's CPU quota) and off
    /// below, which a container's quota can change; `Engine::stats` shows what was chosen.
    pub fn latency_profile(mut self, p: LatencyProfile) -> Self {
        let (mode, linger, window) = match p {
            LatencyProfile::LowCpu => (ReactorMode::Event, Duration::ZERO, Duration::ZERO),
            LatencyProfile::Balanced => (ReactorMode::Event, LINGER_DEFAULT, POLL_WINDOW_DEFAULT),
            LatencyProfile::LowLatency => (ReactorMode::BusyPoll, LINGER_DEFAULT, Duration::ZERO),
        };
        self.mode = mode;
        self.await_linger = linger;
        self.poll_window = window;
        self.await_spin = Duration::ZERO;
        self
    }

    /// The latency settings an engine built now would run with.
    pub(crate) fn settings(&self) -> crate::engine::stats::EngineSettings {
        crate::engine::stats::EngineSettings {
            mode: self.mode,
            await_linger: self.await_linger,
            poll_window: self.poll_window,
            await_spin: self.await_spin,
            direct_post: self.direct_post,
            cpus: crate::sys::machine_cpus(),
        }
    }

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

    /// [`ReactorMode::Inline`]: how long a pending future spins inside one `poll` (running
    /// reactor passes on the caller's thread) before it hands the thread back to the
    /// executor and asks to be polled again (default 20 µs). Longer keeps more hops inside
    /// one poll; shorter lets other tasks of the same runtime run sooner.
    pub fn inline_spin(mut self, d: Duration) -> Self {
        self.inline_spin = d;
        self
    }

    /// `Event`, `Adaptive` and `BusyPoll`: how long a pending future (an operation's,
    /// a `wait_for`, a `recv`) keeps its thread inside one `poll` running reactor passes
    /// there, as an `Inline` engine's would, before it registers its waker and parks until
    /// the reactor thread wakes it. Default 0 (no spin; the environment variable
    /// `FABRIC_AWAIT_SPIN_US` sets another default).
    ///
    /// For round trips on an engine that must not spin while idle: an operation or arrival
    /// that completes within the spin costs no OS wake-up of the awaiting thread (what that
    /// saves on tcp and shm round trips: `docs/latency.md`). While callers spin, the reactor
    /// thread stands by; a caller that parks tells it at once. The cost is the awaiting
    /// thread's CPU while it spins, and other tasks of its runtime wait that long: leave it at
    /// 0 where many tasks await at once (a `join_all` of a thousand transfers would spin for
    /// each pending one). An idle engine spins nowhere: only a `poll` of a pending future
    /// does. Bandwidth loops gain nothing measurable from it (`docs/latency.md`,
    /// "`await_spin`").
    pub fn await_spin(mut self, d: Duration) -> Self {
        self.await_spin = d;
        self
    }

    /// `Event`, `Adaptive` and `BusyPoll`: how long a pending future (an operation's, a
    /// `wait_for`, a `recv`) keeps checking for its result before it registers its waker and
    /// parks its thread until the reactor thread wakes it. Default: 200 µs on a machine
    /// where this process may run on 8 or more CPUs (online, within its cgroup's CPU quota;
    /// the building thread's own affinity does not count), else 0 (off); the environment variable
    /// `FABRIC_AWAIT_LINGER_US` sets another default. Ignored with [`Self::await_spin`]
    /// (which runs passes itself) and in [`ReactorMode::Inline`] (which never parks).
    ///
    /// While it lingers, each `poll` of the future looks for its result for up to 20 µs and,
    /// still pending, asks its executor to poll it again (as `tokio::task::yield_now` does),
    /// so other tasks of the runtime run in between; the reactor thread meanwhile keeps
    /// polling the NICs rather than sleeping, yielding its core when a pass finds nothing.
    /// The result is then seen as soon as it lands, with no OS wake-up of either thread on
    /// its path: a parked thread on an idle CPU takes microseconds to wake, which a stream of
    /// writes pays once per window and a round trip once per hop (what it saves:
    /// `docs/latency.md`, "Lingering awaits").
    ///
    /// One future of an engine lingers at a time (the first to find itself pending; the
    /// others wait as without lingering), each `poll` of it spins for at most 20 µs before it
    /// hands the thread back, and a lingerer that nobody polls again stops counting at the
    /// end of its budget all the same.
    ///
    /// On a [`ReactorMode::BusyPoll`] engine the lingering future also drives the NICs: it
    /// runs the reactor's pass between its peeks (first up to 32 passes before it takes the
    /// engine's lingering slot, which most waits of a round trip never need), while the
    /// reactor thread stands by (the round trips it saves: `docs/latency.md`). A budget of 0
    /// there makes futures park at once; the synchronous spin paths drive all the same.
    ///
    /// The cost is CPU while something is awaited and has not completed: the awaiting
    /// thread and the reactor thread each keep a core busy for up to this long per wait (a
    /// wait that ends sooner stops sooner; [`ReactorStats`](crate::ReactorStats) counts the
    /// waits that lingered and those that parked). An idle engine, with nothing awaited,
    /// spins nowhere. On a machine with few CPUs the spinning threads would take the cores
    /// the transfer itself needs (on 2 cores a tcp stream fell to half), hence no default
    /// there. 0 turns it off.
    ///
    /// Lingering turns itself off while it does not pay: when more than half of the last 64
    /// lingering futures spent their budget and parked anyway (results that take longer than
    /// the budget, as in a deep pipeline of CUDA IPC copies), futures park at once, but one
    /// in 16, whose outcome tells when results are quick again (`ReactorStats::linger_skipped`
    /// counts the others): a lingering spin that runs out ends in a wake-up that costs the
    /// reactor more than the spin saved (measured on CUDA IPC streams: `docs/gpu.md`).
    pub fn await_linger(mut self, d: Duration) -> Self {
        self.await_linger = d;
        self
    }

    /// How long the reactor thread keeps polling after its last activity (a pass that
    /// posted, completed or counted anything) before it sleeps on the NICs' wait fds, in
    /// `Event` mode (and `Adaptive` after its spin, `Inline` while nobody drives). It polls
    /// yielding the core, so a thread waiting to run on it goes first. Default: 250 µs on
    /// machines with 8 or more CPUs (as [`Self::await_linger`]), else 0: sleep at once.
    ///
    /// A provider whose progress is driven by polling (libfabric `tcp`: the target's polls
    /// read the socket, the initiator's send the data) moves nothing while its reactor
    /// sleeps, and each wake-up costs microseconds during which its socket buffer fills and
    /// the sender stalls. A stream whose writes complete more often than the window keeps
    /// it open, so its reactors never sleep mid-transfer; larger writes, which arrive
    /// further apart, let it sleep between arrivals at no measured cost (there the sender
    /// limits the stream). What the window gains on tcp: `docs/performance.md`, "The poll
    /// window".
    /// The cost is CPU just after activity: up to this long per burst of work, one core
    /// while work arrives more often than this (as the raw loop, which spins all along); an
    /// idle engine still sleeps. On a NIC with no wait fd (shm, EFA) the reactor polls for
    /// at least 1 ms after activity anyway. `FABRIC_POLL_WINDOW_US` sets the default; 0
    /// turns it off.
    pub fn poll_window(mut self, d: Duration) -> Self {
        self.poll_window = d;
        self
    }

    /// Whether an operation submitted while the reactor thread sleeps (`Event`, `Adaptive`
    /// after its window, `Inline` while nobody drives) is posted on the submitter's own
    /// thread, in a reactor pass run there, instead of waking the reactor thread to post it.
    /// On by default: it takes one OS wake-up (several microseconds) off every operation
    /// started on an idle engine, such as each hop of a ping-pong. Only on an idle engine:
    /// with operations in flight the reactor thread is woken to post it (their completions
    /// wake it anyway), so a stream of writes has one thread in the NIC instead of two
    /// taking turns on its lock (which cost bandwidth on tcp). The pass takes the
    /// reactor's lock only if it is free (never waits for it) and also completes whatever it
    /// finds in the completion queues; registrations, peer changes and the synchronous
    /// `post_*` path (`OpBatch`: no allocation and no reactor work on its caller's thread)
    /// always go to the reactor thread. Used only where every NIC has a completion wait fd (tcp, verbs): on
    /// a provider without one (shm, EFA), only the reactor thread's poll window moves a
    /// transfer, so it is woken as before. `FABRIC_DIRECT_POST=0` (or `off`, `false`, `no`) sets
    /// the default to off.
    ///
    /// In [`ReactorMode::Inline`] it means more, on every provider: each write (a future's,
    /// or the synchronous path's) is posted on the caller's thread when it is submitted,
    /// whenever no other thread is in a pass, instead of being queued for the caller's next
    /// pass; the caller already drives the NICs there. Operations keep their order: what was
    /// queued before is posted first. [`Engine::direct_posts`](crate::Engine::direct_posts)
    /// counts both kinds.
    pub fn direct_post(mut self, on: bool) -> Self {
        self.direct_post = on;
        self
    }

    /// Whether the reactor times its calls into the NIC backends (post, poll) and its
    /// handling of completions, for [`ReactorStats`](crate::ReactorStats)' `in_post`,
    /// `in_poll` and `completing`: where a reactor thread's time goes, and whether it is
    /// the bottleneck of a transfer (its NIC calls near its whole time) or waits for its
    /// callers. Off by default: it reads the clock twice per call (tens of nanoseconds,
    /// which an imm-only stream on verbs would notice); the figures are then zero.
    pub fn time_reactor(mut self, on: bool) -> Self {
        self.time_reactor = on;
        self
    }

    /// Whether host regions of 2 MiB and more ([`Engine::alloc`](crate::Engine::alloc),
    /// [`Engine::register_copy`](crate::Engine::register_copy)) are aligned to 2 MiB and advised to use
    /// transparent huge pages (`madvise(MADV_HUGEPAGE)`). On by default; the environment
    /// variable `FABRIC_HUGE_PAGES=0` (or `off`, `false`, `no`) turns the default off.
    ///
    /// Every walk over a region's pages then takes one step per 2 MiB instead of per 4 KiB:
    /// shm's copy (`process_vm_readv` pins the source pages of every write), a verbs NIC's
    /// pinning and mapping at registration, the TLB (measured: `docs/performance.md`, "Huge
    /// pages").
    ///
    /// The kernel decides at the first touch of each 2 MiB: with THP `never`, or no free huge
    /// page, the memory is ordinary small pages and works the same. The cost: a touched 2 MiB
    /// is resident as a whole, so a large region used sparsely takes more memory than it
    /// would in 4 KiB pages (`docs/operations.md`, "Host memory").
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// The most immediate counters that **arrivals** may create: 65,536 by default (or
    /// `FABRIC_MAX_COUNTERS`). Every distinct immediate a peer sends gets a counter that
    /// keeps its arrivals until a wait consumes them, so without a bound a peer that sends
    /// millions of values (hostile, or leaking per-request immediates) grows this engine's
    /// memory without end. A full table of 65,536 took about 22 MiB of resident memory in
    /// `tests/counter_limit.rs` (`docs/security.md`, "Immediates").
    ///
    /// Below the limit nothing changes: arrivals that land before anybody asked for their
    /// counter are kept. Once the table holds `n` counters, an arrival of a value that has
    /// none is **refused**: counted in [`EngineStats::imm_refused`](crate::EngineStats::imm_refused),
    /// logged (the first, then at most one `warn` per 10 s), and remembered (the last 4,096
    /// values refused), so that a counter created for that value later knows its count is
    /// short: a wait it cannot satisfy from what it holds fails with
    /// [`Error::CounterLimit`](crate::Error::CounterLimit) instead of waiting for arrivals
    /// that were dropped. Arrivals of a value that has a counter are never refused.
    ///
    /// Counters the application asks for ([`Engine::imm_counter`](crate::Engine::imm_counter),
    /// `gpu_counter`) are always created and count toward the table's size, leaving less
    /// room for arrivals; give them back with
    /// [`Engine::retire_counter`](crate::Engine::retire_counter) (per-request immediates).
    /// `0` counts only the values the application asked for. `docs/imm-counter.md`, "A
    /// bounded table".
    pub fn max_counters(mut self, n: usize) -> Self {
        self.max_counters = n;
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

    /// verbs: how long a connected peer with nothing in flight may go without a completion
    /// before it gets a keep-alive probe (a zero-length RDMA write its NIC answers alone), so
    /// that a dead peer is found within about a second even when nothing is posted to it
    /// (`docs/faults.md`). Default 100 ms; `None` turns the probes off (a dead peer is then
    /// found by the next operation to it). `FABRIC_VERBS_KEEPALIVE_MS` sets it from the
    /// environment (0: off; the builder method wins). Ignored by other providers.
    pub fn verbs_keepalive(mut self, period: Option<Duration>) -> Self {
        self.verbs_keepalive = Some(period);
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

    /// Test only (cargo feature `faults`): wraps every NIC of the engine in
    /// [`Faulty`](crate::provider::faults::Faulty), which refuses posts with `Again` and
    /// fails completions at the plan's rates (`docs/operations.md`, "Fault injection").
    /// Without this call, `FABRIC_FAULTS=again=0.1,fail=0.01,seed=7` sets the plan; with
    /// neither, the NICs are opened unwrapped. Probabilities outside `0..=1` fail the build
    /// with [`Error::Config`] before any NIC is opened.
    #[cfg(feature = "faults")]
    pub fn faults(mut self, plan: crate::provider::faults::FaultPlan) -> Self {
        self.faults = Some(plan);
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

    /// How long a pending future will linger before it parks ([`Self::await_linger`]: the
    /// value set, or this machine's default); zero when it does not linger, including with
    /// `await_spin` or in `Inline` mode.
    pub fn linger_budget(&self) -> Duration {
        if self.mode == ReactorMode::Inline || !self.await_spin.is_zero() {
            Duration::ZERO
        } else {
            self.await_linger
        }
    }

    /// How long the reactor thread will keep polling after its last activity before it
    /// sleeps ([`Self::poll_window`]: the value set, or this machine's default); zero in
    /// `BusyPoll` mode, whose reactor never sleeps. On a NIC with no wait fd it polls for
    /// at least 1 ms all the same.
    pub fn reactor_poll_window(&self) -> Duration {
        if self.mode == ReactorMode::BusyPoll {
            Duration::ZERO
        } else {
            self.poll_window
        }
    }

    /// What the reactor thread needs of these settings.
    pub(crate) fn reactor_config(&self) -> ReactorConfig {
        ReactorConfig {
            mode: self.mode,
            pin_core: self.pin_core,
            idle_poll_interval: self.idle_poll_interval,
            shutdown_grace: self.shutdown_grace,
            recv_depth: self.recv_depth,
            send_depth: self.send_depth,
            op_timeout: self.op_timeout,
            msg_slot: self.max_msg_size + crate::pure::control::HEADER_LEN,
            inline_spin: self.inline_spin,
            await_spin: self.await_spin,
            await_linger: self.await_linger,
            direct_post: self.direct_post,
            poll_window: self.poll_window,
            time_calls: self.time_reactor,
        }
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
        self.staging_slots()?;
        #[cfg(feature = "faults")]
        if let Some(plan) = &self.faults {
            plan.validate()?;
        }
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
                let keepalive = match (self.verbs_keepalive, std::env::var("FABRIC_VERBS_KEEPALIVE_MS")) {
                    (Some(k), _) => k,
                    (None, Ok(v)) => match v.trim().parse::<u64>() {
                        Ok(0) => None,
                        Ok(ms) => Some(Duration::from_millis(ms)),
                        Err(_) => {
                            return Err(Error::Config(format!(
                                "FABRIC_VERBS_KEEPALIVE_MS={v:?} is not a whole number of milliseconds"
                            )))
                        }
                    },
                    (None, Err(_)) => Some(crate::provider::verbs::DEFAULT_KEEPALIVE),
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
                        keepalive,
                        ..Default::default()
                    };
                    domains.push(crate::provider::verbs::VerbsDomain::open(&cfg)?);
                }
                return start(domains, self);
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
                let cfg = crate::provider::libfabric::LibfabricConfig {
                    hmem: self.libfabric_hmem.unwrap_or(cfg.hmem),
                    ..cfg
                };
                domains.push(crate::provider::libfabric::LibfabricDomain::open(&cfg)?);
            }
            start(domains, self)
        }
        #[cfg(not(feature = "libfabric"))]
        Err(Error::ProviderNotFound {
            provider: self.provider,
            reason: "fabric-runtime was built without the `libfabric` feature".into(),
        })
    }
}

/// Starts the engine over `domains`, each wrapped in a fault injector when a plan is set.
#[cfg(feature = "faults")]
fn start<D: crate::provider::Domain>(domains: Vec<D>, cfg: EngineBuilder) -> Result<Engine> {
    use crate::provider::faults::{FaultPlan, Faulty};
    let plan = match &cfg.faults {
        Some(plan) => Some(plan.clone()),
        None => FaultPlan::from_env()?,
    };
    let Some(plan) = plan else { return Engine::start(domains, cfg) };
    tracing::warn!(again = plan.again, fail = plan.fail, seed = plan.seed, "fault injection on");
    let wrapped = domains.into_iter().enumerate().map(|(i, d)| Faulty::new(d, &plan, i as u64)).collect();
    Engine::start(wrapped, cfg)
}

/// Starts the engine over `domains`.
#[cfg(not(feature = "faults"))]
fn start<D: crate::provider::Domain>(domains: Vec<D>, cfg: EngineBuilder) -> Result<Engine> {
    Engine::start(domains, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_pool_is_cut_into_chunks_and_bad_sizes_are_refused() {
        let b = EngineBuilder::default();
        assert_eq!(b.staging_slots().unwrap(), (16, 4 << 20), "default: 16 x 4 MiB");
        let b = EngineBuilder::default().staging_pool(2 << 20).staging_chunk(1 << 20);
        assert_eq!(b.staging_slots().unwrap(), (2, 1 << 20));
        // Rounded down to whole slots; one slot is enough.
        let b = EngineBuilder::default().staging_pool((5 << 20) + 7).staging_chunk(2 << 20);
        assert_eq!(b.staging_slots().unwrap(), (2, 2 << 20));
        let b = EngineBuilder::default().staging_pool(4096).staging_chunk(4096);
        assert_eq!(b.staging_slots().unwrap(), (1, 4096));

        let err = |b: EngineBuilder| match b.staging_slots() {
            Err(Error::Config(m)) => m,
            other => panic!("expected Config, got {other:?}"),
        };
        assert!(err(EngineBuilder::default().staging_chunk(0)).contains("staging_chunk(0)"));
        let m = err(EngineBuilder::default().staging_pool(1 << 20).staging_chunk(4 << 20));
        assert!(m.contains("smaller than one staging_chunk"), "{m}");
        assert!(err(EngineBuilder::default().staging_pool(0)).contains("at least one slot"));
        let m = err(EngineBuilder::default().staging_pool(1 << 40).staging_chunk(1));
        assert!(m.contains("at most 1048575"), "{m}");
        // `build` refuses the same settings before opening anything.
        let e = EngineBuilder::default().provider("tcp").staging_pool(1).build().unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e}");
    }

    #[test]
    fn the_poll_window_is_what_was_set_and_none_on_busy_poll() {
        let us = Duration::from_micros;
        let b = EngineBuilder::default().poll_window(us(70));
        assert_eq!(b.reactor_poll_window(), us(70));
        assert_eq!(b.reactor_config().poll_window, us(70));
        let b = b.mode(ReactorMode::Adaptive { spin: us(10) });
        assert_eq!(b.reactor_poll_window(), us(70));
        assert_eq!(b.mode(ReactorMode::BusyPoll).reactor_poll_window(), Duration::ZERO);
        // The default follows the machine's CPUs (unless FABRIC_POLL_WINDOW_US says).
        if std::env::var_os("FABRIC_POLL_WINDOW_US").is_none() {
            let want = with_many_cpus(POLL_WINDOW_DEFAULT);
            assert_eq!(EngineBuilder::default().reactor_poll_window(), want);
        }
    }

    #[test]
    fn max_counters_is_65536_unless_set() {
        if std::env::var_os("FABRIC_MAX_COUNTERS").is_none() {
            assert_eq!(EngineBuilder::default().max_counters, 65_536);
        }
        assert_eq!(EngineBuilder::default().max_counters(10).max_counters, 10);
    }
}
