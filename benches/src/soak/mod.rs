//! `fabric-bench soak`: random traffic for minutes while peers are killed and restarted;
//! every byte and immediate of every posted operation is accounted for.
//!
//! ```text
//!  leader (this process, one engine)                peers p0.0, p1.0, ... (soak-peer)
//!  --tasks traffic tasks ── write / write_imm / imm ──► region + ImmCounter(IMM)
//!    ~20% of futures dropped                          publishes its IMM count (TcpStore)
//!  every --kill-every s: SIGKILL one peer ─► probes must fail typed, never hang
//!  every round (--round-secs): quiesce, read each live region back, compare; remove the
//!    killed peer (remove_peer) and restart it as a new incarnation (new process, address,
//!    descriptor)
//! ```
//!
//! Checks (any failure is a violation and a non-zero exit): no awaited future hangs; no
//! operation to a live peer fails other than by an injected fault (`--faults`); for every
//! incarnation that was not killed, every created write (awaited, dropped or failed by
//! injection: `ledger.rs` says why) has its exact bytes at the peer, and the peer counted
//! exactly the immediates of every created write_imm and imm-only write (its count is never
//! above that, never below the `Ok` ones); the leader's RSS and open fds stay bounded.
//!
//! Among the random operations, bad remote accesses (`bad.rs`): through the descriptors of
//! short-lived regions the peers keep allocating and freeing (stale: before the free, racing
//! it, after the revocation) and through forged descriptors of the live regions. Each must
//! end as the engine promises (`Stale`, `RemoteAccess`, `ConnectionLost`; `Ok` only before
//! or racing the free), a forged one must not land, and no live peer may be reported `Down`.
//! On tcp a bad access tears the connection down and fails what else was in flight on it
//! with `ConnectionLost`: only those operations (and as many dropped ones as the engine
//! failed) may be missing from the checks above (`ledger.rs`).
//! Files: `traffic.rs` (one traffic task), `ledger.rs` (what was created, the checks),
//! `verify.rs` (the leader's check of one target at the end of a round: quiesce, read back,
//! compare), `peer.rs` (the peer process and the leader's handle on it), `bad.rs` (stale
//! and forged descriptors).

mod bad;
mod extras;
mod ledger;
mod peer;
mod rng;
mod traffic;
mod verify;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::faults::{FaultHandle, FaultPlan};
use fabric_async::{Engine, Error, MemoryRegion, PeerEvent, PeerId};
use futures::StreamExt;

use crate::pair::Res;
use ledger::{Counts, Target};
use peer::{Incarnation, PeerArgs, IMM};
use rng::Rng;
use traffic::TaskPlan;

/// `fabric-bench soak` and its hidden peer.
#[derive(Parser, Debug)]
#[command(name = "fabric-bench")]
struct SoakCli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Random writes, write_imm and imm-only writes from many tasks to several peer processes
    /// that are killed and restarted; every byte and immediate checked (docs/operations.md).
    Soak(SoakArgs),
    /// Internal: one peer process of the soak.
    #[command(hide = true)]
    SoakPeer(PeerArgs),
}

