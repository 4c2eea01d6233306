//! Compile-time checks that the public handles and futures can cross threads (so they work
//! with `tokio::spawn`).

use fabric_async::*;

fn is_send_sync<T: Send + Sync>() {}
fn is_send<T: Send>(_: &T) {}

#[test]
fn handles_and_futures_are_send() {
    is_send_sync::<Engine>();
    is_send_sync::<ImmCounter>();
    is_send_sync::<MemoryRegion>();
    is_send_sync::<RemoteRegion>();
    is_send_sync::<OpBatch>();
    is_send_sync::<OpFuture>();
    is_send_sync::<WaitFor>();
    is_send_sync::<RecvFuture>();
    is_send_sync::<TcpStore>();
    // The async fns' futures too.
    let check = |e: Engine, r: RemoteRegion| {
        is_send(&async move {
            let _ = e.add_peer(&[]).await;
            let _ = e.remote_region(&[]).await;
            let _ = e.alloc(1).await;
            let _ = e.register_copy(vec![1]).await;
            let _ = e.imm(&r, 1).await;
        });
    };
    let _ = check;
}
