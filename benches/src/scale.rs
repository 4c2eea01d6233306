//! `scale`: one engine writing to 1..256 peer engines (bandwidth and RSS per peer), then
//! 1..100,000 imm futures in flight at once (rate and RSS per future).

use std::collections::VecDeque;
use std::time::Instant;

use fabric_async::ReactorMode;
use futures::future::join_all;

use crate::measure::{gbps, mem_available, rss, trim};
use crate::pair::{
    builder, engine_absorb, engine_side, fill, on_thread, raw_side, Ctx, Res, IMM_ACK, IMM_DATA, IMM_WARM,
};
use crate::pattern::Pattern;
use crate::rate::RATE_WINDOW;
use crate::report::{Report, Row};
use crate::{on_verbs, Test};

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let verbs = on_verbs(&ctx.o);
    let peer_counts: Vec<usize> = match (verbs, ctx.o.quick) {
        (_, true) => vec![1, 4],
        (false, false) => vec![1, 4, 16, 64, 256],
        (true, false) => vec![1, 4, 16],
    };
    let size = 64usize << 10;
    // About 256 MiB per point (quick: 16 MiB; verbs: 16 MiB, quick 4 MiB), spread evenly over
    // the peers.
    let total: u64 = match (verbs, ctx.o.quick) {
        (false, true) => 256,
        (false, false) => 4096,
        (true, true) => 64,
        (true, false) => 256,
    };
    let mut one_peer = None;
    for (j, &k) in peer_counts.iter().enumerate() {
        let what = format!("{}/{} {k} peers", j + 1, peer_counts.len());
        ctx.progress("scale", 0.5 * j as f64 / peer_counts.len() as f64, &what);
        let per_peer = total.div_ceil(k as u64).max(16);
        // The peer process hosts k engines (k reactor threads, k endpoints); the leader has
        // one engine with k peers.
        if ctx.lead {
            let engine = builder(&ctx.o).build()?;
            let src = engine.alloc(size).await?;
            fill(&src)?;
            let theirs = ctx.swap("scale", src.descriptor().to_bytes()).await?;
            let descs = decode_descs(&theirs)?;
            trim();
            let rss0 = rss();
            let mut remotes = Vec::with_capacity(k);
            for d in &descs {
                let r = engine.remote_region(d).await?;
                engine.imm(&r, IMM_WARM).await?;
                remotes.push(r);
            }
            let ops = per_peer * k as u64;
            let ack = engine.imm_counter(IMM_ACK);
            let t0 = Instant::now();
            let mut inflight = VecDeque::new();
            for i in 0..ops {
                let dst = &remotes[i as usize % k];
                inflight.push_back(engine.write_imm(&src, 0, dst, 0, size as u64, IMM_DATA));
                if inflight.len() >= ctx.o.window {
                    inflight.pop_front().expect("non-empty").await?;
                }
            }
            for f in inflight {
                f.await?;
            }
            ack.wait_for(1).await.expect("engine shut down during the benchmark");
            let g = gbps(size as u64 * ops, t0.elapsed());
            let lead_per_peer = rss().saturating_sub(rss0) as f64 / k as f64;
            let base = *one_peer.get_or_insert(g);
            let msg = ctx.swap("scale-rss", Vec::new()).await?;
            let rss_peer = f64::from_le_bytes(msg[..8].try_into()?);
            let stop = msg[8] != 0;
            let label = format!("{k} peers, 64 KiB write_imm");
            rep.push(Row::new("scale", &label, "gbps", g).baseline("1 peer", base));
            rep.push(Row::new(
                "scale",
                &format!("{k} peers: leader RSS per peer"),
                "kib",
                lead_per_peer / 1024.0,
            ));
            rep.push(Row::new(
                "scale",
                &format!("{k} peers: peer-process RSS per engine"),
                "kib",
                rss_peer / 1024.0,
            ));
            ctx.barrier("scale-end").await?;
            if stop {
                ctx.note(&format!(
                    "scale: stopped after {k} peer engines: the next step would need more than half \
                     the free memory"
                ));
                break;
            }
        } else {
            trim();
            let rss0 = rss();
            let mut engines = Vec::with_capacity(k);
            for _ in 0..k {
                let e = builder(&ctx.o).build()?;
                let r = e.alloc(size).await?;
                engines.push((e, r));
            }
            let mut msg = Vec::new();
            for (_, r) in &engines {
                let d = r.descriptor().to_bytes();
                msg.extend_from_slice(&(d.len() as u32).to_le_bytes());
                msg.extend_from_slice(&d);
            }
            let lead_desc = ctx.swap("scale", msg).await?;
            // Engine 0 acks into the leader's region once every engine has its arrivals.
            let (e0, _) = &engines[0];
            let back = e0.remote_region(&lead_desc).await?;
            let waits = engines.iter().map(|(e, _)| e.imm_counter(IMM_DATA).wait_for(per_peer));
            for r in join_all(waits).await {
                r?;
            }
            e0.imm(&back, IMM_ACK).await?;
            // After traffic, so that pools the provider fills lazily are counted.
            let per = rss().saturating_sub(rss0) as f64 / k as f64;
            // Each engine costs tens of MiB on tcp (provider buffer pools): do not let the
            // next step exhaust the machine.
            let next = peer_counts.iter().find(|&&n| n > k).copied().unwrap_or(0);
            let stop = per * next as f64 > mem_available() as f64 / 2.0;
            let mut msg = per.to_le_bytes().to_vec();
            msg.push(stop as u8);
            ctx.swap("scale-rss", msg).await?;
            drop(engines);
            ctx.barrier("scale-end").await?;
            if stop {
                break;
            }
        }
    }
    inflight_test(ctx, rep).await
}

