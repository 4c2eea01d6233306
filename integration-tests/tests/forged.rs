//! A write with immediate through a forged descriptor of a live region ends promptly with a
//! typed error, lands nothing and counts nothing, and the owner stays reachable
//! (`docs/faults.md`, "A bad remote access fails that operation, and only it").
//!
//! The owner is another process (`fabric-peer keeper`: a live region and a neighbour, both
//! hashed on request, and the arrivals of the bad and the good immediate counted). Forged
//! copies of the live region's descriptor: a key the owner never gave out (writes of 8 B,
//! 4 KiB and 1 MiB: shm's inject path, its larger path, and several chunks), a length
//! altered past the region's end and a base moved so the range leaves it (a 4 KiB write
//! beyond the real end). On shm the owner's provider refuses a bad key without answering
//! the writer, so the engine has the owner vouch for a descriptor in `remote_region`,
//! which refuses these with `RemoteAccess`; on tcp the owner's provider refuses the write
//! (`ConnectionLost` or `RemoteAccess`). After each bad write both regions' bytes are
//! unchanged and nothing was counted, and a write with immediate of the whole live region
//! lands (every byte checked by its hash) and is counted once; three rounds; the owner is
//! never reported down.

use std::time::{Duration, Instant};

use fabric_async::{Engine, Error, MemoryRegion, PeerEvent, PeerEvents, RegionDescriptor, Rendezvous};
use futures::{FutureExt, StreamExt};
use integration_tests::{fill_pattern, get, hash, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const SIZE: usize = 2 << 20;
const ROUNDS: usize = 3;
const GOOD_IMM: u32 = 5;
const BAD_IMM: u32 = 9;
/// The target is 100 ms; this only catches a wait for `op_timeout` (below), never a slow
/// machine.
const PROMPT: Duration = Duration::from_secs(2);
const OP_TIMEOUT: Duration = Duration::from_secs(10);

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

/// One forged descriptor and the write through it.
#[derive(Clone, Copy, Debug)]
enum Forgery {
    /// A key the owner never gave out; a write of this many bytes at offset 0.
    Key(u64),
    /// The length doubled; a 4 KiB write just past the real end.
    Len,
    /// The base moved by half the region; a 4 KiB write at the (shifted) end, past the
    /// real one.
    Base,
}

impl Forgery {
    fn forge(self, real: &RegionDescriptor) -> (Vec<u8>, u64, u64) {
        let mut d = RegionDescriptor::from_bytes(&real.to_bytes()).unwrap();
        let (off, len) = match self {
            Forgery::Key(len) => {
                for n in &mut d.domains {
                    n.key ^= 0x5a5a_0000_1234;
                }
                (0, len)
            }
            Forgery::Len => {
                d.len *= 2;
                (SIZE as u64, 4096)
            }
            Forgery::Base => {
                for n in &mut d.domains {
                    n.base += SIZE as u64 / 2;
                }
                (SIZE as u64 - 4096, 4096)
            }
        };
        (d.to_bytes(), off, len)
    }
}

/// No `Down` (nor `Removed`) for any peer so far.
fn never_down(p: &str, events: &mut PeerEvents) {
    while let Some(Some(ev)) = events.next().now_or_never() {
        assert!(matches!(ev, PeerEvent::Up { .. }), "{p}: the owner was reported {ev:?}");
    }
}

struct Checks<'a> {
    store: &'a fabric_async::bootstrap::TcpStore,
    next: usize,
}

