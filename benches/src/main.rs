//! fabric-bench: the engine measured beside its ceiling, in the same run.
//!
//! ```text
//! cargo run --release -p fabric-bench -- <bw|lat|rate|wake|scale|all> [--provider tcp|shm|verbs[:DEV]]
//!     [--domains N|1,2,4] [--sizes 4K,1M,..] [--iters N] [--window N] [--json PATH] [--plot PATH] [--quick]
//!     [--mode event|adaptive|busypoll|inline] [--location host|cuda|cuda:N,M] [--buffer hot,cold]
//!     [--fabtests DIR] [--peer nixl,nccl]
//! ```
//!
//! `--help` (and `fabric-bench TEST --help`) explains every option; the options go before or
//! after the test's name.
//!
//! This process is the leader. It starts a second copy of itself as the peer; the two meet
//! through a `TcpStore` on 127.0.0.1 and then run the same sequence of phases, each side
//! playing its role (`run.rs`: the tests in order, then the report). Every engine figure is
//! printed beside a baseline measured in the same run: the raw provider loop (`raw.rs`: the
//! provider's domain driven through the `Domain` trait by a plain thread), libfabric's own
//! fabtests when `--fabtests DIR` is given (`fabtests.rs`: `fi_rma_bw`, `fi_rdm_pingpong`),
//! iperf3 for tcp bandwidth when it is installed, and perftest's `ib_write_bw` /
//! `ib_write_lat` for verbs (`perftest.rs`), and with `--peer` NIXL and NCCL beside bw's rows
//! (`peers/`). On verbs the tests move less data ([`on_verbs`]):
//! the only verbs device here is Soft-RoCE in an emulated VM, ~20-45 MB/s.
//!
//! One module per test: `bw.rs`, `lat.rs`, `rate.rs`, `wake.rs`, `scale.rs`, `rtt.rs`.
//! `soak` (`soak/`) and `moe` (`moe.rs`: fabric-moe on GPUs beside NCCL) have command lines of
//! their own.
//! Shared: `pair.rs` (the two processes, their meeting point, engine and raw sides; it
//! imports no test), `pattern.rs` (bw's `--buffer hot|cold` offsets), `measure.rs` (CPU, RSS,
//! percentiles, units), `report.rs` (table, JSON, plot), `progress.rs` (the progress
//! display). This file parses the command line and dispatches to `run.rs`.

mod account;
mod bw;
mod fabtests;
mod gpu;
mod lat;
mod measure;
mod moe;
mod pair;
mod pattern;
mod peers;
mod perftest;
mod pin;
mod progress;
mod rate;
mod raw;
mod report;
mod rtt;
mod run;
mod scale;
mod soak;
mod wake;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use fabric_async::ReactorMode;

