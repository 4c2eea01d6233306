//! The CUDA layer on a real GPU.
//!
//! Without a CUDA driver (CI, laptops) every GPU test prints one line,
//! `skipped: no CUDA driver (<reason>): <test>`, straight to stderr (visible without
//! `--nocapture`) and passes. With `FABRIC_REQUIRE_CUDA=1` a skip is a failure instead: set it
//! where a GPU must be present, so a broken driver setup cannot pass as "skipped".
//!
//! On a GPU machine (no cargo there): build with
//! `cargo test -p fabric-runtime --test cuda --release --no-run`, ship the binary, run
//! `FABRIC_REQUIRE_CUDA=1 ./cuda-<hash> --test-threads 1`.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_runtime::cuda::{
    self, pattern_byte, Context, DeviceBuffer, DeviceMemory, Event, EventStatus, IpcExport, IpcMapping,
    Kernels, MemoryKind, PinnedHostBuffer, Stream, SPIN_RELEASED,
};
use fabric_runtime::Error;

const MIB: usize = 1 << 20;

/// Device 0, or `None` after printing the skip line.
fn gpu(test: &str) -> Option<Arc<Context>> {
    let why = match cuda::available() {
        Ok(0) => "no CUDA device (the driver sees none)".to_string(),
        Ok(_) => match cuda::context(0) {
            Ok(ctx) => return Some(ctx),
            Err(e) => format!("no CUDA device (device 0: {e})"),
        },
        Err(Error::Unsupported(m)) => {
            format!("no CUDA driver ({})", m.strip_prefix("no CUDA driver: ").unwrap_or(&m))
        }
        Err(e) => format!("no CUDA driver ({e})"),
    };
    skip(test, &why);
    None
}

/// The built-in kernels, or `None` after printing the skip line (no NVRTC).
fn kernels(test: &str, ctx: &Arc<Context>) -> Option<Kernels> {
    match Kernels::load(ctx) {
        Ok(k) => Some(k),
        Err(Error::Unsupported(m)) => {
            skip(test, &format!("no NVRTC ({})", m.strip_prefix("no NVRTC: ").unwrap_or(&m)));
            None
        }
        Err(e) => panic!("{test}: compiling the built-in kernels failed: {e}"),
    }
}

fn skip(test: &str, why: &str) {
    if std::env::var_os("FABRIC_REQUIRE_CUDA").is_some_and(|v| v != "0") {
        panic!("{test}: FABRIC_REQUIRE_CUDA is set but: {why}");
    }
    let _ = writeln!(std::io::stderr(), "skipped: {why}: {test}");
}

