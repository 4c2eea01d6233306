//! The stale descriptors' two ends (`bad.rs` says what they are for): the leader's
//! [`cycle_extras`], which resolves each extra region a peer publishes, hands it to the
//! traffic tasks and asks for its free, and the peer's [`peer_extras`], which allocates,
//! publishes and frees them. Apart from `bad.rs`, which defines what an access is and how it
//! may end, so that the ledger and the traffic read those definitions and this file reads
//! theirs: imports go one way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::bootstrap::{Rendezvous, TcpStore};
use fabric_async::Engine;

use super::bad::{split_gen, Extra, KEEP};
use super::ledger::Target;
use super::rng::Rng;
use crate::pair::Res;

/// The leader's side of one incarnation's extra regions (module docs), until `stop` or the
/// target is killed. Returns its violations.
pub async fn cycle_extras(
    engine: Engine,
    store_addr: SocketAddr,
    t: Arc<Target>,
    stop: Arc<AtomicBool>,
    every: Duration,
    seed: u64,
) -> Vec<String> {
    match cycle(&engine, store_addr, &t, &stop, every, seed).await {
        Ok(()) => Vec::new(),
        Err(e) if t.is_alive() && !stop.load(Ordering::Acquire) => {
            vec![format!("extra regions of {}: {e}", t.name)]
        }
        Err(_) => Vec::new(),
    }
}

async fn cycle(
    engine: &Engine,
    store_addr: SocketAddr,
    t: &Target,
    stop: &AtomicBool,
    every: Duration,
    seed: u64,
) -> Res<()> {
    let store = TcpStore::connect(store_addr).await?;
    let mut rng = Rng::new(seed);
    let running = || t.is_alive() && !stop.load(Ordering::Acquire);
    let key = format!("{}/x", t.name);
    let mut gen = 0u64;
    while running() {
        // The peer publishes generation `gen` once it freed the previous one.
        let since = Instant::now();
        let desc = loop {
            if !running() {
                return Ok(());
            }
            let v = tokio::time::timeout(Duration::from_secs(10), store.get(&key)).await.ok().transpose()?;
            if let Some((g, d)) = v.as_deref().and_then(split_gen) {
                if g == gen {
                    break d.to_vec();
                }
            }
            if since.elapsed() > Duration::from_secs(60) {
                return Err(format!("generation {gen} not published within 60 s").into());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let remote = match tokio::time::timeout(Duration::from_secs(10), engine.remote_region(&desc)).await {
            Ok(r) => r?,
            Err(_) => return Err("remote_region of an extra region did not answer within 10 s".into()),
        };
        if remote.peer() != t.peer {
            return Err(format!("an extra region resolved to {:?}, not {:?}", remote.peer(), t.peer).into());
        }
        let extra = Arc::new(Extra::new(remote));
        {
            let mut x = t.extras.lock().unwrap_or_else(|p| p.into_inner());
            x.push_back(extra.clone());
            while x.len() > KEEP {
                x.pop_front();
            }
        }
        // Live for a while, then freed while the tasks may still be using it.
        tokio::time::sleep(Duration::from_micros(rng.below(every.as_micros().max(1) as u64))).await;
        extra.request_free().await;
        store.put(&format!("{}/xfree", t.name), gen.to_le_bytes().to_vec()).await?;
        gen += 1;
    }
    Ok(())
}

/// The peer's side (module docs): until `stop`, allocate a region of `size`, publish it,
/// free it when told, wait `every`, again.
pub async fn peer_extras(
    engine: Engine,
    store_addr: SocketAddr,
    name: String,
    size: usize,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> Res<()> {
    let store = TcpStore::connect(store_addr).await?;
    let free_key = format!("{name}/xfree");
    let mut gen = 0u64;
    while !stop.load(Ordering::Acquire) {
        let region = engine.alloc(size).await?;
        let mut v = gen.to_le_bytes().to_vec();
        v.extend_from_slice(&region.descriptor().to_bytes());
        store.put(&format!("{name}/x"), v).await?;
        loop {
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            // (`peer_main` put an empty value before the leader could see any generation.)
            if split_gen(&store.get(&free_key).await?).is_some_and(|(g, _)| g >= gen) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        drop(region);
        gen += 1;
        tokio::time::sleep(every).await;
    }
    Ok(())
}
