//! The prefill of `kv_transfer`: computes each request's blocks, routes it to a live decode
//! worker (one `write_paged`, one immediate), re-routes what a leaving or dead worker failed,
//! starts and stops workers mid-run, and reports.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Child;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::{Engine, MemoryRegion, PageLayout, RemoteRegion};
use fabric_examples::{
    percentiles, race_down, spawn_self, transport_args, unless_down, wait_child, BoxError,
};
use tokio::sync::{oneshot, Semaphore};
use tokio::task::JoinSet;

use super::{block_seed, fill_block, Cli, FreeBlocks, ATTEMPTS, IMM_BASE, SETUP_TIMEOUT};

/// Why one attempt of a request failed.
#[derive(Debug)]
enum KvError {
    /// The announcement or the paged write failed (PeerUnreachable after op_timeout, ...).
    Transfer(fabric_async::Error),
    /// Not done within the deadline; `stage` says what it was waiting for.
    Deadline { after: Duration, stage: &'static str },
    /// The worker said goodbye without acknowledging the request.
    WorkerLeft,
    /// The worker checked the blocks and found them wrong (or never saw them arrive).
    Rejected(String),
    /// No live worker to route to, or no room in its cache.
    NoCapacity(String),
}

impl std::fmt::Display for KvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvError::Transfer(e) => write!(f, "transfer failed: {e}"),
            KvError::Deadline { after, stage } => {
                write!(f, "deadline of {} ms passed while {stage}", after.as_millis())
            }
            KvError::WorkerLeft => write!(f, "the worker left before acknowledging"),
            KvError::Rejected(why) => write!(f, "the worker rejected it: {why}"),
            KvError::NoCapacity(why) => write!(f, "{why}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    Live,
    /// Told to stop; gets no new requests.
    Leaving,
    Left,
    /// Failed a request; out of the routing table.
    Dead(String),
}

/// A decode worker as the prefill sees it.
struct Worker {
    id: usize,
    kv: RemoteRegion,
    free: Mutex<FreeBlocks>,
    state: Mutex<State>,
    in_flight: AtomicUsize,
    verified: AtomicUsize,
}

impl Worker {
    fn state(&self) -> State {
        self.state.lock().expect("state").clone()
    }
}

/// A request's verdict from its worker, with when its `got` came (if it did).
type AckTx = oneshot::Sender<Result<Option<Instant>, String>>;
/// A request awaiting its worker: (worker, verdict waiter, when its `got` came).
type Pending = (usize, AckTx, Option<Instant>);

struct Prefill {
    cli: Cli,
    engine: Engine,
    src: MemoryRegion,
    src_free: Mutex<FreeBlocks>,
    workers: Mutex<Vec<Arc<Worker>>>,
    next: AtomicUsize,
    /// Pending acknowledgements: request -> (worker, waiter, when its `got` came).
    acks: Mutex<HashMap<u32, Pending>>,
    /// Time with at least one request in transfer (announced, not yet verified).
    busy: Mutex<Busy>,
    byes: Mutex<HashMap<usize, oneshot::Sender<u64>>>,
    events: Mutex<Vec<String>>,
}

/// How long requests were in transfer: the union of their intervals.
#[derive(Default)]
struct Busy {
    in_flight: usize,
    since: Option<Instant>,
    total: Duration,
}

impl Busy {
    fn enter(&mut self) {
        self.in_flight += 1;
        if self.in_flight == 1 {
            self.since = Some(Instant::now());
        }
    }
    fn leave(&mut self) {
        self.in_flight -= 1;
        if self.in_flight == 0 {
            self.total += self.since.take().map_or(Duration::ZERO, |t| t.elapsed());
        }
    }
}

/// What became of one request.
struct Done {
    /// When its transfer started (the blocks were ready).
    started: Instant,
    /// To the worker's verified `ack`.
    latency: Duration,
    /// To the worker's `got`: the blocks arrived.
    arrived: Option<Duration>,
    bytes: usize,
    /// The failed attempts before the one that worked: (worker, error).
    failures: Vec<(usize, String)>,
}

impl Prefill {
    fn event(&self, e: String) {
        println!("kv_transfer: {e}");
        self.events.lock().expect("events").push(e);
    }

