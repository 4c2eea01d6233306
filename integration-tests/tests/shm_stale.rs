//! An shm engine opens although a dead process of the same pid left its regions in
//! /dev/shm: libfabric's shm names a region `PID:UID:N` (N counting the process's
//! endpoints), and a process that was killed never unlinks its own. A later process that
//! gets that pid used to fail `fi_enable` with EBUSY (found when a killed CI run's leftovers
//! made a later test's peer fail to open).

use std::time::Duration;

use fabric_async::Engine;
use integration_tests::{providers, skipped};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_opens_past_regions_a_dead_process_of_our_pid_left() {
    if !providers().iter().any(|p| p == "shm") {
        return skipped(
            "shm_opens_past_regions_a_dead_process_of_our_pid_left",
            "shm is not among FABRIC_TEST_PROVIDERS",
        );
    }
    // What a killed process of our pid leaves behind: its first regions, here 8 of them.
    // (This test binary opens no other shm endpoint, so ours start at N = 0 too.)
    let (pid, uid) = (std::process::id(), own_uid());
    let stale: Vec<String> = (0..8).map(|n| format!("/dev/shm/{pid}:{uid}:{n}")).collect();
    for path in &stale {
        std::fs::write(path, vec![0u8; 4096]).expect("write a stale region into /dev/shm");
    }
    let a = Engine::builder().provider("shm").build().expect("opens past the stale regions");
    let b = Engine::builder().provider("shm").build().unwrap();
    let (ra, rb) = (a.alloc(1 << 16).await.unwrap(), b.alloc(1 << 16).await.unwrap());
    let pattern: Vec<u8> = (0..1 << 16).map(|i| (i * 13 % 251) as u8).collect();
    ra.write_at(0, &pattern).unwrap();
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let c = b.imm_counter(4);
    tokio::time::timeout(Duration::from_secs(30), a.write_imm(&ra, 0, &to_b, 0, 1 << 16, 4))
        .await
        .expect("answered")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), c.wait_for(1)).await.expect("arrived").unwrap();
    let mut got = vec![0u8; 1 << 16];
    rb.read_at(0, &mut got).unwrap();
    assert!(got == pattern, "the bytes landed");
    drop((a, b));
    for path in &stale {
        let _ = std::fs::remove_file(path); // whatever libfabric did not take over
    }
}

/// Our uid, as the region names spell it (from /proc/self's owner: no unsafe call).
fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
}
