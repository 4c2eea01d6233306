//! Signals between CUDA work and the engine, on a real GPU and real libfabric (tcp, two
//! engines of this process on loopback): a kernel that spins on a `GpuCounter` until the
//! peer's writes have arrived, and writes that start when a CUDA event completes
//! (`Engine::after`), with nobody synchronizing a stream. Without a GPU each test prints one
//! `skipped:` line and passes; `FABRIC_REQUIRE_CUDA=1` makes that a failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_runtime::cuda::{self, DeviceBuffer, EventStatus, Kernels, PinnedHostBuffer, Stream};
use fabric_runtime::{Engine, MemoryLocation, MemoryRegion, RemoteRegion};

/// Whether a GPU is here; prints the skip line if not.
fn gpu(test: &str) -> bool {
    let why = match cuda::available() {
        Ok(n) if n > 0 => return true,
        Ok(_) => "no CUDA device (the driver sees none)".to_string(),
        Err(e) => format!("no CUDA driver ({e})"),
    };
    if std::env::var("FABRIC_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
        panic!("{test}: FABRIC_REQUIRE_CUDA=1 but {why}");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skipped: {why}: {test}");
    false
}

/// Two tcp engines on loopback; `b`'s region of `len` bytes in `loc`, as `a` sees it.
async fn pair(len: usize, loc: MemoryLocation) -> (Engine, Engine, MemoryRegion, RemoteRegion) {
    let a = Engine::builder().provider("tcp").build().unwrap();
    let b = Engine::builder().provider("tcp").build().unwrap();
    let region = b.alloc_in(len, loc).await.unwrap();
    let remote = a.remote_region(&region.descriptor().to_bytes()).await.unwrap();
    (a, b, region, remote)
}

/// Polls `ev` until it is ready or `limit` passes.
fn wait_event(ev: &cuda::Event, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if ev.query().unwrap() == EventStatus::Ready {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

/// A kernel waits on the GPU-visible total of an immediate: still spinning after 4 of 5
/// arrivals, released by the 5th, with no CPU in between (the reactor writes the word).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_spins_on_a_gpu_counter_until_the_writes_arrive() {
    if !gpu("kernel_spins_on_a_gpu_counter_until_the_writes_arrive") {
        return;
    }
    let (a, b, _region, remote) = pair(4096, MemoryLocation::Host).await;
    let ctx = cuda::context(0).unwrap();
    let gc = b.gpu_counter(7, 0).unwrap();
    assert_eq!(gc.total(), 0);
    let kernels = Kernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let out = Arc::new(PinnedHostBuffer::new(&ctx, 64).unwrap());
    kernels.spin_until(&stream, (gc.buffer(), 0), 5, (&out, 0), Duration::from_secs(20)).unwrap();
    let done = stream.record().unwrap();
    for _ in 0..4 {
        a.imm(&remote, 7).await.unwrap();
    }
    // The 4th arrival is in the word once the host counter has it.
    let t = Instant::now();
    while gc.counter().available() < 4 && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(gc.total(), 4, "the GPU word follows the arrivals");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(done.query().unwrap(), EventStatus::NotReady, "4 of 5: the kernel still spins");
    a.imm(&remote, 7).await.unwrap();
    assert!(wait_event(&done, Duration::from_secs(10)), "the 5th arrival releases the kernel");
    assert_eq!(out.atomic_u64s()[0].load(std::sync::atomic::Ordering::Acquire), cuda::SPIN_RELEASED);
    assert_eq!(gc.total(), 5);
    // Consuming on the host does not move the GPU's total; a second handle shares the word.
    gc.counter().wait_for(5).await.unwrap();
    assert_eq!(gc.counter().available(), 0);
    let again = b.gpu_counter(7, 0).unwrap();
    assert_eq!((again.total(), again.device_ptr()), (5, gc.device_ptr()));
    println!("gpu counter: kernel released after the 5th arrival; device ptr {:#x}", gc.device_ptr());
}

/// `after(&event).write_imm(..)`: the write waits for the kernel that fills its source (a
/// 200 ms sleep, then the fill) without anybody synchronizing the stream, into host memory
/// and into (staged) GPU memory; every byte is the kernel's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_after_a_cuda_event_waits_for_the_kernel() {
    if !gpu("write_after_a_cuda_event_waits_for_the_kernel") {
        return;
    }
    let len = 1 << 20;
    for dst_loc in [MemoryLocation::Host, MemoryLocation::Cuda { ordinal: 0 }] {
        let (a, b, region, remote) = pair(len, dst_loc).await;
        let ctx = cuda::context(0).unwrap();
        let buf = Arc::new(DeviceBuffer::new(&ctx, len).unwrap());
        // SAFETY: `buf` outlives the region (both live until the end of this iteration, the
        // region dropped first).
        let src = unsafe { a.register_cuda(buf.device_ptr(), len, 0).await.unwrap() };
        let kernels = Kernels::load(&ctx).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        kernels.sleep(&stream, Duration::from_millis(200)).unwrap();
        kernels.fill(&stream, &buf, 0, len, 0xabc).unwrap();
        let ev = Arc::new(stream.record().unwrap());
        let counter = b.imm_counter(9);
        let t = Instant::now();
        let write = a.after(&ev).write_imm(&src, 0, &remote, 0, len as u64, 9);
        tokio::time::sleep(Duration::from_millis(50)).await;
        if t.elapsed() < Duration::from_millis(150) {
            assert_eq!(counter.available(), 0, "{dst_loc}: nothing lands while the kernel sleeps");
            assert_eq!(ev.query().unwrap(), EventStatus::NotReady);
        }
        write.await.unwrap();
        counter.wait_for(1).await.unwrap();
        assert!(t.elapsed() >= Duration::from_millis(190), "{dst_loc}: the write waited for the event");
        let got = region.to_vec();
        let bad = (0..len).find(|&i| got[i] != cuda::pattern_byte(i as u64, 0xabc));
        assert_eq!(bad, None, "{dst_loc}: the bytes are the kernel's fill");
        println!("after(event): {dst_loc} destination: {len} bytes written {:?} after the call", t.elapsed());
        drop(src);
        drop(region);
    }
}

/// An event whose work is already done (recorded on an idle stream) lets the write go at
/// once, through the same gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_after_a_completed_event_goes_at_once() {
    if !gpu("write_after_a_completed_event_goes_at_once") {
        return;
    }
    let (a, b, region, remote) = pair(4096, MemoryLocation::Host).await;
    let src = a.alloc(4096).await.unwrap();
    src.write_at(0, &[0x42; 4096]).unwrap();
    let ctx = cuda::context(0).unwrap();
    let ev = Arc::new(Stream::new(&ctx).unwrap().record().unwrap());
    a.after(&ev).write_imm(&src, 0, &remote, 0, 4096, 3).await.unwrap();
    b.imm_counter(3).wait_for(1).await.unwrap();
    assert_eq!(region.to_vec(), vec![0x42; 4096]);
}