/// Polls `ev` (never blocking) until it is ready; returns how many polls said NotReady.
fn wait_ready(ev: &Event, limit: Duration) -> u64 {
    let start = Instant::now();
    let mut not_ready = 0;
    loop {
        match ev.query().expect("cuEventQuery") {
            EventStatus::Ready => return not_ready,
            EventStatus::NotReady => not_ready += 1,
        }
        assert!(start.elapsed() < limit, "event not ready after {limit:?}");
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn pattern(len: usize, index0: usize, seed: u32) -> Vec<u8> {
    (0..len).map(|i| pattern_byte((index0 + i) as u64, seed)).collect()
}

/// First differing index, for short failure messages on large buffers.
fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

#[test]
fn types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Context>();
    send_sync::<DeviceBuffer>();
    send_sync::<PinnedHostBuffer>();
    send_sync::<Stream>();
    send_sync::<Event>();
    send_sync::<IpcMapping>();
    send_sync::<Kernels>();
    send_sync::<cuda::Module>();
}

/// Runs everywhere: without a driver every entry point is an `Unsupported` error, not a panic.
#[test]
fn without_a_driver_every_call_is_an_error_not_a_panic() {
    match cuda::available() {
        Err(e) => {
            assert!(matches!(&e, Error::Unsupported(m) if m.starts_with("no CUDA driver")), "{e}");
            assert!(cuda::driver().is_err());
            assert!(matches!(cuda::context(0), Err(Error::Unsupported(_))));
            assert!(matches!(cuda::pointer_info(0x1000), Err(Error::Unsupported(_))));
            assert!(matches!(cuda::ipc_export(0x1000, 1), Err(Error::Unsupported(_))));
            // Asking twice gives the same answer (cached), still without panicking.
            assert!(matches!(cuda::available(), Err(Error::Unsupported(_))));
            let _ = writeln!(std::io::stderr(), "no CUDA driver here, as expected off a GPU machine: {e}");
        }
        Ok(n) => {
            let d = cuda::driver().unwrap();
            assert_eq!(d.device_count(), n);
            assert!(matches!(cuda::context(n), Err(Error::Unsupported(_))), "ordinal past the end");
        }
    }
}

#[test]
fn device_info() {
    let Some(ctx) = gpu("device_info") else { return };
    let d = cuda::driver().unwrap();
    let nvrtc = cuda::nvrtc_version().map(|(a, b)| format!("{a}.{b}")).unwrap_or_else(|e| e.to_string());
    println!(
        "driver CUDA {:?}, {} device(s); device 0: {} sm_{}{} {} GiB, pci {}, dma-buf {:?}; NVRTC {nvrtc}",
        d.version(),
        d.device_count(),
        ctx.name(),
        ctx.compute_capability().0,
        ctx.compute_capability().1,
        ctx.total_memory().unwrap() >> 30,
        ctx.pci_bus_id().unwrap(),
        ctx.dmabuf_supported(),
    );
    assert!(Arc::ptr_eq(&ctx, &cuda::context(0).unwrap()), "one shared primary context per device");
}

#[test]
fn h2d_d2h_round_trip() {
    let Some(ctx) = gpu("h2d_d2h_round_trip") else { return };
    let stream = Stream::new(&ctx).unwrap();
    for (i, len) in [1, 4096 + 3, MIB, 64 * MIB].into_iter().enumerate() {
        let want = pattern(len, 0, i as u32 + 1);
        let mut src = PinnedHostBuffer::new(&ctx, len).unwrap();
        src.as_mut_slice().copy_from_slice(&want);
        let src = Arc::new(src);
        let dev = Arc::new(DeviceBuffer::new(&ctx, len).unwrap());
        let mut dst = Arc::new(PinnedHostBuffer::new(&ctx, len).unwrap());

        let start = Instant::now();
        stream.copy_h2d(&dev, 0, &src, 0, len).unwrap();
        stream.copy_d2h(&dst, 0, &dev, 0, len).unwrap();
        let done = stream.record().unwrap();
        wait_ready(&done, Duration::from_secs(30));
        let took = start.elapsed();
        assert!(stream.in_flight() > 0, "buffers still held until reaped");
        assert_eq!(stream.reap().unwrap(), 0, "everything completed, everything released");
        let got = Arc::get_mut(&mut dst).expect("no copy holds the buffer any more").as_slice();
        assert_eq!(first_diff(got, &want), None, "{len} bytes");

        // The blocking helpers agree, on a sub-range.
        let mut back = vec![0u8; len.min(4096)];
        let off = len - back.len();
        dev.copy_to_host(off, &mut back).unwrap();
        assert_eq!(back, want[off..]);
        if len == 64 * MIB {
            println!(
                "h2d + d2h of 64 MiB: {took:?} ({:.1} GB/s each way, averaged)",
                2.0 * len as f64 / took.as_secs_f64() / 1e9
            );
        }
    }
    // Out-of-range copies are refused before anything is queued.
    let small = Arc::new(DeviceBuffer::new(&ctx, 16).unwrap());
    let host = Arc::new(PinnedHostBuffer::new(&ctx, 64).unwrap());
    assert!(matches!(stream.copy_h2d(&small, 8, &host, 0, 16), Err(Error::OutOfBounds { .. })));
    assert!(matches!(stream.copy_d2h(&host, 60, &small, 0, 8), Err(Error::OutOfBounds { .. })));
}

#[test]
fn d2d_and_peer_copies() {
    let Some(ctx) = gpu("d2d_and_peer_copies") else { return };
    let len = 16 * MIB;
    let want = pattern(len, 0, 9);
    let a = Arc::new(DeviceBuffer::new(&ctx, len).unwrap());
    let b = Arc::new(DeviceBuffer::new(&ctx, len).unwrap());
    a.copy_from_host(0, &want).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    // A sub-range to an offset, then the rest: exercises both offsets.
    stream.copy_d2d(&b, 4096, &a, 4096, len - 4096).unwrap();
    stream.copy_d2d(&b, 0, &a, 0, 4096).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(stream.in_flight(), 0);
    let mut got = vec![0u8; len];
    b.copy_to_host(0, &mut got).unwrap();
    assert_eq!(first_diff(&got, &want), None);

    if cuda::available().unwrap() < 2 {
        println!("peer copy: only one device here, not exercised");
        return;
    }
    let ctx1 = cuda::context(1).unwrap();
    println!("peer access 0 -> 1: {:?}", ctx.can_access_peer(&ctx1));
    let c = Arc::new(DeviceBuffer::new(&ctx1, len).unwrap());
    stream.copy_d2d(&c, 0, &a, 0, len).unwrap();
    stream.synchronize().unwrap();
    let mut got = vec![0u8; len];
    c.copy_to_host(0, &mut got).unwrap();
    assert_eq!(first_diff(&got, &want), None, "peer copy");
}

#[test]
fn kernel_writes_device_and_mapped_pinned_memory() {
    let test = "kernel_writes_device_and_mapped_pinned_memory";
    let Some(ctx) = gpu(test) else { return };
    let Some(k) = kernels(test, &ctx) else { return };
    let stream = Stream::new(&ctx).unwrap();

    // Device memory, a sub-range: the rest stays zero.
    let len = 8 * MIB;
    let dev = Arc::new(DeviceBuffer::new(&ctx, len).unwrap());
    k.fill(&stream, &dev, MIB, 2 * MIB, 3).unwrap();
    stream.synchronize().unwrap();
    let mut got = vec![0u8; len];
    dev.copy_to_host(0, &mut got).unwrap();
    assert!(got[..MIB].iter().all(|&b| b == 0));
    assert_eq!(first_diff(&got[MIB..3 * MIB], &pattern(2 * MIB, MIB, 3)), None);
    assert!(got[3 * MIB..].iter().all(|&b| b == 0));

    // Pinned host memory, written by the kernel through the mapped view.
    let mut host = Arc::new(PinnedHostBuffer::new(&ctx, MIB).unwrap());
    k.fill_mapped(&stream, &host, 4096, 64 * 1024, 11).unwrap();
    let done = stream.record().unwrap();
    wait_ready(&done, Duration::from_secs(10));
    stream.reap().unwrap();
    let bytes = Arc::get_mut(&mut host).expect("released after completion").as_slice();
    assert!(bytes[..4096].iter().all(|&b| b == 0));
    assert_eq!(first_diff(&bytes[4096..4096 + 65536], &pattern(65536, 4096, 11)), None);
    assert!(bytes[4096 + 65536..].iter().all(|&b| b == 0));
}

#[test]
fn kernel_spins_on_a_host_counter_until_released() {
    let test = "kernel_spins_on_a_host_counter_until_released";
    let Some(ctx) = gpu(test) else { return };
    let Some(k) = kernels(test, &ctx) else { return };
    let stream = Stream::new(&ctx).unwrap();
    let counter = Arc::new(PinnedHostBuffer::new(&ctx, 4096).unwrap());
    let out = Arc::new(PinnedHostBuffer::new(&ctx, 4096).unwrap());
    let target = 5;
    k.spin_until(&stream, (&counter, 3), target, (&out, 0), Duration::from_secs(20)).unwrap();
    let done = stream.record().unwrap();

    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(done.query().unwrap(), EventStatus::NotReady, "the kernel waits for the counter");
    assert_eq!(out.atomic_u64s()[0].load(Ordering::Acquire), 0);
    for v in 1..target {
        counter.atomic_u64s()[3].store(v, Ordering::Release);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(done.query().unwrap(), EventStatus::NotReady, "{} < {target}: still waiting", target - 1);
    let released = Instant::now();
    counter.atomic_u64s()[3].store(target, Ordering::Release);
    // The host sees the kernel's answer in the mapped words, without any copy.
    while out.atomic_u64s()[0].load(Ordering::Acquire) == 0 {
        assert!(released.elapsed() < Duration::from_secs(25), "kernel did not answer");
        std::hint::spin_loop();
    }
    let seen_after = released.elapsed();
    wait_ready(&done, Duration::from_secs(25));
    let words = out.atomic_u64s();
    let (status, seen, spun_ns) = (
        words[0].load(Ordering::Acquire),
        words[1].load(Ordering::Acquire),
        words[2].load(Ordering::Acquire),
    );
    assert_eq!(status, SPIN_RELEASED, "released, not timed out (seen {seen})");
    assert_eq!(seen, target);
    println!(
        "spin kernel: released {seen_after:?} after the host's store; spun {:.1} ms",
        spun_ns as f64 / 1e6
    );
}

#[test]
fn stream_waits_on_a_host_word_and_writes_one() {
    let test = "stream_waits_on_a_host_word_and_writes_one";
    let Some(ctx) = gpu(test) else { return };
    if !cuda::stream_memops_supported() {
        return skip(test, "this driver has no cuStreamWaitValue32_v2 (CUDA 11.7 or later)");
    }
    let words = Arc::new(PinnedHostBuffer::new(&ctx, 4096).unwrap());
    let (gate, mark) = (words.device_ptr() + 64, words.device_ptr() + 128);
    let (gate_word, mark_word) = (&words.atomic_u32s()[16], &words.atomic_u32s()[32]);
    gate_word.store(u32::MAX, Ordering::Release);
    /// Opens the wait when dropped, before the stream (declared after it): a failed assertion
    /// cannot leave the stream's drop waiting forever.
    struct Open<'a>(&'a std::sync::atomic::AtomicU32);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.store(1, Ordering::Release);
        }
    }
    let stream = Stream::new(&ctx).unwrap();
    let _open = Open(gate_word);
    // SAFETY: both words are inside `words`, which outlives the stream (declared before it:
    // dropped after the stream's drop waited for its work); the host opens the wait below.
    unsafe {
        stream.write_value32_raw(gate, 0).unwrap();
        stream.wait_value32_raw(gate, 1, cuda::WaitValue::Geq).unwrap();
        stream.write_value32_raw(mark, 7).unwrap();
    }
    let done = stream.record().unwrap();
    let start = Instant::now();
    while gate_word.load(Ordering::Acquire) != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "the stream's write of 0 never landed");
        std::hint::spin_loop();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(done.query().unwrap(), EventStatus::NotReady, "the stream waits for the word");
    assert_eq!(mark_word.load(Ordering::Acquire), 0, "nothing after the wait ran");
    let opened = Instant::now();
    gate_word.store(1, Ordering::Release);
    wait_ready(&done, Duration::from_secs(10));
    assert_eq!(mark_word.load(Ordering::Acquire), 7);
    println!("stream wait: released {:?} after the host's store", opened.elapsed());

    // The same three operations captured in a graph and replayed: the values are constants.
    mark_word.store(0, Ordering::Release);
    gate_word.store(u32::MAX, Ordering::Release);
    stream.begin_capture().unwrap();
    // SAFETY: as above; the graph is replayed only while `words` lives.
    unsafe {
        stream.write_value32_raw(gate, 0).unwrap();
        stream.wait_value32_raw(gate, 1, cuda::WaitValue::Geq).unwrap();
        stream.write_value32_raw(mark, 9).unwrap();
    }
    let graph = stream.end_capture().expect("capturing stream memory operations");
    for _ in 0..3 {
        // SAFETY: the captured addresses are inside `words`, alive until the end.
        unsafe { graph.launch(&stream).unwrap() };
        let done = stream.record().unwrap();
        let start = Instant::now();
        while gate_word.load(Ordering::Acquire) != 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "the replay's write of 0 never landed");
            std::hint::spin_loop();
        }
        assert_eq!(done.query().unwrap(), EventStatus::NotReady, "the replay waits for the word");
        gate_word.store(1, Ordering::Release);
        wait_ready(&done, Duration::from_secs(10));
        assert_eq!(mark_word.swap(0, Ordering::AcqRel), 9);
        gate_word.store(u32::MAX, Ordering::Release);
    }
    stream.synchronize().unwrap();
}

