//! Host regions of 2 MiB and more use transparent huge pages (`EngineBuilder::huge_pages`, on
//! by default): `alloc` and `register` give memory aligned to 2 MiB whose mapping carries the
//! kernel's `hg` flag (`madvise(MADV_HUGEPAGE)`, shown in /proc/self/smaps), and real writes
//! through libfabric (tcp and shm on loopback, or `FABRIC_TEST_PROVIDERS`) land byte for byte
//! in it. Off, or under 2 MiB, the memory is ordinary. Where the kernel has no THP at all the
//! flag cannot be set: those checks are skipped with a line saying so, the transfers are not.

use std::time::Duration;

use fabric_async::{Engine, MemoryRegion};
use integration_tests::{fill_pattern, pattern_byte, providers, skipped};

const WAIT: Duration = Duration::from_secs(30);
const HUGE: u64 = 2 << 20;
const IMM: u32 = 11;
/// Over two huge pages, not a multiple of one: the tail is in small pages.
const LEN: usize = (4 << 20) + 3 * 4096;

/// The kernel was built with transparent huge pages (the advice is refused otherwise).
fn thp_in_kernel() -> bool {
    std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists()
}

/// The `VmFlags` and `AnonHugePages` (kB) of the mapping of this process that holds `addr`.
fn mapping_of(addr: u64) -> (Vec<String>, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
    let mut inside = false;
    let mut huge_kb = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                inside = (a..b).contains(&addr);
                continue;
            }
        }
        if !inside {
            continue;
        }
        if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            huge_kb = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
        }
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            return (flags.split_whitespace().map(String::from).collect(), huge_kb);
        }
    }
    panic!("no mapping of this process holds {addr:#x}");
}

fn advised(r: &MemoryRegion) -> bool {
    mapping_of(r.as_ptr() as u64).0.iter().any(|f| f == "hg")
}

/// `LEN` bytes from a region `w` registered to one `r` allocated, as 4 writes with one imm
/// each; checks every byte arrived. Returns both regions.
async fn write_across(w: &Engine, r: &Engine) -> (MemoryRegion, MemoryRegion) {
    let dst = r.alloc(LEN).await.expect("alloc");
    let remote = w.remote_region(&dst.descriptor().to_bytes()).await.expect("remote region");
    let mut data = vec![0u8; LEN];
    fill_pattern(&mut data, 7, 0);
    let src = w.register_copy(data).await.expect("register");
    let part = (LEN / 4) as u64;
    let len = |i: u64| if i == 3 { LEN as u64 - 3 * part } else { part };
    let arrivals: u64 = (0..4).map(|i| w.write_arrivals(&remote, len(i)).expect("arrivals")).sum();
    let writes = (0..4u64).map(|i| w.write_imm(&src, i * part, &remote, i * part, len(i), IMM));
    tokio::time::timeout(WAIT, futures::future::try_join_all(writes))
        .await
        .expect("writes in time")
        .expect("writes");
    tokio::time::timeout(WAIT, r.imm_counter(IMM).wait_for(arrivals))
        .await
        .expect("arrivals in time")
        .expect("arrivals");
    let got = dst.to_vec();
    assert_eq!(got.len(), LEN);
    if let Some(i) = (0..LEN).find(|&i| got[i] != pattern_byte(7, i as u64)) {
        panic!("byte {i} of {LEN}: {} instead of {}", got[i], pattern_byte(7, i as u64));
    }
    (src, dst)
}

#[tokio::test]
async fn regions_from_two_mib_up_are_aligned_and_advised_to_use_huge_pages_by_default() {
    if std::env::var("FABRIC_HUGE_PAGES")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"))
    {
        skipped("huge_pages", "FABRIC_HUGE_PAGES turns the default off in this environment");
        return;
    }
    for p in providers() {
        let w = Engine::builder().provider(&p).build().expect("writer");
        let r = Engine::builder().provider(&p).build().expect("receiver");
        let (src, dst) = write_across(&w, &r).await;
        for (what, region) in [("registered", &src), ("allocated", &dst)] {
            assert_eq!(region.as_ptr() as u64 % HUGE, 0, "{p}: {what} region at {:p}", region.as_ptr());
            if thp_in_kernel() {
                assert!(
                    advised(region),
                    "{p}: {what} region has no hg flag: {:?}",
                    mapping_of(region.as_ptr() as u64)
                );
            }
        }
        if !thp_in_kernel() {
            skipped("huge_pages", "this kernel has no transparent huge pages: the hg flag is not checked");
        }
        // What the kernel gave (not asserted: a free huge page at first touch is its call).
        eprintln!("{p}: AnonHugePages of the allocated region: {} kB", mapping_of(dst.as_ptr() as u64).1);
        // Under 2 MiB: ordinary memory.
        let small = r.alloc((2 << 20) - 4096).await.expect("alloc small");
        assert!(!advised(&small), "{p}: a region under 2 MiB was advised");
        w.shutdown();
        r.shutdown();
    }
}

#[tokio::test]
async fn huge_pages_off_gives_ordinary_memory_that_carries_the_same_bytes() {
    for p in providers() {
        let w = Engine::builder().provider(&p).huge_pages(false).build().expect("writer");
        let r = Engine::builder().provider(&p).huge_pages(false).build().expect("receiver");
        let (src, dst) = write_across(&w, &r).await;
        for (what, region) in [("registered", &src), ("allocated", &dst)] {
            assert!(!advised(region), "{p}: {what} region advised with huge_pages(false)");
        }
        w.shutdown();
        r.shutdown();
    }
}
