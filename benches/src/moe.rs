//! `fabric-bench moe`: fabric-moe's dispatch and combine on the GPUs of this host, over
//! NVLink and through the proxy (shm, tcp engines), beside NCCL's `all_to_all_single` of the
//! same bytes in the same run.
//!
//! ```text
//!  fabric-bench moe (leader: no GPU work)
//!    per shape (decode, prefill) and transport (nvlink, nvlink-split, proxy-shm, proxy-tcp):
//!      fabric_moe::harness::lead ── fabric-bench moe-rank --rank R --store ADDR ... (R = 0..ranks)
//!        each rank: AllToAll, checked / back-to-back / CUDA-graph passes, report into the store
//!    per shape: python3 moe_gpu_nccl.py --ranks --tokens --hidden --steps --warmup
//!      "nccl all_to_all_single: rank R (cuda:R): back to back: p50 X us  p90 Y us ..."
//!  rows: shape, transport, pass, rank: dispatch and combine p50/p90, each p50 / NCCL's p50
//! ```
//!
//! The ranks are the harness of `examples/moe_gpu.rs` (`fabric_moe::harness`), started as
//! copies of this binary with the hidden `moe-rank` command; every world runs in fresh
//! processes, so one transport's failure leaves the others' rows. The NCCL driver is
//! `examples/moe_gpu_nccl.py`: `--nccl-script PATH`, else `moe_gpu_nccl.py` next to this
//! binary, else the copy built into it ([`NCCL_SCRIPT`]), run by `FABRIC_PYTHON` or
//! `python3`. Without torch, or with fewer GPUs than ranks, its rows have no ratio and a note
//! says why. Without a CUDA driver or device, one `skipped:` line and exit 0.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use fabric_moe::harness::{self, Params, PassTimes, Pcts, Rank0, RankReport};
use fabric_moe::Transport;
use serde_json::json;

use crate::perftest::{status_str, tail, Spawned};
use crate::report::{Report, Row};

/// `examples/moe_gpu_nccl.py`, built in: only the binary has to travel.
pub const NCCL_SCRIPT: &str = include_str!("../../examples/moe_gpu_nccl.py");
/// The prefix of the NCCL driver's lines.
const NCCL: &str = "nccl all_to_all_single: ";