/// What fabric-moe's receive gates rely on: a stream write into pinned memory is visible to
/// the host before anything a later kernel of the stream writes there (the host, having
/// seen the kernel's word, never reads the word from before the stream's write).
#[test]
fn stream_write_is_seen_before_a_later_kernels_write() {
    let test = "stream_write_is_seen_before_a_later_kernels_write";
    let Some(ctx) = gpu(test) else { return };
    let Some(k) = kernels(test, &ctx) else { return };
    if !cuda::stream_memops_supported() {
        return skip(test, "this driver has no cuStreamWriteValue32_v2 (CUDA 11.7 or later)");
    }
    let words = Arc::new(PinnedHostBuffer::new(&ctx, 4096).unwrap());
    let stream = Stream::new(&ctx).unwrap();
    let gate = &words.atomic_u32s()[16];
    let bell_at = 256;
    for seed in 1..=200u32 {
        gate.store(1, Ordering::Release);
        // SAFETY: the word is inside `words`, which outlives the stream (declared before it).
        unsafe { stream.write_value32_raw(words.device_ptr() + 64, 0).unwrap() };
        k.fill_mapped(&stream, &words, bell_at, 8, seed).unwrap();
        let want = u64::from_le_bytes(std::array::from_fn(|i| pattern_byte((bell_at + i) as u64, seed)));
        let start = Instant::now();
        while words.atomic_u64s()[bell_at / 8].load(Ordering::Acquire) != want {
            assert!(start.elapsed() < Duration::from_secs(10), "the kernel's word never landed");
            std::hint::spin_loop();
        }
        assert_eq!(gate.load(Ordering::Acquire), 0, "step {seed}: the kernel's word came first");
        stream.synchronize().unwrap();
    }
}

