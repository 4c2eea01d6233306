//! `bw`: write_imm bandwidth over a size sweep, `--window` writes in flight, for each
//! `--buffer` pattern (hot, cold) and each `--domains` count, beside the raw provider loop
//! (same sizes, window, pattern and acknowledgement; one domain), fabtests' `fi_rma_bw` with
//! `--fabtests DIR`, iperf3 on tcp and perftest's `ib_write_bw` on verbs.
//!
//! `--rounds` bursts per size and pattern (3; quick 1). In Event, Inline and Adaptive mode
//! each round runs the engine's burst and the raw loop's, the raw loop first in every second
//! round, so each round gives a ratio of two bursts taken seconds apart; the row after each
//! size gives the median of those per-round ratios, its distribution-free 95% confidence
//! interval (`measure::median_ci`, from 6 rounds) and their range (the machine's drift over
//! a run moves both alike). With five or more physical cores each side's threads are pinned
//! (`pin::plan_bw`): the raw loop's thread and the engine's reactor thread on one CPU, the
//! runtime's thread on another; `fi_rma_bw`'s client and server on the two raw-loop CPUs.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use fabric_async::ReactorMode;

use crate::account::{Account, Burst, Calls, Who};
use crate::fabtests::{self, Fabtests};
use crate::gpu::{self, Location};
use crate::measure::{gbps, human, median};
use crate::pair::{
    builder_domains, engine_absorb, engine_side_with, engine_stream, mode_name, on_thread, perftest_target,
    raw_side, Ctx, Res, IMM_ACK, IMM_DATA,
};
use crate::pattern::{self, Pattern};
use crate::perftest;
use crate::pin::{self, Pinned};
use crate::report::{FtRef, Report, Rounds, Row};
use crate::{on_verbs, Opts};

pub fn bw_sizes(o: &Opts) -> Vec<usize> {
    if let Some(s) = &o.sizes {
        return s.clone();
    }
    if matches!(o.location, Location::Cuda(_)) {
        return gpu::sizes(o.quick);
    }
    match (on_verbs(o), o.quick) {
        (false, true) => vec![4 << 10, 64 << 10, 1 << 20, 4 << 20],
        (false, false) => (0..8).map(|i| (4usize << 10) << (2 * i)).collect(), // 4 KiB .. 64 MiB, x4
        (true, true) => vec![4 << 10, 64 << 10, 1 << 20],
        (true, false) => (0..5).map(|i| (4usize << 10) << (2 * i)).collect(), // 4 KiB .. 1 MiB, x4
    }
}

/// Writes per measured burst: about 1 GiB (quick: 16 MiB; verbs: 32 MiB, quick 8 MiB), at
/// least two windows (verbs: 32 writes), bounded.
pub fn bw_ops(o: &Opts, size: usize) -> u64 {
    if let Some(n) = o.iters {
        return n as u64;
    }
    let (target, max) = match (on_verbs(o), o.quick) {
        (false, true) => (16usize << 20, 1000),
        (false, false) => (1 << 30, 30_000),
        (true, true) => (8 << 20, 1000),
        (true, false) => (32 << 20, 4000),
    };
    if on_verbs(o) {
        // ~30 MB/s: two windows of 128 x 1 MiB would take 8 s per burst. At least 32 writes;
        // fewer than the window means every write is posted at once (ib_write_bw, given the
        // same -n and -t, does the same).
        return (target / size).clamp(32, max) as u64;
    }
    (target / size).clamp(2 * o.window, max) as u64
}

/// Bytes registered per side: the largest size for `--buffer hot`; with `cold`, a region
/// several times the last-level cache ([`pattern::region_len`]).
pub fn region_len(o: &Opts, sizes: &[usize]) -> usize {
    let max = sizes.iter().copied().max().unwrap_or(1 << 20);
    let llc = pattern::llc_bytes();
    pattern::region_len(&o.buffers, llc, o.window, max, pattern::region_cap(llc, on_verbs(o)))
}

/// One pass over patterns x sizes x repetitions: an engine of `engine` domains, and/or the
/// raw loop (with perftest and fabtests after its bursts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pass {
    engine: Option<usize>,
    raw: bool,
}