/// `fabric-bench moe` and its hidden ranks.
#[derive(Parser, Debug)]
#[command(name = "fabric-bench")]
struct MoeCli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// fabric-moe dispatch/combine (decode and prefill shapes; NVLink, proxy over shm and
    /// tcp) beside NCCL's all_to_all_single of the same bytes (docs/moe.md).
    Moe(MoeArgs),
    /// Internal: one rank of a world (fabric_moe::harness::follow).
    #[command(hide = true)]
    MoeRank {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Which shapes run.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ShapeArg {
    /// 128 tokens x 7168 bf16 per rank, 256 experts, top-8 (DeepSeek-V3 decode).
    Decode,
    /// 4096 tokens per rank, experts bounded to --capacity rows.
    Prefill,
    /// Decode, then prefill.
    Both,
}

#[derive(clap::Args, Debug, Clone)]
struct MoeArgs {
    /// The shapes: decode (128 tokens per rank, 200 steps), prefill (4096 tokens, 20 steps)
    /// or both.
    #[arg(long, value_enum, default_value_t = ShapeArg::Both)]
    shape: ShapeArg,
    /// The transports, comma-separated: nvlink (CUDA IPC stores; dispatch and combine one
    /// fused kernel each; the combine streamed at prefill sizes), nvlink-split (the same,
    /// each stage its own launch), nvlink-unstreamed (nvlink with the combine never
    /// streamed; not in the default list), proxy-shm, proxy-tcp (the proxy thread writing
    /// with an shm or tcp engine).
    #[arg(long, value_name = "LIST", default_value = "nvlink,nvlink-split,proxy-shm,proxy-tcp", value_parser = transports)]
    transports: TransportList,
    /// Ranks (processes); rank r on GPU r % devices. NCCL needs a GPU per rank.
    #[arg(long, value_name = "N", default_value_t = 2)]
    ranks: usize,
    /// Timed steps per pass [default: decode 200, prefill 20].
    #[arg(long, value_name = "N")]
    steps: Option<usize>,
    /// Untimed steps first [default: decode 10, prefill 3].
    #[arg(long, value_name = "N")]
    warmup: Option<usize>,
    /// Rows each expert can receive per step in the prefill shape (decode: every token of
    /// every rank, which cannot overflow).
    #[arg(long, value_name = "ROWS", default_value_t = 1024)]
    capacity: usize,
    /// Also time each stage alone (the ranks' lines on stderr show them).
    #[arg(long)]
    stages: bool,
    /// The NCCL driver [default: moe_gpu_nccl.py next to this binary, else the built-in copy].
    #[arg(long, value_name = "PATH")]
    nccl_script: Option<PathBuf>,
    /// Seconds one world (or the NCCL driver) may take before its processes are killed.
    #[arg(long, value_name = "S", default_value_t = 300)]
    timeout: u64,
    /// Writes the rows as JSON to PATH (fabric-bench's shape; benches/check_json.py).
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

/// One `--transports` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Nvlink,
    /// NVLink, each stage its own launch (`--split`): the fused kernels' comparison.
    NvlinkSplit,
    /// NVLink, the fused combine never streamed (`--streamed-combine off`): the streamed combine's
    /// comparison (prefill; at decode sizes nvlink does not stream either).
    NvlinkUnstreamed,
    ProxyShm,
    ProxyTcp,
}

impl Via {
    pub fn name(self) -> &'static str {
        match self {
            Via::Nvlink => "nvlink",
            Via::NvlinkSplit => "nvlink-split",
            Via::NvlinkUnstreamed => "nvlink-unstreamed",
            Via::ProxyShm => "proxy-shm",
            Via::ProxyTcp => "proxy-tcp",
        }
    }

    /// The all-to-all's transport and the engine's provider.
    fn setup(self) -> (Transport, &'static str) {
        match self {
            Via::Nvlink | Via::NvlinkSplit | Via::NvlinkUnstreamed => (Transport::Nvlink, "shm"),
            Via::ProxyShm => (Transport::Proxy, "shm"),
            Via::ProxyTcp => (Transport::Proxy, "tcp"),
        }
    }
}

#[derive(Clone, Debug)]
struct TransportList(Vec<Via>);

fn transports(s: &str) -> Result<TransportList, String> {
    parse_transports(s).map(TransportList)
}

/// `nvlink,proxy-shm,proxy-tcp` (any of them, in the order given, duplicates dropped).
pub fn parse_transports(s: &str) -> Result<Vec<Via>, String> {
    let mut v = Vec::new();
    for w in s.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let t = match w {
            "nvlink" => Via::Nvlink,
            "nvlink-split" => Via::NvlinkSplit,
            "nvlink-unstreamed" => Via::NvlinkUnstreamed,
            "proxy-shm" => Via::ProxyShm,
            "proxy-tcp" => Via::ProxyTcp,
            other => {
                return Err(format!(
                    "{other:?}: expected nvlink, nvlink-split, nvlink-unstreamed, proxy-shm or proxy-tcp"
                ))
            }
        };
        if !v.contains(&t) {
            v.push(t);
        }
    }
    if v.is_empty() {
        return Err("no transport".into());
    }
    Ok(v)
}

/// `fabric-bench moe ...` and `fabric-bench moe-rank ...` run here (their own command line,
/// as `soak`); `None` for every other command.
pub fn main_if_moe() -> Option<i32> {
    let first = std::env::args().nth(1)?;
    if first != "moe" && first != "moe-rank" {
        return None;
    }
    let cli = MoeCli::parse();
    if std::env::var_os("FI_TCP_IFACE").is_none() {
        std::env::set_var("FI_TCP_IFACE", "lo");
    }
    // Ranks block in CUDA synchronizes while the harness's parent watch runs on a worker.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    Some(match cli.cmd {
        Cmd::MoeRank { args } => match Params::parse_args(&args) {
            Err(e) => {
                eprintln!("fabric-bench moe-rank: {e}");
                2
            }
            Ok((p, rank, store)) => match rt.block_on(harness::follow(&p, rank, store)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("fabric-bench moe rank {rank}: {e}");
                    1
                }
            },
        },
        Cmd::Moe(a) => match leader(&rt, &a) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("fabric-bench moe failed: {e}");
                1
            }
        },
    })
}

