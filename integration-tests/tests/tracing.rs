//! The engine's tracing events: with a subscriber at debug, engine start, registration, peers,
//! each transfer and shutdown are reported; at info, none of them is (they are debug events,
//! and only failures are at warn). One test per binary: the subscriber is process-global
//! (the reactor thread logs too).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fabric_async::Engine;
use integration_tests::primary;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt;

/// Everything the subscriber writes, kept in memory.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Buf {
    type Writer = Buf;
    fn make_writer(&'a self) -> Buf {
        self.clone()
    }
}

impl Buf {
    fn take(&self) -> String {
        String::from_utf8_lossy(&std::mem::take(&mut *self.0.lock().unwrap())).into_owned()
    }
}

async fn one_transfer() {
    let p = primary();
    let w = Engine::builder().provider(p.as_str()).build().expect("writer");
    let r = Engine::builder().provider(p.as_str()).build().expect("receiver");
    let dst = r.alloc(4096).await.expect("alloc");
    let src = w.alloc(4096).await.expect("alloc");
    let remote = w.remote_region(&dst.descriptor().to_bytes()).await.expect("remote");
    w.write_imm(&src, 0, &remote, 0, 4096, 3).await.expect("write");
    tokio::time::timeout(Duration::from_secs(30), r.imm_counter(3).wait_for(1))
        .await
        .expect("in time")
        .expect("wait");
    drop((src, dst, remote));
    drop(w);
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_events_at_debug_and_none_at_info() {
    let buf = Buf::default();
    let (filter, level) = reload::Layer::new(LevelFilter::DEBUG);
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_writer(buf.clone()).with_ansi(false))
        .init();

    one_transfer().await;
    let debug = buf.take();
    for what in [
        "engine started",
        "memory registered",
        "peer added",
        "transfer submitted",
        "engine_close",
        "reactor closed",
        "memory deregistered",
    ] {
        assert!(debug.contains(what), "no {what:?} at debug in:\n{debug}");
    }

    level.modify(|l| *l = LevelFilter::INFO).expect("set info");
    one_transfer().await;
    let info = buf.take();
    assert!(info.is_empty(), "nothing at info for a healthy transfer, got:\n{info}");
}
