//! `EngineBuilder::libfabric_hmem(true)` on host memory: asking the provider for `FI_HMEM`
//! changes nothing a host-memory user relies on (bytes, counts, errors), whether the provider
//! grants it (Debian's 1.17 `shm` does) or refuses it (`tcp;ofi_rxm`: the engine opens
//! without it). GPU regions registered this way run on the GPU machines
//! (`scripts/gpu-hmem-run.sh`, docs/gpu.md "GPUDirect through libfabric").

use std::time::Duration;

use fabric_async::{Engine, MemoryLocation};
use integration_tests::{fill_pattern, hash, providers};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_for_hmem_keeps_host_transfers_exact() {
    for p in providers() {
        if p == "verbs" {
            continue; // a libfabric option
        }
        let a = Engine::builder().provider(p.as_str()).libfabric_hmem(true).build().expect("engine a");
        let b = Engine::builder().provider(p.as_str()).libfabric_hmem(true).build().expect("engine b");
        let len = (4 << 20) + 13;
        let mut data = vec![0u8; len];
        fill_pattern(&mut data, 0x4e3, 0);
        let src = a.register_copy(data.clone()).await.unwrap();
        let dst = b.alloc(len).await.unwrap();
        let remote = a.remote_region(&dst.descriptor().to_bytes()).await.unwrap();
        let imm = 0x4e3;
        let arrivals = a.write_arrivals(&remote, len as u64).unwrap();
        for round in 0..3 {
            tokio::time::timeout(Duration::from_secs(30), a.write_imm(&src, 0, &remote, 0, len as u64, imm))
                .await
                .expect("no completion in 30 s")
                .unwrap_or_else(|e| panic!("{p}: round {round}: {e}"));
            let c = b.imm_counter(imm);
            assert!(
                tokio::time::timeout(Duration::from_secs(30), c.wait_for(arrivals)).await.is_ok(),
                "{p}: round {round}: arrivals"
            );
            assert_eq!(hash(&dst.to_vec()), hash(&data), "{p}: round {round}: bytes");
        }
        // Bad input is still refused before anything is posted.
        assert!(a.write(&src, 0, &remote, len as u64, 1).await.is_err(), "{p}: out of bounds");
        // GPU memory without a GPU stays a clear error, not a registration attempt.
        if fabric_async::cuda::available().map_or(true, |n| n == 0) {
            let r = a.alloc_in(4096, MemoryLocation::Cuda { ordinal: 0 }).await;
            assert!(r.is_err(), "{p}: alloc_in(Cuda) without a GPU");
        }
        eprintln!("{p}: 3 rounds of {len} B verified with FI_HMEM asked");
    }
}