#[test]
fn event_query_is_not_ready_then_ready_around_a_long_kernel() {
    let test = "event_query_is_not_ready_then_ready_around_a_long_kernel";
    let Some(ctx) = gpu(test) else { return };
    let Some(k) = kernels(test, &ctx) else { return };
    let stream = Stream::new(&ctx).unwrap();
    let fresh = Event::new(&ctx).unwrap();
    assert_eq!(fresh.query().unwrap(), EventStatus::Ready, "a never recorded event is ready");

    let start = Instant::now();
    k.sleep(&stream, Duration::from_millis(300)).unwrap();
    let done = stream.record().unwrap();
    assert_eq!(done.query().unwrap(), EventStatus::NotReady);
    let polls = wait_ready(&done, Duration::from_secs(10));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(250),
        "ready after {took:?}, before the kernel could have finished"
    );
    assert!(polls > 0);
    println!("event: NotReady for {polls} polls, Ready after {took:?}");

    // Another stream can wait for the event on the GPU.
    let other = Stream::new(&ctx).unwrap();
    k.sleep(&stream, Duration::from_millis(100)).unwrap();
    let first = stream.record().unwrap();
    other.wait(&first).unwrap();
    let second = other.record().unwrap();
    assert_eq!(second.query().unwrap(), EventStatus::NotReady, "waits for the first stream");
    wait_ready(&second, Duration::from_secs(10));
    assert_eq!(first.query().unwrap(), EventStatus::Ready);
}