#[derive(clap::Args, Debug, Clone)]
struct SoakArgs {
    /// How long to run, in minutes.
    #[arg(long, conflicts_with = "seconds")]
    minutes: Option<u64>,
    /// How long to run, in seconds (default 60).
    #[arg(long)]
    seconds: Option<u64>,
    /// tcp (default) or shm.
    #[arg(long, default_value = "tcp")]
    provider: String,
    /// Peer processes alive at once.
    #[arg(long, default_value_t = 3)]
    peers: usize,
    /// Traffic tasks of the leader.
    #[arg(long, default_value_t = 8)]
    tasks: usize,
    /// Largest write, in bytes (sizes are log-uniform from 1 B).
    #[arg(long, default_value_t = 1 << 20)]
    max_size: u64,
    /// Percent of futures dropped before they resolve.
    #[arg(long, default_value_t = 20)]
    drop_pct: u64,
    /// Awaited futures in flight per task.
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// Kill one peer (SIGKILL) every N seconds, and restart it at the end of the round; 0: never.
    #[arg(long, default_value_t = 10)]
    kill_every: u64,
    /// Longest traffic phase of a round (a task stops early once its slots are full), after
    /// which the leader quiesces, verifies and restarts the killed peer.
    #[arg(long, default_value_t = 1)]
    round_secs: u64,
    /// The engine's op_timeout, in seconds: how long an operation to a dead peer may take to fail.
    #[arg(long, default_value_t = 5)]
    op_timeout: u64,
    /// Print RSS, open fds and counts every N seconds.
    #[arg(long, default_value_t = 10)]
    report_every: u64,
    /// Fault injection on the leader's NICs: again=P,fail=P[,seed=N] (docs/operations.md).
    #[arg(long)]
    faults: Option<FaultPlan>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Do not count a probe of a killed peer that completes Ok as a violation. For shm, where
    /// a small write posted right after the peer died, before the engine noticed, can still
    /// complete Ok (docs/operations.md, "Soak").
    #[arg(long)]
    allow_dead_ok: bool,
    /// Operations per 1000 through the descriptor of a peer's short-lived extra region: before
    /// its free, racing it, or after its revocation (docs/operations.md, "Soak").
    #[arg(long, default_value_t = 20)]
    stale_per_mille: u64,
    /// Operations per 1000 through a forged descriptor of a peer's region.
    #[arg(long, default_value_t = 1)]
    forged_per_mille: u64,
    /// Bytes of each peer's short-lived extra regions.
    #[arg(long, default_value_t = 64 << 10)]
    extra_size: usize,
    /// Longest time an extra region lives (uniform), and the pause before the next, in ms.
    #[arg(long, default_value_t = 50)]
    extra_every_ms: u64,
    /// Test hook: misrecord one write and one immediate, so the run must fail.
    #[arg(long, hide = true)]
    tamper: bool,
}

/// Runs `fabric-bench soak ...` or `soak-peer ...` if that is the command line; `None` if
/// it is another test's.
pub fn main_if_soak() -> Option<i32> {
    let first = std::env::args().nth(1)?;
    if first != "soak" && first != "soak-peer" {
        return None;
    }
    let cli = SoakCli::parse();
    if std::env::var_os("FI_TCP_IFACE").is_none() {
        std::env::set_var("FI_TCP_IFACE", "lo");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::Soak(a) => leader(a).await,
            Cmd::SoakPeer(a) => peer::peer_main(a).await.map(|()| true),
        }
    });
    Some(match r {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("fabric-bench soak failed: {e}");
            2
        }
    })
}

/// Everything the leader tallies over the run.
#[derive(Default)]
struct Totals {
    counts: Counts,
    killed: u64,
    restarted: u64,
    probes_failed: u64,
    probes_ok: u64,
    /// Removed incarnations whose next operation failed at once with `PeerUnreachable`.
    removed_refused: u64,
    /// Operations in flight or queued in the engine to a peer when it was killed.
    pending_at_kill: u64,
    /// Moving average of the traffic phase of rounds without a kill, ms.
    traffic_ms: f64,
    bytes_verified: u64,
    bytes_lost: u64,
    /// Writes (and bytes) not in place that may have been lost with a connection.
    lost_writes: u64,
    lost_bytes: u64,
    /// Immediates that never arrived, of operations that may have been lost with a connection.
    imm_missing: u64,
    /// Rounds in which the engine failed a dropped future's operation, of a live peer.
    dropped_failed_rounds: u64,
    writes_verified: u64,
    arrivals_checked: u64,
    rounds: u64,
    /// (seconds, RSS bytes, open fds).
    samples: Vec<(f64, u64, u64)>,
}

