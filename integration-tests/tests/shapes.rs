//! The transfer shapes over engines of 1, 2 and 4 NICs: sharded single writes, paged writes,
//! scatter, barrier and RDMA READ, with bytes and arrival counts verified, and the
//! arrival-count function checked against what really arrives over random requests.
//!
//! The engines live in this one process (each NIC of each engine is its own libfabric
//! endpoint, or verbs device context, with its own connections), so shards of one transfer
//! travel different connections and complete in whatever order the transport gives. On
//! libfabric the N NICs are N domains on loopback (`EngineBuilder::domains`); on verbs (the
//! rxe VM, `FABRIC_TEST_PROVIDERS=verbs`) they are the devices in `RXE_VM_DEVICES`.

use std::time::Duration;

use fabric_async::{Arrivals, Engine, Error, PageLayout, RemoteRegion, Route, ScatterEntry, TransferOpts};
use integration_tests::{fill_pattern, nic_engine, pattern_byte, primary};

const WAIT: Duration = Duration::from_secs(30);
/// How long to watch a counter after the expected arrivals, to see that no extra one comes.
const SETTLE: Duration = Duration::from_millis(150);

/// An engine of `nics` NICs on the primary provider ([`nic_engine`]).
fn engine(nics: usize) -> Option<Engine> {
    nic_engine(nics)
}

/// Two connected engines of `nics` NICs each: the sender and the target.
fn pair(nics: usize) -> Option<(Engine, Engine)> {
    Some((engine(nics)?, engine(nics)?))
}

async fn patterned(e: &Engine, len: usize, seed: u64) -> fabric_async::MemoryRegion {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, seed, 0);
    e.register_copy(v).await.expect("register")
}

async fn remote(from: &Engine, region: &fabric_async::MemoryRegion) -> RemoteRegion {
    from.remote_region(&region.descriptor().to_bytes()).await.expect("remote region")
}

/// Waits for exactly `n` arrivals of `imm` at `e`: all of them within [`WAIT`], and no
/// other within [`SETTLE`] after.
async fn expect_arrivals(e: &Engine, imm: u32, n: u64, what: &str) {
    let c = e.imm_counter(imm);
    let got = tokio::time::timeout(WAIT, c.wait_for(n)).await;
    assert!(matches!(got, Ok(Ok(()))), "{what}: {n} arrivals of imm {imm} did not come ({got:?})");
    tokio::time::sleep(SETTLE).await;
    assert_eq!(c.available(), 0, "{what}: arrivals beyond the {n} the arrival function promised");
}

