//! Micro-benchmarks of the hot pure paths, no NIC involved:
//!
//! - the immediate counter (arrive, try_consume, wait_for when arrivals are already there,
//!   and the wake of a parked waiter) and the OpFuture completion and wake;
//! - the counter table: the reactor's dispatch of `Completion::Imm` (its own map, and the
//!   engine's shared table on an immediate's first arrival) and `Engine::imm_counter`'s lookup;
//! - the op table: the reactor's slab of in-flight operations (`next_token` + `insert`,
//!   `remove` by token, a stale token);
//! - the wake path: a submission through the engine's queue (`has_items`, and the eventfd
//!   when the reactor sleeps), the reactor taking it, and the completion waking the future.
//!
//! `cargo bench -p fabric-bench --bench micro -- --warm-up-time 1 --measurement-time 2`

use std::collections::VecDeque;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use fabric_runtime::bench_hooks::BenchReactor;
use fabric_runtime::pure::slab::Slab;
use fabric_runtime::{ImmCounter, OpFuture};

/// A waker that only counts, so the cost measured is the engine's, not an executor's.
struct CountWaker(std::sync::atomic::AtomicU64);

impl Wake for CountWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn waker() -> Waker {
    Waker::from(Arc::new(CountWaker(0.into())))
}

fn counter(c: &mut Criterion) {
    let (counter, arrive) = ImmCounter::detached_for_bench(7);
    c.bench_function("counter/arrive (no waiter)", |b| b.iter(|| arrive(black_box(1))));
    c.bench_function("counter/arrive+try_consume", |b| {
        b.iter(|| {
            arrive(1);
            assert!(counter.try_consume(black_box(1)));
        })
    });
    c.bench_function("counter/try_consume (empty)", |b| b.iter(|| counter.try_consume(black_box(1))));
    let w = waker();
    let mut cx = Context::from_waker(&w);
    c.bench_function("counter/wait_for ready (fast path)", |b| {
        b.iter(|| {
            arrive(1);
            let mut f = pin!(counter.wait_for(1));
            assert!(f.as_mut().poll(&mut cx).is_ready());
        })
    });
    c.bench_function("counter/wait_for park+arrive+wake+ready", |b| {
        b.iter(|| {
            let mut f = pin!(counter.wait_for(1));
            assert!(f.as_mut().poll(&mut cx).is_pending());
            arrive(1);
            assert!(f.as_mut().poll(&mut cx).is_ready());
        })
    });
    let (counter2, arrive2) = ImmCounter::detached_for_bench(8);
    c.bench_function("counter/spin_wait ready", |b| {
        b.iter(|| {
            arrive2(1);
            assert!(counter2.spin_wait(1, std::time::Duration::from_secs(1)));
        })
    });
}

