//! `wake`: the cost of waking up. An 8 B ping-pong in each reactor mode (Event, Adaptive,
//! BusyPoll) and through the synchronous spin path, with the process's CPU use while
//! ping-ponging and while idle, beside the raw loop, fabtests' 8 B `fi_rdm_pingpong` (with
//! `--fabtests DIR`) and an OS thread park/unpark round trip.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::{OpBatch, ReactorMode};

use crate::lat::{engine_ping, engine_pong, fabtests_rt, lat_iters};
use crate::measure::{cpu_time, percentiles};
use crate::on_verbs;
use crate::pair::{
    builder, engine_side_with, mode_name, on_thread, raw_side, Ctx, Res, Side, IMM_PING, IMM_PONG,
};
use crate::report::{Report, Row};

/// The synchronous path: post_write_imm into an OpBatch, spin_wait on the counter.
pub fn spin_ping(s: &Side, size: usize, iters: usize, lead: bool) -> Res<Vec<Duration>> {
    let batch = OpBatch::new();
    let (wait, send) = if lead { (IMM_PONG, IMM_PING) } else { (IMM_PING, IMM_PONG) };
    let counter = s.engine.imm_counter(wait);
    let mut rtts = Vec::with_capacity(iters);
    let tmo = Duration::from_secs(30);
    for _ in 0..iters {
        let t = Instant::now();
        if lead {
            s.engine.post_write_imm(&batch, &s.region, 0, &s.remote, 0, size as u64, send)?;
        }
        if !counter.spin_wait(1, tmo) {
            return Err("spin_wait timed out".into());
        }
        if !lead {
            s.engine.post_write_imm(&batch, &s.region, 0, &s.remote, 0, size as u64, send)?;
        }
        rtts.push(t.elapsed());
    }
    if !batch.spin_until(iters as u64, tmo)? {
        return Err("OpBatch::spin_until timed out".into());
    }
    Ok(rtts)
}

/// Round trips between two threads that sleep in `thread::park` (futex) and wake each other.
fn thread_handoff(iters: usize) -> Vec<Duration> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let turn = Arc::new(AtomicU64::new(0));
    let main = std::thread::current();
    let t2 = turn.clone();
    let other = std::thread::spawn(move || {
        for i in 0..iters as u64 {
            while t2.load(Ordering::Acquire) != 2 * i + 1 {
                std::thread::park();
            }
            t2.store(2 * i + 2, Ordering::Release);
            main.unpark();
        }
    });
    let mut rtts = Vec::with_capacity(iters);
    for i in 0..iters as u64 {
        let t = Instant::now();
        turn.store(2 * i + 1, Ordering::Release);
        other.thread().unpark();
        while turn.load(Ordering::Acquire) != 2 * i + 2 {
            std::thread::park();
        }
        rtts.push(t.elapsed());
    }
    other.join().expect("handoff thread");
    rtts
}

#[derive(Clone, Copy)]
enum WakeCase {
    Mode(ReactorMode),
    /// Event mode with `EngineBuilder::direct_post(false)`: every post wakes the reactor.
    EventNoDirect,
    /// Event mode with a `CompletionWatch` on the awaiting runtime.
    EventWatch,
    /// post_write_imm + spin_wait on the caller's thread, reactor in this mode.
    Spin(ReactorMode),
}

