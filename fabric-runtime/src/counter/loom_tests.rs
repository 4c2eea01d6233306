//! The loom model check of the immediate counter (`counter/mod.rs`): every interleaving of
//! arrivals and waiters (`RUSTFLAGS="--cfg loom"`, scripts/test.sh).

use super::*;
use loom::future::block_on;
use loom::thread;

/// An arrival racing a waiter that is queueing itself is never lost: the waiter always
/// completes, and exactly the requested count is consumed.
#[test]
fn arrival_races_waiter() {
    loom::model(|| {
        let cell = Arc::new(CounterCell::new(1));
        let c = ImmCounter::from_cell(cell.clone());
        let t = thread::spawn(move || cell.arrive(1));
        block_on(c.wait_for(1)).unwrap();
        t.join().unwrap();
        assert_eq!(c.available(), 0);
    });
}

/// A waiter queueing itself while the engine shuts down never hangs.
#[test]
fn close_races_waiter() {
    loom::model(|| {
        let cell = Arc::new(CounterCell::new(1));
        let c = ImmCounter::from_cell(cell.clone());
        let t = thread::spawn(move || cell.close());
        assert!(block_on(c.wait_for(1)).is_err());
        t.join().unwrap();
    });
}

/// A waiter queueing itself while its counter is retired never hangs, and is either
/// served by the arrival counted before the retirement or told the counter is retired.
#[test]
fn retire_races_waiter() {
    loom::model(|| {
        let cell = Arc::new(CounterCell::new(1));
        cell.arrive(1);
        let c = ImmCounter::from_cell(cell.clone());
        let t = thread::spawn(move || cell.retire());
        let r = block_on(c.wait_for(1));
        let discarded = t.join().unwrap();
        match r {
            Ok(()) => assert_eq!(discarded, 0),
            Err(Error::CounterRetired { imm: 1 }) => assert_eq!(discarded, 1),
            Err(e) => panic!("{e}"),
        }
        assert_eq!(c.available(), 0);
    });
}

/// A queued waiter dropped while an arrival races it gives back whatever it was granted.
#[test]
fn drop_racing_arrival_gives_back() {
    loom::model(|| {
        let cell = Arc::new(CounterCell::new(1));
        let c = ImmCounter::from_cell(cell.clone());
        let mut a = c.wait_for(1);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut a).poll(&mut cx).is_pending());
        let t = thread::spawn(move || cell.arrive(1));
        drop(a);
        t.join().unwrap();
        assert_eq!(c.available(), 1);
        block_on(c.wait_for(1)).unwrap();
        assert_eq!(c.available(), 0);
    });
}