struct Leader {
    a: SoakArgs,
    engine: Engine,
    store: TcpStore,
    store_addr: SocketAddr,
    src: Arc<MemoryRegion>,
    src_bytes: Vec<u8>,
    /// Where reads through stale and forged descriptors land (nobody looks).
    sink: Arc<MemoryRegion>,
    readback: MemoryRegion,
    /// `readback`'s bytes copied out for the comparison (allocated once).
    scratch: Vec<u8>,
    region: usize,
    /// Per place: the running incarnation, its target, and its generation.
    places: Vec<(Incarnation, Arc<Target>, usize)>,
    violations: Arc<Mutex<Vec<String>>>,
    t: Totals,
    /// Stops the leader's side of the extra regions (`extras::cycle_extras`), one task per
    /// incarnation.
    stop: Arc<AtomicBool>,
    extras: Vec<tokio::task::JoinHandle<Vec<String>>>,
    /// Every `PeerEvent::Down` so far, and the incarnations the soak killed.
    downs: Arc<Mutex<Vec<(PeerId, String)>>>,
    killed_peers: HashSet<PeerId>,
}

async fn leader(a: SoakArgs) -> Res<bool> {
    let secs = a.minutes.map(|m| m * 60).or(a.seconds).unwrap_or(60);
    if a.peers == 0
        || a.tasks == 0
        || a.window == 0
        || a.max_size == 0
        || a.drop_pct > 100
        || a.round_secs == 0
    {
        return Err(
            "--peers, --tasks, --window, --max-size and --round-secs must be above 0, --drop-pct at most 100"
                .into(),
        );
    }
    let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
    let store_addr = server.local_addr();
    let store = TcpStore::connect(store_addr).await?;
    let mut b = Engine::builder().provider(&a.provider).op_timeout(Some(Duration::from_secs(a.op_timeout)));
    // `--faults`, else FABRIC_FAULTS (which the engine would read itself): set here so that
    // the summary can say what was injected.
    let mut a = a;
    if a.faults.is_none() {
        a.faults = FaultPlan::from_env()?;
    }
    let faults: Option<FaultHandle> = a.faults.as_ref().map(|p| p.handle.clone());
    if let Some(plan) = a.faults.clone() {
        b = b.faults(plan);
    }
    let engine = b.build()?;
    let downs: Arc<Mutex<Vec<(PeerId, String)>>> = Arc::default();
    {
        let mut events = engine.peer_events();
        let downs = downs.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                if let PeerEvent::Down { peer, reason } = ev {
                    downs.lock().unwrap_or_else(|p| p.into_inner()).push((peer, reason));
                }
            }
        });
    }
    // Each task owns a slot of every peer region that holds a few of the largest writes.
    let slot = (8 * a.max_size).max(1 << 20);
    let region = slot as usize * a.tasks;
    let src_len = 2 * a.max_size as usize;
    let src_bytes: Vec<u8> = {
        let mut rng = Rng::new(a.seed ^ 0x50ac);
        (0..src_len).map(|_| rng.next() as u8).collect()
    };
    let src = Arc::new(engine.register_copy(src_bytes.clone()).await?);
    let readback = engine.alloc(region).await?;
    let sink = Arc::new(engine.alloc(a.extra_size.max(4096)).await?);
    eprintln!(
        "soak: {} for {secs} s, {} peers, {} tasks, writes 1 B..{} B, {}% of futures dropped, \
         {}, op_timeout {} s{}; {}/1000 stale, {}/1000 forged",
        a.provider,
        a.peers,
        a.tasks,
        a.max_size,
        a.drop_pct,
        match a.kill_every {
            0 => "no kills".to_string(),
            n => format!("a peer killed every {n} s"),
        },
        a.op_timeout,
        a.faults.as_ref().map_or(String::new(), |p| format!(", faults again={} fail={}", p.again, p.fail)),
        a.stale_per_mille,
        a.forged_per_mille
    );
    let mut l = Leader {
        a: a.clone(),
        engine,
        store,
        store_addr,
        src,
        src_bytes,
        sink,
        readback,
        scratch: vec![0; region],
        region,
        places: Vec::new(),
        violations: Arc::default(),
        t: Totals::default(),
        stop: Arc::default(),
        extras: Vec::new(),
        downs,
        killed_peers: HashSet::new(),
    };
    for place in 0..a.peers {
        let inc = l.start(place, 0).await?;
        l.places.push(inc);
    }
    if a.stale_per_mille + a.forged_per_mille > 1000 {
        return Err("--stale-per-mille plus --forged-per-mille must be at most 1000".into());
    }
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    let mut next_kill = (a.kill_every > 0).then(|| t0 + Duration::from_secs(a.kill_every));
    let mut next_report = t0;
    let mut rng = Rng::new(a.seed);
    while Instant::now() < end {
        let round_end = (Instant::now() + Duration::from_secs(a.round_secs)).min(end);
        let kill_at = next_kill.filter(|k| *k < round_end).map(|_| {
            // While the tasks still fill their slots (80% of the last rounds' traffic phase):
            // mid-transfer.
            let span = (l.t.traffic_ms * 0.8) as u64;
            Instant::now() + Duration::from_millis(rng.below(span.max(1)))
        });
        let killed = l.round(round_end, kill_at, &mut rng, slot).await?;
        if killed.is_some() {
            next_kill = next_kill.map(|k| k + Duration::from_secs(a.kill_every));
        }
        l.settle(killed).await?;
        if Instant::now() >= next_report && Instant::now() < end {
            next_report += Duration::from_secs(a.report_every.max(1));
            l.sample(t0);
        }
    }
    l.sample(t0);
    l.finish(faults, t0).await
}

