//! `bw --peer nixl,nccl`: other transfer libraries moving the same bytes in the same run,
//! each a baseline row beside the engine's row of that size and location.
//!
//! ```text
//!  fabric-bench (leader, after the bw sweep and its peer process are done)
//!    ├─ python3 peers.py probe nixl|nccl        "ok NIXL 1.5.1 UCX" / "skip <why>"
//!    ├─ nixl: peers.py nixl target  ─┐ metadata through files in a temp folder
//!    │        peers.py nixl initiator ┘ WRITE requests of --window blocks, one at a time
//!    └─ nccl: peers.py nccl --rank 0 ─┐ torch.distributed, tcp://127.0.0.1:PORT
//!             peers.py nccl --rank 1 ─┘ batch_isend_irecv of --window ops, one batch at a time
//!  each burst: "fabric-peer peer=.. pattern=.. size=.. ops=.. bytes=.. seconds=.. gbps=.."
//! ```
//!
//! - **nixl**: NIXL's UCX backend (the `nixl-cu13` wheel, module `nixl_cu13`, else `nixl`)
//!   between two processes of this host: host memory (`DRAM`) at bw's sizes, patterns
//!   (`--buffer`), region and `--huge-pages`, beside the host rows (first `--domains`
//!   count); with `--location cuda`, GPU S → GPU R (`VRAM`, torch tensors) beside the CUDA
//!   IPC rows. UCX is held to the engine's transport ([`ucx_tls`]: tcp → `tcp,self` on `lo`,
//!   shm → `sm,self`, GPU → `cuda_ipc,cuda_copy,tcp,self`); left to itself it moves DRAM with
//!   `cma` whatever the engine's provider. An explicit `UCX_TLS` in fabric-bench's environment
//!   wins. Each row's baseline names the transport UCX reported for that size's puts
//!   (`UCX_PROTO_INFO=y` tables, [`put_ranges`]) and the `UCX_TLS` it ran with.
//! - **nccl**: torch.distributed's NCCL `send`/`recv`, rank 0 on GPU S, rank 1 on GPU R,
//!   beside the CUDA IPC rows; host rows say `skipped: NCCL is GPU-only`.
//!
//! The script is [`SCRIPT`] (`peers.py`, embedded: only the binary travels), written to a
//! temporary folder and run with `FABRIC_PYTHON` or `python3`; NIXL is found through
//! `PYTHONPATH` (docs/gpu.md, "NIXL and NCCL beside the engine"). A peer that cannot run here
//! (no Python, `import nixl` fails, torch without CUDA, fewer than two GPUs) gives one row
//! `... skipped: <why>` with no figures, as an absent baseline does. Nothing here runs unless
//! `--peer` names a peer (CI never does).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::bw;
use crate::gpu::{self, Location};
use crate::measure::{human, median};
use crate::pattern::Pattern;
use crate::perftest::{tail, Spawned};
use crate::report::{Report, Row};
use crate::Opts;

mod place;
mod ucx;

pub use place::Place;
pub use ucx::{engine_transport, nixl_label, put_ranges, put_via, ucx_tls, PutRange, Ucx, UcxTls};

/// The driver script; [`run`] writes it to a temporary folder.
pub const SCRIPT: &str = include_str!("peers.py");

/// Longest one peer's sweep at one location (both processes) may take before both are killed.
pub const RUN_LIMIT: Duration = Duration::from_secs(480);
/// Longest a probe (`import nixl`, `import torch`) may take.
const PROBE_LIMIT: Duration = Duration::from_secs(120);

/// A library measured beside the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// NIXL, UCX backend.
    Nixl,
    /// NCCL through torch.distributed.
    Nccl,
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Peer::Nixl => "nixl",
            Peer::Nccl => "nccl",
        }
    }
}

/// `--peer`'s value: `nixl`, `nccl`, `nixl,nccl`; empty (or `none`): no peer.
pub fn parse_list(s: &str) -> Result<Vec<Peer>, String> {
    let mut v = Vec::new();
    for w in s.split(',').map(str::trim).filter(|w| !w.is_empty() && *w != "none") {
        let p = match w {
            "nixl" => Peer::Nixl,
            "nccl" => Peer::Nccl,
            other => return Err(format!("{other:?}: expected nixl, nccl or nixl,nccl")),
        };
        if !v.contains(&p) {
            v.push(p);
        }
    }
    Ok(v)
}