/// Event, Inline and Adaptive mode: engine and raw loop alternate per size, so drift on this
/// shared machine hits both (an idle reactor of these modes sleeps; Adaptive's only
/// `spin` after its last completion, a fraction of a raw burst); the raw loop (one domain)
/// beside the first domain count only. A BusyPoll reactor spins for as long as it lives and
/// would steal a core from the raw loop, so that mode runs each engine sweep, drops the
/// engine, then the raw one.
fn passes(counts: &[usize], interleave: bool) -> Vec<Pass> {
    let mut v: Vec<Pass> = counts
        .iter()
        .enumerate()
        .map(|(i, &d)| Pass { engine: Some(d), raw: interleave && i == 0 })
        .collect();
    if !interleave {
        v.push(Pass { engine: None, raw: true });
    }
    v
}

/// The pattern whose raw bursts the external baselines (fi_rma_bw, ib_write_bw, both hot)
/// follow: hot when it is measured, else the first.
fn external_pattern(patterns: &[Pattern]) -> Pattern {
    if patterns.contains(&Pattern::Hot) {
        Pattern::Hot
    } else {
        patterns[0]
    }
}

/// Bursts per size and pattern: `--rounds`, else 3 (quick: 1).
pub fn rounds(o: &Opts) -> usize {
    o.rounds.unwrap_or(if o.quick { 1 } else { 3 })
}