/// The shapes `a` asks for, with its steps, warm-up and capacity.
fn shapes(a: &MoeArgs) -> Vec<(&'static str, Params)> {
    let mut v = Vec::new();
    if a.shape != ShapeArg::Prefill {
        v.push(("decode", Params::decode()));
    }
    if a.shape != ShapeArg::Decode {
        v.push(("prefill", Params { capacity: Some(a.capacity), ..Params::prefill() }));
    }
    for (_, p) in v.iter_mut() {
        p.ranks = a.ranks;
        p.steps = a.steps.unwrap_or(p.steps);
        p.warmup = a.warmup.unwrap_or(p.warmup);
        p.stages = a.stages;
    }
    v
}

fn leader(rt: &tokio::runtime::Runtime, a: &MoeArgs) -> Result<(), harness::BoxError> {
    let shapes = shapes(a);
    for (_, p) in &shapes {
        p.check()?;
    }
    let vias = &a.transports.0;
    if let Err(why) = gpu_verdict() {
        println!("fabric-bench moe: skipped: {why}");
        if let Some(path) = &a.json {
            let mut rep = Report::new(&names(vias));
            rep.push(
                Row::new("moe", &format!("skipped: {why}"), "us", f64::NAN).baseline(BASELINE, f64::NAN),
            );
            rep.write_json(path)?;
        }
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let limit = Duration::from_secs(a.timeout);
    let mut table = Vec::new();
    let mut notes = Vec::new();
    for (shape, base) in &shapes {
        let mut worlds = Vec::new();
        for &via in vias {
            let (transport, provider) = via.setup();
            let split = via == Via::NvlinkSplit;
            let streamed_combine = (via == Via::NvlinkUnstreamed).then_some(false);
            let p = Params { transport, provider: provider.into(), split, streamed_combine, ..base.clone() };
            eprintln!("moe: {shape} over {} ({} steps + {} warm-up)", via.name(), p.steps, p.warmup);
            let spawn = |args: Vec<String>| -> Result<std::process::Child, harness::BoxError> {
                Ok(Command::new(&exe).arg("moe-rank").args(args).stdin(Stdio::null()).spawn()?)
            };
            let t0 = Instant::now();
            let r = rt.block_on(harness::lead(&p, Rank0::Spawned, limit, spawn)).map_err(|e| e.to_string());
            match &r {
                Ok(reports) => {
                    eprintln!("{}", p.header("moe", &reports[0]));
                    for rep in reports {
                        eprintln!("{}", rep.lines("moe"));
                    }
                    eprintln!("moe: {shape} over {} in {:.1} s", via.name(), t0.elapsed().as_secs_f64());
                }
                Err(e) => eprintln!("moe: {shape} over {}: failed: {e}", via.name()),
            }
            worlds.push((via, r));
        }
        eprintln!("moe: {shape}: NCCL all_to_all_single of the same bytes");
        let nccl = run_nccl(a, base, limit);
        match &nccl {
            Nccl::Skipped(why) => notes.push(format!("{shape}: NCCL skipped: {why}")),
            Nccl::Ran { label, error, .. } => {
                notes.push(format!("{shape}: {label}"));
                if let Some(e) = error {
                    notes.push(format!("{shape}: NCCL failed: {e}"));
                }
            }
        }
        for (via, r) in &worlds {
            table.extend(rows(shape, via.name(), r, &nccl));
        }
    }
    print_table(&table, &notes);
    if let Some(path) = &a.json {
        let mut rep = Report::new(&names(vias));
        for r in &table {
            for row in r.json_rows() {
                rep.push(row);
            }
        }
        rep.write_json(path)?;
        println!("json: {}", path.display());
    }
    Ok(())
}

fn names(vias: &[Via]) -> String {
    vias.iter().map(|v| v.name()).collect::<Vec<_>>().join(",")
}

/// Why no world can run here (no driver, no device), or `Ok`.
fn gpu_verdict() -> Result<(), String> {
    match fabric_runtime::cuda::available() {
        Ok(0) => Err("no CUDA device (the driver sees none)".into()),
        Ok(_) => Ok(()),
        Err(fabric_async::Error::Unsupported(m)) => {
            Err(format!("no CUDA driver ({})", m.strip_prefix("no CUDA driver: ").unwrap_or(&m)))
        }
        Err(e) => Err(format!("no CUDA driver ({e})")),
    }
}

/// The NCCL driver on disk: `--nccl-script`, `moe_gpu_nccl.py` next to this binary, or the
/// built-in copy written to a temporary file (removed on drop).
struct Script {
    path: PathBuf,
    temp: bool,
}

impl Script {
    fn find(given: Option<&PathBuf>) -> Result<Script, String> {
        if let Some(p) = given {
            return Ok(Script { path: p.clone(), temp: false });
        }
        let beside = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join("moe_gpu_nccl.py")));
        if let Some(p) = beside.filter(|p| p.is_file()) {
            return Ok(Script { path: p, temp: false });
        }
        let path = std::env::temp_dir().join(format!("fabric-bench-moe-nccl-{}.py", std::process::id()));
        std::fs::write(&path, NCCL_SCRIPT).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(Script { path, temp: true })
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        if self.temp {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn run_nccl(a: &MoeArgs, p: &Params, limit: Duration) -> Nccl {
    let script = match Script::find(a.nccl_script.as_ref()) {
        Ok(s) => s,
        Err(e) => return Nccl::Skipped(e),
    };
    let python = std::env::var("FABRIC_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut args = vec![script.path.display().to_string()];
    for (k, v) in [
        ("--ranks", p.ranks),
        ("--tokens", p.tokens),
        ("--hidden", p.hidden),
        ("--steps", p.steps),
        ("--warmup", p.warmup),
    ] {
        args.extend([k.to_string(), v.to_string()]);
    }
    let child = match Spawned::start_on(&python, &args, None, &[]) {
        Ok(c) => c,
        Err(e) => return Nccl::Skipped(format!("{e} (FABRIC_PYTHON picks the interpreter)")),
    };
    let (status, out) = child.finish(Instant::now() + limit);
    for l in out.lines().filter(|l| l.starts_with(NCCL)) {
        eprintln!("{l}");
    }
    let mut n = parse_nccl(&out);
    if let Nccl::Ran { error, .. } = &mut n {
        if status != Some(true) && error.is_none() {
            *error = Some(format!("{}: {}", status_str(status), tail(&out, 2)));
        }
    }
    n
}

/// NCCL's figures of one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct NcclRank {
    pub rank: usize,
    /// Back to back, batches of 64 calls with no host wait (the ratios' baseline).
    pub back_to_back: Pcts,
    /// A barrier before each call.
    pub barrier_each: Option<Pcts>,
}

/// What the NCCL driver came to.
#[derive(Clone, Debug, PartialEq)]
pub enum Nccl {
    /// Not run: why.
    Skipped(String),
    /// Run: its header line, the ranks it reported, and what went wrong (a rank's bytes
    /// wrong, no result lines, a failed exit).
    Ran { label: String, ranks: Vec<NcclRank>, error: Option<String> },
}

impl Nccl {
    /// Rank `r`'s back-to-back figures, if NCCL ran and checked its bytes.
    pub fn rank(&self, r: usize) -> Option<Pcts> {
        match self {
            Nccl::Ran { ranks, error: None, .. } => {
                ranks.iter().find(|x| x.rank == r).map(|x| x.back_to_back)
            }
            _ => None,
        }
    }
}

/// `p50 X us  p90 Y us` anywhere in `s`.
fn p50_p90(s: &str) -> Option<Pcts> {
    let w: Vec<&str> = s.split_whitespace().collect();
    let at = |k: &str| w.iter().position(|x| *x == k).and_then(|i| w.get(i + 1)?.parse::<f64>().ok());
    Some(Pcts { p50: at("p50")?, p90: at("p90")? })
}

/// Reads the NCCL driver's output (`examples/moe_gpu_nccl.py`): its `skipped:` line, or its
/// header and per-rank `back to back:` / `barrier each:` lines.
pub fn parse_nccl(out: &str) -> Nccl {
    let mut label = None;
    let mut ranks: Vec<NcclRank> = Vec::new();
    let mut errors = Vec::new();
    for line in out.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix(NCCL) else { continue };
        if let Some(why) = rest.strip_prefix("skipped: ") {
            return Nccl::Skipped(why.trim().to_string());
        }
        let Some(after) = rest.strip_prefix("rank ") else {
            label.get_or_insert_with(|| rest.to_string());
            continue;
        };
        let Some(rank) = after.split_whitespace().next().and_then(|r| r.parse::<usize>().ok()) else {
            errors.push(format!("unreadable line {line:?}"));
            continue;
        };
        let (kind, figures) = if let Some(i) = after.find("back to back:") {
            ("b2b", &after[i..])
        } else if let Some(i) = after.find("barrier each:") {
            ("barrier", &after[i..])
        } else {
            continue;
        };
        let Some(pcts) = p50_p90(figures) else {
            errors.push(format!("no p50/p90 in {line:?}"));
            continue;
        };
        if kind == "b2b" {
            if line.contains("WRONG BYTES") {
                errors.push(format!("rank {rank}: WRONG BYTES"));
            }
            ranks.push(NcclRank { rank, back_to_back: pcts, barrier_each: None });
        } else if let Some(x) = ranks.iter_mut().find(|x| x.rank == rank) {
            x.barrier_each = Some(pcts);
        }
    }
    if ranks.is_empty() && errors.is_empty() {
        errors.push("no result lines".into());
    }
    Nccl::Ran {
        label: label.unwrap_or_else(|| "NCCL".into()),
        ranks,
        error: (!errors.is_empty()).then(|| errors.join("; ")),
    }
}

/// The baseline's name in the rows.
const BASELINE: &str = "nccl all_to_all_single back to back";

/// One line of the table: a rank's pass of one shape and transport, or a world that failed.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeRow {
    pub shape: String,
    pub via: String,
    /// `back to back` or `CUDA graph`; empty for a failed world.
    pub pass: &'static str,
    pub rank: usize,
    pub device: usize,
    /// The figures, or why there are none.
    pub times: Result<PassTimes, String>,
    /// NCCL's back-to-back figures of the same rank.
    pub nccl: Option<Pcts>,
}