/// One measured burst: a result line of the script.
#[derive(Clone, Debug, PartialEq)]
pub struct Burst {
    pub peer: Peer,
    pub pattern: Pattern,
    pub size: usize,
    pub bytes: u64,
    pub secs: f64,
}

impl Burst {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.secs / 1e9
    }
}

/// The prefix of the script's result lines.
const LINE: &str = "fabric-peer ";

/// A result line `fabric-peer peer=nixl pattern=hot size=65536 ops=256 bytes=16777216
/// seconds=0.00123 gbps=109.1`: `None` for any other line, an error for a result line that
/// does not read (a field missing or not a number, seconds not above 0). The figure is
/// computed from `bytes` and `seconds`; `gbps` and `ops` are for whoever reads the output.
pub fn parse_line(line: &str) -> Option<Result<Burst, String>> {
    let rest = line.trim().strip_prefix(LINE)?;
    let field = |k: &str| {
        rest.split_whitespace()
            .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            .ok_or_else(|| format!("no {k}= in {line:?}"))
    };
    let num = |k: &str| -> Result<f64, String> {
        let v = field(k)?;
        v.parse::<f64>().map_err(|_| format!("{k}={v} is not a number in {line:?}"))
    };
    let burst = || -> Result<Burst, String> {
        let peer = match parse_list(field("peer")?)?.as_slice() {
            [p] => *p,
            _ => return Err(format!("bad peer in {line:?}")),
        };
        let pattern = match crate::pattern::parse_list(field("pattern")?)?.as_slice() {
            [p] => *p,
            _ => return Err(format!("bad pattern in {line:?}")),
        };
        let size = field("size")?.parse::<usize>().map_err(|_| format!("bad size in {line:?}"))?;
        let bytes = field("bytes")?.parse::<u64>().map_err(|_| format!("bad bytes in {line:?}"))?;
        let secs = num("seconds")?;
        if !(secs > 0.0 && secs.is_finite()) {
            return Err(format!("seconds={secs} in {line:?}"));
        }
        Ok(Burst { peer, pattern, size, bytes, secs })
    };
    Some(burst())
}

/// What a peer's run at one place came to.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Not run: why.
    Skipped(String),
    /// Run: the peer's name and version from its probe (`NIXL 1.5.1 UCX`), the bursts it
    /// printed, what went wrong if it failed part way, and (NIXL) the UCX transports it was
    /// given and reported.
    Ran { label: String, bursts: Vec<Burst>, error: Option<String>, ucx: Option<Ucx> },
}

/// How the peer moved the blocks, for the rows' case.
fn how(peer: Peer, place: Place, window: usize) -> String {
    match (peer, place) {
        (Peer::Nixl, Place::Host) => format!("DRAM, one request of {window} blocks at a time"),
        (Peer::Nixl, Place::Gpu { .. }) => format!("VRAM, one request of {window} blocks at a time"),
        (Peer::Nccl, _) => format!("batch_isend_irecv of {window} at a time"),
    }
}