fn med(v: Option<&Vec<f64>>) -> f64 {
    v.filter(|v| !v.is_empty()).map_or(f64::NAN, |v| median(v.clone()))
}

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let sizes = bw_sizes(&ctx.o);
    let reps = rounds(&ctx.o);
    let window = ctx.o.window;
    let len = region_len(&ctx.o, &sizes);
    let patterns = ctx.o.buffers.clone();
    let counts = ctx.o.domain_counts.clone();
    let ext = external_pattern(&patterns);
    let passes = passes(&counts, !matches!(ctx.o.mode, ReactorMode::BusyPoll));
    // Each side's NIC CPU (raw loop, reactor) and app CPU (this runtime's thread).
    let plan = pin::plan_bw();
    let (nic, app) = match plan {
        Some(p) if ctx.lead => (Some(p[0]), Some(p[1])),
        Some(p) => (Some(p[2]), Some(p[3])),
        None => (None, None),
    };
    let _app = Pinned::to(app);
    // (domains, pattern, size index) -> engine/raw of each round where both ran.
    let mut ratios: HashMap<(usize, Pattern, usize), Vec<f64>> = HashMap::new();
    // (domains, pattern, size index) -> engine figures; (pattern, size index) -> raw ones.
    let mut e: HashMap<(usize, Pattern, usize), Vec<f64>> = HashMap::new();
    let mut b: HashMap<(Pattern, usize), Vec<f64>> = HashMap::new();
    // On verbs, perftest's ib_write_bw too, run by the leader after each raw burst (so that
    // drift hits all three alike), with as many bytes and as many writes in flight (`-t`).
    // fabtests' fi_rma_bw likewise, with `--fabtests DIR` (tcp, shm).
    let verbs = on_verbs(&ctx.o);
    let perftest = if verbs && ctx.lead { perftest_target(ctx, "ib_write_bw").await? } else { None };
    let with_ft = ctx.o.fabtests.is_some();
    let ft = match &ctx.o.fabtests {
        // On the CPUs of the raw loop's two threads (the leader's and the peer's NIC CPU).
        Some(dir) if ctx.lead => Some(
            Fabtests::new(dir, &ctx.o.provider, &[fabtests::RMA_BW])?
                .pinned(plan.map(|p| [p[0], p[2]]))
                .huge_pages(ctx.o.huge_pages),
        ),
        _ => None,
    };
    let (mut p, mut f) = (vec![Vec::new(); sizes.len()], vec![Vec::new(); sizes.len()]);
    let (mut raw, mut side, mut watch) = (None, None, None);
    let steps = (passes.len() * patterns.len() * sizes.len() * reps) as f64;
    let mut step = 0;
    // `--time-calls`: this side's bursts (the engine of the first domain count, the raw loop).
    let timed = ctx.o.time_calls;
    let mut acct = Account::default();
    for (i, pass) in passes.iter().enumerate() {
        if i > 0 {
            ctx.barrier("bw-pass-end").await?;
        }
        // Both sides are done with the previous engine: drop it before the next one opens.
        drop(watch.take());
        drop(side.take());
        side = match pass.engine {
            Some(d) => {
                let mut b = builder_domains(&ctx.o, d).mode(ctx.o.mode).time_reactor(timed);
                if let Some(c) = nic {
                    b = b.pin_core(c);
                }
                Some(engine_side_with(ctx, b, len).await?)
            }
            None => None,
        };
        // `--watch`: this runtime's thread wakes on the engine's completions (both sides).
        if let (true, Some(s)) = (ctx.o.watch, &side) {
            let w =
                fabric_async::CompletionWatch::spawn(&s.engine).map_err(|e| format!("bw --watch: {e}"))?;
            watch = Some(w);
        }
        if pass.raw && raw.is_none() {
            let mut r = raw_side(ctx, len).await?;
            r.time_calls(timed);
            raw = Some(r);
        }
        for &pat in &patterns {
            for (k, &size) in sizes.iter().enumerate() {
                let ops = bw_ops(&ctx.o, size);
                for r in 0..reps {
                    let side_of = match (pass.engine, pass.raw) {
                        (Some(d), true) if counts.len() > 1 => format!("{d} dom + raw "),
                        (Some(_), true) => String::new(),
                        (Some(d), false) => format!("engine {d} dom "),
                        (None, _) => "raw ".into(),
                    };
                    let what = format!(
                        "{side_of}{pat} {}/{} {} x{ops} rep {}/{reps}",
                        k + 1,
                        sizes.len(),
                        human(size),
                        r + 1
                    );
                    ctx.progress("bw", step as f64 / steps, &what);
                    step += 1;
                    // Odd rounds run the raw loop first: whatever the first burst of a
                    // round pays (or gains), both pay it equally often.
                    let raw_first = r % 2 == 1;
                    let (mut ev, mut rv) = (None, None);
                    for raw_turn in [raw_first, !raw_first] {
                        if !raw_turn {
                            if let (Some(s), Some(d)) = (&side, pass.engine) {
                                let before = Calls::of_engine(&s.engine.stats());
                                let t = if ctx.lead {
                                    let t = engine_stream(s, size, ops, window, pat).await?;
                                    let v = gbps(size as u64 * ops, t);
                                    e.entry((d, pat, k)).or_default().push(v);
                                    ev = Some((d, v));
                                    t
                                } else {
                                    let t0 = std::time::Instant::now();
                                    engine_absorb(s, ops, size).await?;
                                    t0.elapsed()
                                };
                                if timed && d == counts[0] {
                                    let calls = Calls::of_engine(&s.engine.stats()).since(before);
                                    acct.push(Who::Engine, pat, k, Burst { calls, wall: t, writes: ops });
                                }
                            }
                            continue;
                        }
                        if !pass.raw {
                            continue;
                        }
                        let w = window as u64;
                        let before = raw.as_ref().map(|r| r.calls()).unwrap_or_default();
                        let (r2, t) = if ctx.lead {
                            let (r2, t) = on_thread(raw.take().expect("raw"), move |r| {
                                let _nic = Pinned::to(nic);
                                r.stream(size, ops, w, (IMM_DATA, IMM_ACK), pat)
                            })
                            .await?;
                            let v = gbps(size as u64 * ops, t);
                            b.entry((pat, k)).or_default().push(v);
                            rv = Some(v);
                            (r2, t)
                        } else {
                            let t0 = std::time::Instant::now();
                            let r2 = on_thread(raw.take().expect("raw"), move |r| {
                                let _nic = Pinned::to(nic);
                                r.absorb(ops, IMM_DATA, IMM_ACK)
                            })
                            .await?
                            .0;
                            (r2, t0.elapsed())
                        };
                        if timed {
                            let calls = r2.calls().since(before);
                            acct.push(Who::Raw, pat, k, Burst { calls, wall: t, writes: ops });
                        }
                        raw = Some(r2);
                    }
                    if let (Some((d, ev)), Some(v)) = (ev, rv) {
                        ratios.entry((d, pat, k)).or_default().push(ev / v);
                    }
                    if !pass.raw || pat != ext {
                        continue;
                    }
                    if verbs {
                        if let Some(t) = perftest.clone() {
                            ctx.progress(
                                "bw",
                                step as f64 / steps,
                                &format!("{what}: ib_write_bw -s {size} -n {ops} -t {window}"),
                            );
                            let run = move || perftest::write_bw(&t, size, ops, window);
                            p[k].push(tokio::task::spawn_blocking(run).await??);
                        }
                        ctx.barrier("bw-perftest").await?;
                    }
                    if with_ft {
                        if let Some(t) = ft.clone() {
                            ctx.progress(
                                "bw",
                                step as f64 / steps,
                                &format!("{what}: fi_rma_bw -W {window} -S {size} -I {ops}"),
                            );
                            let run = move || t.rma_bw(size, ops, window);
                            f[k].push(tokio::task::spawn_blocking(run).await??);
                        }
                        ctx.barrier("bw-fabtests").await?;
                    }
                }
            }
        }
    }
    // The receiving side's bursts go to the leader, which makes both sides' rows.
    let peer_acct = if timed {
        let theirs = ctx.swap("bw-time", if ctx.lead { Vec::new() } else { acct.encode() }).await?;
        if ctx.lead {
            Some(Account::decode(&theirs)?)
        } else {
            None
        }
    } else {
        None
    };
    if ctx.lead {
        let several = counts.len() > 1 || counts[0] > 1;
        let ft_tool = format!(
            "fi_rma_bw -e rdm -o writedata -W {window}{} (hot{}), Gbit/s",
            fabtests::extra_label(),
            if ctx.o.huge_pages { ", glibc.malloc.hugetlb=1" } else { "" }
        );
        for &d in &counts {
            for &pat in &patterns {
                for (k, &size) in sizes.iter().enumerate() {
                    let mut case = format!("{} {pat}", human(size));
                    if several {
                        case.push_str(&format!(", {d} domain{}", if d == 1 { "" } else { "s" }));
                    }
                    if ctx.o.mode != ReactorMode::Event {
                        case.push_str(&format!(" [{}]", mode_name(ctx.o.mode)));
                    } else if ctx.o.watch {
                        case.push_str(" [Event + CompletionWatch]");
                    }
                    if let Some(d) = ctx.o.await_spin.filter(|d| !d.is_zero()) {
                        case.push_str(&format!(" [await_spin {} us]", d.as_micros()));
                    }
                    if let Some(d) = ctx.o.await_linger {
                        case.push_str(&format!(" [linger {} us]", d.as_micros()));
                    }
                    if let Some(d) = ctx.o.poll_window {
                        case.push_str(&format!(" [poll window {} us]", d.as_micros()));
                    }
                    if !ctx.o.huge_pages {
                        case.push_str(" [4 KiB pages]");
                    }
                    let row = Row::new("bw", &case, "gbps", med(e.get(&(d, pat, k))))
                        .size(size)
                        .pattern(pat)
                        .domains(d)
                        .baseline("raw", med(b.get(&(pat, k))));
                    rep.push(match (verbs, with_ft) {
                        (true, _) => row,
                        (false, true) => {
                            row.fabtests(FtRef::Value { tool: ft_tool.clone(), v: med(Some(&f[k])) })
                        }
                        (false, false) => row.fabtests(FtRef::Skipped(fabtests::SKIPPED.into())),
                    });
                    if let Some(r) = ratios.get(&(d, pat, k)).filter(|r| r.len() > 1) {
                        let (m, k) = Rounds::of(r);
                        let what = format!(
                            "{case} engine/raw, median of {} per-round ratios ({}{})",
                            r.len(),
                            k.label(),
                            if nic.is_some() { ", pinned" } else { "" }
                        );
                        rep.push(Row::new("bw", &what, "x", m).size(size).pattern(pat).domains(d).rounds(k));
                    }
                }
            }
        }
        if let Some(peer) = &peer_acct {
            for &pat in &patterns {
                for (k, &size) in sizes.iter().enumerate() {
                    acct.rows(rep, "sender", pat, k, size);
                    peer.rows(rep, "receiver", pat, k, size);
                }
            }
        }
        for (k, &size) in sizes.iter().enumerate().filter(|_| verbs) {
            let case = format!("{} {ext} vs ib_write_bw -t {window}", human(size));
            let row = Row::new("bw", &case, "gbps", med(e.get(&(counts[0], ext, k)))).size(size);
            rep.push(if p[k].is_empty() { row } else { row.baseline("ib_write_bw", median(p[k].clone())) });
        }
    }
    ctx.barrier("bw-end").await?;
    drop((side, raw));
    if let Location::Cuda(ords) = ctx.o.location {
        // The host sweep's engine rows (cold where measured) are the staged rows' host-memory
        // ceiling.
        let pat = if patterns.contains(&Pattern::Cold) { Pattern::Cold } else { patterns[0] };
        let host: Vec<f64> = (0..sizes.len()).map(|k| med(e.get(&(counts[0], pat, k)))).collect();
        let o = ctx.o.clone();
        gpu::run(ctx, rep, ords, &sizes, &host, |size| bw_ops(&o, size)).await?;
    }
    Ok(())
}