/// The engine measured beside its ceiling, in the same run.
///
/// This process is the leader: it starts a second copy of itself as the peer, both meet
/// through a TcpStore on 127.0.0.1, and every engine figure is printed beside a baseline
/// measured in the same run. Traffic stays on loopback (FI_TCP_IFACE=lo unless set).
#[derive(Parser, Debug)]
#[command(
    name = "fabric-bench",
    subcommand_required = true,
    arg_required_else_help = true,
    args_override_self = true,
    after_help = "Baselines: the raw provider loop (the provider's domain driven by a plain thread), \
                  fabtests 1.17 with --fabtests DIR (fi_rma_bw, fi_rdm_pingpong; tcp and shm), \
                  iperf3 on tcp, ib_write_bw / ib_write_lat (perftest) on verbs, NIXL and NCCL with \
                  --peer (bw).\n\
                  The options go before or after the test's name. Progress goes to stderr, the \
                  table to stdout.\n\
                  `fabric-bench soak --help`: the soak (peers killed and restarted, every byte and \
                  immediate checked), a command of its own.\n\
                  `fabric-bench moe --help`: fabric-moe's dispatch/combine on this host's GPUs \
                  (NVLink, proxy over shm and tcp) beside NCCL's all_to_all_single, a command of \
                  its own."
)]
struct Cli {
    #[command(subcommand)]
    test: Test,
    /// The transport: tcp, shm or verbs[:DEV].
    ///
    /// tcp: libfabric's tcp;ofi_rxm on 127.0.0.1. shm: libfabric's shared memory. verbs[:DEV]:
    /// ibverbs RC queue pairs on the first device with an active port, or on DEV (on these
    /// machines only inside the Soft-RoCE VM, where every test moves less data).
    #[arg(long, global = true, value_name = "PROVIDER", default_value = "tcp", value_parser = provider)]
    provider: String,
    /// NICs (domains) per engine; bw also takes a list (1,2,4): one engine per count.
    ///
    /// EngineBuilder::domains: engine writes are sharded over N domains in 1 MiB shards and the
    /// receiver waits for write_arrivals per write. The raw baselines stay on one domain. With
    /// a list, bw runs its sweep with an engine of each count (rows say `N domains`); the
    /// other tests take one count only.
    #[arg(long, global = true, value_name = "N|N,N,..", default_value = "1", value_parser = domain_list)]
    domains: DomainList,
    /// bw's access pattern, for the engine and the raw loop alike: hot, cold or hot,cold.
    ///
    /// hot: every write from offset 0 of the source to offset 0 of the target, a buffer of the
    /// write's size (what fabtests' fi_rma_bw does) at the start of a region of at least
    /// 4 MiB. cold: writes swept sequentially over a region of max(4 x last-level cache,
    /// window x largest size) per side (the LLC from /sys/devices/system/cpu/cpu0/cache, else
    /// 32 MiB; at most 256 MiB, or 4 x LLC up to 1 GiB; verbs 64 MiB). Every row names its pattern [default: hot,cold; --quick: cold].
    #[arg(long, global = true, value_name = "hot|cold|hot,cold", value_parser = buffer_list)]
    buffer: Option<Buffers>,
    /// A directory of fabtests 1.17 binaries: run them beside the engine and the raw loop.
    ///
    /// bw: fi_rma_bw -e rdm -o writedata -W WINDOW -S SIZE -I OPS per size and repetition
    /// (RMA writes with remote CQ data, always from/to offset 0: hot; where bw pins, client and
    /// server on the CPUs of the raw loop's two threads). lat: fi_rdm_pingpong -S
    /// SIZE at lat's sizes, wake: at 8 B (send/recv; it prints one-way latency, the rows show
    /// 2x, a mean round trip). Rows get columns fabtests, engine/ft and raw/ft. Server and
    /// client on 127.0.0.1, -p tcp (tcp;ofi_rxm) or -p shm; not on verbs. Without it the rows
    /// say "skipped: no --fabtests DIR".
    #[arg(long, global = true, value_name = "DIR")]
    fabtests: Option<PathBuf>,
    /// The bw sweep's sizes, comma-separated (4096, 4K, 4KiB, 1M, 64MiB, 1G).
    ///
    /// Default 4 KiB..64 MiB by factors of 4 (--quick: 4K,64K,1M,4M; verbs: 4 KiB..1 MiB,
    /// --quick 4K,64K,1M; --location cuda: 1M..256M, --quick 4M,64M,256M).
    #[arg(long, global = true, value_name = "4K,64K,1M,..", value_parser = sizes)]
    sizes: Option<Sizes>,
    /// Operations per bw point, round trips per lat case (and the most per wake case),
    /// operations per rate run.
    ///
    /// Default: sized per test (bw about 1 GiB per point, lat 3000 round trips, rate 200,000
    /// operations); smaller with --quick and on verbs.
    #[arg(long, global = true, value_name = "N", value_parser = positive)]
    iters: Option<usize>,
    /// Writes in flight in bw and scale [default: 16; verbs: 128].
    ///
    /// 16 as in the fabtests reference numbers; on verbs 128, the default send queue depth
    /// (-t) of ib_write_bw, the baseline there.
    #[arg(long, global = true, value_name = "N", value_parser = positive)]
    window: Option<usize>,
    /// Writes the results as JSON to PATH (the shape benches/check_json.py checks).
    #[arg(long, global = true, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Where the PNG plot of the bw sweep goes [default: target/fabric-bench/bw-<provider>.png].
    ///
    /// Written whenever bw ran.
    #[arg(long, global = true, value_name = "PATH")]
    plot: Option<PathBuf>,
    /// A smoke run (seconds): fewer sizes, operations and repetitions.
    #[arg(long, global = true)]
    quick: bool,
    /// The engine's reactor mode in bw and rate (lat and wake choose their own).
    #[arg(long, global = true, value_name = "MODE", value_enum, default_value_t = Mode::Event)]
    mode: Mode,
    /// Where bw's engine regions live: host, cuda, cuda:N or cuda:N,M.
    ///
    /// cuda: after the host sweep (engine vs the raw loop, as with host), the same sizes
    /// between GPU regions, sender on cuda:0 and receiver on cuda:1 when two GPUs exist,
    /// else both on cuda:0 (cuda:N,M: sender on N, receiver on M). Two engine rows per size:
    /// staged (cuda_ipc off: D2H chunk by chunk into pinned bounce slots, the transport, a
    /// pull into the receiver's slots and H2D; --staging-pool / --staging-chunk size them) at the
    /// receiver), against the slowest of its ceilings: pinned D2H on the sender's GPU,
    /// pinned H2D on the receiver's, and the host->host engine row at that size; and CUDA
    /// IPC (a peer copy, then an imm-only write), against the peer copy cuda:N->cuda:M
    /// (cuMemcpyDtoD when N = M). The copy ceilings are measured in the same run with
    /// cuda::Stream and listed as gpu-ceiling rows. Default sizes 1M..256M by factors of 4
    /// (--quick: 4M,64M,256M). Without a CUDA driver the GPU rows say "skipped: no CUDA
    /// driver"; FABRIC_REQUIRE_CUDA=1 makes that an error.
    #[arg(long, global = true, value_name = "LOC", default_value = "host", value_parser = gpu::parse_location)]
    location: gpu::Location,
    /// Staged GPU rows: bytes of each engine's pinned bounce pool
    /// (EngineBuilder::staging_pool; default 64M).
    #[arg(long, global = true, value_name = "BYTES", value_parser = one_size)]
    staging_pool: Option<usize>,
    /// Staged GPU rows: bytes per bounce slot, the chunk of every staged copy
    /// (EngineBuilder::staging_chunk; default 4M).
    #[arg(long, global = true, value_name = "BYTES", value_parser = one_size)]
    staging_chunk: Option<usize>,
    /// bw: a CompletionWatch on each side's engine (Event mode, providers whose NICs have a
    /// completion wait fd: tcp, verbs), so the awaiting runtime's thread wakes on completions
    /// and runs the reactor passes itself instead of being woken by the reactor thread.
    #[arg(long, global = true)]
    watch: bool,
    /// bw: time each side's NIC thread (the engine's reactor, EngineBuilder::time_reactor, and
    /// the raw loop's thread) inside the provider's post and poll calls and in completion
    /// handling; rows `bw-time` give per write the NIC calls' microseconds and the engine's
    /// completion work, and each thread's busy share of the burst, sender and receiver
    /// (docs/performance.md). Two clock reads per call, in both.
    #[arg(long, global = true)]
    time_calls: bool,
    /// Every test's engines: a pending future runs reactor passes on its own thread
    /// for up to US microseconds before it parks (EngineBuilder::await_spin; Event, Adaptive
    /// and BusyPoll mode) [default: 0, or FABRIC_AWAIT_SPIN_US].
    #[arg(long, global = true, value_name = "US")]
    await_spin: Option<u64>,
    /// Every test's engines: a pending future looks for its result at each poll and asks to
    /// be polled again for up to US microseconds before it parks, while the reactor thread
    /// polls instead of sleeping (EngineBuilder::await_linger; Event, Adaptive and BusyPoll
    /// mode; 0: off) [default: the engine's, 200 us with 8 or more CPUs, else 0, or
    /// FABRIC_AWAIT_LINGER_US]. The run's first line says what the engines do.
    #[arg(long, global = true, value_name = "US")]
    await_linger: Option<u64>,
    /// Every test's engines: the reactor thread keeps polling for US microseconds after its
    /// last activity before it sleeps (EngineBuilder::poll_window; Event, Adaptive after its
    /// spin, Inline; 0: sleep at once) [default: the engine's, 250 us with 8 or more CPUs,
    /// else 0, or FABRIC_POLL_WINDOW_US]. The run's first line says what the engines do.
    #[arg(long, global = true, value_name = "US")]
    poll_window: Option<u64>,
    /// Host regions of 2 MiB and more, the engine's (EngineBuilder::huge_pages) and the raw
    /// loop's alike, aligned to 2 MiB and advised to use transparent huge pages; with `on`,
    /// bw's fi_rma_bw runs with glibc's malloc tunable glibc.malloc.hugetlb=1 to match.
    /// `off`: 4 KiB pages everywhere (bw's rows say "[4 KiB pages]").
    #[arg(long, global = true, value_name = "on|off", value_enum, default_value_t = Switch::On)]
    huge_pages: Switch,
    /// rtt: interleaved rounds, each running every path once [default: 7; --quick: 2].
    /// bw: bursts per size and pattern, engine and raw loop in each, the raw loop first in
    /// every second one [default: 3; --quick: 1].
    #[arg(long, global = true, value_name = "N", value_parser = positive)]
    rounds: Option<usize>,
    /// Install a tracing subscriber (fmt to stderr at level info) in both processes.
    ///
    /// fabric's per-transfer events are at debug, so with `on` they are disabled by the
    /// subscriber's level rather than by the absence of one: run a test with `off` and `on`
    /// (e.g. `rate --tracing on`) to see that cost (docs/operations.md).
    #[arg(long, global = true, value_name = "off|on", value_enum, default_value_t = Tracing::Off)]
    tracing: Tracing,
    /// bw: other libraries as baselines in the same run: nixl, nccl (a comma list, or the
    /// option repeated; none by default).
    ///
    /// After the bw sweep, each peer moves the same sizes with --window blocks per request,
    /// two processes on this host, and its row (median of --rounds bursts) goes beside the
    /// engine's, ratio engine / peer. nixl: NIXL's UCX backend (the nixl-cu13 wheel, found
    /// through PYTHONPATH), host memory at bw's sizes and --buffer patterns, and with
    /// --location cuda GPU S -> GPU R beside the CUDA IPC rows; UCX held to the engine's
    /// transport (UCX_TLS=tcp,self on lo beside tcp, sm,self beside shm,
    /// cuda_ipc,cuda_copy,tcp,self beside CUDA IPC; UCX_TLS in the environment wins), each row
    /// naming the transport UCX reported. nccl: torch.distributed NCCL
    /// send/recv, GPU rows only. Run by FABRIC_PYTHON or python3; a peer that cannot run
    /// here gets a row "skipped: <why>" (docs/gpu.md).
    #[arg(long, global = true, value_name = "nixl,nccl", num_args = 0..=1, default_missing_value = "",
          action = clap::ArgAction::Append, value_parser = peer_list)]
    peer: Vec<PeerList>,
    /// Internal: run as the peer of the leader whose TcpStore is at ADDR.
    #[arg(long, global = true, hide = true, value_name = "ADDR")]
    peer_of: Option<String>,
}