fn op_future(c: &mut Criterion) {
    let w = waker();
    let mut cx = Context::from_waker(&w);
    c.bench_function("op_future/complete then poll", |b| {
        b.iter(|| {
            let (f, done) = OpFuture::detached_for_bench();
            done();
            let mut f = pin!(f);
            assert!(matches!(f.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        })
    });
    c.bench_function("op_future/poll, complete+wake, poll", |b| {
        b.iter(|| {
            let (f, done) = OpFuture::detached_for_bench();
            let mut f = pin!(f);
            assert!(f.as_mut().poll(&mut cx).is_pending());
            done();
            assert!(matches!(f.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        })
    });
}

/// Runs `f(i)` for `iters` values of `i`, calling `reset` (untimed) every `every` calls.
fn timed_with_resets(iters: u64, every: u64, mut reset: impl FnMut(), mut f: impl FnMut(u64)) -> Duration {
    let (mut total, mut done) = (Duration::ZERO, 0);
    while done < iters {
        let n = (iters - done).min(every);
        reset();
        let t = Instant::now();
        for i in 0..n {
            f(i);
        }
        total += t.elapsed();
        done += n;
    }
    total
}

fn counter_table(c: &mut Criterion) {
    let mut r = BenchReactor::new().expect("eventfd");
    r.dispatch_imm(7);
    c.bench_function("counter_table/dispatch Imm, known imm (reactor map hit)", |b| {
        b.iter(|| r.dispatch_imm(black_box(7)))
    });
    for i in 0..64 {
        r.dispatch_imm(i);
    }
    let mut k = 0u32;
    c.bench_function("counter_table/dispatch Imm, 64 imms round-robin (hit)", |b| {
        b.iter(|| {
            k = (k + 1) & 63;
            r.dispatch_imm(black_box(k))
        })
    });
    c.bench_function("counter_table/dispatch Imm, first arrival (creates the cell)", |b| {
        let r = std::cell::RefCell::new(BenchReactor::new().expect("eventfd"));
        b.iter_custom(|iters| {
            timed_with_resets(
                iters,
                1024,
                || r.borrow_mut().clear_counters(),
                |i| r.borrow_mut().dispatch_imm(black_box(i as u32)),
            )
        })
    });
    c.bench_function("counter_table/imm_counter, existing (shared table lookup)", |b| {
        b.iter(|| r.imm_counter(black_box(7)))
    });
}

/// About the size of the reactor's `InFlight` entry.
type Entry = [u64; 8];

fn op_table(c: &mut Criterion) {
    let mut s: Slab<Entry> = Slab::default();
    c.bench_function("op_table/next_token+insert, remove (1 in flight)", |b| {
        b.iter(|| {
            let t = s.next_token();
            s.insert([t; 8]);
            black_box(s.remove(black_box(t)))
        })
    });
    // A full window: 1000 in flight, the oldest completes as a new one is posted.
    let mut s: Slab<Entry> = Slab::default();
    let mut q: VecDeque<u64> = (0..1000)
        .map(|_| {
            let t = s.next_token();
            s.insert([t; 8]);
            t
        })
        .collect();
    c.bench_function("op_table/next_token+insert, remove oldest (1000 in flight)", |b| {
        b.iter(|| {
            let t = s.next_token();
            s.insert([t; 8]);
            q.push_back(t);
            let old = q.pop_front().expect("1000 in flight");
            black_box(s.remove(black_box(old)))
        })
    });
    let stale = q[0] ^ (1 << 32);
    c.bench_function("op_table/remove, stale token (finds nothing)", |b| {
        b.iter(|| assert!(s.remove(black_box(stale)).is_none()))
    });
}

fn wake_path(c: &mut Criterion) {
    let mut r = BenchReactor::new().expect("eventfd");
    c.bench_function("wake/reactor pass, empty queue (has_items load)", |b| {
        b.iter(|| black_box(r.take_submissions()))
    });
    c.bench_function("wake/reactor sleep decision + zero-timeout ppoll, no wake", |b| {
        b.iter(|| {
            assert!(r.prepare_sleep());
            assert!(!r.poll_wake());
        })
    });
    c.bench_function("wake/submit, take, complete (reactor awake, no eventfd)", |b| {
        b.iter(|| {
            let f = r.submit_imm(1);
            r.take_submissions();
            r.complete_all();
            drop(f);
        })
    });
    c.bench_function("wake/submit, take, complete (reactor asleep: eventfd write+ppoll+read)", |b| {
        b.iter(|| {
            r.prepare_sleep();
            let f = r.submit_imm(1);
            assert!(r.poll_wake());
            r.take_submissions();
            r.complete_all();
            drop(f);
        })
    });
    let w = waker();
    let mut cx = Context::from_waker(&w);
    c.bench_function("wake/parked future: submit, poll, take, complete+wake, poll (awake)", |b| {
        b.iter(|| {
            let mut f = pin!(r.submit_imm(1));
            assert!(f.as_mut().poll(&mut cx).is_pending());
            r.take_submissions();
            r.complete_all();
            assert!(matches!(f.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        })
    });
    c.bench_function("wake/parked future: as above, reactor asleep (eventfd)", |b| {
        b.iter(|| {
            r.prepare_sleep();
            let mut f = pin!(r.submit_imm(1));
            assert!(f.as_mut().poll(&mut cx).is_pending());
            assert!(r.poll_wake());
            r.take_submissions();
            r.complete_all();
            assert!(matches!(f.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        })
    });
}

criterion_group!(benches, counter, op_future, counter_table, op_table, wake_path);
criterion_main!(benches);
