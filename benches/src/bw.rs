//! `bw`: write_imm bandwidth over a size sweep, `--window` writes in flight, beside the raw
//! provider loop (same sizes, window and acknowledgement), iperf3 on tcp and perftest's
//! `ib_write_bw` on verbs.

use std::process::{Command, Stdio};
use std::time::Duration;

use fabric_async::ReactorMode;

use crate::gpu::{self, Location};
use crate::measure::{gbps, human, median};
use crate::perftest;
use crate::report::{Report, Row};
use crate::session::{
    engine_absorb, engine_side, engine_stream, mode_name, on_thread, perftest_target, raw_side, Ctx, Res,
    IMM_ACK, IMM_DATA,
};
use crate::{on_verbs, Opts};

fn bw_sizes(o: &Opts) -> Vec<usize> {
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
fn bw_ops(o: &Opts, size: usize) -> u64 {
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

/// Region per side: up to `window` slots of the largest size, capped at 256 MiB (verbs:
/// 64 MiB; the test VM has 2 GiB for both processes, and writes in flight may share a slot).
fn region_len(o: &Opts, sizes: &[usize]) -> usize {
    let max = sizes.iter().copied().max().unwrap_or(1 << 20);
    let cap = if on_verbs(o) { 64 << 20 } else { 256 << 20 };
    (max * o.window).min(cap).max(max).max(1 << 20)
}

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let sizes = bw_sizes(&ctx.o);
    let reps = if ctx.o.quick { 1 } else { 3 };
    let window = ctx.o.window;
    let len = region_len(&ctx.o, &sizes);
    // Event mode: engine and raw loop alternate per size, so drift on this shared machine hits
    // both (an idle Event reactor sleeps). A spinning reactor would steal a core from the raw
    // loop on 2 cores, so other modes run the engine sweep, drop the engine, then the raw one.
    let interleave = ctx.o.mode == ReactorMode::Event;
    let passes: &[(bool, bool)] = if interleave { &[(true, true)] } else { &[(true, false), (false, true)] };
    let (mut e, mut b) = (vec![Vec::new(); sizes.len()], vec![Vec::new(); sizes.len()]);
    // On verbs, perftest's ib_write_bw too, run by the leader after each raw burst (so that
    // drift hits all three alike), with as many bytes and as many writes in flight (`-t`).
    let verbs = on_verbs(&ctx.o);
    let perftest = if verbs && ctx.lead { perftest_target(ctx, "ib_write_bw").await? } else { None };
    let mut p = vec![Vec::new(); sizes.len()];
    let mut side = Some(engine_side(ctx, ctx.o.mode, len).await?);
    let mut raw = if interleave { Some(raw_side(ctx, len).await?) } else { None };
    let steps = (passes.len() * sizes.len() * reps) as f64;
    for (pass, &(do_engine, do_raw)) in passes.iter().enumerate() {
        if !do_engine && side.is_some() {
            ctx.barrier("bw-engine-end").await?;
            side = None;
            raw = Some(raw_side(ctx, len).await?);
        }
        for (k, &size) in sizes.iter().enumerate() {
            let ops = bw_ops(&ctx.o, size);
            for r in 0..reps {
                let side_of = match (do_engine, do_raw) {
                    (true, true) => "",
                    (true, false) => "engine ",
                    _ => "raw ",
                };
                let what =
                    format!("{side_of}{}/{} {} x{ops} rep {}/{reps}", k + 1, sizes.len(), human(size), r + 1);
                let frac = ((pass * sizes.len() + k) * reps + r) as f64 / steps;
                ctx.progress("bw", frac, &what);
                if do_engine {
                    let s = side.as_ref().expect("engine side");
                    if ctx.lead {
                        e[k].push(gbps(size as u64 * ops, engine_stream(s, size, ops, window).await?));
                    } else {
                        engine_absorb(s, ops, size).await?;
                    }
                }
                if do_raw {
                    let w = window as u64;
                    if ctx.lead {
                        let (r2, t) = on_thread(raw.take().expect("raw"), move |r| {
                            r.stream(size, ops, w, IMM_DATA, IMM_ACK)
                        })
                        .await?;
                        raw = Some(r2);
                        b[k].push(gbps(size as u64 * ops, t));
                    } else {
                        let (r2, ()) =
                            on_thread(raw.take().expect("raw"), move |r| r.absorb(ops, IMM_DATA, IMM_ACK))
                                .await?;
                        raw = Some(r2);
                    }
                    if verbs {
                        if let Some(t) = perftest.clone() {
                            ctx.progress(
                                "bw",
                                frac,
                                &format!("{what}: ib_write_bw -s {size} -n {ops} -t {window}"),
                            );
                            let run = move || perftest::write_bw(&t, size, ops, window);
                            p[k].push(tokio::task::spawn_blocking(run).await??);
                        }
                        ctx.barrier("bw-perftest").await?;
                    }
                }
            }
        }
    }
    if ctx.lead {
        for (k, &size) in sizes.iter().enumerate() {
            let case = match ctx.o.mode {
                ReactorMode::Event => human(size),
                m => format!("{} [{}]", human(size), mode_name(m)),
            };
            let row = Row::new("bw", &case, "gbps", median(e[k].clone())).size(size);
            rep.push(row.baseline("raw", median(b[k].clone())));
        }
        for (k, &size) in sizes.iter().enumerate().filter(|_| verbs) {
            let case = format!("{} vs ib_write_bw -t {window}", human(size));
            let row = Row::new("bw", &case, "gbps", median(e[k].clone())).size(size);
            rep.push(if p[k].is_empty() { row } else { row.baseline("ib_write_bw", median(p[k].clone())) });
        }
    }
    ctx.barrier("bw-end").await?;
    if let Location::Cuda(ords) = ctx.o.location {
        // The host sweep's engine rows are the staged rows' host-memory ceiling.
        let host: Vec<f64> =
            e.iter().map(|v| if v.is_empty() { f64::NAN } else { median(v.clone()) }).collect();
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
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out = None;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        let o = Command::new("iperf3")
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