    /// The next live worker, round-robin.
    fn pick(&self) -> Option<Arc<Worker>> {
        let workers = self.workers.lock().expect("workers");
        let live: Vec<_> = workers.iter().filter(|w| w.state() == State::Live).collect();
        (!live.is_empty()).then(|| live[self.next.fetch_add(1, Ordering::Relaxed) % live.len()].clone())
    }

    fn worker(&self, id: usize) -> Option<Arc<Worker>> {
        self.workers.lock().expect("workers").iter().find(|w| w.id == id).cloned()
    }

    /// Takes a live worker that failed a request out of the routing table (once). A worker
    /// that was told to leave is out of it already: its failures are expected.
    fn mark_dead(&self, w: &Worker, req: u32, e: &KvError) {
        let mut s = w.state.lock().expect("state");
        if *s == State::Live {
            *s = State::Dead(e.to_string());
            drop(s);
            self.event(format!("worker {} out of the routing table: request {req}: {e}", w.id));
        }
    }

    /// One request, re-routed to another live worker when an attempt fails.
    async fn request(&self, req: u32) -> Result<Done, BoxError> {
        let n = self.cli.request_blocks(req);
        let src_table = self.src_free.lock().expect("free").take(n).ok_or("prefill cache full")?;
        // "Prefill": compute this request's KV into its blocks, every layer (CPU work: off the
        // runtime, so acknowledgements and other requests keep moving).
        let (src, table, cli) = (self.src.clone(), src_table.clone(), self.cli.clone());
        tokio::task::spawn_blocking(move || -> Result<(), fabric_async::Error> {
            let mut buf = vec![0u8; cli.block()];
            for layer in 0..cli.layers {
                for (j, &b) in table.iter().enumerate() {
                    fill_block(&mut buf, block_seed(req, layer, j));
                    src.write_at(((layer * cli.blocks() + b as usize) * cli.block()) as u64, &buf)?;
                }
            }
            Ok(())
        })
        .await??;
        self.busy.lock().expect("busy").enter();
        let r = self.transfer(req, n, src_table).await;
        self.busy.lock().expect("busy").leave();
        r
    }

    /// The transfer of one request whose blocks are ready in `src_table`: attempts until one
    /// is verified.
    async fn transfer(&self, req: u32, n: usize, src_table: Vec<u32>) -> Result<Done, BoxError> {
        let start = Instant::now();
        let mut failures = Vec::new();
        while failures.len() < ATTEMPTS {
            let Some(w) = self.pick() else {
                failures.push((usize::MAX, "no live decode worker".to_string()));
                break;
            };
            match self.attempt(&w, req, &src_table).await {
                Ok(got) => {
                    w.verified.fetch_add(1, Ordering::Relaxed);
                    self.src_free.lock().expect("free").give(src_table);
                    let bytes = n * self.cli.layers * self.cli.block();
                    let arrived = got.map(|t| t.saturating_duration_since(start));
                    return Ok(Done { started: start, latency: start.elapsed(), arrived, bytes, failures });
                }
                Err(KvError::Rejected(why)) => {
                    return Err(format!("request {req}: worker {} rejected it: {why}", w.id).into())
                }
                Err(e) => {
                    self.mark_dead(&w, req, &e);
                    failures.push((w.id, e.to_string()));
                }
            }
        }
        Err(format!("request {req}: failed {} times: {failures:?}", failures.len()).into())
    }

