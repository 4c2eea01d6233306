//! The run: the tests in order, in both processes, and the leader's report.
//!
//! The leader ([`leader_main`]) starts the peer process (`Ctx::leader`), both run
//! [`run_tests`] (each test playing its side, meeting through the `Ctx`), and once the peer has
//! exited the leader prints the table, writes `--json` and the plot. The tests' modules use
//! `pair.rs`; this module uses them: the imports flow one way.

use std::path::PathBuf;
use std::time::Instant;

use crate::fabtests::{self, Fabtests};
use crate::pair::{builder, mode_name, Ctx, Res};
use crate::report::Report;
use crate::{bw, lat, peers, rate, rtt, scale, wake, Opts, Test};

pub async fn leader_main(o: Opts) -> Res<()> {
    // A `--fabtests DIR` without the binaries the run needs fails here, before any test.
    if let Some(dir) = &o.fabtests {
        let mut tools = Vec::new();
        if o.runs(Test::Bw) {
            tools.push(fabtests::RMA_BW);
        }
        if o.runs(Test::Lat) || o.runs(Test::Wake) || o.runs(Test::Rtt) {
            tools.push(fabtests::PINGPONG);
        }
        Fabtests::new(dir, &o.provider, &tools)?;
    }
    let (mut ctx, mut child) = Ctx::leader(o.clone()).await?;
    let linger = builder(&o).mode(o.mode).linger_budget();
    let window = builder(&o).mode(o.mode).reactor_poll_window();
    let mut rep = Report::new(&o.provider);
    rep.set_linger(linger);
    rep.set_poll_window(window);
    eprintln!(
        "fabric-bench {} on {} ({} cores{}{}){}{}",
        o.test.name(),
        o.provider,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if linger.is_zero() {
            ", futures park at once".to_string()
        } else {
            format!(", futures linger {} us", linger.as_micros())
        },
        if window.is_zero() {
            ", reactors sleep at once when idle".to_string()
        } else {
            format!(", reactors poll {} us after activity", window.as_micros())
        },
        if o.quick { ", quick" } else { "" },
        if o.domain_counts.len() > 1 || o.domains > 1 {
            let n: Vec<String> = o.domain_counts.iter().map(|n| n.to_string()).collect();
            format!(", engines with {} domains (raw baselines: 1)", n.join(","))
        } else {
            String::new()
        }
    );
    let t0 = Instant::now();
    let result = run_tests(&mut ctx, &mut rep).await;
    ctx.finish_progress();
    eprintln!("done in {:.1} s", t0.elapsed().as_secs_f64());
    if result.is_err() {
        // The peer may be waiting for this side at the store (up to its 300 s timeout).
        let _ = child.kill();
    }
    let status = tokio::task::spawn_blocking(move || child.wait()).await??;
    result?;
    if !status.success() {
        return Err(format!("the peer process exited with {status}").into());
    }
    // `--peer`: the other libraries, with nothing else running (their rows go beside bw's).
    if o.runs(Test::Bw) {
        peers::run(&o, &mut rep).await;
    }
    rep.print();
    if let Some(p) = &o.json {
        rep.write_json(p)?;
        println!("json: {}", p.display());
    }
    if rep.has_bw() {
        let path = o.plot.clone().unwrap_or_else(|| {
            let dir = PathBuf::from("target/fabric-bench");
            let _ = std::fs::create_dir_all(&dir);
            dir.join(format!("bw-{}.png", o.provider))
        });
        // The plot draws the first pattern and domain count (`Report::plot_bw`).
        let engine = match o.domains {
            1 => format!("futures, {}", mode_name(o.mode)),
            n => format!("futures, {}, {n} domains", mode_name(o.mode)),
        };
        match rep.plot_bw(&path, &engine) {
            Ok(()) => println!("plot: {}", path.display()),
            Err(e) => println!("plot: not written: {e}"),
        }
    }
    Ok(())
}

pub async fn peer_main(o: Opts, addr: String) -> Res<()> {
    let mut ctx = Ctx::peer(o, &addr).await?;
    let mut rep = Report::new("");
    run_tests(&mut ctx, &mut rep).await
}

async fn run_tests(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let o = &ctx.o;
    let (bw, lat, rate, wake, scale) =
        (o.runs(Test::Bw), o.runs(Test::Lat), o.runs(Test::Rate), o.runs(Test::Wake), o.runs(Test::Scale));
    if bw {
        bw::run(ctx, rep).await?;
        if ctx.lead {
            bw::iperf3(ctx, rep).await;
        }
    }
    if lat {
        lat::run(ctx, rep).await?;
        if ctx.lead {
            lat::perftest_lat(ctx, rep).await?;
        }
    }
    if rate {
        rate::run(ctx, rep).await?;
    }
    if wake {
        wake::run(ctx, rep).await?;
    }
    if scale {
        scale::run(ctx, rep).await?;
    }
    if ctx.o.runs(Test::Rtt) {
        rtt::run(ctx, rep).await?;
    }
    Ok(())
}
