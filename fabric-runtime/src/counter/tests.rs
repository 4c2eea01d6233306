//! Unit tests of the immediate counter (`counter/mod.rs`): arrivals, waits in order, dropped
//! waits, the spin wait, and the closed states (shutdown, a short counter, a retired one),
//! polled through a no-op waker, and arrivals and waiters on several threads.

use super::*;
use futures::task::noop_waker;

fn counter() -> ImmCounter {
    ImmCounter::from_cell(Arc::new(CounterCell::new(7)))
}

fn poll(f: &mut WaitFor) -> Poll<()> {
    let w = noop_waker();
    let mut cx = Context::from_waker(&w);
    Pin::new(f).poll(&mut cx).map(|r| r.expect("not shut down"))
}

#[test]
fn early_arrivals_are_counted() {
    let c = counter();
    c.cell.arrive(3);
    let mut f = c.wait_for(3);
    assert_eq!(poll(&mut f), Poll::Ready(()));
    assert_eq!(c.available(), 0);
    assert_eq!(c.total_arrived(), 3);
}

#[test]
fn dropped_pending_wait_leaves_everything_for_the_next() {
    let c = counter();
    c.cell.arrive(100);
    let mut big = c.wait_for(150);
    assert_eq!(poll(&mut big), Poll::Pending);
    drop(big);
    assert_eq!(c.available(), 100);
    let mut f = c.wait_for(100);
    assert_eq!(poll(&mut f), Poll::Ready(()));
    assert_eq!(c.available(), 0);
}

#[test]
fn waits_then_consumes_exactly_n() {
    let c = counter();
    let mut f = c.wait_for(5);
    assert_eq!(poll(&mut f), Poll::Pending);
    c.cell.arrive(4);
    assert_eq!(poll(&mut f), Poll::Pending);
    c.cell.arrive(3);
    assert_eq!(poll(&mut f), Poll::Ready(()));
    assert_eq!(c.available(), 2);
}

#[test]
fn fifo_order_between_waiters() {
    let c = counter();
    let mut big = c.wait_for(5);
    let mut small = c.wait_for(1);
    assert!(poll(&mut big).is_pending());
    assert!(poll(&mut small).is_pending());
    c.cell.arrive(2);
    // `small` is behind `big` and must keep waiting.
    assert!(poll(&mut small).is_pending());
    c.cell.arrive(4);
    assert!(poll(&mut big).is_ready());
    assert!(poll(&mut small).is_ready());
    assert_eq!(c.available(), 0);
}

#[test]
fn dropped_granted_wait_gives_back() {
    let c = counter();
    let mut a = c.wait_for(3);
    let mut b = c.wait_for(3);
    assert!(poll(&mut a).is_pending());
    assert!(poll(&mut b).is_pending());
    c.cell.arrive(3); // granted to `a`, which never observes it
    drop(a);
    // the three pass on to `b`
    assert!(poll(&mut b).is_ready());
    assert_eq!(c.available(), 0);
}

#[test]
fn dropped_pending_head_unblocks_next() {
    let c = counter();
    let mut a = c.wait_for(10);
    let mut b = c.wait_for(2);
    assert!(poll(&mut a).is_pending());
    assert!(poll(&mut b).is_pending());
    c.cell.arrive(2);
    assert!(poll(&mut b).is_pending());
    drop(a);
    assert!(poll(&mut b).is_ready());
}

#[test]
fn try_consume_respects_queue() {
    let c = counter();
    c.cell.arrive(1);
    let mut a = c.wait_for(2);
    assert!(poll(&mut a).is_pending());
    assert!(!c.try_consume(1), "an async waiter is ahead");
    drop(a);
    assert!(c.try_consume(1));
    assert!(!c.try_consume(1));
}

#[test]
fn spin_wait_times_out_without_consuming() {
    let c = counter();
    c.cell.arrive(1);
    assert!(!c.spin_wait(2, Duration::from_millis(5)));
    assert_eq!(c.available(), 1);
    assert!(c.spin_wait(1, Duration::from_millis(5)));
}

#[test]
fn close_fails_pending_waits_and_keeps_counted_arrivals() {
    let c = counter();
    c.cell.arrive(2);
    let mut big = c.wait_for(5);
    assert!(poll(&mut big).is_pending());
    c.cell.close();
    let w = noop_waker();
    let r = Pin::new(&mut big).poll(&mut Context::from_waker(&w));
    assert!(matches!(r, Poll::Ready(Err(Error::Shutdown))));
    drop(big);
    // A new wait after shutdown: what arrived is still there, more never comes.
    assert!(futures::executor::block_on(c.wait_for(2)).is_ok());
    assert!(matches!(futures::executor::block_on(c.wait_for(1)), Err(Error::Shutdown)));
    assert!(!c.spin_wait(1, Duration::from_secs(10)), "spin_wait gives up at once");
}

#[test]
fn a_short_counter_serves_what_it_holds_and_fails_the_rest_at_once() {
    let c = ImmCounter::from_cell(Arc::new(CounterCell::short(9, 16)));
    c.cell.arrive(2);
    assert!(futures::executor::block_on(c.wait_for(1)).is_ok(), "what it holds is served");
    let w = noop_waker();
    let mut big = c.wait_for(2);
    let r = Pin::new(&mut big).poll(&mut Context::from_waker(&w));
    assert!(matches!(r, Poll::Ready(Err(Error::CounterLimit { imm: 9, limit: 16 }))), "{r:?}");
    assert_eq!(c.available(), 1, "a failed wait consumes nothing");
    assert!(!c.spin_wait(2, Duration::from_secs(10)), "spin_wait gives up at once");
    assert!(c.try_consume(1));
    assert_eq!(c.total_arrived(), 2);
}

#[test]
fn retiring_discards_what_is_left_and_fails_waits_not_granted() {
    let c = counter();
    c.cell.arrive(5);
    let mut granted = c.wait_for(3);
    assert_eq!(poll(&mut granted), Poll::Ready(()));
    let mut queued = c.wait_for(4);
    assert!(poll(&mut queued).is_pending());
    assert_eq!(c.cell.retire(), 2, "the two arrivals nobody consumed are discarded");
    let w = noop_waker();
    let r = Pin::new(&mut queued).poll(&mut Context::from_waker(&w));
    assert!(matches!(r, Poll::Ready(Err(Error::CounterRetired { imm: 7 }))), "{r:?}");
    drop(queued);
    assert_eq!(c.available(), 0);
    assert!(matches!(futures::executor::block_on(c.wait_for(1)), Err(Error::CounterRetired { imm: 7 })));
    assert!(futures::executor::block_on(c.wait_for(0)).is_ok());
    // A short counter retired says retired: that is what the application did last.
    let s = CounterCell::short(3, 1);
    s.retire();
    assert!(matches!(s.closed_error(), Error::CounterRetired { imm: 3 }));
}

#[test]
fn concurrent_arrivals_and_waiters_are_exact() {
    let c = counter();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let cell = c.cell.clone();
            std::thread::spawn(move || {
                for _ in 0..10_000 {
                    cell.arrive(1);
                }
            })
        })
        .collect();
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let c = c.clone();
            std::thread::spawn(move || {
                for _ in 0..1000 {
                    futures::executor::block_on(c.wait_for(10)).unwrap();
                }
            })
        })
        .collect();
    for t in threads.into_iter().chain(waiters) {
        t.join().unwrap();
    }
    assert_eq!(c.available(), 0);
    assert_eq!(c.total_arrived(), 40_000);
}