    /// Announce, write every layer's blocks with one write_paged, await the acknowledgement;
    /// all within the deadline.
    async fn attempt(&self, w: &Worker, req: u32, src_table: &[u32]) -> Result<Option<Instant>, KvError> {
        let dst_table = w.free.lock().expect("free").take(src_table.len()).ok_or_else(|| {
            KvError::NoCapacity(format!("worker {}: no {} free blocks", w.id, src_table.len()))
        })?;
        let (src_pages, dst_pages) = (self.cli.pages(src_table), self.cli.pages(&dst_table));
        let imm = IMM_BASE + req;
        // One write_paged for every layer's blocks, in host or GPU memory (into a GPU cache
        // on this host: one gate of copies through CUDA IPC and one arrival).
        let arrivals = self.engine.paged_arrivals(&w.kv, dst_pages.len()).map_err(KvError::Transfer)?;
        let blocks: Vec<String> = dst_table.iter().map(u32::to_string).collect();
        let announce = format!("req {req} {imm} {arrivals} {}", blocks.join(","));
        let (tx, rx) = oneshot::channel();
        self.acks.lock().expect("acks").insert(req, (w.id, tx, None));
        let layout = PageLayout::packed(self.cli.block() as u64);
        w.in_flight.fetch_add(1, Ordering::Relaxed);
        let deadline = self.cli.deadline();
        let stage = Mutex::new("announcing the request");
        let set = |s| *stage.lock().expect("stage") = s;
        let attempt = async {
            self.engine.send(w.kv.peer(), announce.as_bytes()).await.map_err(KvError::Transfer)?;
            set("writing the blocks");
            self.engine
                .write_paged(&self.src, &w.kv, &layout, &src_pages, &dst_pages, Some(imm))
                .await
                .map_err(KvError::Transfer)?;
            set("awaiting the acknowledgement");
            rx.await.map_err(|_| KvError::WorkerLeft)?.map_err(KvError::Rejected)
        };
        // A worker that dies fails the attempt at once (and it is re-routed), whatever it
        // waited for: on shm the writes complete into the dead worker's memory, and its
        // acknowledgement never comes.
        let attempt = async {
            race_down(&self.engine, &[w.kv.peer()], attempt)
                .await
                .unwrap_or_else(|e| Err(KvError::Transfer(e)))
        };
        let outcome = tokio::time::timeout(deadline, attempt).await.unwrap_or_else(|_| {
            Err(KvError::Deadline { after: deadline, stage: *stage.lock().expect("stage") })
        });
        w.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.acks.lock().expect("acks").remove(&req);
        if outcome.is_ok() {
            // The worker is done with these blocks (a paged-attention server frees them when
            // the sequence finishes; here, once checked).
            w.free.lock().expect("free").give(dst_table);
        }
        outcome
    }

    /// Acknowledgements and goodbyes from the decode workers.
    async fn receive(&self) {
        while let Ok((_, msg)) = self.engine.recv().await {
            let text = String::from_utf8_lossy(&msg).to_string();
            let words: Vec<&str> = text.splitn(4, ' ').collect();
            let num = |i: usize| words.get(i).and_then(|s| s.parse::<u64>().ok());
            match (words.first().copied(), num(1), num(2)) {
                (Some("got"), Some(w), Some(req)) => {
                    let mut acks = self.acks.lock().expect("acks");
                    if let Some((id, _, got)) = acks.get_mut(&(req as u32)) {
                        if *id == w as usize {
                            *got = Some(Instant::now());
                        }
                    }
                }
                (Some("ack"), Some(w), Some(req)) => {
                    let mut acks = self.acks.lock().expect("acks");
                    // A late ack from a worker the request has left behind is ignored.
                    if acks.get(&(req as u32)).is_some_and(|(id, _, _)| *id == w as usize) {
                        let (_, tx, got) = acks.remove(&(req as u32)).expect("present");
                        let verdict = match words.get(3) {
                            Some(&"ok") => Ok(got),
                            other => Err(other.unwrap_or(&"?").trim_start_matches("bad ").to_string()),
                        };
                        let _ = tx.send(verdict);
                    }
                }
                (Some("bye"), Some(w), Some(verified)) => {
                    let w = w as usize;
                    // Requests it never acknowledged fail now (and are re-routed), not at
                    // their deadline.
                    self.acks.lock().expect("acks").retain(|_, (id, _, _)| *id != w);
                    if let Some(tx) = self.byes.lock().expect("byes").remove(&w) {
                        let _ = tx.send(verified);
                    }
                }
                _ => eprintln!("kv_transfer: unexpected message {text:?}"),
            }
        }
    }