impl Checks<'_> {
    /// Has the keeper wait for `arrivals` more good immediates, then report its regions'
    /// hashes and what it counted: (live, neighbour, bad arrivals, good arrivals left over).
    async fn check(&mut self, arrivals: u64) -> (u64, u64, u64, u64) {
        let k = self.next;
        self.next += 1;
        self.store.put(&format!("test/check/{k}"), arrivals.to_string().into_bytes()).await.unwrap();
        let got = String::from_utf8(get(self.store, &format!("keeper/{k}")).await).unwrap();
        let v: Vec<u64> = got.split(',').map(|x| x.parse().unwrap()).collect();
        (v[0], v[1], v[2], v[3])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_write_imm_fails_promptly_and_lands_nothing() {
    let forgeries = [Forgery::Key(8), Forgery::Key(4096), Forgery::Key(1 << 20), Forgery::Len, Forgery::Base];
    for p in providers() {
        let (_server, store, addr) = store().await;
        let count = (ROUNDS * forgeries.len() * 2).to_string();
        let mut keeper =
            Peer::spawn(PEER, addr, &p, &["keeper", "--size", &SIZE.to_string(), "--count", &count]);
        let engine = Engine::builder().provider(p.as_str()).op_timeout(Some(OP_TIMEOUT)).build().unwrap();
        let mut events = engine.peer_events();
        let live_bytes = get(&store, "keeper/live").await;
        let neighbour_bytes = get(&store, "keeper/neighbour").await;

        // What remote_region costs: the first adds the owner (and, where the owner vouches,
        // asks it), a second descriptor of the same owner only asks, and the same one again
        // is remembered.
        let t = Instant::now();
        let live = bounded(engine.remote_region(&live_bytes)).await.unwrap();
        let first = t.elapsed();
        let t = Instant::now();
        let _neighbour = bounded(engine.remote_region(&neighbour_bytes)).await.unwrap();
        let second = t.elapsed();
        let t = Instant::now();
        let _again = bounded(engine.remote_region(&live_bytes)).await.unwrap();
        let again = t.elapsed();
        eprintln!(
            "{p}: remote_region: first {first:?}, another of the owner {second:?}, the same again {again:?}"
        );
        // The price of the question: descriptors of sub-ranges of the live region (which the
        // owner vouches for), each new, then each again (remembered).
        let (mut fresh, mut known, mut keep) = (Vec::new(), Vec::new(), Vec::new());
        for i in 1..=20u64 {
            let mut d = RegionDescriptor::from_bytes(&live_bytes).unwrap();
            for n in &mut d.domains {
                n.base += 4096 * i;
            }
            d.len -= 4096 * i;
            let d = d.to_bytes();
            let t = Instant::now();
            keep.push(bounded(engine.remote_region(&d)).await.expect("a sub-range of a live region"));
            fresh.push(t.elapsed());
            let t = Instant::now();
            keep.push(bounded(engine.remote_region(&d)).await.unwrap());
            known.push(t.elapsed());
        }
        fresh.sort();
        known.sort();
        eprintln!(
            "{p}: remote_region of 20 new descriptors of a known owner: median {:?}, max {:?}; again: median {:?}, max {:?}",
            fresh[10], fresh[19], known[10], known[19]
        );

        let zeros = hash(&vec![0u8; SIZE]);
        let (mut want_live, want_neighbour) = (zeros, zeros);
        let mut checks = Checks { store: &store, next: 0 };
        let src = engine.alloc(SIZE).await.unwrap();
        let mut bytes = vec![0u8; SIZE];
        let mut slowest = Duration::ZERO;
        for r in 0..ROUNDS {
            for (i, f) in forgeries.iter().enumerate() {
                let seed = (r * forgeries.len() + i) as u64;
                let (forged, off, len) = f.forge(live.descriptor());
                fill_pattern(&mut bytes, 1000 + seed, 0);
                src.write_at(0, &bytes).unwrap();
                let t = Instant::now();
                let result = bounded(async {
                    let dst = engine.remote_region(&forged).await?;
                    engine.write_imm(&src, 0, &dst, off, len, BAD_IMM).await
                })
                .await;
                let took = t.elapsed();
                slowest = slowest.max(took);
                match &result {
                    // Refused by the owner in remote_region: nothing was posted.
                    Err(Error::RemoteAccess { op: "descriptor", .. }) if p == "shm" => {}
                    // Refused by the owner's provider (tcp: with the connection it closed).
                    Err(Error::RemoteAccess { .. } | Error::ConnectionLost { .. }) if p != "shm" => {}
                    other => panic!("{p}: round {r}: write_imm through {f:?}: got {other:?}"),
                }
                assert!(took < PROMPT, "{p}: round {r}: {f:?} took {took:?} to fail");
                eprintln!("{p}: round {r}: {f:?}: {took:?}: {}", result.unwrap_err());

                let (l, n, bad, left) = checks.check(0).await;
                assert_eq!(l, want_live, "{p}: round {r}: {f:?} changed the live region");
                assert_eq!(n, want_neighbour, "{p}: round {r}: {f:?} changed the neighbour region");
                assert_eq!((bad, left), (0, 0), "{p}: round {r}: {f:?}: arrivals counted (bad, good)");

                // The owner is still reachable: a write with immediate of the whole live
                // region lands, every byte, and is counted once.
                live_write(&p, &engine, &src, &live, &mut bytes, seed).await;
                want_live = hash(&bytes);
                let (l, n, bad, left) = checks.check(1).await;
                assert_eq!(l, want_live, "{p}: round {r}: after {f:?}: the live region's bytes");
                assert_eq!(n, want_neighbour, "{p}: round {r}: after {f:?}: the neighbour's bytes");
                assert_eq!((bad, left), (0, 0), "{p}: round {r}: after {f:?}: arrivals (bad, good left)");
                never_down(&p, &mut events);
            }
        }
        eprintln!("{p}: the slowest forged write_imm took {slowest:?}");
        store.put("keeper/exit", b"bye".to_vec()).await.unwrap();
        assert!(keeper.wait_success(Duration::from_secs(30)).await, "{p}: the keeper exited cleanly");
    }
}

async fn live_write(
    p: &str,
    engine: &Engine,
    src: &MemoryRegion,
    live: &fabric_async::RemoteRegion,
    bytes: &mut [u8],
    seed: u64,
) {
    fill_pattern(bytes, seed, 0);
    src.write_at(0, bytes).unwrap();
    bounded(engine.write_imm(src, 0, live, 0, SIZE as u64, GOOD_IMM))
        .await
        .unwrap_or_else(|e| panic!("{p}: a write with immediate to the live region: {e}"));
}

/// An owner that does not answer the question (here: stopped; an older build drops it) ends
/// `remote_region` at `op_timeout` with `PeerUnreachable` and goes `Down`, as an operation
/// that outlived it would: never a hang. Only where the owner is asked (shm).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_does_not_answer_ends_remote_region_at_op_timeout() {
    if !providers().iter().any(|p| p == "shm") {
        integration_tests::skipped("an_owner_that_does_not_answer...", "only shm asks the owner");
        return;
    }
    let limit = Duration::from_secs(1);
    let (_server, store, addr) = store().await;
    let mut target = Peer::spawn(PEER, addr, "shm", &["target", "--size", "65536"]);
    let engine = Engine::builder().provider("shm").op_timeout(Some(limit)).build().unwrap();
    let desc = get(&store, "target/desc").await;
    let dst = bounded(engine.remote_region(&desc)).await.expect("a live owner vouches");
    let mut events = engine.peer_events();
    target.signal("STOP");
    // A descriptor not asked about yet: a sub-range of the same region.
    let mut d = RegionDescriptor::from_bytes(&desc).unwrap();
    for n in &mut d.domains {
        n.base += 4096;
    }
    d.len -= 4096;
    let t = Instant::now();
    let r = bounded(engine.remote_region(&d.to_bytes())).await;
    let took = t.elapsed();
    assert!(matches!(r, Err(Error::PeerUnreachable { .. })), "a stopped owner: {r:?}");
    assert!(took >= limit && took < limit + PROMPT, "ended after {took:?}");
    eprintln!("a stopped owner: remote_region failed after {took:?}: {}", r.unwrap_err());
    let down = loop {
        match bounded(events.next()).await {
            Some(PeerEvent::Down { peer, .. }) => break peer,
            Some(_) => continue,
            None => panic!("the event stream ended"),
        }
    };
    assert_eq!(down, dst.peer());
    target.signal("CONT");
    store.put("target/exit", b"bye".to_vec()).await.unwrap();
    assert!(target.wait_success(Duration::from_secs(30)).await, "the target exited cleanly");
}