/// `--tracing`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Tracing {
    /// No subscriber: every tracing call is a disabled callsite.
    Off,
    /// A fmt subscriber at info on stderr.
    On,
}

/// An option that is on or off.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Switch {
    On,
    Off,
}

/// The tests. `all` runs them in this order.
#[derive(Subcommand, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    /// write_imm bandwidth over a size sweep, --window writes in flight.
    ///
    /// Sizes 4 KiB..64 MiB by factors of 4 (verbs: 4 KiB..1 MiB), median of 3 bursts of about
    /// 1 GiB each, timed until every local completion and the receiver's ack. Baselines: the
    /// raw loop (same sizes and window), iperf3 -l 1M on tcp, ib_write_bw on verbs. Writes
    /// the PNG plot (--plot). With --location cuda, then GPU->GPU rows (staged and CUDA IPC)
    /// beside their copy ceilings measured in the same run (docs/gpu.md).
    Bw,
    /// write_imm ping-pong round trip p50/p99 (8 B, 256 B, 4 KiB).
    ///
    /// 3000 round trips per size, the first 10% dropped; the engine in Event mode (BusyPoll on
    /// shm, which has no CQ wait fd). Baselines: the raw loop's ping-pong, ib_write_lat on verbs.
    Lat,
    /// imm-only operations per second, window 64.
    ///
    /// Through futures (median of 3 runs) and through post_imm + OpBatch. Baseline: the raw
    /// loop's imm-only rate.
    Rate,
    /// 8 B ping-pong in Event, Adaptive, BusyPoll, Inline and the sync spin path, with CPU use.
    ///
    /// Each case sized to about 3 s by a short probe; the process's CPU while ping-ponging and
    /// while idle with the engine up. Baselines: the raw loop's ping-pong and its CPU, and an
    /// OS thread park/unpark round trip.
    Wake,
    /// 1..256 peer engines, and 1..100,000 futures in flight.
    ///
    /// One engine writes 64 KiB write_imm round-robin to k peer engines (bandwidth against the
    /// 1-peer figure, RSS per peer); then n imm futures created at once (rate against the raw
    /// loop's imm rate, RSS per future).
    Scale,
    /// The latency-critical 8 B round trip against the raw loop, interleaved and pinned.
    ///
    /// The raw loop, the Inline spin path, Inline futures, Event futures and Event futures
    /// with a CompletionWatch (providers with a CQ wait fd), each run in every one of
    /// --rounds rounds (order rotated each round), each side's measuring thread pinned to a
    /// physical core of its own (not cpu 0's; no pinning below three cores). Rows: the median
    /// p50 over the rounds, and the median of the per-round ratios to the raw loop with
    /// their range. 2000 round trips per path per round (--iters).
    Rtt,
    /// Every test: bw, lat, rate, wake, scale, rtt.
    All,
    /// The soak: peers killed and restarted, every byte and immediate checked (`fabric-bench
    /// soak --help`: a command line of its own).
    Soak,
    /// fabric-moe's dispatch/combine on this host's GPUs beside NCCL (`fabric-bench moe
    /// --help`: a command line of its own).
    Moe,
}

