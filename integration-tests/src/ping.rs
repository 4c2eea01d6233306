//! An 8-byte `write_imm` ping-pong between two engines of this process, each side on a
//! thread of its own with a current-thread runtime, counting how often that runtime parks
//! its thread: whether awaiting parks (`Event`) or not (`Inline`, lingering awaits).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use fabric_async::{Engine, EngineBuilder, MemoryRegion, RemoteRegion};

/// One side: its engine, its region (bytes 0..8 are what it sends, 8..16 what it receives)
/// and the peer's region.
pub struct Side {
    pub engine: Engine,
    pub region: MemoryRegion,
    pub remote: RemoteRegion,
}

/// Two engines of `builder`'s settings, each with a 4 KiB region the other can write.
pub async fn pair(builder: impl Fn() -> EngineBuilder) -> (Side, Side) {
    let (a, b) = (builder().build().unwrap(), builder().build().unwrap());
    let (ra, rb) = (a.alloc(4096).await.unwrap(), b.alloc(4096).await.unwrap());
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
    (Side { engine: a, region: ra, remote: to_b }, Side { engine: b, region: rb, remote: to_a })
}

/// `n` round trips of 8 bytes with immediates: the leader writes `i`, the other side checks
/// it landed and echoes it, the leader checks the echo. Returns how often the thread's
/// runtime parked while doing it.
pub fn ping_pong(s: &Side, lead: bool, n: u64) -> usize {
    let parks = Arc::new(AtomicUsize::new(0));
    let p2 = parks.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(move || {
            p2.fetch_add(1, Ordering::Relaxed);
        })
        .build()
        .unwrap();
    rt.block_on(async {
        let (send, wait) = if lead { (1, 2) } else { (2, 1) };
        let c = s.engine.imm_counter(wait);
        // Parks before the first round trip (the runtime starting) do not count.
        let before = parks.load(Ordering::Relaxed);
        let mut got = [0u8; 8];
        for i in 0..n {
            if lead {
                s.region.write_at(0, &i.to_le_bytes()).unwrap();
                s.engine.write_imm(&s.region, 0, &s.remote, 8, 8, send).await.unwrap();
                c.wait_for(1).await.unwrap();
                s.region.read_at(8, &mut got).unwrap();
                assert_eq!(u64::from_le_bytes(got), i, "the echo of round trip {i}");
            } else {
                c.wait_for(1).await.unwrap();
                s.region.read_at(8, &mut got).unwrap();
                assert_eq!(u64::from_le_bytes(got), i, "round trip {i} landed before its immediate");
                s.region.write_at(0, &got).unwrap();
                s.engine.write_imm(&s.region, 0, &s.remote, 8, 8, send).await.unwrap();
            }
        }
        assert_eq!(c.available(), 0, "exactly one arrival per round trip");
        parks.load(Ordering::Relaxed) - before
    })
}

/// [`ping_pong`] on both sides at once, each on a thread of its own: the leader's parks and
/// the other side's, and the sides back (for their statistics).
pub async fn run(a: Side, b: Side, n: u64) -> (usize, usize, Side, Side) {
    let pong = std::thread::spawn(move || (ping_pong(&b, false, n), b));
    let ping = std::thread::spawn(move || (ping_pong(&a, true, n), a));
    let (lead, a) = tokio::task::spawn_blocking(move || ping.join().expect("ping thread")).await.unwrap();
    let (other, b) = tokio::task::spawn_blocking(move || pong.join().expect("pong thread")).await.unwrap();
    (lead, other, a, b)
}