#[test]
fn pointer_info_of_device_host_and_garbage_addresses() {
    let Some(ctx) = gpu("pointer_info_of_device_host_and_garbage_addresses") else { return };
    let dev = DeviceBuffer::new(&ctx, 3 * MIB).unwrap();
    let info = cuda::pointer_info(dev.device_ptr() + 12345).unwrap();
    println!("device: {info:?}");
    assert_eq!(info.kind, MemoryKind::Device);
    assert_eq!(info.ordinal, Some(0));
    let range = info.allocation.expect("device allocations have a range");
    assert_eq!(range.base, dev.device_ptr());
    assert!(range.len >= 3 * MIB);
    assert_eq!(ctx.address_range(dev.device_ptr() + 3 * MIB as u64 - 1).unwrap(), range);

    let pinned = PinnedHostBuffer::new(&ctx, MIB).unwrap();
    let info = cuda::pointer_info(pinned.as_ptr() as u64 + 100).unwrap();
    println!("pinned host: {info:?}");
    assert_eq!(info.kind, MemoryKind::Host);

    let pageable = vec![0u8; 4096];
    let info = cuda::pointer_info(pageable.as_ptr() as u64).unwrap();
    println!("pageable host: {info:?}");
    assert_ne!(info.kind, MemoryKind::Device);

    for garbage in [0u64, 8, 0xdead_beef_0000, u64::MAX - 7] {
        let info = cuda::pointer_info(garbage).unwrap();
        println!("{garbage:#x}: {info:?}");
        assert_ne!(info.kind, MemoryKind::Device, "{garbage:#x}");
    }
    // Only device memory can be exported.
    assert!(cuda::ipc_export(pageable.as_ptr() as u64, 16).is_err());
    assert!(matches!(
        cuda::ipc_export(dev.device_ptr() + 3 * MIB as u64 - 8, 16),
        Err(Error::OutOfBounds { .. })
    ));
}

