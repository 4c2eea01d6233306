//! `rate`: imm-only operations per second, through futures and through `post_imm` +
//! `OpBatch`, beside the raw provider loop's imm-only rate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::OpBatch;

use crate::measure::median;
use crate::pair::{
    engine_absorb, engine_side, engine_stream, on_thread, raw_side, Ctx, Res, Side, IMM_ACK, IMM_DATA,
};
use crate::pattern::Pattern;
use crate::report::{Report, Row};
use crate::{on_verbs, Opts};

fn rate_ops(o: &Opts) -> u64 {
    let n = match (on_verbs(o), o.quick) {
        (false, true) => 5_000,
        (false, false) => 200_000,
        (true, true) => 2_000,
        (true, false) => 20_000,
    };
    o.iters.map_or(n, |n| n as u64)
}

pub const RATE_WINDOW: usize = 64;

/// Imm-only ops/s through the sync path: post_imm into an OpBatch, keep `window` in flight.
fn batch_stream(s: &Side, ops: u64, window: u64) -> Res<Duration> {
    let batch = OpBatch::new();
    let ack = s.engine.imm_counter(IMM_ACK);
    let t0 = Instant::now();
    let mut posted = 0;
    while posted < ops {
        if posted - batch.completed() < window {
            s.engine.post_imm(&batch, &s.remote, IMM_DATA)?;
            posted += 1;
        } else {
            std::hint::spin_loop();
        }
    }
    if !batch.spin_until(ops, Duration::from_secs(60))? {
        return Err("batch never completed".into());
    }
    if !ack.spin_wait(1, Duration::from_secs(60)) {
        return Err("no ack".into());
    }
    Ok(t0.elapsed())
}

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let ops = rate_ops(&ctx.o);
    let reps = if ctx.o.quick { 1 } else { 3 };
    let side = Arc::new(engine_side(ctx, ctx.o.mode, 1 << 20).await?);
    let mut raw = Some(raw_side(ctx, 1 << 20).await?);
    let (mut e, mut b) = (Vec::new(), Vec::new());
    for r in 0..reps {
        ctx.progress(
            "rate",
            r as f64 / (reps + 1) as f64,
            &format!("imm futures x{ops} rep {}/{reps}", r + 1),
        );
        if ctx.lead {
            e.push(ops as f64 / engine_stream(&side, 0, ops, RATE_WINDOW, Pattern::Hot).await?.as_secs_f64());
            let (r2, t) = on_thread(raw.take().expect("raw"), move |r| {
                r.stream(0, ops, RATE_WINDOW as u64, (IMM_DATA, IMM_ACK), Pattern::Hot)
            })
            .await?;
            raw = Some(r2);
            b.push(ops as f64 / t.as_secs_f64());
        } else {
            engine_absorb(&side, ops, 0).await?;
            let (r2, ()) =
                on_thread(raw.take().expect("raw"), move |r| r.absorb(ops, IMM_DATA, IMM_ACK)).await?;
            raw = Some(r2);
        }
    }
    ctx.barrier("rate-end").await?;
    if ctx.lead {
        let base = median(b);
        rep.push(
            Row::new("rate", &format!("imm futures, window {RATE_WINDOW}"), "ops_per_s", median(e))
                .baseline("raw", base),
        );
        rep.set_raw_rate(base);
    }
    // The same through post_imm + OpBatch (Event reactor; the caller spins on the batch).
    ctx.progress("rate", reps as f64 / (reps + 1) as f64, &format!("post_imm+OpBatch x{ops}"));
    ctx.barrier("rate-batch").await?;
    if ctx.lead {
        let s = side.clone();
        let t = tokio::task::spawn_blocking(move || batch_stream(&s, ops, RATE_WINDOW as u64)).await??;
        let v = ops as f64 / t.as_secs_f64();
        let row = Row::new("rate", &format!("imm post_imm+OpBatch, window {RATE_WINDOW}"), "ops_per_s", v);
        rep.push(row.baseline("raw", rep.raw_rate().unwrap_or(f64::NAN)));
    } else {
        engine_absorb(&side, ops, 0).await?;
    }
    ctx.barrier("rate-batch-end").await?;
    Ok(())
}