impl Test {
    pub fn name(self) -> &'static str {
        match self {
            Test::Bw => "bw",
            Test::Lat => "lat",
            Test::Rate => "rate",
            Test::Wake => "wake",
            Test::Scale => "scale",
            Test::Rtt => "rtt",
            Test::All => "all",
            Test::Soak => "soak",
            Test::Moe => "moe",
        }
    }
}

/// `--mode`: the engine's `ReactorMode` in bw and rate.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The reactor sleeps on the completion channel when idle.
    Event,
    /// Spins 200 us after activity, then sleeps as Event.
    Adaptive,
    /// The reactor polls without sleeping (a core per engine).
    Busypoll,
    /// Awaiting tasks drive the NICs themselves and never park (ReactorMode::Inline).
    Inline,
}

impl From<Mode> for ReactorMode {
    fn from(m: Mode) -> ReactorMode {
        match m {
            Mode::Event => ReactorMode::Event,
            Mode::Adaptive => ReactorMode::Adaptive { spin: Duration::from_micros(200) },
            Mode::Busypoll => ReactorMode::BusyPoll,
            Mode::Inline => ReactorMode::Inline,
        }
    }
}

/// The `--sizes` list (one value, comma-separated: a later `--sizes` replaces it).
#[derive(Clone, Debug)]
struct Sizes(Vec<usize>);