#[test]
fn dmabuf_export_where_supported() {
    let Some(ctx) = gpu("dmabuf_export_where_supported") else { return };
    let dev = DeviceBuffer::new(&ctx, 4 * MIB).unwrap();
    match (ctx.dmabuf_supported(), dev.dmabuf_fd(0, 2 * MIB)) {
        (Ok(true), Ok(fd)) => {
            let shown = format!("{fd:?}");
            let meta = std::fs::File::from(fd).metadata().expect("the exported fd is open");
            println!("dma-buf: exported {shown}, {} bytes", meta.len());
        }
        (Ok(true), Err(e)) => panic!("the device says dma-buf is supported, but: {e}"),
        (supported, r) => println!("dma-buf: not supported here ({supported:?}, {:?})", r.err()),
    }
}

const IPC_CHILD_ENV: &str = "FABRIC_CUDA_IPC_CHILD";
const IPC_SEED: u32 = 77;

/// Parent: allocates 8 MiB, exports the 2 MiB at offset 1 MiB *by address* (as a user's
/// tensor would be), runs this test binary again as the child, and checks that exactly that
/// range holds the child's pattern. Child: opens the export and writes the pattern with a
/// stream copy from pinned memory into the mapping.
#[test]
fn cuda_ipc_between_two_processes() {
    if let Ok(hex) = std::env::var(IPC_CHILD_ENV) {
        return ipc_child(&hex);
    }
    let Some(ctx) = gpu("cuda_ipc_between_two_processes") else { return };
    let len = 8 * MIB;
    let dev = DeviceBuffer::new(&ctx, len).unwrap();
    let export = cuda::ipc_export(dev.device_ptr() + MIB as u64, 2 * MIB).unwrap();
    assert_eq!((export.offset, export.len), (MIB as u64, 2 * MIB as u64));
    assert_eq!(export, dev.ipc_export(MIB, 2 * MIB).unwrap());
    let wire = export.to_bytes();
    assert_eq!(IpcExport::from_bytes(&wire).unwrap(), export);
    let hex: String = wire.iter().map(|b| format!("{b:02x}")).collect();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "cuda_ipc_between_two_processes", "--nocapture", "--test-threads", "1"])
        .env(IPC_CHILD_ENV, hex)
        .stdin(Stdio::null())
        .spawn()
        .expect("re-run this test binary as the child");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("IPC child still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "IPC child failed: {status}");

    let mut got = vec![0u8; len];
    dev.copy_to_host(0, &mut got).unwrap();
    assert!(got[..MIB].iter().all(|&b| b == 0), "before the exported range");
    assert_eq!(first_diff(&got[MIB..3 * MIB], &pattern(2 * MIB, 0, IPC_SEED)), None, "the exported range");
    assert!(got[3 * MIB..].iter().all(|&b| b == 0), "after the exported range");
    println!(
        "CUDA IPC: child wrote 2 MiB into the parent's allocation at offset 1 MiB in {:?}",
        start.elapsed()
    );
}

fn ipc_child(hex: &str) {
    let wire: Vec<u8> =
        (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
    let export = IpcExport::from_bytes(&wire).unwrap();
    let ctx = cuda::context(0).expect("the IPC child needs the GPU its parent used");
    let mapping = Arc::new(IpcMapping::open(&ctx, &export).expect("cuIpcOpenMemHandle"));
    println!("IPC child: {mapping:?}");
    assert_eq!(mapping.len(), 2 * MIB);
    let mut src = PinnedHostBuffer::new(&ctx, mapping.len()).unwrap();
    src.as_mut_slice().copy_from_slice(&pattern(mapping.len(), 0, IPC_SEED));
    let src = Arc::new(src);
    let stream = Stream::new(&ctx).unwrap();
    stream.copy_h2d(&mapping, 0, &src, 0, mapping.len()).unwrap();
    stream.synchronize().unwrap();
    // Out of the exported range is refused, even though the allocation is larger.
    assert!(matches!(stream.copy_h2d(&mapping, 1, &src, 0, mapping.len()), Err(Error::OutOfBounds { .. })));
}