impl MoeRow {
    /// fabric / NCCL at p50: (dispatch, combine).
    pub fn ratios(&self) -> (Option<f64>, Option<f64>) {
        let (Ok(t), Some(n)) = (&self.times, self.nccl) else { return (None, None) };
        let r = |x: f64| Some(x / n.p50).filter(|r| r.is_finite() && *r > 0.0);
        (r(t.dispatch.p50), r(t.combine.p50))
    }

    /// Two report rows (dispatch, combine), or one for a failed world: JSON `engine_us` the
    /// p50, `baseline_us` NCCL's, `ratio`, and `p90_us`, `baseline_p90_us`, `shape`,
    /// `transport`, `pass`, `rank`, `stage`.
    fn json_rows(&self) -> Vec<Row> {
        let base = self.nccl.map_or(f64::NAN, |n| n.p50);
        let Ok(t) = &self.times else {
            let why = self.times.as_ref().err().map_or("", |e| e.lines().next().unwrap_or(""));
            let case = format!("{} {}: {why}", self.shape, self.via);
            return vec![Row::new("moe", &case, "us", f64::NAN)
                .baseline(BASELINE, base)
                .field("shape", json!(self.shape))
                .field("transport", json!(self.via))];
        };
        [("dispatch", t.dispatch), ("combine", t.combine)]
            .into_iter()
            .map(|(stage, p)| {
                let case = format!("{} {} {} rank {} {stage}", self.shape, self.via, self.pass, self.rank);
                Row::new("moe", &case, "us", p.p50)
                    .baseline(BASELINE, base)
                    .field("p90_us", json!(p.p90))
                    .field("baseline_p90_us", self.nccl.map_or(serde_json::Value::Null, |n| json!(n.p90)))
                    .field("shape", json!(self.shape))
                    .field("transport", json!(self.via))
                    .field("pass", json!(self.pass))
                    .field("rank", json!(self.rank))
                    .field("stage", json!(stage))
            })
            .collect()
    }
}

