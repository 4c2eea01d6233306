//! The decode worker of `kv_transfer`: takes the prefill's announcements, awaits each
//! request's one completion signal, says `got`, checks every byte, and acknowledges.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fabric_async::bootstrap::{Rendezvous, TcpStore};
use fabric_async::{Engine, MemoryRegion, PeerId};
use fabric_examples::{exit_with_parent, race_down, wait_arrivals, BoxError};
use tokio::task::JoinSet;

use super::{block_ok, block_seed, Cli, SETUP_TIMEOUT};

pub(super) async fn decode_worker(cli: Cli, store_addr: String) -> Result<(), BoxError> {
    exit_with_parent("kv_transfer decode worker");
    let id = cli.id;
    let store = TcpStore::connect(store_addr.parse()?).await?.with_timeout(SETUP_TIMEOUT);
    let engine = cli.engine()?;
    let kv = engine.alloc_in(cli.cache_bytes(), cli.location.memory()).await?;
    let prefill = engine.add_peer(&store.get("prefill/addr").await?).await?;
    store.put(&format!("decode/{id}/desc"), kv.descriptor().to_bytes()).await?;
    println!("kv_transfer: decode worker {id} up (pid {})", std::process::id());
    let cli = Arc::new(cli);
    let verified = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    loop {
        // From the prefill only, and an error (not a hang) if it dies.
        let (_, msg) = engine
            .recv_from(prefill)
            .await
            .map_err(|e| format!("decode {id}: waiting for the prefill (peer {prefill}): {e}"))?;
        let text = String::from_utf8_lossy(&msg).to_string();
        let mut words = text.split_whitespace();
        match words.next() {
            Some("req") => {
                let req: u32 = words.next().ok_or("req without id")?.parse()?;
                let imm: u32 = words.next().ok_or("req without imm")?.parse()?;
                let arrivals: u64 = words.next().ok_or("req without arrivals")?.parse()?;
                let table = words
                    .next()
                    .ok_or("req without blocks")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<Vec<u32>, _>>()?;
                let (engine, kv, cli, verified) = (engine.clone(), kv.clone(), cli.clone(), verified.clone());
                tasks.spawn(async move {
                    let served = serve(&engine, prefill, &kv, &cli, req, imm, arrivals, &table).await;
                    let verdict = match served {
                        Ok(()) => {
                            verified.fetch_add(1, Ordering::Relaxed);
                            "ok".to_string()
                        }
                        // The prefill died: this worker fails, it has nobody to answer.
                        Err(Served::PrefillDown(e)) => return Err(e),
                        Err(Served::Bad(e)) => format!("bad {e}"),
                    };
                    engine
                        .send(prefill, format!("ack {} {req} {verdict}", cli.id).as_bytes())
                        .await
                        .map_err(|e| format!("request {req}: acknowledging to the prefill: {e}").into())
                });
            }
            Some("stop") => break,
            other => return Err(format!("decode {id}: unexpected message {other:?}").into()),
        }
        while let Some(done) = tasks.try_join_next() {
            done?.map_err(|e: BoxError| format!("decode {id}: {e}"))?;
        }
    }
    // A clean leave: finish every request already announced, then say goodbye.
    while let Some(done) = tasks.join_next().await {
        done?.map_err(|e: BoxError| format!("decode {id}: {e}"))?;
    }
    let bye = format!("bye {id} {}", verified.load(Ordering::Relaxed));
    engine.send(prefill, bye.as_bytes()).await?;
    Ok(())
}

/// Why a request failed at a decode worker.
enum Served {
    /// Not served right: the prefill is told (`ack .. bad ..`).
    Bad(BoxError),
    /// The prefill died while this worker waited for its blocks: the worker fails.
    PrefillDown(BoxError),
}

impl<E: Into<BoxError>> From<E> for Served {
    fn from(e: E) -> Served {
        Served::Bad(e.into())
    }
}

/// One request at a decode worker: wait (with a deadline, and unless the prefill dies) for
/// its one completion signal, then check every byte of every block of every layer.
#[allow(clippy::too_many_arguments)]
async fn serve(
    engine: &Engine,
    prefill: PeerId,
    kv: &MemoryRegion,
    cli: &Cli,
    req: u32,
    imm: u32,
    announced: u64,
    table: &[u32],
) -> Result<(), Served> {
    // The same arrival count, computed here from what this side knows: one per page into
    // host memory; into GPU memory exactly one when the writer copies through CUDA IPC or
    // this cache is staged (`paged_arrivals`), one per page when its NICs write it directly.
    let per_page = engine.transfer_opts().paged_arrivals(table.len() * cli.layers, engine.nics())?;
    let pages = (table.len() * cli.layers) as u64;
    let fits = announced == per_page || (kv.gpu_path().is_some() && announced == u64::from(pages > 0));
    if !fits {
        return Err(format!("request {req}: {announced} arrivals announced, {per_page} expected").into());
    }
    let expected = announced;
    let counter = engine.imm_counter(imm);
    match race_down(engine, &[prefill], wait_arrivals(&counter, expected, cli.deadline())).await {
        Ok(r) => r?,
        Err(e) => {
            let e = format!("request {req}: waiting for the prefill's (peer {prefill}) blocks: {e}");
            return Err(Served::PrefillDown(e.into()));
        }
    }
    // The blocks are here: a decode server would start on them now. Say so at once; the
    // check of every byte below is this example's, and the verdict follows it.
    let got = format!("got {} {req}", cli.id);
    engine.send(prefill, got.as_bytes()).await?;
    // One immediate per request: give its counter back, or a long run would fill the
    // engine's table (`EngineBuilder::max_counters`) with the counters of finished requests.
    engine.retire_counter(imm).await?;
    // Blocking reads (GPU memory: one CUDA copy per block) and hashing: off the runtime, so
    // other requests' arrivals are acknowledged meanwhile.
    let (kv, layers, blocks, block, table) =
        (kv.clone(), cli.layers, cli.blocks(), cli.block(), table.to_vec());
    tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
        let mut buf = vec![0u8; block];
        for layer in 0..layers {
            for (j, &b) in table.iter().enumerate() {
                let page = (layer * blocks + b as usize) * block;
                kv.read_at(page as u64, &mut buf)?;
                if !block_ok(&buf, block_seed(req, layer, j)) {
                    return Err(format!("request {req}: layer {layer} block {b} differs").into());
                }
            }
        }
        Ok(())
    })
    .await
    .map_err(|e| Served::Bad(e.into()))?
    .map_err(Served::Bad)
}