/// The `--domains` list (`2`, or `1,2,4` for bw).
#[derive(Clone, Debug)]
struct DomainList(Vec<usize>);

/// The `--buffer` list.
#[derive(Clone, Debug)]
struct Buffers(Vec<pattern::Pattern>);

/// One `--peer` value.
#[derive(Clone, Debug)]
struct PeerList(Vec<peers::Peer>);

/// The run, as the tests see it.
#[derive(Clone, Debug)]
pub struct Opts {
    pub test: Test,
    pub provider: String,
    pub sizes: Option<Vec<usize>>,
    pub iters: Option<usize>,
    pub window: usize,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub quick: bool,
    /// Reactor mode of the engine in bw and rate (default Event).
    pub mode: ReactorMode,
    pub peer_of: Option<String>,
    /// NICs (domains) per engine: `EngineBuilder::domains`. The raw baselines use one. The
    /// first of `--domains` (the only one outside bw, [`Opts::check`]).
    pub domains: usize,
    /// Every count of `--domains`: bw runs an engine of each.
    pub domain_counts: Vec<usize>,
    /// bw's access patterns (`--buffer`, or its default).
    pub buffers: Vec<pattern::Pattern>,
    /// `--fabtests DIR`.
    pub fabtests: Option<PathBuf>,
    /// `--location`: host, or GPU regions in bw.
    pub location: gpu::Location,
    /// `--staging-pool`, `--staging-chunk` (engine defaults when absent).
    pub staging_pool: Option<usize>,
    pub staging_chunk: Option<usize>,
    /// `--rounds`: rtt's interleaved rounds (default 7, quick 2).
    pub rounds: Option<usize>,
    /// `--await-spin`: `EngineBuilder::await_spin` of the engines.
    pub await_spin: Option<Duration>,
    /// `--await-linger`: `EngineBuilder::await_linger` of the engines (`None`: their default).
    pub await_linger: Option<Duration>,
    /// `--poll-window`: `EngineBuilder::poll_window` of the engines (`None`: their default).
    pub poll_window: Option<Duration>,
    /// `--watch`: bw's engines get a `CompletionWatch`.
    pub watch: bool,
    /// `--time-calls`: bw times each side's NIC thread (`account.rs`).
    pub time_calls: bool,
    /// `--huge-pages`: engines' `EngineBuilder::huge_pages`, the raw loop's memory, and
    /// fi_rma_bw's malloc tunable.
    pub huge_pages: bool,
    /// `--peer`: the libraries bw measures beside the engine (none: no peer runs).
    pub peers: Vec<peers::Peer>,
}

impl Opts {
    /// Whether `test` runs in this invocation (it was named, or `all` was).
    pub fn runs(&self, test: Test) -> bool {
        self.test == Test::All || self.test == test
    }

    /// What the parser alone cannot refuse: a `--domains` list outside bw, `--fabtests` on a
    /// provider fabtests is not run on.
    pub fn check(&self) -> Result<(), String> {
        if matches!(self.test, Test::Soak | Test::Moe) {
            // `main` hands these to their own parsers before this one runs.
            return Err(format!(
                "{0} has a command line of its own: fabric-bench {0} --help",
                self.test.name()
            ));
        }
        if self.domain_counts.len() > 1 && self.test != Test::Bw {
            return Err(format!(
                "--domains {}: a list is accepted by bw only; give {} one count",
                self.domain_counts.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(","),
                self.test.name()
            ));
        }
        if self.fabtests.is_some() {
            fabtests::provider_arg(&self.provider)?;
        }
        if !self.peers.is_empty() && !self.runs(Test::Bw) {
            return Err(format!(
                "--peer: the peers are baselines of bw; {} does not run it",
                self.test.name()
            ));
        }
        Ok(())
    }
}

