//! `rtt`: the latency-critical round trip against the raw loop, interleaved and pinned.
//!
//! `wake` measures each path once, one after the other, against one raw run. On the 16-core
//! device machine a pair of spinning threads moves by ±30% between runs, so a ratio of two
//! figures taken at different moments says little. Here every path runs in each of
//! `--rounds` rounds, in an order rotated by one each round; each side's measuring thread is
//! pinned to a physical core of its own, the same two for every path (`pin.rs`); every round
//! gives each path's p50 over the raw loop's p50 of the same round, and the rows give the
//! median of those per-round ratios with their range.
//!
//! Paths (8 B write_imm ping-pong): the raw loop; the synchronous spin path
//! (`post_write_imm` + `spin_wait`) on an `Inline` engine; futures on that `Inline` engine;
//! futures on an `Event` engine, without and with a `CompletionWatch` (where the provider
//! has a completion wait fd); and, where the measuring threads are pinned (three physical
//! cores or more: its reactor thread spins all along and needs a core of its own), the spin
//! path and futures on a `BusyPoll` engine, whose reactor thread is pinned to one more core
//! of its own where there are five (`pin::plan_reactors`). Futures run on the pinned thread in a
//! current-thread runtime, as docs/latency.md tells users of `Inline` to do. Futures of
//! the `Event` and `BusyPoll` engines linger as the engines' default says (the run's first
//! line; `--await-linger US` sets it).
//!
//! With `--fabtests DIR` (tcp, shm), fabtests' 8 B `fi_rdm_pingpong` is one more path of the
//! rotation: its client and server each run on one of the two measuring CPUs, so the
//! independent baseline is pinned like the paths it is compared with. It reports a mean
//! (2 x its one-way `usec/xfer`), not a p50; its row says so. Without DIR the rows say
//! "skipped", as in `lat`.

use std::sync::Arc;

use fabric_async::{CompletionWatch, ReactorMode};

use crate::fabtests::{self, Fabtests};
use crate::lat::{engine_ping, engine_pong};
use crate::measure::{percentiles, spread};
use crate::pair::{builder, engine_side_with, on_thread, raw_side, Ctx, Res, Side, IMM_PING, IMM_PONG};
use crate::pin::{self, Pinned};
use crate::raw::Raw;
use crate::report::{FtRef, Report, Rounds, Row};
use crate::wake::spin_ping;
use crate::{on_verbs, Opts};

const SIZE: usize = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Raw,
    InlineSpin,
    InlineFutures,
    EventFutures,
    EventWatch,
    BusySpin,
    BusyFutures,
    /// fabtests' `fi_rdm_pingpong`, run by the leader (`--fabtests DIR`).
    Fabtests,
}

impl Path {
    /// Its name in `FABRIC_BENCH_RTT_PATHS`.
    fn key(self) -> &'static str {
        match self {
            Path::Raw => "raw",
            Path::InlineSpin => "spin",
            Path::InlineFutures => "futures",
            Path::EventFutures => "event",
            Path::EventWatch => "watch",
            Path::BusySpin => "busyspin",
            Path::BusyFutures => "busy",
            Path::Fabtests => "fabtests",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Path::Raw => "raw loop",
            Path::InlineSpin => "Inline spin path",
            Path::InlineFutures => "Inline futures",
            Path::EventFutures => "Event futures",
            Path::EventWatch => "Event futures + CompletionWatch",
            Path::BusySpin => "BusyPoll spin path",
            Path::BusyFutures => "BusyPoll futures",
            Path::Fabtests => "fi_rdm_pingpong",
        }
    }
}

/// Round `r`'s order: the paths rotated left by `r`, so that each runs first in some round.
fn order(paths: &[Path], r: usize) -> Vec<Path> {
    let mut v = paths.to_vec();
    let k = r % v.len().max(1);
    v.rotate_left(k);
    v
}

/// Rounds: `--rounds`, else 7 (quick: 2).
pub fn rounds(o: &Opts) -> usize {
    o.rounds.unwrap_or(if o.quick { 2 } else { 7 })
}

/// Round trips per path per round: `--iters`, else 2000 (quick: 200).
fn iters(o: &Opts) -> usize {
    o.iters.unwrap_or(if o.quick { 200 } else { 2000 })
}

struct Sides {
    raw: Option<Raw>,
    inline: Arc<Side>,
    event: Arc<Side>,
    /// A `BusyPoll` engine, where the measuring threads are pinned.
    busy: Option<Arc<Side>>,
    /// The leader's fabtests, pinned to the two measuring CPUs.
    ft: Option<Fabtests>,
}

