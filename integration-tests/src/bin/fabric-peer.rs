//! The second process of the integration tests. It meets the test through a `TcpStore`
//! and plays one role:
//!
//! * `target --size N [--sentinel B] [--wait IMM=COUNT,...]`: registers N bytes filled with
//!   B, publishes `target/desc` and `target/addr`, waits for the given counts of each
//!   immediate, then publishes `target/hash` (hash of the whole region) and
//!   `target/extra` (arrivals left over per immediate after a short settle, `imm=n,...`).
//!   Waits for `target/exit` before leaving.
//! * `writer --storm TOTAL,TASKS,DISTINCT,SEED [--then IMM=COUNT,...]`: fetches
//!   `writer/desc`, runs the counter storm (TASKS concurrent tasks of imm-only writes), then
//!   COUNT imm-only writes of each IMM in turn, and publishes `writer/done`.
//! * `echo --count N`: adds the peer at `test/addr`, sends every received message back.
//! * `owner --size N --count R`: for each round r < R, allocates two zeroed regions of N
//!   bytes, publishes their descriptors as `owner/r/live` and `owner/r/doomed`, frees the
//!   doomed one when `test/r/drop` appears (then publishes `owner/r/dropped`), and publishes
//!   the hash of the live one as `owner/r/hash` when `test/r/check` appears. Waits for
//!   `owner/exit` before leaving.
//! * `keeper --size N --count K`: allocates two zeroed regions of N bytes, publishes their
//!   descriptors as `keeper/live` and `keeper/neighbour`; then K times: when `test/check/k`
//!   appears (its value: how many arrivals of imm 5 to wait for first), waits for them, lets
//!   20 ms pass (for anything late), and publishes `keeper/k` =
//!   `HASH_LIVE,HASH_NEIGHBOUR,ARRIVALS_OF_9,ARRIVALS_OF_5_LEFT`. Waits for `keeper/exit`.
//! * `racer --count K`: K races of writes with immediate against a region's free. Race k:
//!   when `test/race/k` = `SIZE,SLOTS` appears, registers SIZE * SLOTS zeroed bytes of its
//!   own (`register_host`, so that it can read them after the region is freed) and allocates
//!   a live region of SIZE bytes; publishes `racer/k/doomed` and `racer/k/live`. When
//!   `test/race/k/drop` appears, drops the doomed region and publishes `racer/k/dropped` =
//!   `T,RELEASED`: the `CLOCK_MONOTONIC` ns just before the drop, and the µs until the engine
//!   let go of the memory (dropped its owner; bounded by 3 s). When `test/race/k/done` =
//!   `N,BASE,LIVE_IMM` appears, waits for one arrival of LIVE_IMM, lets 200 ms pass, and
//!   publishes `racer/k/report` = `LIVE_HASH;C0,...;H0,...`: the arrivals of BASE + i for
//!   i < N (then retired) and the hash of each SIZE-byte slot of the doomed memory.
//!   Waits for `racer/exit`.
//!
//! On any failure it publishes `<role>/error` and exits non-zero.

use std::time::Duration;

use fabric_async::bootstrap::{Rendezvous, TcpStore};
use fabric_async::{Engine, ImmCounterExt};
use integration_tests::{hash, storm_plan};

struct Args {
    store: String,
    provider: String,
    role: String,
    size: usize,
    sentinel: u8,
    wait: Vec<(u32, u64)>,
    storm: (usize, usize, u32, u64),
    then: Vec<(u32, u64)>,
    count: usize,
}