/// The rows of one peer at one place (pure). Host: one row per pattern and size, its engine
/// figure from `engine(Some(pattern), size)`, its case naming the engine's transport
/// (`engine_tl`, [`engine_transport`]); GPU: one per size, `engine(None, size)` (the CUDA IPC
/// row). Each row's baseline is the median of the peer's bursts, its ratio engine / peer; a
/// NIXL baseline is named by [`nixl_label`]. A skip or a failure is a row of its own with no
/// figures.
#[allow(clippy::too_many_arguments)]
pub fn rows(
    peer: Peer,
    place: Place,
    window: usize,
    outcome: &Outcome,
    sizes: &[usize],
    patterns: &[Pattern],
    engine_tl: &str,
    engine: impl Fn(Option<Pattern>, usize) -> Option<f64>,
) -> Vec<Row> {
    let empty = |why: &str| {
        let short = why.lines().next().unwrap_or(why);
        Row::new("bw", &format!("{} vs {}: {short}", place.label(), peer.name()), "gbps", f64::NAN)
            .baseline(peer.name(), f64::NAN)
    };
    let (label, bursts, error, ucx) = match outcome {
        Outcome::Skipped(why) => return vec![empty(&format!("skipped: {why}"))],
        Outcome::Ran { label, bursts, error, ucx } => (label, bursts, error, ucx),
    };
    let how = how(peer, place, window);
    let mut out = Vec::new();
    let pats: Vec<Option<Pattern>> = match place {
        Place::Host => patterns.iter().map(|&p| Some(p)).collect(),
        Place::Gpu { .. } => vec![None],
    };
    for pat in pats {
        for &size in sizes {
            let v: Vec<f64> = bursts
                .iter()
                .filter(|b| b.peer == peer && b.size == size && pat.is_none_or(|p| b.pattern == p))
                .map(Burst::gbps)
                .collect();
            if v.is_empty() {
                continue;
            }
            let e = engine(pat, size).unwrap_or(f64::NAN);
            let row = match (pat, place) {
                (Some(p), _) => {
                    let case = format!("{} {p} {engine_tl} vs {} ({how})", human(size), peer.name());
                    Row::new("bw", &case, "gbps", e).pattern(p)
                }
                (None, Place::Gpu { .. }) => {
                    let case = format!("{} vs {} ({how})", gpu_case(size, place), peer.name());
                    Row::new("bw", &case, "gbps", e)
                }
                (None, Place::Host) => unreachable!("host rows have a pattern"),
            };
            let row = row.size(size).field("engine_transport", json!(engine_tl));
            let row = match ucx {
                Some(u) => {
                    let via = put_via(&u.puts, size);
                    row.baseline(&nixl_label(label, &u.tls, via.as_deref()), median(v))
                        .field("peer_transport", via.map_or(Value::Null, |w| json!(w)))
                        .field("peer_ucx_tls", json!(u.tls.tls))
                        .field(
                            "peer_ucx_tls_from",
                            json!(if u.tls.from_env { "environment" } else { "matched" }),
                        )
                        .field(
                            "peer_ucx_error_handling",
                            json!(if u.tls.error_handling_none() { "none" } else { "peer" }),
                        )
                }
                None => row.baseline(label, median(v)),
            };
            out.push(row);
        }
    }
    if let Some(e) = error {
        out.push(empty(&format!("failed: {e}")));
    } else if out.is_empty() {
        out.push(empty("failed: no result lines"));
    }
    out
}

fn gpu_case(size: usize, place: Place) -> String {
    match place {
        Place::Gpu { send, recv } => gpu::ipc_case(size, send, recv),
        Place::Host => human(size),
    }
}

/// `size:ops,size:ops`: the script's `--points`.
pub fn points_arg(points: &[(usize, u64)]) -> String {
    points.iter().map(|(s, n)| format!("{s}:{n}")).collect::<Vec<_>>().join(",")
}

/// What the script needs for one place.
#[derive(Clone, Debug)]
struct Sweep {
    place: Place,
    points: Vec<(usize, u64)>,
    patterns: Vec<Pattern>,
    region: usize,
    window: usize,
    rounds: usize,
    huge: bool,
}

impl Sweep {
    /// The script's options for one of the two processes: its memory on GPU `ord`, or on the
    /// host (`None`).
    fn args(&self, ord: Option<usize>) -> Vec<String> {
        let pats: Vec<&str> = self.patterns.iter().map(|p| p.name()).collect();
        let mut v = vec![
            "--region".to_string(),
            self.region.to_string(),
            "--window".into(),
            self.window.to_string(),
            "--rounds".into(),
            self.rounds.to_string(),
            "--patterns".into(),
            pats.join(","),
            "--points".into(),
            points_arg(&self.points),
            "--limit".into(),
            RUN_LIMIT.as_secs().to_string(),
        ];
        if self.huge {
            v.push("--huge".into());
        }
        v.push("--loc".into());
        v.push(ord.map_or("host".into(), |n| format!("cuda:{n}")));
        v
    }
}

/// The script on disk and the interpreter that runs it.
struct Script {
    dir: PathBuf,
    python: String,
}