    /// Starts decode worker `id` and adds it to the routing table once it has met us
    /// through the store: a new process, a new peer, a new descriptor.
    async fn start_worker(
        &self,
        id: usize,
        store: &TcpStore,
        addr: SocketAddr,
        children: &Mutex<HashMap<usize, Child>>,
    ) -> Result<(), BoxError> {
        let c = &self.cli;
        let head = ["--decode-of".to_string(), addr.to_string(), "--id".into(), id.to_string()];
        let tail = [
            "--layers".to_string(),
            c.layers.to_string(),
            "--block-kib".into(),
            c.block_kib.to_string(),
            "--max-blocks".into(),
            c.max_blocks.to_string(),
            "--inflight".into(),
            c.inflight.to_string(),
            "--deadline-ms".into(),
            c.deadline_ms.to_string(),
        ];
        let child = spawn_self(
            head.into_iter().chain(transport_args(&c.provider, &c.nics, &c.location)).chain(tail),
        )?;
        children.lock().expect("children").insert(id, child);
        let desc = store.get(&format!("decode/{id}/desc")).await?;
        let kv = self.engine.remote_region(&desc).await?;
        let blocks = self.cli.blocks();
        self.workers.lock().expect("workers").push(Arc::new(Worker {
            id,
            kv,
            free: Mutex::new(FreeBlocks::new(blocks, 0xdec0de ^ id as u64)),
            state: Mutex::new(State::Live),
            in_flight: AtomicUsize::new(0),
            verified: AtomicUsize::new(0),
        }));
        Ok(())
    }