impl From<Cli> for Opts {
    fn from(c: Cli) -> Opts {
        // On verbs the baseline is ib_write_bw, whose default send queue depth (`-t`) is 128:
        // the engine gets as many writes in flight. With 16, its bandwidth on Soft-RoCE in the
        // VM depends on how soon the (sleeping) reactor reaps each completion:
        // docs/performance-2core.md.
        let window = c.window.unwrap_or(if raw::is_verbs(&c.provider) { 128 } else { 16 });
        Opts {
            test: c.test,
            provider: c.provider,
            sizes: c.sizes.map(|s| s.0),
            iters: c.iters,
            window,
            json: c.json,
            plot: c.plot,
            quick: c.quick,
            mode: c.mode.into(),
            peer_of: c.peer_of,
            domains: c.domains.0[0],
            domain_counts: c.domains.0,
            buffers: match c.buffer {
                Some(b) => b.0,
                None if c.quick => vec![pattern::Pattern::Cold],
                None => vec![pattern::Pattern::Hot, pattern::Pattern::Cold],
            },
            fabtests: c.fabtests,
            location: c.location,
            staging_pool: c.staging_pool,
            staging_chunk: c.staging_chunk,
            rounds: c.rounds,
            watch: c.watch,
            time_calls: c.time_calls,
            huge_pages: c.huge_pages == Switch::On,
            await_spin: c.await_spin.map(Duration::from_micros),
            await_linger: c.await_linger.map(Duration::from_micros),
            poll_window: c.poll_window.map(Duration::from_micros),
            peers: {
                let mut v: Vec<peers::Peer> = Vec::new();
                for p in c.peer.into_iter().flat_map(|l| l.0) {
                    if !v.contains(&p) {
                        v.push(p);
                    }
                }
                v
            },
        }
    }
}

/// Whether the run is on the ibverbs backend. The only verbs device on these machines is
/// Soft-RoCE inside an emulated (TCG) VM: ~20-45 MB/s and tens of microseconds per operation,
/// so every test moves less data there (sized for `all --quick` in well under a minute of VM
/// time and `all` in a few minutes); the figures' meaning does not change.
pub fn on_verbs(o: &Opts) -> bool {
    raw::is_verbs(&o.provider)
}

fn provider(s: &str) -> Result<String, String> {
    if matches!(s, "tcp" | "shm") || raw::is_verbs(s) {
        Ok(s.to_string())
    } else {
        Err("only tcp, shm and verbs[:DEV] are benchmarked".into())
    }
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("expected a whole number above 0".into()),
    }
}

fn domain_list(s: &str) -> Result<DomainList, String> {
    let v: Result<Vec<usize>, String> = s.split(',').map(positive).collect();
    let mut v = v.map_err(|_| "expected a count above 0, or a list such as 1,2,4".to_string())?;
    let mut seen = Vec::new();
    v.retain(|n| {
        if seen.contains(n) {
            false
        } else {
            seen.push(*n);
            true
        }
    });
    Ok(DomainList(v))
}

fn peer_list(s: &str) -> Result<PeerList, String> {
    peers::parse_list(s).map(PeerList)
}

fn buffer_list(s: &str) -> Result<Buffers, String> {
    pattern::parse_list(s).map(Buffers)
}

fn one_size(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| "expected a size such as 4096, 4K, 1M, 64MiB (above 0)".into())
}

fn sizes(s: &str) -> Result<Sizes, String> {
    let v: Option<Vec<usize>> = s.split(',').map(parse_size).collect();
    v.map(Sizes).ok_or_else(|| "expected sizes such as 4096,4K,64KiB,1M,1G (above 0), comma-separated".into())
}

/// `4096`, `4K`, `4KiB`, `1M`, `64MiB`, `1G`.
fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim().trim_end_matches("iB").trim_end_matches('B');
    let (num, mul) = match t.chars().last()? {
        'K' | 'k' => (&t[..t.len() - 1], 1usize << 10),
        'M' | 'm' => (&t[..t.len() - 1], 1 << 20),
        'G' | 'g' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>().ok().map(|n| n * mul).filter(|&n| n > 0)
}

fn main() {
    pin::remember_start_mask();
    // `soak` and its peers have their own command line (soak/mod.rs).
    if let Some(code) = soak::main_if_soak() {
        std::process::exit(code);
    }
    // So do `moe` and its ranks (moe.rs).
    if let Some(code) = moe::main_if_moe() {
        std::process::exit(code);
    }
    let cli = Cli::parse();
    if cli.tracing == Tracing::On {
        tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .with_writer(std::io::stderr)
            .init();
        if cli.peer_of.is_none() {
            eprintln!("tracing: fmt subscriber at info installed (fabric's debug events disabled by level)");
        }
    }
    let o = Opts::from(cli);
    if let Err(e) = o.check() {
        eprintln!("fabric-bench: {e}");
        std::process::exit(2);
    }
    // Set before any thread exists (LibfabricDomain::open would set it lazily otherwise).
    if std::env::var_os("FI_TCP_IFACE").is_none() {
        std::env::set_var("FI_TCP_IFACE", "lo");
    }
    raise_fd_limit();
    // Blocking-pool threads start with the process's mask, not that of the thread that made
    // them (bw pins this runtime's thread while it runs).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_start(pin::reset_to_start_mask)
        .build()
        .expect("tokio runtime");
    let result = rt.block_on(async {
        match o.peer_of.clone() {
            Some(addr) => run::peer_main(o, addr).await,
            None => run::leader_main(o).await,
        }
    });
    if let Err(e) = result {
        eprintln!("\nfabric-bench failed: {e}");
        std::process::exit(1);
    }
}

