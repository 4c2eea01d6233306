//! shm engines made, used and dropped one pair after another in one process: each pair moves
//! its bytes, and no later pair trips over what an earlier one left in libfabric (found from
//! Python, where a test suite makes many engines in one interpreter: the Python suite's
//! in-process tests make a pair per test, on shm as on tcp).

use std::time::Duration;

use fabric_async::Engine;

/// Pairs made and dropped in one process; every other one is dropped without `shutdown()`.
const PAIRS: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_pairs_made_after_dropped_pairs_still_move_bytes() {
    let start = std::time::Instant::now();
    for round in 0..PAIRS {
        assert!(start.elapsed() < Duration::from_secs(120), "round {round}: past 120 s");
        let a = Engine::builder().provider("shm").build().expect("engine a");
        let b = Engine::builder().provider("shm").build().expect("engine b");
        // 64 KiB: shm's iov path, not only its inline one.
        let dst = b.alloc(8 + 65536).await.unwrap();
        let src = a.register_copy(vec![round as u8 + 1; 65536]).await.unwrap();
        let remote = a.remote_region(&dst.descriptor().to_bytes()).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), a.write_imm(&src, 0, &remote, 8, 65536, 77))
            .await
            .unwrap_or_else(|_| panic!("round {round}: no completion in 10 s"))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let c = b.imm_counter(77);
        assert!(
            tokio::time::timeout(Duration::from_secs(10), c.wait_for(1)).await.is_ok(),
            "round {round}: arrival"
        );
        let got = dst.to_vec();
        assert!(got[..8].iter().all(|&x| x == 0), "round {round}: bytes before the range");
        assert!(got[8..8 + 65536].iter().all(|&x| x == round as u8 + 1), "round {round}: bytes");
        if round % 2 == 0 {
            a.shutdown();
            b.shutdown();
        }
        drop((src, dst, remote, c));
        drop((a, b));
    }
}

/// The same, as the Python suite did it: a current-thread runtime, plain writes, and both
/// engines shut down back to back while the target may still be handling the writer's hello
/// (it then adds the writer as a peer while the writer's endpoints close: libfabric 1.17
/// crashed with SIGSEGV in `fi_enable` on the second or third pair).
#[test]
fn shm_pairs_shut_down_back_to_back() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for round in 0..PAIRS {
        let a = Engine::builder().provider("shm").build().expect("engine a");
        let b = Engine::builder().provider("shm").build().expect("engine b");
        let (dst, src) = rt.block_on(async { (b.alloc(8192).await.unwrap(), a.alloc(4096).await.unwrap()) });
        src.write_at(0, &[round as u8 + 7; 8]).unwrap();
        let r = rt.block_on(a.remote_region(&dst.descriptor().to_bytes())).unwrap();
        rt.block_on(a.write(&src, 0, &r, 0, 8)).unwrap_or_else(|e| panic!("round {round}: {e}"));
        // shm writes are not delivery-complete (docs/transfers.md): the completion says the
        // write was handed over; libfabric >= 1.18 places an 8-byte one when the target's
        // provider progresses. Wait for the bytes, bounded.
        let t = std::time::Instant::now();
        while dst.to_vec()[..8] != [round as u8 + 7; 8] && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(dst.to_vec()[..8], [round as u8 + 7; 8], "round {round}: bytes");
        a.shutdown();
        b.shutdown();
        drop((src, dst, r));
        drop((a, b));
    }
}
