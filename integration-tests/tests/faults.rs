//! Fault injection (feature `faults`, `docs/operations.md`): a writer whose NIC refuses posts
//! with `Again` at random and fails a fraction of completions, against a plain receiver, both
//! engines of this process over libfabric (tcp and shm on loopback, or
//! `FABRIC_TEST_PROVIDERS`).
//!
//! Every operation must resolve, either `Ok` or with the injected, typed
//! `Error::Completion`; the receiver must count every immediate of every posted operation (an
//! injected failure changes only the writer's local outcome), the bytes of every successful
//! write must be in place, the writer's statistics must count exactly the injected failures
//! as errors, and the same engine must work cleanly once injection is switched off.

use std::time::{Duration, Instant};

use fabric_async::faults::{FaultHandle, FaultPlan, INJECTED_ERRNO, INJECTED_MESSAGE};
use fabric_async::{Engine, Error, MemoryRegion, RemoteRegion};
use integration_tests::{fill_pattern, pattern_byte, primary, providers};

const IMM: u32 = 31;
/// Slot size of every write: one slot per operation, so no two writes overlap.
const SLOT: usize = 16 << 10;
const WAIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Write,
    WriteImm,
    Imm,
}

fn kind(i: usize) -> Kind {
    match i % 3 {
        0 => Kind::Write,
        1 => Kind::WriteImm,
        _ => Kind::Imm,
    }
}

/// `n` operations at once, operation `i` into slot `base + i` (its length varies with `i`);
/// returns each one's result.
async fn storm(
    w: &Engine,
    src: &MemoryRegion,
    dst: &RemoteRegion,
    base: usize,
    n: usize,
) -> Vec<(usize, Kind, usize, fabric_async::Result<()>)> {
    let ops = (0..n).map(|i| {
        let slot = base + i;
        let off = (slot * SLOT) as u64;
        let len = 1 + (i * 997) % SLOT;
        let k = kind(i);
        let fut = match k {
            Kind::Write => w.write(src, off, dst, off, len as u64),
            Kind::WriteImm => w.write_imm(src, off, dst, off, len as u64, IMM),
            Kind::Imm => w.imm(dst, IMM),
        };
        async move { (slot, k, len, fut.await) }
    });
    tokio::time::timeout(WAIT, futures::future::join_all(ops))
        .await
        .expect("every operation resolved in time")
}