/// The rows of one world (pure): per rank, back to back and CUDA graph beside NCCL's
/// back-to-back figures of that rank; a failed world is one row with its error.
pub fn rows(shape: &str, via: &str, world: &Result<Vec<RankReport>, String>, nccl: &Nccl) -> Vec<MoeRow> {
    let reports = match world {
        Ok(r) => r,
        Err(e) => {
            return vec![MoeRow {
                shape: shape.into(),
                via: via.into(),
                pass: "",
                rank: 0,
                device: 0,
                times: Err(format!("failed: {e}")),
                nccl: None,
            }]
        }
    };
    let mut out = Vec::new();
    for r in reports {
        for (pass, t) in [("back to back", r.back_to_back), ("CUDA graph", r.graph)] {
            out.push(MoeRow {
                shape: shape.into(),
                via: via.into(),
                pass,
                rank: r.rank,
                device: r.device,
                times: Ok(t),
                nccl: nccl.rank(r.rank),
            });
        }
    }
    out
}

fn print_table(rows: &[MoeRow], notes: &[String]) {
    let head = [
        "shape",
        "transport",
        "pass",
        "rank",
        "dispatch p50/p90 us",
        "combine p50/p90 us",
        "NCCL p50/p90 us",
        "dispatch/NCCL",
        "combine/NCCL",
    ];
    let pair = |p: Pcts| format!("{:.1} / {:.1}", p.p50, p.p90);
    let ratio = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}x"));
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut c = vec![r.shape.clone(), r.via.clone()];
            match &r.times {
                Ok(t) => {
                    let (d, k) = r.ratios();
                    c.extend([
                        r.pass.to_string(),
                        format!("{} (cuda:{})", r.rank, r.device),
                        pair(t.dispatch),
                        pair(t.combine),
                        r.nccl.map_or("-".into(), pair),
                        ratio(d),
                        ratio(k),
                    ]);
                }
                Err(e) => c.push(e.lines().next().unwrap_or("").to_string()),
            }
            c
        })
        .collect();
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for c in cells.iter().filter(|c| c.len() == head.len()) {
        for (i, s) in c.iter().enumerate() {
            w[i] = w[i].max(s.len());
        }
    }
    println!("\nfabric-moe dispatch/combine vs NCCL all_to_all_single of the same bytes; ratio = fabric p50 / NCCL back-to-back p50 (lower is better)");
    let line = |c: &[String]| {
        let s: Vec<String> = c
            .iter()
            .enumerate()
            .map(|(i, x)| if i < 4 { format!("{:<w$}", x, w = w[i]) } else { format!("{:>w$}", x, w = w[i]) })
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(&head.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    line(&w.iter().map(|&n| "-".repeat(n)).collect::<Vec<_>>());
    for c in &cells {
        line(c);
    }
    for n in notes {
        println!("{n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "\
nccl all_to_all_single: 2 ranks (NVIDIA H200), torch 2.9.0, NCCL 2.27.3, 200 steps (+10 warm-up)
nccl all_to_all_single: rank 0 (cuda:0): back to back: p50    65.0 us  p90    75.5 us   (256 rows = 3.50 MiB per rank per step, checked)
nccl all_to_all_single: rank 0 (cuda:0): barrier each: p50    71.9 us  p90   105.6 us
nccl all_to_all_single: rank 1 (cuda:1): back to back: p50    70.0 us  p90    80.0 us   (256 rows = 3.50 MiB per rank per step, checked)
nccl all_to_all_single: rank 1 (cuda:1): barrier each: p50    71.4 us  p90   106.2 us
";

    #[test]
    fn nccl_lines_parse() {
        let n = parse_nccl(&format!("some warning\n{OUT}"));
        let Nccl::Ran { label, ranks, error } = &n else { panic!("{n:?}") };
        assert!(label.starts_with("2 ranks (NVIDIA H200), torch 2.9.0"), "{label}");
        assert_eq!(error, &None);
        assert_eq!(ranks.len(), 2);
        assert_eq!(ranks[0].back_to_back, Pcts { p50: 65.0, p90: 75.5 });
        assert_eq!(ranks[1].barrier_each, Some(Pcts { p50: 71.4, p90: 106.2 }));
        assert_eq!(n.rank(1), Some(Pcts { p50: 70.0, p90: 80.0 }));
        assert_eq!(n.rank(2), None);
        assert_eq!(
            parse_nccl("nccl all_to_all_single: skipped: torch is not installed (No module named 'torch')\n"),
            Nccl::Skipped("torch is not installed (No module named 'torch')".into())
        );
        // Wrong bytes or no figures: no baseline.
        let wrong = parse_nccl(&OUT.replacen("checked", "WRONG BYTES", 1));
        assert!(matches!(&wrong, Nccl::Ran { error: Some(e), .. } if e.contains("rank 0: WRONG BYTES")));
        assert_eq!(wrong.rank(1), None);
        let none = parse_nccl("Traceback (most recent call last):\n");
        assert!(matches!(&none, Nccl::Ran { error: Some(e), .. } if e == "no result lines"));
    }

    #[test]
    fn rows_and_ratios() {
        let t = |d: f64, c: f64| PassTimes {
            dispatch: Pcts { p50: d, p90: d + 1.0 },
            combine: Pcts { p50: c, p90: c + 1.0 },
        };
        let report = |rank: usize| RankReport {
            rank,
            device: rank,
            back_to_back: t(39.0, 32.5),
            graph: t(35.0, 26.0),
            ..RankReport::default()
        };
        let nccl = parse_nccl(OUT);
        let v = rows("decode", "nvlink", &Ok(vec![report(0), report(1)]), &nccl);
        assert_eq!(v.len(), 4);
        assert_eq!((v[0].pass, v[1].pass, v[2].rank), ("back to back", "CUDA graph", 1));
        let (d, c) = v[0].ratios();
        assert!((d.unwrap() - 39.0 / 65.0).abs() < 1e-12 && (c.unwrap() - 32.5 / 65.0).abs() < 1e-12);
        let (d, _) = v[3].ratios();
        assert!((d.unwrap() - 35.0 / 70.0).abs() < 1e-12, "rank 1 against NCCL's rank 1");
        assert_eq!(v[0].json_rows().len(), 2);
        // NCCL skipped: figures, no ratios.
        let v = rows("decode", "proxy-tcp", &Ok(vec![report(0)]), &Nccl::Skipped("no torch".into()));
        assert_eq!(v[0].ratios(), (None, None));
        assert!(v[0].times.is_ok());
        // A failed world: one row saying so.
        let v = rows("prefill", "proxy-shm", &Err("a rank failed: rank 1: exited".into()), &nccl);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].times, Err("failed: a rank failed: rank 1: exited".into()));
        assert_eq!(v[0].json_rows().len(), 1);
    }

    #[test]
    fn command_line() {
        use clap::CommandFactory;
        MoeCli::command().debug_assert();
        let a = |args: &[&str]| match MoeCli::try_parse_from(["fabric-bench", "moe"].iter().chain(args)) {
            Ok(MoeCli { cmd: Cmd::Moe(a) }) => Ok(a),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        let d = a(&[]).unwrap();
        assert_eq!(d.transports.0, [Via::Nvlink, Via::NvlinkSplit, Via::ProxyShm, Via::ProxyTcp]);
        let s = shapes(&d);
        assert_eq!(s.iter().map(|(n, _)| *n).collect::<Vec<_>>(), ["decode", "prefill"]);
        assert_eq!((s[0].1.tokens, s[0].1.steps, s[0].1.capacity), (128, 200, None));
        assert_eq!((s[1].1.tokens, s[1].1.steps, s[1].1.capacity), (4096, 20, Some(1024)));
        let q =
            a(&["--shape", "decode", "--transports", "proxy-tcp,nvlink,nvlink", "--steps", "50"]).unwrap();
        assert_eq!(q.transports.0, [Via::ProxyTcp, Via::Nvlink]);
        let s = shapes(&q);
        assert_eq!((s.len(), s[0].1.steps, s[0].1.warmup), (1, 50, 10));
        assert!(a(&["--transports", "ib"]).is_err());
        assert!(a(&["--transports", ""]).is_err());
        // The ranks' hidden command takes the harness's arguments as they are.
        let r = MoeCli::try_parse_from(["fabric-bench", "moe-rank", "--rank", "1", "--store", "127.0.0.1:9"]);
        assert!(matches!(r, Ok(MoeCli { cmd: Cmd::MoeRank { args } }) if args.len() == 4));
    }
}
