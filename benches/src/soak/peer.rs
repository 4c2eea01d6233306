//! The soak's peer processes: what one does (`fabric-bench soak-peer`, hidden), and the
//! leader's handle on one incarnation of it.
//!
//! A peer builds an engine, allocates one region, publishes its address and the region's
//! descriptor under `<name>/addr` and `<name>/desc`, and then every 10 ms publishes how many
//! immediates [`IMM`] it has counted under `<name>/imm` (the store keeps the last value),
//! until the leader puts `soak/exit` or the leader dies (`PR_SET_PDEATHSIG`). The leader
//! writes into the region and reads it back to verify; the peer itself never checks bytes.
//! Meanwhile it keeps allocating and freeing short-lived extra regions for the leader's
//! stale-descriptor operations (`bad.rs`).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use fabric_async::bootstrap::{Rendezvous, TcpStore};
use fabric_async::{Engine, PeerId, RemoteRegion};

use crate::pair::Res;

/// The immediate value of every write_imm and imm-only write of the soak.
pub const IMM: u32 = 77;

/// `fabric-bench soak-peer` (started by the soak leader, not by hand).
#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    /// The leader's TcpStore.
    #[arg(long)]
    pub store: SocketAddr,
    /// This incarnation's name (its keys' prefix).
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub provider: String,
    /// Bytes of the region the leader writes into.
    #[arg(long)]
    pub region: usize,
    /// Bytes of each short-lived extra region (`bad.rs`); 0: none.
    #[arg(long, default_value_t = 0)]
    pub extra_size: usize,
    /// Pause between freeing an extra region and allocating the next, in ms.
    #[arg(long, default_value_t = 50)]
    pub extra_every_ms: u64,
}

/// The peer process.
pub async fn peer_main(a: PeerArgs) -> Res<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets this process's own death signal; no memory
    // is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let store = TcpStore::connect(a.store).await?;
    let engine = Engine::builder().provider(&a.provider).build()?;
    let region = engine.alloc(a.region).await?;
    let counter = engine.imm_counter(IMM);
    let counter_bad = engine.imm_counter(super::bad::IMM_BAD);
    store.put(&format!("{}/addr", a.name), engine.address()).await?;
    // (Before the leader can see any extra region: `extras::peer_extras` polls it.)
    store.put(&format!("{}/xfree", a.name), Vec::new()).await?;
    store.put(&format!("{}/desc", a.name), region.descriptor().to_bytes()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let extras = (a.extra_size > 0).then(|| {
        tokio::spawn(super::extras::peer_extras(
            engine.clone(),
            a.store,
            a.name.clone(),
            a.extra_size,
            Duration::from_millis(a.extra_every_ms),
            stop.clone(),
        ))
    });
    let exit = store.get("soak/exit");
    tokio::pin!(exit);
    loop {
        let arrivals = engine.stats().counter(IMM).map_or(0, |c| c.arrivals);
        store.put(&format!("{}/imm", a.name), arrivals.to_le_bytes().to_vec()).await?;
        tokio::select! {
            r = &mut exit => {
                r?;
                break;
            }
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    stop.store(true, Ordering::Release);
    if let Some(x) = extras {
        match tokio::time::timeout(Duration::from_secs(5), x).await {
            Ok(r) => r??,
            Err(_) => return Err("the extra regions' task did not stop within 5 s".into()),
        }
    }
    drop(counter_bad);
    drop(counter);
    drop(region);
    engine.shutdown();
    Ok(())
}

/// The leader's side of one incarnation: the process, and the engine's view of it.
pub struct Incarnation {
    /// `p<slot>.<generation>`.
    pub name: String,
    pub peer: PeerId,
    pub remote: RemoteRegion,
    child: ChildGuard,
}

/// A child process killed (SIGKILL) and reaped when dropped.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Incarnation {
    /// Starts the process and waits (bounded) until it is reachable. `extra`: the size of its
    /// short-lived extra regions (0: none) and their pace in ms (`bad.rs`).
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        engine: &Engine,
        store: &TcpStore,
        store_addr: SocketAddr,
        provider: &str,
        place: usize,
        generation: usize,
        region: usize,
        extra: (usize, u64),
    ) -> Res<Incarnation> {
        let name = format!("p{place}.{generation}");
        let child = ChildGuard(Some(
            Command::new(std::env::current_exe()?)
                .args(["soak-peer", "--store", &store_addr.to_string(), "--name", &name])
                .args(["--provider", provider, "--region", &region.to_string()])
                .args(["--extra-size", &extra.0.to_string(), "--extra-every-ms", &extra.1.to_string()])
                .stdin(Stdio::null())
                .spawn()?,
        ));
        let get = |k: String| async move {
            match tokio::time::timeout(Duration::from_secs(60), store.get(&k)).await {
                Ok(v) => Ok(v?),
                Err(_) => {
                    Err::<Vec<u8>, crate::pair::BoxError>(format!("{k}: not published within 60 s").into())
                }
            }
        };
        let addr = get(format!("{name}/addr")).await?;
        let desc = get(format!("{name}/desc")).await?;
        let peer = engine.add_peer(&addr).await?;
        let remote = engine.remote_region(&desc).await?;
        Ok(Incarnation { name, peer, remote, child })
    }

    /// SIGKILL, and reap the process.
    pub fn kill(&mut self) {
        drop(self.child.0.take().map(|c| ChildGuard(Some(c))));
    }

    /// The immediates it has counted, as last published (bounded wait for the first value).
    pub async fn arrivals(&self, store: &TcpStore) -> Res<u64> {
        let key = format!("{}/imm", self.name);
        let v = tokio::time::timeout(Duration::from_secs(10), store.get(&key))
            .await
            .map_err(|_| format!("{key}: no value within 10 s"))??;
        Ok(u64::from_le_bytes(v.as_slice().try_into().map_err(|_| format!("{key}: bad value"))?))
    }

    /// Waits for the process to exit by itself (after `soak/exit`), killing it after `grace`.
    /// Returns whether it exited cleanly.
    pub fn finish(&mut self, grace: Duration) -> bool {
        let Some(mut c) = self.child.0.take() else { return true };
        let deadline = Instant::now() + grace;
        loop {
            match c.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return false;
                }
            }
        }
    }
}