    /// Tells worker `id` to stop and waits for its goodbye; returns what it verified.
    async fn stop_worker(&self, id: usize) -> Result<u64, BoxError> {
        let w = self.worker(id).ok_or("no such worker")?;
        *w.state.lock().expect("state") = State::Leaving;
        let (tx, rx) = oneshot::channel();
        self.byes.lock().expect("byes").insert(id, tx);
        let bye = async {
            self.engine.send(w.kv.peer(), b"stop").await?;
            Ok::<_, BoxError>(rx.await?)
        };
        let verified = tokio::time::timeout(SETUP_TIMEOUT, unless_down(&self.engine, &[w.kv.peer()], bye))
            .await
            .map_err(|_| format!("worker {id} did not say goodbye"))??;
        *w.state.lock().expect("state") = State::Left;
        Ok(verified)
    }
}

pub(super) async fn prefill(cli: Cli) -> Result<(), BoxError> {
    let engine = cli.engine()?;
    cli.location.exit_if_unavailable(&engine).await;
    let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
    let addr = server.local_addr();
    let store = TcpStore::connect(addr).await?.with_timeout(SETUP_TIMEOUT);
    store.put("prefill/addr", engine.address()).await?;
    let src = engine.alloc_in(cli.cache_bytes(), cli.location.memory()).await?;
    println!(
        "kv_transfer: prefill + {} decode workers on {} ({} NIC(s)), {} requests of 1..={} blocks x {} layers x {} KiB, {} in flight, deadline {} ms",
        cli.decoders,
        engine.transport(),
        engine.nics(),
        cli.requests,
        cli.max_blocks,
        cli.layers,
        cli.block_kib,
        cli.inflight,
        cli.deadline_ms
    );
    let p = Arc::new(Prefill {
        src_free: Mutex::new(FreeBlocks::new(cli.blocks(), 0x5eed)),
        cli: cli.clone(),
        engine,
        src,
        workers: Mutex::new(Vec::new()),
        next: AtomicUsize::new(0),
        acks: Mutex::new(HashMap::new()),
        busy: Mutex::new(Busy::default()),
        byes: Mutex::new(HashMap::new()),
        events: Mutex::new(Vec::new()),
    });
    let children = Arc::new(Mutex::new(HashMap::new()));
    for id in 0..cli.decoders {
        p.start_worker(id, &store, addr, &children).await?;
    }
    let receiver = tokio::spawn({
        let p = p.clone();
        async move { p.receive().await }
    });

    // The join starts at a quarter; it must be done by three eighths, so that the joiner is
    // in the routing table with requests in flight when worker 0 leaves at half.
    let (join_at, joined_by, leave_at) = (cli.requests / 4, cli.requests * 3 / 8, cli.requests / 2);
    let joiner = cli.decoders;
    let mut joining = None;
    let permits = Arc::new(Semaphore::new(cli.inflight));
    let mut requests = JoinSet::new();
    let start = Instant::now();
    let mut leave: Option<(usize, Instant)> = None;
    for req in 0..cli.requests as u32 {
        if req as usize == join_at {
            // A new decode worker joins while requests keep flowing to the others.
            let (p, store, children) = (p.clone(), TcpStore::connect(addr).await?, children.clone());
            joining = Some(tokio::spawn(async move {
                let t = Instant::now();
                p.start_worker(joiner, &store, addr, &children).await?;
                p.event(format!(
                    "worker {joiner} joined at request {req}: new process, rendezvous through the store, new peer and descriptor in {} ms",
                    t.elapsed().as_millis()
                ));
                Ok::<_, BoxError>(())
            }));
        }
        if req as usize == joined_by {
            if let Some(j) = joining.take() {
                j.await??;
            }
        }
        if req as usize == leave_at {
            let in_flight = p.worker(0).map_or(0, |w| w.in_flight.load(Ordering::Relaxed));
            if cli.kill {
                // Nobody tells the prefill: it finds out from the failed requests.
                let mut children = children.lock().expect("children");
                children.get_mut(&0).ok_or("worker 0 is gone")?.kill()?;
                p.event(format!(
                    "worker 0 killed (SIGKILL) at request {req} with {in_flight} request(s) in flight"
                ));
                leave = Some((0, Instant::now()));
            } else {
                let p2 = p.clone();
                tokio::spawn(async move {
                    let t = Instant::now();
                    match p2.stop_worker(0).await {
                        Ok(v) => p2.event(format!(
                            "worker 0 left cleanly at request {req}: {in_flight} request(s) in flight drained, {v} verified in all, goodbye after {} ms",
                            t.elapsed().as_millis()
                        )),
                        Err(e) => p2.event(format!("worker 0 failed to leave: {e}")),
                    }
                });
                leave = Some((0, Instant::now()));
            }
        }
        let permit = permits.clone().acquire_owned().await?;
        let p = p.clone();
        requests.spawn(async move {
            let r = p.request(req).await;
            drop(permit);
            (req, r)
        });
    }
    let mut done = Vec::new();
    let mut failed = Vec::new();
    while let Some(r) = requests.join_next().await {
        match r? {
            (_, Ok(d)) => done.push(d),
            (req, Err(e)) => failed.push(format!("request {req}: {e}")),
        }
    }
    let secs = start.elapsed().as_secs_f64();

    // Stop the workers still in the routing table; check every process's exit.
    let live: Vec<usize> = {
        let w = p.workers.lock().expect("workers");
        w.iter().filter(|w| w.state() == State::Live).map(|w| w.id).collect()
    };
    let mut problems = failed.clone();
    for id in &live {
        match p.stop_worker(*id).await {
            Ok(v) => {
                let counted = p.worker(*id).map_or(0, |w| w.verified.load(Ordering::Relaxed)) as u64;
                if v != counted {
                    problems
                        .push(format!("worker {id} verified {v} requests, the prefill counted {counted}"));
                }
            }
            Err(e) => problems.push(format!("worker {id}: {e}")),
        }
    }
    let children: Vec<(usize, Child)> = children.lock().expect("children").drain().collect();
    for (id, mut child) in children {
        // Every worker was told to stop (or killed): a few seconds are plenty.
        let status = wait_child(&mut child, Duration::from_secs(10)).await?;
        let killed = cli.kill && id == 0;
        if !killed && !status.success() {
            problems.push(format!("worker {id} exited with {status}"));
        }
    }
    p.engine.shutdown();
    receiver.abort();

    // What happened to the requests, and the checks that make the run fail.
    let workers = p.workers.lock().expect("workers").clone();
    for w in &workers {
        if let State::Dead(why) = w.state() {
            if !(cli.kill && w.id == 0) {
                problems.push(format!("worker {} failed a request although it never left: {why}", w.id));
            }
        }
    }
    if workers.iter().find(|w| w.id == joiner).is_none_or(|w| w.verified.load(Ordering::Relaxed) == 0) {
        problems.push(format!("the worker that joined (worker {joiner}) verified no request"));
    }
    let rerouted: Vec<&Done> = done.iter().filter(|d| !d.failures.is_empty()).collect();
    let clean: Vec<Duration> = done.iter().filter(|d| d.failures.is_empty()).map(|d| d.latency).collect();
    let (p50, p99) = percentiles(clean);
    let arrived: Vec<Duration> =
        done.iter().filter(|d| d.failures.is_empty()).filter_map(|d| d.arrived).collect();
    let (a50, a99) = percentiles(arrived);
    let bytes: usize = done.iter().map(|d| d.bytes).sum();
    let busy = p.busy.lock().expect("busy").total.as_secs_f64();
    // The time with at least one request's blocks on their way: the union of every request's
    // interval from the start of its transfer to its blocks' arrival (its `got`; to its
    // verified ack where no `got` came).
    let arriving = union_secs(done.iter().map(|d| (d.started, d.started + d.arrived.unwrap_or(d.latency))));
    let per_worker: Vec<String> = workers
        .iter()
        .map(|w| {
            let state = match (w.id, w.state()) {
                (0, _) if cli.kill => "killed mid-run, taken out of the routing table",
                (_, State::Dead(_)) => "failed, taken out of the routing table",
                (0, _) => "left mid-run",
                (id, _) if id == joiner => "joined mid-run",
                _ => "from start to end",
            };
            format!("worker {}: {} ({state})", w.id, w.verified.load(Ordering::Relaxed))
        })
        .collect();
    println!("kv_transfer: verified per worker: {}", per_worker.join(", "));
    if let Some((id, _)) = leave {
        let errors: Vec<String> =
            rerouted.iter().flat_map(|d| d.failures.iter().map(|f| f.1.clone())).collect();
        let mut kinds = errors;
        kinds.sort();
        kinds.dedup();
        let worst = rerouted.iter().map(|d| d.latency).max().unwrap_or_default();
        let how = if cli.kill { "was killed" } else { "left" };
        let others = if problems.is_empty() {
            "the other workers were undisturbed"
        } else {
            "but see the problems below"
        };
        if rerouted.is_empty() {
            println!("kv_transfer: worker {id} {how}: no request failed on it; {others}");
        } else {
            println!(
                "kv_transfer: worker {id} {how}: {} request(s) failed on it ({}), were re-routed to live workers and verified there (slowest {} ms end to end); {others}",
                rerouted.len(),
                kinds.join("; "),
                worst.as_millis()
            );
        }
    }
    println!(
        "kv_transfer: latency (requests not re-routed), announce to the blocks' arrival (the worker's got): p50 {:.3} ms  p99 {:.3} ms; to the verified ack: p50 {:.2} ms  p99 {:.2} ms",
        a50 / 1e3,
        a99 / 1e3,
        p50 / 1e3,
        p99 / 1e3,
    );
    println!(
        "kv_transfer: {} MiB: {:.2} GB/s over the {arriving:.3} s with blocks on their way (transfer start to arrival); \
         {:.2} GB/s over the {busy:.2} s with requests in transfer or verification (to the verified ack); \
         {:.2} GB/s over the whole {secs:.2} s (the join's start-up included)",
        bytes >> 20,
        bytes as f64 / arriving.max(1e-9) / 1e9,
        bytes as f64 / busy.max(1e-9) / 1e9,
        bytes as f64 / secs / 1e9
    );
    if !problems.is_empty() {
        for e in &problems {
            eprintln!("kv_transfer: {e}");
        }
        return Err(format!(
            "{} problem(s), {} of {} requests verified",
            problems.len(),
            done.len(),
            cli.requests
        )
        .into());
    }
    println!(
        "kv_transfer: ok: {} of {} requests verified byte for byte; worker {joiner} joined, worker 0 {}; {} re-routed",
        done.len(),
        cli.requests,
        if cli.kill { "was killed" } else { "left cleanly" },
        rerouted.len()
    );
    Ok(())
}

/// Seconds covered by the union of the intervals `(start, end)`.
fn union_secs(intervals: impl Iterator<Item = (Instant, Instant)>) -> f64 {
    let mut v: Vec<(Instant, Instant)> = intervals.collect();
    v.sort_by_key(|&(s, _)| s);
    let mut total = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for (s, e) in v {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    if let Some((cs, ce)) = cur {
        total += ce - cs;
    }
    total.as_secs_f64()
}