/// Waits (bounded) until every slot in `ok` holds its pattern; panics naming the first that
/// does not. Plain writes say nothing about placement at the target when they complete
/// (`delivery_complete` is false on tcp and shm), hence the wait.
async fn bytes_in_place(region: &MemoryRegion, ok: &[(usize, usize)]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let bad = ok.iter().find(|(slot, len)| {
            let mut got = vec![0u8; *len];
            region.read_at((slot * SLOT) as u64, &mut got).expect("read");
            got.iter().enumerate().any(|(j, b)| *b != pattern_byte(3, (slot * SLOT + j) as u64))
        });
        match bad {
            None => return ok.iter().map(|(_, len)| *len as u64).sum(),
            Some(s) if Instant::now() > deadline => panic!("slot {} ({} B) never got its bytes", s.0, s.1),
            Some(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

struct Tally {
    ok_imm: u64,
    all_imm: u64,
    failed: u64,
    ok_writes: Vec<(usize, usize)>,
}

fn tally(
    w: &Engine,
    dst: &RemoteRegion,
    results: &[(usize, Kind, usize, fabric_async::Result<()>)],
) -> Tally {
    let mut t = Tally { ok_imm: 0, all_imm: 0, failed: 0, ok_writes: Vec::new() };
    for (slot, k, len, r) in results {
        let arrivals = match k {
            Kind::Write => 0,
            Kind::WriteImm => w.write_arrivals(dst, *len as u64).expect("arrivals"),
            Kind::Imm => 1,
        };
        t.all_imm += arrivals;
        match r {
            Ok(()) => {
                t.ok_imm += arrivals;
                if *k != Kind::Imm {
                    t.ok_writes.push((*slot, *len));
                }
            }
            Err(Error::Completion { errno, message, .. })
                if *errno == INJECTED_ERRNO && message.starts_with(INJECTED_MESSAGE) =>
            {
                t.failed += 1
            }
            Err(e) => panic!("slot {slot} ({k:?}): only injected failures are expected, got {e}"),
        }
    }
    t
}

async fn case(provider: &str) {
    const N: usize = 600;
    let plan = FaultPlan::new(0.2, 0.1).seed(0x5eed);
    let faults: FaultHandle = plan.handle.clone();
    let w = Engine::builder().provider(provider).faults(plan).build().expect("faulty writer");
    let r = Engine::builder().provider(provider).build().expect("receiver");
    let region = r.alloc(2 * N * SLOT).await.expect("alloc dst");
    let dst = w.remote_region(&region.descriptor().to_bytes()).await.expect("remote");
    let mut data = vec![0u8; 2 * N * SLOT];
    fill_pattern(&mut data, 3, 0);
    let src = w.register_copy(data).await.expect("register src");
    let counter = r.imm_counter(IMM);
    // The writer's own Hello to the new peer (docs/faults.md) went through the faulty NIC
    // too: let it finish, and count only what the storm injects.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (again0, failed0) = (faults.again_injected(), faults.failures_injected());

    // Under injection.
    let results = storm(&w, &src, &dst, 0, N).await;
    let t = tally(&w, &dst, &results);
    assert!(faults.again_injected() > again0, "no post was refused: the backlog path did not run");
    assert!(t.failed > 0, "no completion failed: the error path did not run");
    assert_eq!(
        t.failed,
        faults.failures_injected() - failed0,
        "each injected failure reached exactly one future"
    );
    // An injected failure changes only the local outcome: every posted write ran, so every
    // immediate arrives, those of the successes first among them.
    tokio::time::timeout(WAIT, counter.wait_for(t.all_imm))
        .await
        .expect("all arrivals in time")
        .expect("wait");
    let arrived = r.stats().counter(IMM).expect("counter entry").arrivals;
    assert_eq!(arrived, t.all_imm, "arrivals >= {} successes, == {} posted", t.ok_imm, t.all_imm);
    let verified = bytes_in_place(&region, &t.ok_writes).await;
    let s = w.stats().total();
    assert_eq!(s.errors, t.failed, "the writer counts exactly the injected failures as errors: {s}");
    assert_eq!(s.posted_ops, N as u64, "each operation posted once, however often refused: {s}");
    assert_eq!(s.completed_ops + s.errors, s.posted_ops, "{s}");
    assert_eq!((s.in_flight, s.backlog), (0, 0), "{s}");
    eprintln!(
        "{provider}: {N} ops under injection: {} refused posts (retried), {} injected failures, \
         {} ok imm / {} arrived, {verified} B verified",
        faults.again_injected(),
        t.failed,
        t.ok_imm,
        arrived
    );

    // Injection off: the same engine, clean.
    faults.set_enabled(false);
    let (again, failed) = (faults.again_injected(), faults.failures_injected());
    let results = storm(&w, &src, &dst, N, N / 2).await;
    let t2 = tally(&w, &dst, &results);
    assert_eq!(t2.failed, 0, "no failure with injection off");
    assert_eq!((faults.again_injected(), faults.failures_injected()), (again, failed));
    tokio::time::timeout(WAIT, counter.wait_for(t2.all_imm)).await.expect("arrivals in time").expect("wait");
    assert_eq!(r.stats().counter(IMM).unwrap().arrivals, t.all_imm + t2.all_imm);
    bytes_in_place(&region, &t2.ok_writes).await;
    let s = w.stats().total();
    assert_eq!(s.errors, t.failed, "no new errors: {s}");
    assert_eq!(s.completed_ops, s.posted_ops - t.failed, "{s}");
    w.shutdown();
    r.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_survive_refused_posts_and_failed_completions() {
    for p in providers() {
        case(&p).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_plans_are_refused_at_build() {
    let e = Engine::builder().provider(primary()).faults(FaultPlan::new(1.5, 0.0)).build().unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(matches!("again=0.1,bogus=1".parse::<FaultPlan>(), Err(Error::Config(_))));
    let p: FaultPlan = "again=0.1,fail=0.01,seed=7".parse().expect("the documented form");
    assert_eq!((p.again, p.fail, p.seed), (0.1, 0.01, 7));
}