/// One path's round trips on this side, on a thread pinned to `cpu`: their p50 (µs) on the
/// leader, `None` on the peer (which times nothing). fabtests' path gives its mean round trip
/// (the leader runs both of its processes; the peer waits at the next barrier).
async fn run_path(path: Path, lead: bool, cpu: Option<usize>, n: usize, s: &mut Sides) -> Res<Option<f64>> {
    let rtts = match path {
        Path::Fabtests => {
            let Some(ft) = s.ft.clone() else { return Ok(None) };
            let one_way = tokio::task::spawn_blocking(move || ft.pingpong(SIZE, n as u64)).await??;
            return Ok(Some(2.0 * one_way));
        }
        Path::Raw => {
            let (r, rtts) = on_thread(s.raw.take().expect("raw side"), move |r| {
                let _pin = Pinned::to(cpu);
                if lead {
                    r.ping(SIZE, n, IMM_PING, IMM_PONG)
                } else {
                    r.pong(SIZE, n, IMM_PING, IMM_PONG).map(|()| Vec::new())
                }
            })
            .await?;
            s.raw = Some(r);
            rtts
        }
        Path::InlineSpin | Path::BusySpin => {
            let side =
                if path == Path::InlineSpin { s.inline.clone() } else { s.busy.clone().expect("busy side") };
            tokio::task::spawn_blocking(move || {
                let _pin = Pinned::to(cpu);
                spin_ping(&side, SIZE, n, lead)
            })
            .await??
        }
        Path::InlineFutures | Path::EventFutures | Path::EventWatch | Path::BusyFutures => {
            let side = match path {
                Path::InlineFutures => s.inline.clone(),
                Path::BusyFutures => s.busy.clone().expect("busy side"),
                _ => s.event.clone(),
            };
            let watch = path == Path::EventWatch;
            tokio::task::spawn_blocking(move || -> Res<Vec<_>> {
                let _pin = Pinned::to(cpu);
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async {
                    // The watch lives on this runtime, beside the awaiting task.
                    let _watch = if watch { Some(CompletionWatch::spawn(&side.engine)?) } else { None };
                    if lead {
                        engine_ping(&side, SIZE, n).await
                    } else {
                        engine_pong(&side, SIZE, n).await.map(|()| Vec::new())
                    }
                })
            })
            .await??
        }
    };
    Ok((lead && !rtts.is_empty()).then(|| percentiles(&rtts).0))
}