impl Leader {
    /// Starts generation `gen` of place `place`, and the leader's side of its extra regions.
    async fn start(&mut self, place: usize, gen: usize) -> Res<(Incarnation, Arc<Target>, usize)> {
        let extra = if self.a.stale_per_mille > 0 { self.a.extra_size } else { 0 };
        let inc = Incarnation::start(
            &self.engine,
            &self.store,
            self.store_addr,
            &self.a.provider,
            place,
            gen,
            self.region,
            (extra, self.a.extra_every_ms),
        )
        .await?;
        // shm: the owner refuses to vouch for a forged descriptor, so nothing is ever posted
        // through it (docs/faults.md); counted as one forged access.
        let forged = match self.engine.remote_region(&bad::forge(inc.remote.descriptor())?).await {
            Ok(f) => Some(f),
            Err(fabric_async::Error::RemoteAccess { op: "descriptor", .. }) if self.a.provider == "shm" => {
                None
            }
            Err(e) => return Err(format!("remote_region of a forged descriptor: {e}").into()),
        };
        let refused = forged.is_none();
        let target = Arc::new(Target::new(inc.name.clone(), inc.peer, inc.remote.clone(), forged));
        if refused {
            target.ledger().counts.forged[bad::BadOutcome::RemoteAccess as usize] += 1;
        }
        if extra > 0 {
            self.extras.push(tokio::spawn(extras::cycle_extras(
                self.engine.clone(),
                self.store_addr,
                target.clone(),
                self.stop.clone(),
                Duration::from_millis(self.a.extra_every_ms),
                self.a.seed ^ ((place as u64) << 32) ^ gen as u64,
            )));
        }
        Ok((inc, target, gen))
    }