fn nic_counts() -> [usize; 3] {
    [1, 2, 4]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_write_imm_bytes_and_arrivals() {
    for nics in nic_counts() {
        let Some((a, b)) = pair(nics) else { continue };
        assert_eq!(a.nics(), nics);
        let len = (3 << 20) + 4099;
        let src = patterned(&a, len, 11).await;
        let dst = b.alloc(len + 8192).await.unwrap();
        let rdst = remote(&a, &dst).await;
        for (k, opts) in [
            TransferOpts::sharded(256 << 10),
            TransferOpts::sharded(256 << 10).one_arrival(),
            TransferOpts::pinned(nics - 1),
            TransferOpts::sharded(4096),
        ]
        .into_iter()
        .enumerate()
        {
            let imm = 1000 + (nics * 10 + k) as u32;
            let t = a.with(opts);
            let expected = t.write_arrivals(&rdst, len as u64).unwrap();
            match (nics, opts.route, opts.arrivals) {
                (1, _, _) | (_, Route::Pinned { .. }, _) | (_, _, Arrivals::One) => assert_eq!(expected, 1),
                (_, Route::Sharded { chunk }, _) => assert_eq!(expected, (len as u64).div_ceil(chunk)),
                _ => unreachable!(),
            }
            // Different destination offsets each round, so stale bytes cannot pass.
            let off = (k * 1024) as u64;
            t.write_imm(&src, 0, &rdst, off, len as u64, imm).await.expect("write_imm");
            expect_arrivals(&b, imm, expected, &format!("{nics} NICs, {opts:?}")).await;
            let got = dst.to_vec();
            let body = &got[off as usize..off as usize + len];
            let first_bad = body.iter().enumerate().position(|(i, &x)| x != pattern_byte(11, i as u64));
            assert_eq!(first_bad, None, "{nics} NICs, {opts:?}: bytes differ");
        }
        if nics > 1 {
            // Out of order on purpose: NIC 0 is busy with a large pinned write when the sharded
            // write is posted, so its shards on NIC 0 complete after the later ones on the
            // other NICs. The one future and the count must not care.
            let big = a.alloc(16 << 20).await.unwrap();
            let sink = b.alloc(16 << 20).await.unwrap();
            let rsink = remote(&a, &sink).await;
            let blocker = a.with(TransferOpts::pinned(0)).write(&big, 0, &rsink, 0, 16 << 20);
            let t = a.with(TransferOpts::sharded(64 << 10));
            let expected = t.write_arrivals(&rdst, len as u64).unwrap();
            t.write_imm(&src, 0, &rdst, 0, len as u64, 1999).await.expect("sharded write behind a busy NIC");
            blocker.await.expect("blocker");
            expect_arrivals(&b, 1999, expected, &format!("{nics} NICs, NIC 0 busy")).await;
            assert!(dst.to_vec()[..len].iter().enumerate().all(|(i, &x)| x == pattern_byte(11, i as u64)));
        }
        eprintln!("{nics} NIC(s): sharded write_imm verified");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paged_write_moves_the_listed_pages() {
    for nics in nic_counts() {
        let Some((a, b)) = pair(nics) else { continue };
        let layout = PageLayout {
            page_len: 4000,
            src_stride: 4096,
            dst_stride: 8192,
            src_offset: 64,
            dst_offset: 128,
        };
        let src = patterned(&a, 64 + 4096 * 48, 21).await;
        let dst = b.alloc(128 + 8192 * 40).await.unwrap();
        let rdst = remote(&a, &dst).await;
        // 32 pages, destination order scrambled, not contiguous on either side.
        let src_pages: Vec<u32> = (0..32).map(|i| (i * 7 + 3) % 48).collect();
        let dst_pages: Vec<u32> = (0..32).map(|i| (i * 11 + 5) % 40).collect();
        for (k, opts) in
            [TransferOpts::default(), TransferOpts::default().one_arrival()].into_iter().enumerate()
        {
            let imm = 2000 + (nics * 10 + k) as u32;
            let t = a.with(opts);
            let expected = t.paged_arrivals(&rdst, src_pages.len()).unwrap();
            assert_eq!(expected, if k == 0 { 32 } else { 1 });
            t.write_paged(&src, &rdst, &layout, &src_pages, &dst_pages, Some(imm))
                .await
                .expect("paged write");
            expect_arrivals(&b, imm, expected, &format!("paged, {nics} NICs, {opts:?}")).await;
            let got = dst.to_vec();
            for (s, d) in src_pages.iter().zip(&dst_pages) {
                let so = 64 + 4096 * *s as u64;
                let dof = 128 + 8192 * *d as usize;
                for j in 0..4000u64 {
                    assert_eq!(
                        got[dof + j as usize],
                        pattern_byte(21, so + j),
                        "{nics} NICs: page {s} -> {d}, byte {j}"
                    );
                }
            }
            // Bytes between pages are untouched.
            assert!(got[..128].iter().all(|&x| x == 0), "bytes before page 0 were written");
            dst.write_at(0, &vec![0u8; dst.len()]).unwrap();
        }
        eprintln!("{nics} NIC(s): paged write verified");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scatter_and_barrier_reach_every_member() {
    for nics in nic_counts() {
        let Some((a, b)) = pair(nics) else { continue };
        let Some(c) = engine(nics) else { continue };
        let src = patterned(&a, 1 << 20, 31).await;
        let db = b.alloc(1 << 20).await.unwrap();
        let dc = c.alloc(1 << 20).await.unwrap();
        let group = a.peer_group(vec![remote(&a, &db).await, remote(&a, &dc).await]).unwrap();
        let entries = [
            ScatterEntry { member: 0, src_off: 0, dst_off: 0, len: 300_000 },
            ScatterEntry { member: 1, src_off: 300_000, dst_off: 4096, len: 500_000 },
            ScatterEntry { member: 0, src_off: 800_000, dst_off: 400_000, len: 200_000 },
            ScatterEntry { member: 1, src_off: 0, dst_off: 600_000, len: 0 },
        ];
        for (k, opts) in [TransferOpts::sharded(64 << 10), TransferOpts::sharded(64 << 10).one_arrival()]
            .into_iter()
            .enumerate()
        {
            let imm = 3000 + (nics * 10 + k) as u32;
            let t = a.with(opts);
            let expected = t.scatter_arrivals(&group, &entries).unwrap();
            if k == 1 {
                assert_eq!(expected, vec![1, 1]);
            } else if nics == 1 {
                assert_eq!(expected, vec![2, 2], "one arrival per entry on one NIC");
            }
            t.scatter(&src, &group, &entries, Some(imm)).await.expect("scatter");
            expect_arrivals(&b, imm, expected[0], &format!("scatter member 0, {nics} NICs")).await;
            expect_arrivals(&c, imm, expected[1], &format!("scatter member 1, {nics} NICs")).await;
            let (gb, gc) = (db.to_vec(), dc.to_vec());
            for e in &entries {
                let got = if e.member == 0 { &gb } else { &gc };
                for j in (0..e.len).step_by(997) {
                    assert_eq!(
                        got[(e.dst_off + j) as usize],
                        pattern_byte(31, e.src_off + j),
                        "{e:?} byte {j}"
                    );
                }
            }
        }
        // Barrier: one arrival at each member per call, on any NIC count.
        for round in 0..3u32 {
            a.barrier(&group, 3900 + round).await.expect("barrier");
        }
        for round in 0..3u32 {
            expect_arrivals(&b, 3900 + round, 1, "barrier at member 0").await;
            expect_arrivals(&c, 3900 + round, 1, "barrier at member 1").await;
        }
        eprintln!("{nics} NIC(s): scatter and barrier verified");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_read_returns_the_remote_bytes() {
    for nics in nic_counts() {
        let Some((a, b)) = pair(nics) else { continue };
        let len = (2 << 20) + 333;
        let theirs = patterned(&b, len, 41).await;
        let rsrc = remote(&a, &theirs).await;
        let mine = a.alloc(len + 100).await.unwrap();
        for (k, opts) in
            [TransferOpts::sharded(128 << 10), TransferOpts::pinned(nics - 1)].into_iter().enumerate()
        {
            let off = 17 * k as u64;
            a.with(opts).read(&mine, off, &rsrc, 5, (len - 5) as u64).await.expect("read");
            let got = mine.to_vec();
            for j in (0..len as u64 - 5).step_by(13) {
                assert_eq!(
                    got[(off + j) as usize],
                    pattern_byte(41, 5 + j),
                    "{nics} NICs {opts:?}: byte {j}"
                );
            }
        }
        // Reads produce no arrivals at the owner: nothing to count, nothing counted.
        assert_eq!(b.imm_counter(0).total_arrived(), 0);
        eprintln!("{nics} NIC(s): read verified");
    }
}

/// xorshift64: deterministic random requests, so a failure can be replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Waits for `n` arrivals of `imm` at `e` (within [`WAIT`]), consuming them.
async fn wait_arrivals(e: &Engine, imm: u32, n: u64, what: &str) {
    let got = tokio::time::timeout(WAIT, e.imm_counter(imm).wait_for(n)).await;
    assert!(matches!(got, Ok(Ok(()))), "{what}: {n} arrivals of imm {imm} did not come ({got:?})");
}

/// Property: for random single writes, paged writes and scatters (random lengths, offsets,
/// page lists, entries, shard sizes, routes and arrival modes) on 1, 2 and 4 NICs, each
/// target counts exactly what `write_arrivals` / `paged_arrivals` / `scatter_arrivals`
/// predicted, and once it has counted them the bytes are there. The scatter group has two
/// members on one engine, whose counts add up there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrival_function_matches_real_arrivals() {
    let seed: u64 =
        std::env::var("FABRIC_PROPTEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_f00d);
    let cases: usize = std::env::var("FABRIC_PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(24);
    let mut rng = Rng(seed | 1);
    const REGION: usize = 1 << 20;
    for nics in nic_counts() {
        let Some((a, b)) = pair(nics) else { continue };
        let Some(c) = engine(nics) else { continue };
        let src = patterned(&a, REGION, 51).await;
        let dst = b.alloc(REGION).await.unwrap();
        let dst2 = b.alloc(REGION / 2).await.unwrap();
        let on_c = c.alloc(REGION).await.unwrap();
        let rdst = remote(&a, &dst).await;
        // Members 0 and 2 are regions of b, member 1 of c.
        let members = [&dst, &on_c, &dst2];
        let group =
            a.peer_group(vec![rdst.clone(), remote(&a, &on_c).await, remote(&a, &dst2).await]).unwrap();
        // (imm, arrivals predicted at b, at c): checked once more at the end, when any extra
        // arrival would have had time to land.
        let mut promised: Vec<(u32, u64, u64)> = Vec::with_capacity(cases);
        let mut shapes = [0usize; 3];
        for case in 0..cases {
            let route = match rng.below(3) {
                0 => Route::Pinned { nic: rng.below(nics as u64) as usize },
                _ => Route::Sharded { chunk: 1 + rng.below(128 << 10) },
            };
            let arrivals = if rng.below(2) == 0 { Arrivals::PerShard } else { Arrivals::One };
            let opts = TransferOpts { route, arrivals };
            let imm = 10_000 + (nics * 1000 + case) as u32;
            let t = a.with(opts);
            let shape = rng.below(3) as usize;
            shapes[shape] += 1;
            let what = format!("seed {seed:#x} case {case} (shape {shape}), {nics} NICs, {opts:?}");
            match shape {
                0 => {
                    let pages = rng.below(24) as usize;
                    let layout = PageLayout::packed(1 + rng.below(8 << 10));
                    let max_pages = (REGION as u64 / layout.page_len).min(u32::MAX as u64) as u32;
                    let src_pages: Vec<u32> =
                        (0..pages).map(|_| rng.below(max_pages as u64) as u32).collect();
                    let mut dst_pages: Vec<u32> = Vec::new();
                    while dst_pages.len() < pages {
                        let p = rng.below(max_pages as u64) as u32;
                        if !dst_pages.contains(&p) {
                            dst_pages.push(p);
                        }
                    }
                    let n = t.paged_arrivals(&rdst, pages).unwrap();
                    t.write_paged(&src, &rdst, &layout, &src_pages, &dst_pages, Some(imm))
                        .await
                        .expect(&what);
                    wait_arrivals(&b, imm, n, &what).await;
                    let got = dst.to_vec();
                    let pl = layout.page_len;
                    for (s, d) in src_pages.iter().zip(&dst_pages) {
                        let (so, dof) = (u64::from(*s) * pl, u64::from(*d) * pl);
                        for j in (0..pl).step_by(61).chain([pl - 1]) {
                            assert_eq!(
                                got[(dof + j) as usize],
                                pattern_byte(51, so + j),
                                "{what}: page {s} -> {d}, byte {j}"
                            );
                        }
                    }
                    promised.push((imm, n, 0));
                }
                1 => {
                    // Up to 6 entries over the three members, never overlapping within one
                    // member's region; some empty (an imm-only write, or nothing with One).
                    let mut cursor = [0u64; 3];
                    let mut entries = Vec::new();
                    for _ in 0..rng.below(7) {
                        let member = rng.below(3) as usize;
                        let len = if rng.below(6) == 0 { 0 } else { 1 + rng.below(96 << 10) };
                        let dst_off = cursor[member] + rng.below(4096);
                        if dst_off + len > members[member].len() as u64 {
                            continue;
                        }
                        cursor[member] = dst_off + len;
                        let src_off = rng.below(REGION as u64 - len);
                        entries.push(ScatterEntry { member, src_off, dst_off, len });
                    }
                    let per_member = t.scatter_arrivals(&group, &entries).unwrap();
                    let (at_b, at_c) = (per_member[0] + per_member[2], per_member[1]);
                    let what = format!("{what}, {entries:?}");
                    t.scatter(&src, &group, &entries, Some(imm)).await.expect(&what);
                    wait_arrivals(&b, imm, at_b, &what).await;
                    wait_arrivals(&c, imm, at_c, &what).await;
                    let got: Vec<Vec<u8>> = members.iter().map(|m| m.to_vec()).collect();
                    for e in &entries {
                        for j in (0..e.len).step_by(97).chain(e.len.checked_sub(1)) {
                            assert_eq!(
                                got[e.member][(e.dst_off + j) as usize],
                                pattern_byte(51, e.src_off + j),
                                "{what}: {e:?} byte {j}"
                            );
                        }
                    }
                    promised.push((imm, at_b, at_c));
                }
                _ => {
                    let len = rng.below(REGION as u64 / 2);
                    let so = rng.below(REGION as u64 - len);
                    let dof = rng.below(REGION as u64 - len);
                    let n = t.write_arrivals(&rdst, len).unwrap();
                    t.write_imm(&src, so, &rdst, dof, len, imm).await.expect(&what);
                    wait_arrivals(&b, imm, n, &what).await;
                    let got = dst.to_vec();
                    for j in (0..len).step_by(251).chain(len.checked_sub(1)) {
                        assert_eq!(got[(dof + j) as usize], pattern_byte(51, so + j), "{what}: byte {j}");
                    }
                    promised.push((imm, n, 0));
                }
            }
        }
        // Nothing beyond the prediction arrived later (one wait for all cases).
        tokio::time::sleep(SETTLE).await;
        for (imm, at_b, at_c) in promised {
            let got = (b.imm_counter(imm).total_arrived(), c.imm_counter(imm).total_arrived());
            assert_eq!(got, (at_b, at_c), "seed {seed:#x}, {nics} NICs, imm {imm}: arrivals at (b, c)");
        }
        eprintln!(
            "{nics} NIC(s): {cases} random requests (paged, scatter, single: {shapes:?}) counted exactly"
        );
    }
}

/// `Arrivals::One` over several NICs is only sound where a write's completion means its
/// data landed. tcp (asked for `FI_DELIVERY_COMPLETE`, granted) and verbs RC have it, and a
/// sharded one-arrival write works there; shm (not asked) lacks it, and such a transfer is
/// refused with `Error::Unsupported` before anything is posted, while what stays sound on it
/// (one arrival per shard, one arrival pinned to one NIC, imm-only) still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_arrival_over_several_nics_needs_delivery_complete() {
    let Some((a, b)) = pair(2) else { return };
    assert!(a.delivery_complete(), "{}: writes complete once delivered", a.transport());
    let src = patterned(&a, 1 << 20, 61).await;
    let dst = b.alloc(1 << 20).await.unwrap();
    let rdst = remote(&a, &dst).await;
    let one = a.with(TransferOpts::sharded(64 << 10).one_arrival());
    one.write_imm(&src, 0, &rdst, 0, 1 << 20, 4000).await.expect("sharded one-arrival write");
    expect_arrivals(&b, 4000, 1, "Arrivals::One over 2 NICs").await;
    assert!(dst.to_vec().iter().enumerate().all(|(i, &x)| x == pattern_byte(61, i as u64)));

    if primary().starts_with("verbs") || !integration_tests::providers().iter().any(|p| p == "shm") {
        return; // shm is not among the providers under test
    }
    let shm = || Engine::builder().provider("shm").domains(2).build().expect("shm engine of 2 domains");
    let (a, b) = (shm(), shm());
    assert!(!a.delivery_complete(), "shm was not asked for FI_DELIVERY_COMPLETE");
    let src = patterned(&a, 1 << 20, 62).await;
    let dst = b.alloc(1 << 20).await.unwrap();
    let rdst = remote(&a, &dst).await;
    let group = a.peer_group(vec![rdst.clone()]).unwrap();
    let one = a.with(TransferOpts::sharded(64 << 10).one_arrival());
    let unsupported = |e: Error| matches!(e, Error::Unsupported(ref m) if m.contains("Arrivals::One"));
    let e = one.write_imm(&src, 0, &rdst, 0, 1 << 20, 4001).await.unwrap_err();
    assert!(unsupported(e.clone()), "write_imm: {e}");
    let e = one.write_imm(&src, 0, &rdst, 0, 100, 4001).await.unwrap_err();
    assert!(unsupported(e.clone()), "a write of one shard is refused too (options decide): {e}");
    let layout = PageLayout::packed(4096);
    let e = one.write_paged(&src, &rdst, &layout, &[0, 1, 2], &[2, 1, 0], Some(4001)).await.unwrap_err();
    assert!(unsupported(e.clone()), "write_paged: {e}");
    let entry = ScatterEntry { member: 0, src_off: 0, dst_off: 0, len: 200_000 };
    let e = one.scatter(&src, &group, &[entry], Some(4001)).await.unwrap_err();
    assert!(unsupported(e.clone()), "scatter: {e}");
    // Writes without an immediate have no arrival to order, and a plain write is allowed.
    one.write(&src, 0, &rdst, 0, 1 << 20).await.expect("write without immediate");
    // An imm-only write has no data to overtake.
    one.imm(&rdst, 4002).await.expect("imm-only under Arrivals::One");
    expect_arrivals(&b, 4002, 1, "imm-only on shm").await;
    // Nothing of the refused transfers reached the target.
    assert_eq!(b.imm_counter(4001).total_arrived(), 0, "a refused transfer posted something");
    // One arrival per shard, and one arrival on one pinned NIC, stay available.
    dst.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    let per_shard = a.with(TransferOpts::sharded(64 << 10));
    let n = per_shard.write_arrivals(&rdst, 1 << 20).unwrap();
    assert_eq!(n, 16);
    per_shard.write_imm(&src, 0, &rdst, 0, 1 << 20, 4003).await.expect("per-shard write on shm");
    expect_arrivals(&b, 4003, n, "per shard on shm").await;
    let pinned = a.with(TransferOpts::pinned(1).one_arrival());
    pinned.write_imm(&src, 0, &rdst, 0, 1 << 20, 4004).await.expect("pinned one-arrival write on shm");
    expect_arrivals(&b, 4004, 1, "pinned one arrival on shm").await;
    assert!(dst.to_vec().iter().enumerate().all(|(i, &x)| x == pattern_byte(62, i as u64)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_shapes_are_refused_before_anything_is_posted() {
    let Some((a, b)) = pair(2) else { return };
    let src = a.alloc(1 << 16).await.unwrap();
    let dst = b.alloc(1 << 16).await.unwrap();
    let rdst = remote(&a, &dst).await;
    let e = a.with(TransferOpts::pinned(2)).write_imm(&src, 0, &rdst, 0, 10, 1).await.unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("NIC 2")), "{e}");
    let e = a.with(TransferOpts::sharded(0)).write(&src, 0, &rdst, 0, 10).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    let layout = PageLayout::packed(4096);
    let e = a.write_paged(&src, &rdst, &layout, &[0, 1], &[0], Some(1)).await.unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("2 source pages but 1")), "{e}");
    let e = a.write_paged(&src, &rdst, &layout, &[0, 1], &[3, 3], Some(1)).await.unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("listed twice")), "{e}");
    let e = a.write_paged(&src, &rdst, &layout, &[16], &[0], Some(1)).await.unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { side: fabric_async::Side::Local, .. }), "{e}");
    let group = a.peer_group(vec![rdst.clone()]).unwrap();
    let overlapping = [
        ScatterEntry { member: 0, src_off: 0, dst_off: 0, len: 100 },
        ScatterEntry { member: 0, src_off: 0, dst_off: 50, len: 100 },
    ];
    let e = a.scatter(&src, &group, &overlapping, Some(1)).await.unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("overlap")), "{e}");
    let e = a
        .scatter(&src, &group, &[ScatterEntry { member: 1, src_off: 0, dst_off: 0, len: 1 }], None)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("member 1")), "{e}");
    // A group made by another engine is refused.
    let other = engine(2).unwrap();
    let foreign = other.peer_group(vec![remote(&other, &dst).await]).unwrap();
    assert!(matches!(a.barrier(&foreign, 1).await, Err(Error::Config(_))));
    assert!(matches!(a.peer_group(vec![remote(&other, &dst).await]), Err(Error::Config(_))));
    // Nothing of the above reached the target.
    tokio::time::sleep(SETTLE).await;
    assert_eq!(b.imm_counter(1).total_arrived(), 0, "a refused request posted something");
    // Engines of different NIC counts cannot be peers: a clear error, not a hang.
    let one = engine(1).unwrap();
    let e = one.remote_region(&dst.descriptor().to_bytes()).await.unwrap_err();
    assert!(matches!(e, Error::Foreign { .. }), "{e}");
}