pub async fn run(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let (rounds, n) = (rounds(&ctx.o), iters(&ctx.o));
    let plan = pin::plan();
    let cpu = plan.map(|p| if ctx.lead { p[0] } else { p[1] });
    if ctx.lead {
        ctx.note(&match plan {
            Some([a, b]) => {
                let busy = match pin::plan_reactors() {
                    Some([c, d]) => format!("; BusyPoll reactor threads to cpu {c} and cpu {d}"),
                    None => String::new(),
                };
                format!("rtt: measuring threads pinned to cpu {a} (leader) and cpu {b} (peer){busy}")
            }
            None => "rtt: not pinned (fewer than three physical cores)".to_string(),
        });
    }
    let raw = Some(raw_side(ctx, 1 << 20).await?);
    let inline = Arc::new(engine_side_with(ctx, builder(&ctx.o).mode(ReactorMode::Inline), 1 << 20).await?);
    let event = Arc::new(engine_side_with(ctx, builder(&ctx.o).mode(ReactorMode::Event), 1 << 20).await?);
    // A BusyPoll reactor spins for as long as its engine lives: only where the measuring
    // threads have cores of their own (both sides see the same machine and decide alike).
    let busy = match plan {
        Some(_) => {
            let mut b = builder(&ctx.o).mode(ReactorMode::BusyPoll);
            if let Some(r) = pin::plan_reactors() {
                b = b.pin_core(if ctx.lead { r[0] } else { r[1] });
            }
            Some(Arc::new(engine_side_with(ctx, b, 1 << 20).await?))
        }
        None => {
            if ctx.lead {
                ctx.note("rtt: BusyPoll paths skipped: fewer than three physical cores");
            }
            None
        }
    };
    let mut paths = vec![Path::Raw, Path::InlineSpin, Path::InlineFutures, Path::EventFutures];
    if busy.is_some() {
        paths.extend([Path::BusySpin, Path::BusyFutures]);
    }
    // A watch needs a completion wait fd on every NIC (not shm): both sides have the same
    // provider, so they decide alike.
    match CompletionWatch::spawn(&event.engine) {
        Ok(_) => paths.push(Path::EventWatch),
        Err(e) if ctx.lead => ctx.note(&format!("rtt: {} skipped: {e}", Path::EventWatch.name())),
        Err(_) => {}
    }
    // fabtests' ping-pong: a path of its own, its processes on the measuring CPUs (the
    // client on the leader's, the server on the peer's). Both sides know whether it runs.
    let with_ft = ctx.o.fabtests.is_some() && !on_verbs(&ctx.o);
    let ft = match &ctx.o.fabtests {
        Some(dir) if with_ft && ctx.lead => {
            Some(Fabtests::new(dir, &ctx.o.provider, &[fabtests::PINGPONG])?.pinned(plan))
        }
        _ => None,
    };
    if with_ft {
        paths.push(Path::Fabtests);
    }
    // Profiling one path (perf record on a run of it alone): FABRIC_BENCH_RTT_PATHS=raw,spin,
    // futures,event,watch,fabtests keeps those; the raw loop always runs, as every ratio's baseline.
    if let Ok(keep) = std::env::var("FABRIC_BENCH_RTT_PATHS") {
        let keep: Vec<&str> = keep.split(',').map(str::trim).collect();
        paths.retain(|p| *p == Path::Raw || keep.contains(&p.key()));
    }
    let mut sides = Sides { raw, inline, event, busy, ft };
    // p50 per path per round (leader only).
    let mut p50: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    let steps = (rounds * paths.len()) as f64;
    for r in 0..rounds {
        for (k, path) in order(&paths, r).into_iter().enumerate() {
            ctx.progress(
                "rtt",
                (r * paths.len() + k) as f64 / steps,
                &format!("round {}/{rounds}: {} x{n}", r + 1, path.name()),
            );
            ctx.barrier("rtt").await?;
            let got = run_path(path, ctx.lead, cpu, n, &mut sides).await?;
            let i = paths.iter().position(|&p| p == path).expect("a listed path");
            p50[i].extend(got);
        }
    }
    ctx.barrier("rtt-end").await?;
    if !ctx.lead {
        return Ok(());
    }
    let raw50 = &p50[0];
    let pinned = if plan.is_some() { "pinned" } else { "unpinned" };
    // Beside every p50 row: fabtests' median round trip, or why there is none (verbs has
    // perftest instead: no column, as in `lat`).
    let ft_ref = match paths.iter().position(|&p| p == Path::Fabtests) {
        Some(i) => Some(FtRef::Value {
            tool: format!(
                "fi_rdm_pingpong -S 8{}: mean round trip (2 x its one-way usec/xfer), us",
                fabtests::extra_label()
            ),
            v: spread(&p50[i]).0,
        }),
        None if on_verbs(&ctx.o) => None,
        None => Some(FtRef::Skipped(fabtests::SKIPPED.into())),
    };
    for (i, path) in paths.iter().enumerate() {
        let (med, lo, hi) = spread(&p50[i]);
        let stat = if *path == Path::Fabtests { "mean round trip (2 x one-way)" } else { "p50" };
        let case = format!(
            "{} 8 B {stat}, median of {rounds} rounds ({pinned}; range {lo:.2}-{hi:.2})",
            path.name()
        );
        let mut row = Row::new("rtt", &case, "us", med).size(SIZE);
        // The raw loop's own figure against fabtests is each path row's raw/ft column.
        if let (Some(f), false) = (&ft_ref, matches!(path, Path::Raw | Path::Fabtests)) {
            row = row.fabtests(f.clone());
        }
        if *path != Path::Raw {
            row = row.baseline("raw", spread(raw50).0);
            let ratios: Vec<f64> = p50[i].iter().zip(raw50).map(|(e, b)| e / b).collect();
            let (rm, k) = Rounds::of(&ratios);
            rep.push(row);
            let what = format!("{} / raw loop, median of per-round ratios ({})", path.name(), k.label());
            rep.push(Row::new("rtt", &what, "x", rm).size(SIZE).rounds(k));
        } else {
            rep.push(row);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_leads_one_round_in_turn() {
        let p = [Path::Raw, Path::InlineSpin, Path::InlineFutures];
        assert_eq!(order(&p, 0), p);
        assert_eq!(order(&p, 1), [Path::InlineSpin, Path::InlineFutures, Path::Raw]);
        assert_eq!(order(&p, 3), p);
    }
}