    /// One round of traffic, killing one peer at `kill_at`; returns the killed place.
    async fn round(
        &mut self,
        until: Instant,
        kill_at: Option<Instant>,
        rng: &mut Rng,
        slot: u64,
    ) -> Res<Option<usize>> {
        let targets: Vec<Arc<Target>> = self.places.iter().map(|p| p.1.clone()).collect();
        for t in &targets {
            t.new_round(self.engine.stats().peer(t.peer).map_or(0, |s| s.errors));
        }
        let hang_after = Duration::from_secs(self.a.op_timeout + 10);
        // `--tamper` misrecords a write and an immediate of the first round: no bad accesses
        // then, so that nothing there may be tolerated as lost with a connection.
        let quiet = self.a.tamper && self.t.rounds == 0;
        let mut tasks = Vec::new();
        for task in 0..self.a.tasks {
            let plan = TaskPlan {
                task,
                slot,
                max_size: self.a.max_size,
                src_len: self.src_bytes.len() as u64,
                drop_pct: self.a.drop_pct,
                window: self.a.window,
                tamper: self.a.tamper && task == 0 && self.t.rounds == 0,
                hang_after,
                deadline: until,
                seed: rng.next(),
                stale_per_mille: if quiet { 0 } else { self.a.stale_per_mille },
                forged_per_mille: if quiet { 0 } else { self.a.forged_per_mille },
                tears_down: self.a.provider != "shm",
                shm: self.a.provider == "shm",
            };
            tasks.push(tokio::spawn(traffic::run(
                self.engine.clone(),
                self.src.clone(),
                self.sink.clone(),
                targets.clone(),
                plan,
            )));
        }
        let started = Instant::now();
        let mut killed = None;
        let mut probe = None;
        if let Some(at) = kill_at {
            tokio::time::sleep_until(at.into()).await;
            let place = rng.below(self.places.len() as u64) as usize;
            let (inc, target, _) = &mut self.places[place];
            let s = self.engine.stats().peer(target.peer).copied().unwrap_or_default();
            self.t.pending_at_kill += s.in_flight + s.backlog;
            target.alive.store(false, std::sync::atomic::Ordering::Release);
            self.killed_peers.insert(target.peer);
            inc.kill();
            self.t.killed += 1;
            killed = Some(place);
            let (engine, src, target) = (self.engine.clone(), self.src.clone(), target.clone());
            probe =
                Some(tokio::spawn(
                    async move { traffic::probe_dead(&engine, &src, &target, hang_after).await },
                ));
        }
        for t in tasks {
            traffic::merge(&self.violations, t.await?);
        }
        // Rounds with a kill last until the dead peer's operations time out: not counted.
        if killed.is_none() {
            let ms = started.elapsed().as_secs_f64() * 1e3;
            self.t.traffic_ms =
                if self.t.traffic_ms == 0.0 { ms } else { 0.8 * self.t.traffic_ms + 0.2 * ms };
        }
        if let Some(p) = probe {
            let (errs, oks, v) = p.await?;
            self.t.probes_failed += errs;
            self.t.probes_ok += oks;
            traffic::merge(&self.violations, v);
        }
        self.t.rounds += 1;
        Ok(killed)
    }

    /// After a round: quiesce and verify every live incarnation, retire the killed one and
    /// start its successor.
    async fn settle(&mut self, killed: Option<usize>) -> Res<()> {
        for i in 0..self.places.len() {
            if Some(i) == killed {
                continue;
            }
            let target = self.places[i].1.clone();
            self.check(&target).await?;
        }
        if let Some(place) = killed {
            // Remove the dead incarnation (its probes have resolved); an operation through it
            // must then fail at once.
            let dead = self.places[place].1.clone();
            self.engine.remove_peer(dead.peer).await?;
            match tokio::time::timeout(Duration::from_secs(1), self.engine.imm(&dead.remote, IMM)).await {
                Ok(Err(Error::PeerUnreachable { .. })) => self.t.removed_refused += 1,
                other => self.violation(format!("an imm to the removed {}: {other:?}", dead.name)),
            }
            let gen = self.places[place].2 + 1;
            let fresh = self.start(place, gen).await?;
            let (_, old, _) = std::mem::replace(&mut self.places[place], fresh);
            let mut l = old.ledger();
            self.t.counts.add(&l.counts);
            l.writes = Vec::new();
            self.t.restarted += 1;
        }
        // The extra regions' tasks of killed incarnations have ended: their violations.
        let mut running = Vec::new();
        for h in std::mem::take(&mut self.extras) {
            if h.is_finished() {
                traffic::merge(&self.violations, h.await?);
            } else {
                running.push(h);
            }
        }
        self.extras = running;
        self.downs_of_live();
        Ok(())
    }

    /// A `Down` event for a peer the soak did not kill is a violation (a bad remote access
    /// must never make its owner `Down`).
    fn downs_of_live(&self) {
        let downs = std::mem::take(&mut *self.downs.lock().unwrap_or_else(|p| p.into_inner()));
        for (peer, reason) in downs {
            if !self.killed_peers.contains(&peer) {
                let name = self.places.iter().find(|p| p.1.peer == peer).map_or("?", |p| p.1.name.as_str());
                self.violation(format!("the live peer {name} ({peer:?}) was reported Down: {reason}"));
            }
        }
    }

    fn violation(&self, v: String) {
        traffic::merge(&self.violations, vec![v]);
    }