impl Script {
    fn write() -> Result<Script, String> {
        let dir = std::env::temp_dir().join(format!("fabric-bench-peers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        std::fs::write(dir.join("peers.py"), SCRIPT)
            .map_err(|e| format!("cannot write {}: {e}", dir.join("peers.py").display()))?;
        let python = std::env::var("FABRIC_PYTHON").unwrap_or_else(|_| "python3".into());
        Ok(Script { dir, python })
    }

    fn env() -> Vec<(&'static str, String)> {
        // NIXL logs at INFO on stdout unless told otherwise.
        match std::env::var_os("NIXL_LOG_LEVEL") {
            Some(_) => Vec::new(),
            None => vec![("NIXL_LOG_LEVEL", "WARN".into())],
        }
    }

    fn start(&self, args: &[String]) -> Result<Spawned, String> {
        self.start_with(args, &[])
    }

    /// The script with `args`, and `extra` in its environment.
    fn start_with(&self, args: &[String], extra: &[(&'static str, String)]) -> Result<Spawned, String> {
        let mut all = vec![self.dir.join("peers.py").display().to_string()];
        all.extend(args.iter().cloned());
        let mut env = Self::env();
        env.extend(extra.iter().cloned());
        Spawned::start_on(&self.python, &all, None, &env).map_err(|e| {
            if self.python == "python3" {
                format!("{e} (set FABRIC_PYTHON to a Python 3 with the peer's packages)")
            } else {
                e.to_string()
            }
        })
    }

    /// `ok <label>`, or why the peer cannot run. NIXL's probe starts its UCX backend as the
    /// sweep will (`tls`'s environment and error handling).
    fn probe(&self, peer: Peer, place: Place, tls: &UcxTls) -> Result<String, String> {
        let mut args = vec!["probe".to_string(), peer.name().into()];
        if let Place::Gpu { send, recv } = place {
            args.extend(["--cuda".into(), format!("{send},{recv}")]);
        }
        let env = match peer {
            Peer::Nixl => {
                args.extend(tls.script_args());
                tls.env(|k| std::env::var_os(k).is_some())
            }
            Peer::Nccl => Vec::new(),
        };
        let (status, out) = self.start_with(&args, &env)?.finish(Instant::now() + PROBE_LIMIT);
        for line in out.lines().rev() {
            if let Some(label) = line.strip_prefix("ok ") {
                return Ok(label.trim().to_string());
            }
            if let Some(why) = line.strip_prefix("skip ") {
                return Err(why.trim().to_string());
            }
        }
        Err(format!(
            "its probe printed no verdict ({}): {}",
            crate::perftest::status_str(status),
            tail(&out, 3)
        ))
    }

    /// The two processes of one sweep; the bursts the sender printed, the put protocols UCX
    /// reported in its output (NIXL), and the error if any. NIXL runs with `tls`'s environment.
    fn sweep(&self, peer: Peer, s: &Sweep, tls: &UcxTls) -> (Vec<Burst>, Vec<PutRange>, Option<String>) {
        let deadline = Instant::now() + RUN_LIMIT;
        let (send, recv) = match s.place {
            Place::Host => (None, None),
            Place::Gpu { send, recv } => (Some(send), Some(recv)),
        };
        let started = match peer {
            Peer::Nixl => {
                let rdv = self.dir.join(format!("rdv-{}", s.place.label().replace(['>', ':'], "_")));
                let _ = std::fs::remove_dir_all(&rdv);
                if let Err(e) = std::fs::create_dir_all(&rdv) {
                    return (Vec::new(), Vec::new(), Some(format!("cannot create {}: {e}", rdv.display())));
                }
                let rdv = rdv.display().to_string();
                let mut target = vec!["nixl".to_string(), "target".into(), "--rdv".into(), rdv.clone()];
                target.extend(s.args(recv));
                let mut init = vec!["nixl".to_string(), "initiator".into(), "--rdv".into(), rdv];
                init.extend(s.args(send));
                target.extend(tls.script_args());
                init.extend(tls.script_args());
                let env = tls.env(|k| std::env::var_os(k).is_some());
                // The target (receiver) first, then the initiator (sender, which prints).
                self.start_with(&target, &env).and_then(|t| self.start_with(&init, &env).map(|i| (i, t)))
            }
            Peer::Nccl => {
                let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
                    Ok(a) => a.port().to_string(),
                    Err(e) => return (Vec::new(), Vec::new(), Some(format!("no free port: {e}"))),
                };
                let rank = |r: usize, ord: Option<usize>| {
                    let mut v = vec!["nccl".to_string(), "--rank".into(), r.to_string(), "--port".into()];
                    v.push(port.clone());
                    v.extend(s.args(ord));
                    v
                };
                if s.place == Place::Host {
                    return (Vec::new(), Vec::new(), Some("NCCL is GPU-only".into()));
                }
                self.start(&rank(0, send)).and_then(|r0| self.start(&rank(1, recv)).map(|r1| (r0, r1)))
            }
        };
        let (sender, receiver) = match started {
            Ok(p) => p,
            Err(e) => return (Vec::new(), Vec::new(), Some(e)),
        };
        let (ss, sout) = sender.finish(deadline);
        let (rs, rout) = receiver.finish(if ss == Some(true) {
            Instant::now() + Duration::from_secs(30)
        } else {
            Instant::now()
        });
        let mut bursts = Vec::new();
        let mut errors = Vec::new();
        for line in sout.lines() {
            match parse_line(line) {
                Some(Ok(b)) => bursts.push(b),
                Some(Err(e)) => errors.push(e),
                None => {}
            }
        }
        let (sname, rname) = match peer {
            Peer::Nixl => ("initiator", "target"),
            Peer::Nccl => ("rank 0", "rank 1"),
        };
        let status = crate::perftest::status_str;
        if ss != Some(true) {
            errors.push(format!("{sname}: {}: {}", status(ss), last_words(&sout)));
        }
        if rs != Some(true) {
            errors.push(format!("{rname}: {}: {}", status(rs), last_words(&rout)));
        }
        let puts = if peer == Peer::Nixl { put_ranges(&sout) } else { Vec::new() };
        (bursts, puts, if errors.is_empty() { None } else { Some(errors.join("; ")) })
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The last line of a child's output that says something (its error, usually).
fn last_words(out: &str) -> String {
    out.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with(LINE))
        .unwrap_or("no output")
        .to_string()
}

/// Runs every `--peer` at bw's host sizes and, with `--location cuda`, between the GPUs, and
/// puts their rows beside bw's (leader only, after the peer process has exited: nothing else
/// runs meanwhile).
pub async fn run(o: &Opts, rep: &mut Report) {
    if o.peers.is_empty() {
        return;
    }
    let o = o.clone();
    let sizes = bw::bw_sizes(&o);
    let points: Vec<(usize, u64)> = sizes.iter().map(|&s| (s, bw::bw_ops(&o, s))).collect();
    let mut sweeps = vec![Sweep {
        place: Place::Host,
        points: points.clone(),
        patterns: o.buffers.clone(),
        region: bw::region_len(&o, &sizes),
        window: o.window,
        rounds: bw::rounds(&o),
        huge: o.huge_pages,
    }];
    let mut gpu_skip = None;
    if let Location::Cuda(loc) = o.location {
        match gpu::resolve(loc) {
            Ok((send, recv)) => sweeps.push(Sweep {
                place: Place::Gpu { send, recv },
                points,
                patterns: vec![Pattern::Cold],
                region: gpu::region_len(&sizes, o.window),
                window: o.window,
                rounds: gpu::reps(o.quick),
                huge: false,
            }),
            Err(why) => gpu_skip = Some(why),
        }
    }
    let peers = o.peers.clone();
    let provider = o.provider.clone();
    let env_tls = std::env::var("UCX_TLS").ok();
    let outcomes = tokio::task::spawn_blocking(move || {
        let script = match Script::write() {
            Ok(s) => s,
            Err(e) => {
                let all = sweeps
                    .iter()
                    .flat_map(|s| peers.iter().map(|&p| (p, s.place, Outcome::Skipped(e.clone()))));
                return all.collect::<Vec<_>>();
            }
        };
        let mut out = Vec::new();
        for s in &sweeps {
            for &peer in &peers {
                let outcome = if peer == Peer::Nccl && s.place == Place::Host {
                    Outcome::Skipped("NCCL is GPU-only (its rows come with --location cuda)".into())
                } else {
                    eprintln!("peer {}: {} probe", peer.name(), s.place.label());
                    let tls = ucx_tls(&provider, s.place, env_tls.as_deref());
                    match script.probe(peer, s.place, &tls) {
                        Err(why) => Outcome::Skipped(why),
                        Ok(label) => {
                            let held = match peer {
                                Peer::Nixl => format!(
                                    ", {}{} (engine: {})",
                                    tls.describe(),
                                    if tls.error_handling_none() {
                                        ", ucx_error_handling_mode=none"
                                    } else {
                                        ""
                                    },
                                    engine_transport(&provider, s.place)
                                ),
                                Peer::Nccl => String::new(),
                            };
                            eprintln!(
                                "peer {}: {label}, {} {} sizes x {} x {} rounds{held}",
                                peer.name(),
                                s.place.label(),
                                s.points.len(),
                                s.patterns.iter().map(|p| p.name()).collect::<Vec<_>>().join(","),
                                s.rounds
                            );
                            let (bursts, puts, error) = script.sweep(peer, s, &tls);
                            if let Some(e) = &error {
                                eprintln!("peer {} {}: {e}", peer.name(), s.place.label());
                            }
                            let ucx = (peer == Peer::Nixl).then_some(Ucx { tls, puts });
                            Outcome::Ran { label, bursts, error, ucx }
                        }
                    }
                };
                out.push((peer, s.place, outcome));
            }
        }
        out
    })
    .await
    .unwrap_or_else(|e| {
        vec![(o.peers[0], Place::Host, Outcome::Skipped(format!("the peers' thread failed: {e}")))]
    });
    let mut new = Vec::new();
    for (peer, place, outcome) in &outcomes {
        let engine = |pat: Option<Pattern>, size: usize| match (place, pat) {
            (Place::Host, Some(p)) => rep.bw_engine(size, p, o.domain_counts[0]),
            (Place::Gpu { send, recv }, _) => rep.engine_of("bw", &gpu::ipc_case(size, *send, *recv)),
            (Place::Host, None) => None,
        };
        let tl = engine_transport(&o.provider, *place);
        new.extend(rows(*peer, *place, o.window, outcome, &sizes, &o.buffers, &tl, engine));
    }
    if let Some(why) = gpu_skip {
        for &peer in &o.peers {
            let short = why.split(" (").next().unwrap_or(&why);
            let row =
                Row::new("bw", &format!("GPU->GPU vs {}: skipped: {short}", peer.name()), "gbps", f64::NAN);
            new.push(row.baseline(peer.name(), f64::NAN));
        }
    }
    rep.insert_after(&["bw", "gpu-ceiling"], new);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_lists_parse() {
        assert_eq!(parse_list("nixl"), Ok(vec![Peer::Nixl]));
        assert_eq!(parse_list("nixl,nccl"), Ok(vec![Peer::Nixl, Peer::Nccl]));
        assert_eq!(parse_list("nccl, nixl,nccl"), Ok(vec![Peer::Nccl, Peer::Nixl]));
        assert_eq!(parse_list(""), Ok(vec![]));
        assert_eq!(parse_list("none"), Ok(vec![]));
        assert!(parse_list("ucx").unwrap_err().contains("expected nixl, nccl"));
        assert!(parse_list("nixl,mpi").is_err());
    }

    const HOT: &str =
        "fabric-peer peer=nixl pattern=hot size=65536 ops=256 bytes=16777216 seconds=0.002 gbps=67.1";

    #[test]
    fn result_lines_parse() {
        let b = parse_line(HOT).unwrap().unwrap();
        assert_eq!((b.peer, b.pattern, b.size, b.bytes), (Peer::Nixl, Pattern::Hot, 65536, 16 << 20));
        assert!((b.gbps() - 16777216.0 * 8.0 / 0.002 / 1e9).abs() < 1e-9);
        // Fields in any order, surrounding blanks.
        let b = parse_line("  fabric-peer seconds=1 bytes=1000000000 size=4194304 pattern=cold peer=nccl \n")
            .unwrap()
            .unwrap();
        assert_eq!((b.peer, b.pattern, b.gbps()), (Peer::Nccl, Pattern::Cold, 8.0));
        // Other lines are not results.
        for other in ["", "2026-11-26 NIXL WARN something", "fabric-peerx peer=nixl", "ok NIXL 1.5.1 UCX"] {
            assert!(parse_line(other).is_none(), "{other:?}");
        }
        // Result lines that do not read are errors, not silently dropped.
        for (bad, why) in [
            (HOT.replace(" seconds=0.002", ""), "no seconds="),
            (HOT.replace("seconds=0.002", "seconds=0"), "seconds=0"),
            (HOT.replace("seconds=0.002", "seconds=abc"), "not a number"),
            (HOT.replace("size=65536", "size=64K"), "bad size"),
            (HOT.replace("peer=nixl", "peer=ucx"), "expected nixl"),
            (HOT.replace("pattern=hot", "pattern=warm"), "expected hot, cold"),
        ] {
            let e = parse_line(&bad).unwrap().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    fn burst(peer: Peer, pattern: Pattern, size: usize, gbps: f64) -> Burst {
        Burst { peer, pattern, size, bytes: 1_000_000_000, secs: 8.0 / gbps }
    }

    #[test]
    fn host_rows_beside_the_engine() {
        use Pattern::{Cold, Hot};
        let bursts = vec![
            burst(Peer::Nixl, Hot, 4096, 10.0),
            burst(Peer::Nixl, Hot, 4096, 30.0),
            burst(Peer::Nixl, Hot, 4096, 20.0),
            burst(Peer::Nixl, Cold, 4096, 5.0),
            burst(Peer::Nixl, Hot, 1 << 20, 40.0),
        ];
        let tls = ucx_tls("tcp", Place::Host, None);
        let puts = vec![
            PutRange { lo: 0, hi: 8184, via: vec!["tcp/lo".into()] },
            PutRange { lo: 8185, hi: u64::MAX, via: vec!["tcp/lo".into(), "tcp/eth0".into()] },
        ];
        let out = Outcome::Ran {
            label: "NIXL 1.5.1 UCX".into(),
            bursts,
            error: None,
            ucx: Some(Ucx { tls, puts }),
        };
        let engine = |p: Option<Pattern>, size: usize| match (p, size) {
            (Some(Hot), 4096) => Some(30.0),
            (Some(Cold), 4096) => Some(2.5),
            _ => None,
        };
        let rows =
            rows(Peer::Nixl, Place::Host, 16, &out, &[4096, 1 << 20], &[Hot, Cold], "tcp;ofi_rxm", engine);
        // hot 4 KiB, hot 1 MiB (no engine row: ratio null), cold 4 KiB; no cold 1 MiB burst.
        assert_eq!(rows.len(), 3);
        let path = std::env::temp_dir().join(format!("fabric-bench-peers-rows-{}.json", std::process::id()));
        let mut rep = Report::new("tcp");
        rep.push(Row::new("bw", "4 KiB hot", "gbps", 30.0).size(4096).pattern(Hot).baseline("raw", 31.0));
        rep.push(Row::new("lat", "8 B p50", "us", 30.0).size(8).baseline("raw", 15.0));
        rep.insert_after(&["bw", "gpu-ceiling"], rows);
        rep.write_json(&path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        let res = v["results"].as_array().unwrap();
        assert_eq!(res.last().unwrap()["test"], "lat", "the peers' rows go after bw's");
        let r = &res[1];
        assert_eq!(r["case"], "4 KiB hot tcp;ofi_rxm vs nixl (DRAM, one request of 16 blocks at a time)");
        assert_eq!(
            (r["baseline"].as_str(), r["baseline_gbps"].as_f64()),
            (Some("NIXL 1.5.1 UCX tcp/lo (UCX_TLS=tcp,self)"), Some(20.0))
        );
        assert_eq!(
            (r["engine_transport"].as_str(), r["peer_transport"].as_str()),
            (Some("tcp;ofi_rxm"), Some("tcp/lo"))
        );
        assert_eq!(
            (r["peer_ucx_tls"].as_str(), r["peer_ucx_tls_from"].as_str()),
            (Some("tcp,self"), Some("matched"))
        );
        assert_eq!(r["peer_ucx_error_handling"], "peer");
        assert_eq!(res[2]["baseline"], "NIXL 1.5.1 UCX tcp/lo+tcp/eth0 (UCX_TLS=tcp,self)");
        assert_eq!((r["engine_gbps"].as_f64(), r["ratio"].as_f64()), (Some(30.0), Some(1.5)));
        assert_eq!((r["pattern"].as_str(), r["size"].as_u64()), (Some("hot"), Some(4096)));
        assert!(res[2]["engine_gbps"].is_null() && res[2]["ratio"].is_null());
        assert_eq!(res[3]["ratio"].as_f64(), Some(0.5));
    }

    #[test]
    fn gpu_rows_skips_and_failures() {
        let place = Place::Gpu { send: 0, recv: 1 };
        let bursts = vec![burst(Peer::Nccl, Pattern::Cold, 64 << 20, 2000.0)];
        let out = Outcome::Ran { label: "NCCL 2.27.5 (torch 2.11.0)".into(), bursts, error: None, ucx: None };
        let engine = |p: Option<Pattern>, size| (p.is_none() && size == 64 << 20).then_some(2500.0);
        let r = rows(Peer::Nccl, place, 4, &out, &[64 << 20], &[Pattern::Hot], "CUDA IPC", engine);
        assert_eq!(r.len(), 1);
        let mut rep = Report::new("shm");
        rep.insert_after(&["bw"], r);
        assert_eq!(
            rep.engine_of(
                "bw",
                "GPU->GPU CUDA IPC 64 MiB cuda:0->cuda:1 vs nccl (batch_isend_irecv of 4 at a time)"
            ),
            Some(2500.0)
        );
        // Skipped: one row, no figures; failed part way: the rows it has, then the failure.
        let skip = Outcome::Skipped("import nixl failed (No module named 'nixl_cu13')".into());
        let r = rows(Peer::Nixl, Place::Host, 16, &skip, &[4096], &[Pattern::Hot], "shm", |_, _| Some(1.0));
        assert_eq!(r.len(), 1);
        let mut rep = Report::new("tcp");
        rep.push(r[0].clone());
        assert!(rep
            .engine_of("bw", "host vs nixl: skipped: import nixl failed (No module named 'nixl_cu13')")
            .is_some_and(f64::is_nan));
        let bursts = vec![burst(Peer::Nixl, Pattern::Hot, 4096, 10.0)];
        let failed = Outcome::Ran {
            label: "NIXL".into(),
            bursts,
            error: Some("target: killed\nmore".into()),
            ucx: None,
        };
        let r = rows(Peer::Nixl, Place::Host, 16, &failed, &[4096, 8192], &[Pattern::Hot], "shm", |_, _| {
            Some(1.0)
        });
        assert_eq!(r.len(), 2);
        let mut rep = Report::new("tcp");
        rep.insert_after(&["bw"], r);
        assert!(rep.engine_of("bw", "host vs nixl: failed: target: killed").is_some());
        let none = Outcome::Ran { label: "NIXL".into(), bursts: Vec::new(), error: None, ucx: None };
        let r = rows(Peer::Nixl, Place::Host, 16, &none, &[4096], &[Pattern::Hot], "shm", |_, _| None);
        let mut rep = Report::new("tcp");
        rep.insert_after(&["bw"], r);
        assert!(rep.engine_of("bw", "host vs nixl: failed: no result lines").is_some());
    }

    #[test]
    fn sweep_arguments() {
        let s = Sweep {
            place: Place::Gpu { send: 1, recv: 0 },
            points: vec![(4 << 20, 64), (64 << 20, 32)],
            patterns: vec![Pattern::Cold],
            region: 256 << 20,
            window: 4,
            rounds: 3,
            huge: false,
        };
        let a = s.args(Some(1)).join(" ");
        assert!(a.contains("--points 4194304:64,67108864:32"), "{a}");
        assert!(a.contains("--patterns cold --") && a.contains("--window 4 --rounds 3"), "{a}");
        assert!(a.ends_with("--loc cuda:1") && !a.contains("--huge"), "{a}");
        let host = Sweep { place: Place::Host, huge: true, ..s };
        assert!(host.args(None).join(" ").ends_with("--huge --loc host"));
    }

    #[test]
    fn the_script_is_embedded() {
        assert!(SCRIPT.contains("def nixl_initiator") && SCRIPT.contains("batch_isend_irecv"));
        assert!(SCRIPT.contains(LINE.trim()));
    }
}