fn parse() -> Args {
    let mut a = Args {
        store: String::new(),
        provider: "tcp".into(),
        role: String::new(),
        size: 4096,
        sentinel: 0,
        wait: Vec::new(),
        storm: (0, 1, 1, 1),
        then: Vec::new(),
        count: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--store" => a.store = v(),
            "--provider" => a.provider = v(),
            "--size" => a.size = v().parse().expect("--size"),
            "--sentinel" => a.sentinel = v().parse().expect("--sentinel"),
            "--wait" => a.wait = imm_counts(&v()),
            "--then" => a.then = imm_counts(&v()),
            "--storm" => {
                let p: Vec<u64> = v().split(',').map(|x| x.parse().expect("storm")).collect();
                a.storm = (p[0] as usize, p[1] as usize, p[2] as u32, p[3]);
            }
            "--count" => a.count = v().parse().expect("--count"),
            role if !role.starts_with("--") && a.role.is_empty() => a.role = role.to_string(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// `IMM=COUNT,...`
fn imm_counts(v: &str) -> Vec<(u32, u64)> {
    v.split(',')
        .map(|p| {
            let (i, n) = p.split_once('=').expect("IMM=COUNT");
            (i.parse().expect("imm"), n.parse().expect("count"))
        })
        .collect()
}

#[tokio::main]
async fn main() {
    let a = parse();
    let store =
        TcpStore::connect(a.store.parse().expect("store address")).await.expect("connect to the store");
    let role = a.role.clone();
    if let Err(e) = run(&a, &store).await {
        eprintln!("fabric-peer {role}: {e}");
        let _ = store.put(&format!("{role}/error"), e.into_bytes()).await;
        std::process::exit(1);
    }
}

async fn run(a: &Args, store: &TcpStore) -> Result<(), String> {
    let engine = Engine::builder().provider(&a.provider).build().map_err(|e| e.to_string())?;
    store.put(&format!("{}/addr", a.role), engine.address()).await.map_err(|e| e.to_string())?;
    match a.role.as_str() {
        "target" => target(a, store, &engine).await,
        "writer" => writer(a, store, &engine).await,
        "echo" => echo(a, store, &engine).await,
        "owner" => owner(a, store, &engine).await,
        "keeper" => keeper(a, store, &engine).await,
        "racer" => racer(a, store, &engine).await,
        other => Err(format!("unknown role {other:?}")),
    }
}

async fn target(a: &Args, store: &TcpStore, engine: &Engine) -> Result<(), String> {
    let region = engine.register_copy(vec![a.sentinel; a.size]).await.map_err(|e| e.to_string())?;
    store.put("target/desc", region.descriptor().to_bytes()).await.map_err(|e| e.to_string())?;
    for &(imm, count) in &a.wait {
        if !engine
            .imm_counter(imm)
            .wait_for_timeout(count, Duration::from_secs(120))
            .await
            .map_err(|e| e.to_string())?
        {
            let got = engine.imm_counter(imm).available();
            return Err(format!("timed out waiting for {count} arrivals of imm {imm} (have {got})"));
        }
    }
    // Let anything extra (a duplicate, a stray) land before reporting what is left over.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let extra: Vec<String> =
        a.wait.iter().map(|&(imm, _)| format!("{imm}={}", engine.imm_counter(imm).available())).collect();
    store.put("target/extra", extra.join(",").into_bytes()).await.map_err(|e| e.to_string())?;
    store
        .put("target/hash", hash(&region.to_vec()).to_string().into_bytes())
        .await
        .map_err(|e| e.to_string())?;
    store.get("target/exit").await.map_err(|e| e.to_string())?;
    Ok(())
}

async fn writer(a: &Args, store: &TcpStore, engine: &Engine) -> Result<(), String> {
    let desc = store.get("writer/desc").await.map_err(|e| e.to_string())?;
    let dst = engine.remote_region(&desc).await.map_err(|e| e.to_string())?;
    let (total, tasks, distinct, seed) = a.storm;
    let plan = storm_plan(total, tasks, distinct, seed);
    let mut handles = Vec::new();
    for imms in plan {
        let engine = engine.clone();
        let dst = dst.clone();
        handles.push(tokio::spawn(async move {
            // Keep a bounded window of writes in flight per task.
            let mut inflight = std::collections::VecDeque::new();
            for imm in imms {
                inflight.push_back(engine.imm(&dst, imm));
                if inflight.len() >= 64 {
                    inflight.pop_front().unwrap().await?;
                }
            }
            for f in inflight {
                f.await?;
            }
            Ok::<(), fabric_async::Error>(())
        }));
    }
    for h in handles {
        h.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    }
    for &(imm, count) in &a.then {
        let mut inflight = std::collections::VecDeque::new();
        for _ in 0..count {
            inflight.push_back(engine.imm(&dst, imm));
            if inflight.len() >= 64 {
                inflight.pop_front().unwrap().await.map_err(|e| e.to_string())?;
            }
        }
        for f in inflight {
            f.await.map_err(|e| e.to_string())?;
        }
    }
    store.put("writer/done", b"ok".to_vec()).await.map_err(|e| e.to_string())?;
    store.get("writer/exit").await.map_err(|e| e.to_string())?;
    Ok(())
}

async fn echo(a: &Args, store: &TcpStore, engine: &Engine) -> Result<(), String> {
    let addr = store.get("test/addr").await.map_err(|e| e.to_string())?;
    let peer = engine.add_peer(&addr).await.map_err(|e| e.to_string())?;
    store.put("echo/ready", b"ok".to_vec()).await.map_err(|e| e.to_string())?;
    for _ in 0..a.count {
        let (_from, msg) = tokio::time::timeout(Duration::from_secs(60), engine.recv())
            .await
            .map_err(|_| "timed out waiting for a message".to_string())?
            .map_err(|e| e.to_string())?;
        engine.send(peer, &msg).await.map_err(|e| e.to_string())?;
    }
    store.get("echo/exit").await.map_err(|e| e.to_string())?;
    Ok(())
}

async fn owner(a: &Args, store: &TcpStore, engine: &Engine) -> Result<(), String> {
    fn e(e: impl std::fmt::Display) -> String {
        e.to_string()
    }
    for r in 0..a.count {
        let live = engine.alloc(a.size).await.map_err(e)?;
        let doomed = engine.alloc(a.size).await.map_err(e)?;
        store.put(&format!("owner/{r}/live"), live.descriptor().to_bytes()).await.map_err(e)?;
        store.put(&format!("owner/{r}/doomed"), doomed.descriptor().to_bytes()).await.map_err(e)?;
        store.get(&format!("test/{r}/drop")).await.map_err(e)?;
        drop(doomed);
        store.put(&format!("owner/{r}/dropped"), b"ok".to_vec()).await.map_err(e)?;
        store.get(&format!("test/{r}/check")).await.map_err(e)?;
        store
            .put(&format!("owner/{r}/hash"), hash(&live.to_vec()).to_string().into_bytes())
            .await
            .map_err(e)?;
    }
    store.get("owner/exit").await.map_err(e)?;
    Ok(())
}

async fn keeper(a: &Args, store: &TcpStore, engine: &Engine) -> Result<(), String> {
    fn e(e: impl std::fmt::Display) -> String {
        e.to_string()
    }
    let live = engine.alloc(a.size).await.map_err(e)?;
    let neighbour = engine.alloc(a.size).await.map_err(e)?;
    let (good, bad) = (engine.imm_counter(5), engine.imm_counter(9));
    store.put("keeper/live", live.descriptor().to_bytes()).await.map_err(e)?;
    store.put("keeper/neighbour", neighbour.descriptor().to_bytes()).await.map_err(e)?;
    for k in 0..a.count {
        let want: u64 = String::from_utf8_lossy(&store.get(&format!("test/check/{k}")).await.map_err(e)?)
            .parse()
            .map_err(e)?;
        if !good.wait_for_timeout(want, Duration::from_secs(30)).await.map_err(e)? {
            return Err(format!("check {k}: timed out waiting for {want} arrivals of imm 5"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let report = format!(
            "{},{},{},{}",
            hash(&live.to_vec()),
            hash(&neighbour.to_vec()),
            bad.available(),
            good.available()
        );
        store.put(&format!("keeper/{k}"), report.into_bytes()).await.map_err(e)?;
    }
    store.get("keeper/exit").await.map_err(e)?;
    Ok(())
}

async fn racer(a: &Args, store: &TcpStore, engine: &Engine) -> Result<(), String> {
    fn e(e: impl std::fmt::Display) -> String {
        e.to_string()
    }
    async fn get_str(store: &TcpStore, key: &str) -> Result<String, String> {
        Ok(String::from_utf8_lossy(&store.get(key).await.map_err(e)?).into_owned())
    }
    for k in 0..a.count {
        let spec = get_str(store, &format!("test/race/{k}")).await?;
        let v: Vec<usize> = spec.split(',').map(|x| x.parse().map_err(e)).collect::<Result<_, _>>()?;
        let (size, slots) = (v[0], v[1]);
        let mem = std::sync::Arc::new(vec![0u8; size * slots]);
        let ptr = mem.as_ptr() as u64;
        // SAFETY: the vector's heap buffer stays allocated while its `Arc` lives, which the
        // region holds (and this function holds another clone to read it afterwards).
        let doomed = unsafe { engine.register_host(ptr, size * slots, mem.clone()) }.await.map_err(e)?;
        let live = engine.alloc(size).await.map_err(e)?;
        store.put(&format!("racer/{k}/doomed"), doomed.descriptor().to_bytes()).await.map_err(e)?;
        store.put(&format!("racer/{k}/live"), live.descriptor().to_bytes()).await.map_err(e)?;
        store.get(&format!("test/race/{k}/drop")).await.map_err(e)?;
        let t = integration_tests::monotonic_ns();
        let dropped = std::time::Instant::now();
        drop(doomed);
        // The engine holds the memory (its owner, our vector's other `Arc`) until nothing
        // can land in it any more.
        while std::sync::Arc::strong_count(&mem) > 1 && dropped.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        let released = dropped.elapsed().as_micros();
        store.put(&format!("racer/{k}/dropped"), format!("{t},{released}").into_bytes()).await.map_err(e)?;
        let done = get_str(store, &format!("test/race/{k}/done")).await?;
        let v: Vec<u32> = done.split(',').map(|x| x.parse().map_err(e)).collect::<Result<_, _>>()?;
        let (n, base, live_imm) = (v[0], v[1], v[2]);
        if !engine.imm_counter(live_imm).wait_for_timeout(1, Duration::from_secs(30)).await.map_err(e)? {
            return Err(format!("race {k}: timed out waiting for the live write"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut counts = Vec::with_capacity(n as usize);
        for i in 0..n {
            counts.push(engine.imm_counter(base + i).available().to_string());
            engine.retire_counter(base + i).await.map_err(e)?;
        }
        if std::sync::Arc::strong_count(&mem) > 1 {
            return Err(format!("race {k}: the engine still holds the freed region's memory"));
        }
        // SAFETY: the engine let go of the memory (above): nothing writes it any more.
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, size * slots) };
        let hashes: Vec<String> = bytes.chunks(size).map(|c| hash(c).to_string()).collect();
        let report = format!("{};{};{}", hash(&live.to_vec()), counts.join(","), hashes.join(","));
        store.put(&format!("racer/{k}/report"), report.into_bytes()).await.map_err(e)?;
    }
    store.get("racer/exit").await.map_err(e)?;
    Ok(())
}