    fn sample(&mut self, t0: Instant) {
        let (rss, fds) = ledger::rss_and_fds();
        let secs = t0.elapsed().as_secs_f64();
        self.t.samples.push((secs, rss, fds));
        let mut c = self.t.counts;
        for p in &self.places {
            c.add(&p.1.ledger().counts);
        }
        println!(
            "[{secs:6.1} s] rss {:.1} MiB, fds {fds}, ops {} (ok {}, failed {}, dropped {}), killed {}, bytes verified {}, lost {}",
            rss as f64 / (1 << 20) as f64,
            c.created_total(),
            c.ok,
            c.injected + c.failed,
            c.dropped,
            self.t.killed,
            self.t.bytes_verified,
            self.t.bytes_lost
        );
    }

    /// Stops the peers, prints the summary and returns whether the run passed.
    async fn finish(mut self, faults: Option<FaultHandle>, t0: Instant) -> Res<bool> {
        // Before the peers exit (which may be reported as Down).
        self.downs_of_live();
        self.stop.store(true, Ordering::Release);
        for h in std::mem::take(&mut self.extras) {
            match tokio::time::timeout(Duration::from_secs(20), h).await {
                Ok(v) => traffic::merge(&self.violations, v?),
                Err(_) => {
                    self.violation("hang: the leader's side of a peer's extra regions did not stop".into())
                }
            }
        }
        self.store.put("soak/exit", Vec::new()).await?;
        let places = std::mem::take(&mut self.places);
        let mut clean = true;
        for (mut inc, target, _) in places {
            self.t.counts.add(&target.ledger().counts);
            clean &= tokio::task::spawn_blocking(move || inc.finish(Duration::from_secs(10))).await?;
        }
        if !clean {
            self.violation("a peer process did not exit cleanly".into());
        }
        let t = &self.t;
        let c = &t.counts;
        let secs = t0.elapsed().as_secs_f64();
        println!("\n== soak summary: {} for {secs:.0} s, {} rounds", self.a.provider, t.rounds);
        println!(
            "ops posted       {} (write {}, write_imm {}, imm {})",
            c.created_total(),
            c.created[0],
            c.created[1],
            c.created[2]
        );
        println!(
            "ops completed    {} ok, {} failed (injected {}, typed errors {}), {} dropped ({:.1}%; {} raced a \
             timeout of up to 0.5 ms, {} of them lost), {} hung",
            c.ok,
            c.injected + c.failed,
            c.injected,
            c.failed,
            c.dropped,
            100.0 * c.dropped as f64 / c.created_total().max(1) as f64,
            c.raced,
            c.raced_lost,
            c.hung
        );
        if let Some(h) = &faults {
            println!(
                "faults injected  {} refused posts (retried), {} failed completions",
                h.again_injected(),
                h.failures_injected()
            );
        }
        println!(
            "peers            {} killed ({} operations to them unresolved at the kill), {} restarted; \
             probes of killed peers: {} typed errors, {} ok; {} removed, then refused at once",
            t.killed, t.pending_at_kill, t.restarted, t.probes_failed, t.probes_ok, t.removed_refused
        );
        println!(
            "verified         {} B in {} writes, {} immediates (live incarnations)",
            t.bytes_verified, t.writes_verified, t.arrivals_checked
        );
        let st = |p: usize| {
            let n: u64 = c.stale[p].iter().sum();
            let by: Vec<String> = (0..bad::BAD_OUTCOMES)
                .filter(|&k| c.stale[p][k] > 0)
                .map(|k| format!("{} {}", bad::OUTCOMES[k], c.stale[p][k]))
                .collect();
            format!("{n} {} ({})", bad::PHASES[p], by.join(", "))
        };
        println!("stale ops        {}; {}; {}", st(1), st(2), st(0));
        let forged: u64 = c.forged.iter().sum();
        let by: Vec<String> = (0..bad::BAD_OUTCOMES)
            .filter(|&k| c.forged[k] > 0)
            .map(|k| format!("{} {}", bad::OUTCOMES[k], c.forged[k]))
            .collect();
        println!("forged ops       {forged} ({})", by.join(", "));
        println!(
            "connection lost  {} live ops (awaited); dropped ops the engine failed: {} in {} rounds; \
             tolerated: {} writes ({} B) not in place, {} immediates not arrived",
            c.lost, c.dropped_failed, t.dropped_failed_rounds, t.lost_writes, t.lost_bytes, t.imm_missing
        );
        println!("bytes lost       {}", t.bytes_lost);
        let line =
            |f: &dyn Fn(&(f64, u64, u64)) -> String| t.samples.iter().map(f).collect::<Vec<_>>().join(" ");
        println!(
            "rss MiB          {}",
            line(&|s| format!("{:.0}s:{:.1}", s.0, s.1 as f64 / (1 << 20) as f64))
        );
        println!("open fds         {}", line(&|s| format!("{:.0}s:{}", s.0, s.2)));
        let (rss_ok, fds_ok) = bounded(&t.samples, secs);
        if !rss_ok {
            self.violation("RSS grew: final > 2 x (value after 10% of the run) + 64 MiB".into());
        }
        if !fds_ok {
            self.violation("open fds grew: final > 2 x (value after 10% of the run) + 32".into());
        }
        if t.probes_ok > 0 && !self.a.allow_dead_ok {
            self.violation(format!(
                "{} write(s) to killed peers completed Ok (--allow-dead-ok tolerates it, for shm)",
                t.probes_ok
            ));
        }
        let after_free = c.stale[bad::Phase::Racing as usize].iter().sum::<u64>()
            + c.stale[bad::Phase::Revoked as usize].iter().sum::<u64>();
        if self.a.stale_per_mille > 0 && (after_free == 0 || c.stale[bad::Phase::Revoked as usize][1] == 0) {
            self.violation(
                "no operation went through a freed region's descriptor (or none was revoked)".into(),
            );
        }
        if self.a.forged_per_mille > 0 && forged == 0 {
            self.violation("no operation went through a forged descriptor".into());
        }
        if c.hung > 0 || t.bytes_lost > 0 {
            self.violation(format!("{} hung operations, {} bytes lost", c.hung, t.bytes_lost));
        }
        let v = self.violations.lock().unwrap_or_else(|p| p.into_inner());
        if v.is_empty() {
            println!("PASS");
            Ok(true)
        } else {
            println!("FAIL: {} violation(s):", v.len());
            for x in v.iter().take(20) {
                println!("  {x}");
            }
            Ok(false)
        }
    }
}