async fn run_wake(ctx: &Ctx, case: WakeCase, side: &Arc<Side>, size: usize, n: usize) -> Res<Vec<Duration>> {
    Ok(match case {
        // Inline futures spin on the awaiting thread: give them one of their own, with a
        // current-thread runtime, as docs/latency.md tells users to.
        WakeCase::Mode(ReactorMode::Inline) => {
            let (s, lead) = (side.clone(), ctx.lead);
            tokio::task::spawn_blocking(move || -> Res<Vec<Duration>> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async {
                    if lead {
                        engine_ping(&s, size, n).await
                    } else {
                        engine_pong(&s, size, n).await.map(|()| Vec::new())
                    }
                })
            })
            .await??
        }
        WakeCase::Mode(_) | WakeCase::EventNoDirect | WakeCase::EventWatch if ctx.lead => {
            engine_ping(side, size, n).await?
        }
        WakeCase::Mode(_) | WakeCase::EventNoDirect | WakeCase::EventWatch => {
            engine_pong(side, size, n).await?;
            Vec::new()
        }
        WakeCase::Spin(_) => {
            let (s, lead) = (side.clone(), ctx.lead);
            tokio::task::spawn_blocking(move || spin_ping(&s, size, n, lead)).await??
        }
    })
}

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let iters = lat_iters(&ctx.o);
    let idle = Duration::from_millis(if ctx.o.quick { 300 } else { 1000 });
    let size = 8;
    // The raw baseline, once, with its CPU use.
    let mut raw = Some(raw_side(ctx, 1 << 20).await?);
    ctx.barrier("wake-raw").await?;
    let (raw50, raw_cpu) = if ctx.lead {
        let (c0, t0) = (cpu_time(), Instant::now());
        let (_, rtts) =
            on_thread(raw.take().expect("raw"), move |r| r.ping(size, iters, IMM_PING, IMM_PONG)).await?;
        let cpu = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0;
        (percentiles(&rtts).0, cpu)
    } else {
        on_thread(raw.take().expect("raw"), move |r| r.pong(size, iters, IMM_PING, IMM_PONG)).await?;
        (0.0, 0.0)
    };
    ctx.barrier("wake-raw-end").await?;
    // fabtests' 8 B ping-pong beside every p50 row (the peer waits at a barrier).
    let ft = fabtests_rt(ctx, "wake", &[size], iters).await?.and_then(|v| v.into_iter().next());
    if ctx.lead {
        // What one cross-thread wake-up costs on this machine: the engine hands every
        // operation from the caller to the reactor and every completion back.
        let (p50, p99) = percentiles(&thread_handoff(iters));
        rep.push(Row::new("wake", "OS: thread park/unpark round trip p50", "us", p50));
        rep.push(Row::new("wake", "OS: thread park/unpark round trip p99", "us", p99));
    }
    let cases = [
        WakeCase::Mode(ReactorMode::Event),
        WakeCase::EventNoDirect,
        WakeCase::EventWatch,
        WakeCase::Mode(ReactorMode::Adaptive { spin: Duration::from_micros(200) }),
        WakeCase::Mode(ReactorMode::BusyPoll),
        WakeCase::Mode(ReactorMode::Inline),
        WakeCase::Spin(ReactorMode::Event),
        WakeCase::Spin(ReactorMode::BusyPoll),
        WakeCase::Spin(ReactorMode::Inline),
    ];
    let ncases = cases.len() as f64;
    for (c, case) in cases.into_iter().enumerate() {
        let (name, mode) = match case {
            WakeCase::Mode(m) => (mode_name(m).to_string(), m),
            WakeCase::EventNoDirect => ("Event, no direct post".to_string(), ReactorMode::Event),
            WakeCase::EventWatch => ("Event + CompletionWatch".to_string(), ReactorMode::Event),
            WakeCase::Spin(m) => (format!("spin path ({})", mode_name(m)), m),
        };
        ctx.progress("wake", c as f64 / ncases, &format!("{name}: probe"));
        let direct = !matches!(case, WakeCase::EventNoDirect);
        let side =
            Arc::new(engine_side_with(ctx, builder(&ctx.o).mode(mode).direct_post(direct), 1 << 20).await?);
        // Providers without a wait fd (shm) have nothing to watch: the row says so.
        let _watch = match case {
            WakeCase::EventWatch => match fabric_async::CompletionWatch::spawn(&side.engine) {
                Ok(w) => Some(w),
                Err(e) => {
                    ctx.note(&format!("wake: {name} skipped: {e}"));
                    ctx.barrier("wake-end").await?;
                    continue;
                }
            },
            _ => None,
        };
        // Some cases are pathological on 2 cores (four spinning threads): a short probe sets
        // how many round trips fit in about 3 s (verbs in the VM: 1.5 s, quick 0.5 s), so the
        // run stays bounded in time.
        let (probe, budget_us) = match (on_verbs(&ctx.o), ctx.o.quick) {
            (false, _) => (20, 3e6),
            (true, false) => (10, 1.5e6),
            (true, true) => (10, 0.5e6),
        };
        let rt = run_wake(ctx, case, &side, size, probe).await?;
        let n = if ctx.lead {
            let p50 = percentiles(&rt).0.max(1.0);
            let n = (iters as f64).min(budget_us / p50).max(probe as f64) as u64;
            ctx.swap("wake-n", n.to_le_bytes().to_vec()).await?;
            n as usize
        } else {
            u64::from_le_bytes(ctx.swap("wake-n", Vec::new()).await?[..8].try_into()?) as usize
        };
        ctx.progress("wake", (c as f64 + 0.1) / ncases, &format!("{name} x{n}"));
        ctx.barrier("wake-go").await?;
        let (c0, t0) = (cpu_time(), Instant::now());
        let rtts = run_wake(ctx, case, &side, size, n).await?;
        let busy_cpu = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0;
        // Idle: both sides keep their engines and do nothing.
        ctx.barrier("wake-idle").await?;
        let (c1, t1) = (cpu_time(), Instant::now());
        tokio::time::sleep(idle).await;
        let idle_cpu = (cpu_time() - c1).as_secs_f64() / t1.elapsed().as_secs_f64() * 100.0;
        ctx.barrier("wake-end").await?;
        drop(side);
        if ctx.lead {
            let (p50, p99) = percentiles(&rtts);
            let name = format!("{name} ({} RT)", rtts.len());
            let row =
                Row::new("wake", &format!("{name} 8 B p50"), "us", p50).size(size).baseline("raw", raw50);
            rep.push(match &ft {
                Some(f) => row.fabtests(f.clone()),
                None => row,
            });
            rep.push(Row::new("wake", &format!("{name} 8 B p99"), "us", p99).size(size));
            rep.push(
                Row::new("wake", &format!("{name} CPU while ping-pong"), "cpu_pct", busy_cpu)
                    .baseline("raw", raw_cpu),
            );
            rep.push(Row::new("wake", &format!("{name} CPU idle"), "cpu_pct", idle_cpu));
        }
    }
    Ok(())
}