/// iperf3 over loopback, when installed and the provider is tcp.
pub async fn iperf3(ctx: &mut Ctx, rep: &mut Report) {
    if ctx.o.provider != "tcp" {
        return;
    }
    if Command::new("iperf3").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        ctx.note("iperf3 not installed: skipped");
        return;
    }
    ctx.progress("bw", 1.0, "baseline: iperf3 -l 1M");
    let secs = if ctx.o.quick { "1" } else { "2" };
    let res = tokio::task::spawn_blocking(move || run_iperf3(secs)).await;
    match res {
        Ok(Ok(g)) => {
            let engine = rep.bw_at(1 << 20);
            let mut row = Row::new("bw", "1 MiB vs iperf3 -l 1M", "gbps", engine.unwrap_or(f64::NAN));
            row = row.size(1 << 20).baseline("iperf3", g);
            rep.push(row);
        }
        Ok(Err(e)) => ctx.note(&format!("iperf3 failed: {e}")),
        Err(e) => ctx.note(&format!("iperf3 failed: {e}")),
    }
}

fn run_iperf3(secs: &str) -> Res<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
    let mut server = pin::unpinned(&mut Command::new("iperf3"))
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out = None;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        let o = pin::unpinned(&mut Command::new("iperf3"))
            .args(["-c", "127.0.0.1", "-B", "127.0.0.1", "-p", &port, "-l", "1M", "-t", secs, "-J"])
            .output()?;
        if o.status.success() {
            out = Some(o.stdout);
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok_or("the iperf3 client never connected")?;
    let v: serde_json::Value = serde_json::from_slice(&out)?;
    let bps =
        v["end"]["sum_received"]["bits_per_second"].as_f64().ok_or("no end.sum_received in iperf3 -J")?;
    Ok(bps / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_and_the_external_pattern() {
        let (e, r) = (|d| Pass { engine: Some(d), raw: false }, Pass { engine: None, raw: true });
        assert_eq!(passes(&[1], true), [Pass { engine: Some(1), raw: true }]);
        assert_eq!(passes(&[1, 2, 4], true), [Pass { engine: Some(1), raw: true }, e(2), e(4)]);
        assert_eq!(passes(&[2], false), [e(2), r]);
        assert_eq!(passes(&[1, 4], false), [e(1), e(4), r]);
        assert_eq!(external_pattern(&[Pattern::Cold, Pattern::Hot]), Pattern::Hot);
        assert_eq!(external_pattern(&[Pattern::Cold]), Pattern::Cold);
    }
}
