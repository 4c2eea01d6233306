//! `lat`: write_imm ping-pong round trips (8 B, 256 B, 4 KiB), p50 and p99, beside the raw
//! provider loop's ping-pong, fabtests' `fi_rdm_pingpong` with `--fabtests DIR` (p50 rows)
//! and, on verbs, perftest's `ib_write_lat`. The ping and pong
//! halves are shared with `wake`.

use std::time::{Duration, Instant};

use fabric_async::ReactorMode;
use futures::future::join_all;

use crate::fabtests::{self, Fabtests};
use crate::measure::{human, percentiles};
use crate::pair::{
    engine_side, mode_name, on_thread, perftest_target, raw_side, Ctx, Res, Side, IMM_PING, IMM_PONG,
};
use crate::perftest;
use crate::report::{FtRef, Report, Row};
use crate::{on_verbs, Opts};

/// perftest's `ib_write_lat -s 8` beside the engine's 8 B round trip (verbs only). perftest
/// reports half a round trip, so its figures are doubled here.
pub async fn perftest_lat(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    if !on_verbs(&ctx.o) {
        return Ok(());
    }
    let tool = "ib_write_lat";
    let size = 8usize;
    let m = mode_name(lat_mode(&ctx.o));
    let e50 = rep.engine_of("lat", &format!("8 B p50 [{m}]")).unwrap_or(f64::NAN);
    let e99 = rep.engine_of("lat", &format!("8 B p99 [{m}]")).unwrap_or(f64::NAN);
    let r50 = Row::new("lat", &format!("8 B p50 [{m}] vs {tool} (2 x t_typical)"), "us", e50).size(size);
    let r99 = Row::new("lat", &format!("8 B p99 [{m}] vs {tool} (2 x 99%)"), "us", e99).size(size);
    let Some(t) = perftest_target(ctx, tool).await? else {
        rep.push(r50);
        rep.push(r99);
        return Ok(());
    };
    let iters = lat_iters(&ctx.o) as u64;
    ctx.progress("lat", 1.0, &format!("baseline: {tool} -s {size} -n {iters}"));
    let (typ, p99) = tokio::task::spawn_blocking(move || perftest::write_lat(&t, size, iters)).await??;
    rep.push(r50.baseline(tool, 2.0 * typ));
    rep.push(r99.baseline(tool, 2.0 * p99));
    Ok(())
}

/// The leader's round trips through futures: write_imm PING, await the PONG counter.
pub async fn engine_ping(s: &Side, size: usize, iters: usize) -> Res<Vec<Duration>> {
    let pong = s.engine.imm_counter(IMM_PONG);
    let mut writes = Vec::with_capacity(iters);
    let mut rtts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        // The write is posted when created; its local completion is collected at the end,
        // as the raw loop does.
        writes.push(s.engine.write_imm(&s.region, 0, &s.remote, 0, size as u64, IMM_PING));
        pong.wait_for(1).await.expect("engine shut down during the benchmark");
        rtts.push(t.elapsed());
    }
    for r in join_all(writes).await {
        r?;
    }
    Ok(rtts)
}

pub async fn engine_pong(s: &Side, size: usize, iters: usize) -> Res<()> {
    let ping = s.engine.imm_counter(IMM_PING);
    let mut writes = Vec::with_capacity(iters);
    for _ in 0..iters {
        ping.wait_for(1).await.expect("engine shut down during the benchmark");
        writes.push(s.engine.write_imm(&s.region, 0, &s.remote, 0, size as u64, IMM_PONG));
    }
    for r in join_all(writes).await {
        r?;
    }
    Ok(())
}

pub fn lat_iters(o: &Opts) -> usize {
    o.iters.unwrap_or(if o.quick { 200 } else { 3000 })
}