/// The scale test opens hundreds of endpoints in one process.
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain get/setrlimit on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn opts(args: &[&str]) -> Result<Opts, clap::Error> {
        Cli::try_parse_from(std::iter::once("fabric-bench").chain(args.iter().copied())).map(Opts::from)
    }

    #[test]
    fn buffers_domains_and_fabtests() {
        use pattern::Pattern::{Cold, Hot};
        let o = opts(&["bw"]).unwrap();
        assert_eq!(
            (o.buffers.as_slice(), o.domain_counts.as_slice(), &o.fabtests),
            (&[Hot, Cold][..], &[1][..], &None)
        );
        assert_eq!(opts(&["bw", "--quick"]).unwrap().buffers, [Cold]);
        assert_eq!(opts(&["bw", "--quick", "--buffer", "hot,cold"]).unwrap().buffers, [Hot, Cold]);
        assert_eq!(opts(&["bw", "--buffer", "hot"]).unwrap().buffers, [Hot]);
        assert!(o.huge_pages, "huge pages by default, as the engine's");
        assert!(!opts(&["bw", "--huge-pages", "off"]).unwrap().huge_pages);
        assert!(opts(&["bw", "--huge-pages", "maybe"]).is_err());
        let o = opts(&["bw", "--domains", "1,2,4", "--fabtests", "/x"]).unwrap();
        assert_eq!((o.domains, o.domain_counts.as_slice()), (1, &[1, 2, 4][..]));
        assert_eq!(o.fabtests, Some(PathBuf::from("/x")));
        assert!(o.check().is_ok());
        let o = opts(&["bw", "--domains", "2"]).unwrap();
        assert_eq!((o.domains, o.domain_counts.as_slice()), (2, &[2][..]));
        assert_eq!(opts(&["bw", "--domains", "2,2,1"]).unwrap().domain_counts, [2, 1]);
        // A list outside bw, fabtests on verbs: refused with a reason.
        for (args, why) in [
            (&["lat", "--domains", "1,2"][..], "accepted by bw only"),
            (&["all", "--domains", "1,2"], "give all one count"),
            (&["bw", "--provider", "verbs", "--fabtests", "/x"], "verbs is not supported"),
        ] {
            let e = opts(args).unwrap().check().unwrap_err();
            assert!(e.contains(why), "{args:?}: {e}");
        }
        assert!(opts(&["lat", "--domains", "2"]).unwrap().check().is_ok());
    }

    #[test]
    fn peers() {
        use peers::Peer::{Nccl, Nixl};
        assert!(opts(&["bw"]).unwrap().peers.is_empty(), "no peer unless asked");
        assert_eq!(opts(&["bw", "--peer", "nixl"]).unwrap().peers, [Nixl]);
        assert_eq!(opts(&["bw", "--peer", "nixl,nccl"]).unwrap().peers, [Nixl, Nccl]);
        // Repeated: the lists add up (duplicates dropped); as with every global option, the
        // values after the test's name replace those before it.
        assert_eq!(opts(&["bw", "--peer", "nccl", "--peer", "nixl,nccl"]).unwrap().peers, [Nccl, Nixl]);
        assert_eq!(opts(&["--peer", "nccl", "--peer", "nixl", "bw"]).unwrap().peers, [Nccl, Nixl]);
        assert_eq!(opts(&["--peer", "nccl", "bw", "--peer", "nixl"]).unwrap().peers, [Nixl]);
        // `--peer` alone, or `none`: today's run.
        assert!(opts(&["bw", "--peer"]).unwrap().peers.is_empty());
        assert!(opts(&["bw", "--peer", "none", "--quick"]).unwrap().peers.is_empty());
        assert!(opts(&["bw", "--peer", "ucx"]).is_err());
        assert!(opts(&["all", "--peer", "nixl"]).unwrap().check().is_ok());
        let e = opts(&["lat", "--peer", "nixl"]).unwrap().check().unwrap_err();
        assert!(e.contains("baselines of bw"), "{e}");
        // The peer process gets the leader's arguments too.
        let o = opts(&["bw", "--peer", "nixl", "--peer-of", "127.0.0.1:1"]).unwrap();
        assert_eq!((o.peers.as_slice(), o.peer_of.as_deref()), (&[Nixl][..], Some("127.0.0.1:1")));
    }

    #[test]
    fn the_command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_lists_every_command_and_soak_and_moe_point_to_their_own() {
        let help = Cli::command().render_long_help().to_string();
        for name in ["bw", "lat", "rate", "wake", "scale", "rtt", "all", "soak", "moe"] {
            assert!(help.contains(&format!("  {name} ")), "--help lists {name}:\n{help}");
        }
        for name in ["soak", "moe"] {
            let e = opts(&["--provider", "shm", name]).unwrap().check().unwrap_err();
            assert!(e.contains(&format!("fabric-bench {name} --help")), "{e}");
        }
    }

    #[test]
    fn defaults() {
        let o = opts(&["all"]).unwrap();
        assert_eq!(o.test, Test::All);
        assert_eq!(o.provider, "tcp");
        assert_eq!((o.window, o.domains, o.quick), (16, 1, false));
        assert_eq!(o.mode, ReactorMode::Event);
        assert!(o.sizes.is_none() && o.iters.is_none() && o.json.is_none() && o.plot.is_none());
        assert_eq!(o.location, gpu::Location::Host);
        assert_eq!(
            opts(&["bw", "--location", "cuda:0,1"]).unwrap().location,
            gpu::Location::Cuda(Some((0, 1)))
        );
        assert_eq!(opts(&["bw", "--location", "cuda"]).unwrap().location, gpu::Location::Cuda(None));
        assert_eq!((o.staging_pool, o.staging_chunk), (None, None));
        let o =
            opts(&["bw", "--location", "cuda", "--staging-pool", "8M", "--staging-chunk", "512K"]).unwrap();
        assert_eq!((o.staging_pool, o.staging_chunk), (Some(8 << 20), Some(512 << 10)));
        assert!(opts(&["bw", "--staging-pool", "0"]).is_err());
        assert_eq!(opts(&["bw", "--provider", "verbs"]).unwrap().window, 128);
        assert_eq!(opts(&["bw", "--provider", "verbs:rxe0", "--window", "8"]).unwrap().window, 8);
    }

    #[test]
    fn options_go_before_or_after_the_test() {
        for args in [
            &["--provider", "shm", "--quick", "bw", "--window", "32"][..],
            &["bw", "--quick", "--window", "32", "--provider", "shm"][..],
        ] {
            let o = opts(args).unwrap();
            assert_eq!((o.test, o.provider.as_str(), o.quick, o.window), (Test::Bw, "shm", true, 32));
        }
        // The peer is started with the leader's arguments plus `--peer-of ADDR` at the end.
        let o = opts(&["all", "--quick", "--json", "x.json", "--peer-of", "127.0.0.1:1"]).unwrap();
        assert_eq!(o.peer_of.as_deref(), Some("127.0.0.1:1"));
        assert_eq!(o.json, Some(PathBuf::from("x.json")));
    }

    #[test]
    fn values_parse_as_before() {
        let o = opts(&["bw", "--sizes", "4096,4K,4KiB,1M,64MiB,1G", "--mode", "busypoll", "--domains", "2"])
            .unwrap();
        assert_eq!(o.sizes.unwrap(), [4096, 4096, 4096, 1 << 20, 64 << 20, 1 << 30]);
        assert_eq!((o.mode, o.domains), (ReactorMode::BusyPoll, 2));
        let o = opts(&["rate", "--mode", "adaptive", "--iters", "7"]).unwrap();
        assert_eq!(o.mode, ReactorMode::Adaptive { spin: Duration::from_micros(200) });
        assert_eq!(o.iters, Some(7));
        // The last of a repeated option wins.
        assert_eq!(opts(&["bw", "--sizes", "4K", "--sizes", "1M"]).unwrap().sizes.unwrap(), [1 << 20]);
        assert_eq!(opts(&["bw", "--window", "4", "--window", "8"]).unwrap().window, 8);
    }

    #[test]
    fn bad_command_lines_are_refused() {
        for args in [
            &[][..],
            &["--quick"],
            &["nope"],
            &["bw", "lat"],
            &["bw", "--provider", "udp"],
            &["bw", "--sizes", "4K,0"],
            &["bw", "--sizes", "4X"],
            &["bw", "--window", "0"],
            &["bw", "--iters", "-1"],
            &["bw", "--domains", "0"],
            &["bw", "--domains", "1,0"],
            &["bw", "--domains", "1,,2"],
            &["bw", "--buffer", "warm"],
            &["bw", "--buffer", ""],
            &["bw", "--mode", "spin"],
            &["bw", "--bogus"],
            &["bw", "--location", "cuda:x"],
        ] {
            assert!(opts(args).is_err(), "{args:?} was accepted");
        }
    }
}
