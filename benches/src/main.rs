//! fabric-bench: the engine measured beside its ceiling, in the same run.
//!
//! ```text
//! cargo run --release -p fabric-bench -- <bw|lat|rate|wake|scale|all> [--provider tcp|shm|verbs[:DEV]]
//!     [--domains N] [--sizes 4K,1M,..] [--iters N] [--window N] [--json PATH] [--plot PATH] [--quick]
//! ```
//!
//! This process is the leader. It starts a second copy of itself as the peer; the two meet
//! through a `TcpStore` on 127.0.0.1 and then run the same sequence of phases, each side
//! playing its role (`session.rs`). Every engine figure is printed beside a baseline measured
//! in the same run: the raw provider loop (`raw.rs`: the provider's domain driven through the
//! `Domain` trait by a plain thread), iperf3 for tcp bandwidth when it is installed, and
//! perftest's `ib_write_bw` / `ib_write_lat` for verbs (`perftest.rs`). On verbs the tests
//! move less data ([`on_verbs`]): the only verbs device here is Soft-RoCE in an emulated VM,
//! ~20-45 MB/s.
//!
//! One module per test: `bw.rs`, `lat.rs`, `rate.rs`, `wake.rs`, `scale.rs`. Shared:
//! `session.rs` (the two processes, their meeting point, engine and raw sides),
//! `measure.rs` (CPU, RSS, percentiles, units), `report.rs` (table, JSON, plot),
//! `progress.rs` (the progress display). This file parses the command line and dispatches.

mod bw;
mod lat;
mod measure;
mod perftest;
mod progress;
mod rate;
mod raw;
mod report;
mod scale;
mod session;
mod wake;

use std::path::PathBuf;
use std::time::Duration;

use fabric_async::ReactorMode;

const TESTS: [&str; 5] = ["bw", "lat", "rate", "wake", "scale"];

#[derive(Clone, Debug)]
pub struct Opts {
    pub test: String,
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
    /// NICs (domains) per engine: `EngineBuilder::domains`. The raw baselines use one.
    pub domains: usize,
}

/// Whether the run is on the ibverbs backend. The only verbs device on these machines is
/// Soft-RoCE inside an emulated (TCG) VM: ~20-45 MB/s and tens of microseconds per operation,
/// so every test moves less data there (sized for `all --quick` in well under a minute of VM
/// time and `all` in a few minutes); the figures' meaning does not change.
pub fn on_verbs(o: &Opts) -> bool {
    raw::is_verbs(&o.provider)
}

fn usage() -> ! {
    eprintln!(
        "usage: fabric-bench <bw|lat|rate|wake|scale|all> [--provider tcp|shm|verbs[:DEV]] [--domains N]\n\
         \x20                   [--sizes 4K,64K,1M,..] [--iters N] [--window N] [--json PATH]\n\
         \x20                   [--plot PATH] [--quick] [--mode event|adaptive|busypoll]\n\
         \n\
         bw     write_imm bandwidth, 4 KiB..64 MiB, `window` writes in flight (default 16;\n\
         \x20      verbs: 128, ib_write_bw's default -t; verbs sizes 4 KiB..1 MiB)\n\
         lat    write_imm ping-pong round trip p50/p99 (8 B, 256 B, 4 KiB)\n\
         rate   imm-only operations per second\n\
         wake   8 B ping-pong in Event, Adaptive, BusyPoll and the sync spin path, with CPU use\n\
         scale  1..256 peer engines, and 1..100,000 futures in flight\n\
         all    every test\n\
         --iters sets the operations per bw point / round trips per latency case.\n\
         --mode is the engine's reactor mode in bw and rate (default event).\n\
         --quick is a smoke run (seconds). Baselines: the raw provider loop, iperf3 on tcp,\n\
         \x20      ib_write_bw / ib_write_lat (perftest) on verbs."
    );
    std::process::exit(2)
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

fn parse() -> Opts {
    let mut o = Opts {
        test: String::new(),
        provider: "tcp".into(),
        sizes: None,
        iters: None,
        window: 16,
        json: None,
        plot: None,
        quick: false,
        mode: ReactorMode::Event,
        peer_of: None,
        domains: 1,
    };
    let mut window = None;
    let mut args = std::env::args().skip(1);
    while let Some(k) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match k.as_str() {
            "--provider" => o.provider = val(),
            "--domains" => {
                o.domains = val().parse().ok().filter(|n| *n > 0).unwrap_or_else(|| usage());
            }
            "--sizes" => {
                let v: Option<Vec<usize>> = val().split(',').map(parse_size).collect();
                o.sizes = Some(v.unwrap_or_else(|| usage()));
            }
            "--iters" => o.iters = Some(val().parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage())),
            "--window" => window = Some(val().parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage())),
            "--json" => o.json = Some(val().into()),
            "--plot" => o.plot = Some(val().into()),
            "--quick" => o.quick = true,
            "--mode" => {
                o.mode = match val().as_str() {
                    "event" => ReactorMode::Event,
                    "adaptive" => ReactorMode::Adaptive { spin: Duration::from_micros(200) },
                    "busypoll" => ReactorMode::BusyPoll,
                    _ => usage(),
                }
            }
            "--peer-of" => o.peer_of = Some(val()),
            "-h" | "--help" => usage(),
            t if !t.starts_with('-') && o.test.is_empty() => o.test = t.to_string(),
            _ => usage(),
        }
    }
    if o.test != "all" && !TESTS.contains(&o.test.as_str()) {
        usage();
    }
    if !matches!(o.provider.as_str(), "tcp" | "shm") && !raw::is_verbs(&o.provider) {
        eprintln!("fabric-bench: --provider {}: only tcp, shm and verbs[:DEV] are benchmarked", o.provider);
        std::process::exit(2);
    }
    // On verbs the baseline is ib_write_bw, whose default send queue depth (`-t`) is 128: the
    // engine gets as many writes in flight. With 16, its bandwidth on Soft-RoCE in the VM
    // depends on how soon the (sleeping) reactor reaps each completion: docs/performance.md.
    o.window = window.unwrap_or(if on_verbs(&o) { 128 } else { 16 });
    o
}

fn main() {
    let o = parse();
    // Set before any thread exists (LibfabricDomain::open would set it lazily otherwise).
    if std::env::var_os("FI_TCP_IFACE").is_none() {
        std::env::set_var("FI_TCP_IFACE", "lo");
    }
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let result = rt.block_on(async {
        match o.peer_of.clone() {
            Some(addr) => session::peer_main(o, addr).await,
            None => session::leader_main(o).await,
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