/// Whether the last sample's RSS and fds are within 2x (+64 MiB, +32 fds) of the first
/// sample taken after 10% of the run.
fn bounded(samples: &[(f64, u64, u64)], secs: f64) -> (bool, bool) {
    let Some(last) = samples.last() else { return (true, true) };
    let base = samples.iter().find(|s| s.0 >= secs / 10.0).unwrap_or(last);
    (last.1 <= 2 * base.1 + (64 << 20), last.2 <= 2 * base.2 + 32)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn command_lines() {
        let cli = SoakCli::try_parse_from([
            "fabric-bench",
            "soak",
            "--seconds",
            "5",
            "--faults",
            "again=0.1,fail=0.01",
        ])
        .unwrap();
        let Cmd::Soak(a) = cli.cmd else { panic!("soak") };
        assert_eq!((a.seconds, a.provider.as_str(), a.peers), (Some(5), "tcp", 3));
        assert_eq!(a.faults.map(|p| (p.again, p.fail)), Some((0.1, 0.01)));
        assert!(
            SoakCli::try_parse_from(["fabric-bench", "soak", "--minutes", "1", "--seconds", "5"]).is_err()
        );
        assert!(SoakCli::try_parse_from(["fabric-bench", "soak", "--faults", "again=2"]).is_err());
    }

    #[test]
    fn growth_bound() {
        let s = |t, rss: u64, fds| (t, rss << 20, fds);
        assert_eq!(bounded(&[s(0.0, 10, 5), s(10.0, 40, 20), s(100.0, 140, 70)], 100.0), (true, true));
        assert_eq!(bounded(&[s(10.0, 40, 20), s(100.0, 150, 73)], 100.0), (false, false));
    }
}