/// The engine mode of latency rows: Event on tcp; shm has no CQ wait fd (Event mode polls it
/// with a backoff up to 1 ms once 1 ms passed without activity), so BusyPoll there.
fn lat_mode(o: &Opts) -> ReactorMode {
    if o.provider == "shm" {
        ReactorMode::BusyPoll
    } else {
        ReactorMode::Event
    }
}

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let iters = lat_iters(&ctx.o);
    let mode = lat_mode(&ctx.o);
    let sizes = [8usize, 256, 4096];
    // The engine first, then the raw loop with the engine gone: a BusyPoll reactor left
    // spinning would steal a core from the raw loop on this 2-core machine.
    let mut eng = Vec::new();
    {
        let side = engine_side(ctx, mode, 1 << 20).await?;
        for (i, size) in sizes.into_iter().enumerate() {
            let frac = i as f64 / (2 * sizes.len()) as f64;
            ctx.progress("lat", frac, &format!("engine {} x{iters}", human(size)));
            ctx.barrier("ping").await?;
            if ctx.lead {
                eng.push(percentiles(&engine_ping(&side, size, iters).await?));
            } else {
                engine_pong(&side, size, iters).await?;
            }
        }
        ctx.barrier("lat-engine-end").await?;
    }
    let mut raw = Some(raw_side(ctx, 1 << 20).await?);
    let mut base = Vec::new();
    for (i, size) in sizes.into_iter().enumerate() {
        let frac = (sizes.len() + i) as f64 / (2 * sizes.len()) as f64;
        ctx.progress("lat", frac, &format!("raw {} x{iters}", human(size)));
        ctx.barrier("ping").await?;
        if ctx.lead {
            let (r2, rtts) =
                on_thread(raw.take().expect("raw"), move |r| r.ping(size, iters, IMM_PING, IMM_PONG)).await?;
            raw = Some(r2);
            base.push(percentiles(&rtts));
        } else {
            let (r2, ()) =
                on_thread(raw.take().expect("raw"), move |r| r.pong(size, iters, IMM_PING, IMM_PONG)).await?;
            raw = Some(r2);
        }
    }
    ctx.barrier("lat-raw-end").await?;
    drop(raw);
    // fabtests' ping-pong, with engine and raw loop gone (the peer waits).
    let ft = fabtests_rt(ctx, "lat", &sizes, iters).await?;
    if ctx.lead {
        for (i, size) in sizes.into_iter().enumerate() {
            let ((e50, e99), (b50, b99)) = (eng[i], base[i]);
            let m = mode_name(mode);
            let h = human(size);
            let p50 = Row::new("lat", &format!("{h} p50 [{m}]"), "us", e50).size(size).baseline("raw", b50);
            rep.push(match &ft {
                Some(ft) => p50.fabtests(ft[i].clone()),
                None => p50,
            });
            rep.push(Row::new("lat", &format!("{h} p99 [{m}]"), "us", e99).size(size).baseline("raw", b99));
        }
    }
    ctx.barrier("lat-end").await?;
    Ok(())
}

/// fabtests' `fi_rdm_pingpong -S SIZE -I ITERS` per size, run by the leader (the peer waits
/// at a barrier): the mean round trip, 2 x its one-way `usec/xfer`. `None` on verbs (perftest
/// is the baseline there); rows that say "skipped" without `--fabtests`.
pub async fn fabtests_rt(
    ctx: &mut Ctx,
    test: &str,
    sizes: &[usize],
    iters: usize,
) -> Res<Option<Vec<FtRef>>> {
    if on_verbs(&ctx.o) {
        return Ok(None);
    }
    let Some(dir) = ctx.o.fabtests.clone() else {
        return Ok(Some(vec![FtRef::Skipped(fabtests::SKIPPED.into()); sizes.len()]));
    };
    let mut v = Vec::new();
    if ctx.lead {
        let ft = Fabtests::new(&dir, &ctx.o.provider, &[fabtests::PINGPONG])?;
        for &size in sizes {
            let what = format!("baseline: fi_rdm_pingpong -S {size} -I {iters}");
            ctx.progress(test, 1.0, &what);
            let t = ft.clone();
            let one_way = tokio::task::spawn_blocking(move || t.pingpong(size, iters as u64)).await??;
            let extra = fabtests::extra_label();
            let tool =
                format!("fi_rdm_pingpong -S SIZE{extra}: mean round trip (2 x its one-way usec/xfer), us");
            v.push(FtRef::Value { tool, v: 2.0 * one_way });
        }
    }
    ctx.barrier(&format!("{test}-fabtests")).await?;
    Ok(Some(v))
}