fn decode_descs(b: &[u8]) -> Res<Vec<Vec<u8>>> {
    let mut v = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let n = u32::from_le_bytes(b[i..i + 4].try_into()?) as usize;
        v.push(b[i + 4..i + 4 + n].to_vec());
        i += 4 + n;
    }
    Ok(v)
}

async fn inflight_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let counts: Vec<u64> = match (on_verbs(&ctx.o), ctx.o.quick) {
        (_, true) => vec![1, 100, 1000],
        (false, false) => vec![1, 10, 100, 1000, 10_000, 100_000],
        (true, false) => vec![1, 10, 100, 1000, 10_000],
    };
    let side = engine_side(ctx, ReactorMode::Event, 1 << 20).await?;
    // The baseline is the raw loop's imm-only rate: measured by `rate`, or here if it did not run.
    if !ctx.o.runs(Test::Rate) {
        let ops = match (on_verbs(&ctx.o), ctx.o.quick) {
            (false, true) => 5_000,
            (false, false) => 50_000,
            (true, true) => 2_000,
            (true, false) => 20_000,
        };
        let raw = raw_side(ctx, 1 << 20).await?;
        if ctx.lead {
            let (_, t) = on_thread(raw, move |r| {
                r.stream(0, ops, RATE_WINDOW as u64, (IMM_DATA, IMM_ACK), Pattern::Hot)
            })
            .await?;
            rep.set_raw_rate(ops as f64 / t.as_secs_f64());
        } else {
            on_thread(raw, move |r| r.absorb(ops, IMM_DATA, IMM_ACK)).await?;
        }
        ctx.barrier("inflight-raw").await?;
    }
    for (i, &n) in counts.iter().enumerate() {
        let what = format!("{}/{} {n} futures in flight", i + 1, counts.len());
        ctx.progress("scale", 0.5 + 0.5 * i as f64 / counts.len() as f64, &what);
        ctx.barrier("inflight").await?;
        if ctx.lead {
            trim();
            let rss0 = rss();
            let ack = side.engine.imm_counter(IMM_ACK);
            let t0 = Instant::now();
            let futs: Vec<_> = (0..n).map(|_| side.engine.imm(&side.remote, IMM_DATA)).collect();
            let rss1 = rss();
            for r in join_all(futs).await {
                r?;
            }
            ack.wait_for(1).await.expect("engine shut down during the benchmark");
            let rate = n as f64 / t0.elapsed().as_secs_f64();
            let row = Row::new("scale", &format!("{n} imm futures in flight"), "ops_per_s", rate);
            rep.push(row.baseline("raw rate", rep.raw_rate().unwrap_or(f64::NAN)));
            let per = rss1.saturating_sub(rss0) as f64 / n as f64;
            rep.push(Row::new("scale", &format!("{n} in flight: RSS per future"), "bytes", per));
        } else {
            engine_absorb(&side, n, 0).await?;
        }
    }
    ctx.barrier("inflight-end").await?;
    Ok(())
}
