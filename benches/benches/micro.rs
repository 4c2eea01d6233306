//! Micro-benchmarks of the hot pure paths: the immediate counter (arrive, try_consume,
//! wait_for when arrivals are already there, and the wake of a parked waiter) and the
//! OpFuture completion and wake path. No NIC involved.
//!
//! `cargo bench -p fabric-bench --bench micro -- --warm-up-time 1 --measurement-time 2`

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use criterion::{black_box, criterion_group, criterion_main, Criterion};
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

criterion_group!(benches, counter, op_future);
criterion_main!(benches);
