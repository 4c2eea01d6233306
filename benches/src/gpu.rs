//! `bw --location cuda`: write_imm between GPU regions, each row beside its ceiling measured
//! in the same run.
//!
//! ```text
//!  leader: region on cuda:S                        peer: region on cuda:R
//!  staged:  D2H (chunk) ─► slot ══ tcp/shm ══► pull ─► slot ─► H2D          ceiling: min(D2H on S,
//!                                                                            H2D on R, host→host row)
//!  GPUDirect: the provider reads S and writes R itself (FI_HMEM)             baseline: the staged row
//!  CUDA IPC: cuMemcpyAsync S ─► R (NVLink / PCIe), then an imm-only write    ceiling: peer copy S→R
//!                                                                            (cuMemcpyDtoD when S = R)
//! ```
//!
//! The GPUDirect pass runs engines with `libfabric_hmem(true)` and `cuda_ipc(false)`; it runs
//! only where both regions came out `GpuPath::GpuDirect` (a libfabric built with CUDA whose
//! provider offers `FI_HMEM`, `scripts/gpu-hmem-run.sh`), and says why it was skipped
//! otherwise. The staged pass asks for no `FI_HMEM`, so it stays staged either way.
//!
//! The copy ceilings are measured by the leader with `cuda::Stream` on pinned memory at each
//! size (as many bytes as the engine row moves, at least 4 copies, after one warm-up copy).
//! The host→host ceiling is the engine row of the host sweep that `bw` ran first at the same
//! size. Without a CUDA driver the GPU rows say `skipped: no CUDA driver (...)`.

use std::sync::Arc;
use std::time::Instant;

use fabric_async::{Engine, MemoryLocation};
use fabric_runtime::cuda;
use fabric_runtime::GpuPath;

use crate::measure::{gbps, human, median};
use crate::pair::{builder, engine_absorb, engine_stream, Ctx, Res, Side, IMM_WARM};
use crate::pattern::Pattern;
use crate::report::{Report, Row};

/// `--location`: where the bw test's engine regions live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Location {
    #[default]
    Host,
    /// GPU memory: the sender's and the receiver's ordinals, or `None` for the default
    /// (0 → 1 when two GPUs exist, else 0 → 0).
    Cuda(Option<(usize, usize)>),
}

/// `host`, `cuda`, `cuda:N` (both on N) or `cuda:N,M` (sender on N, receiver on M).
pub fn parse_location(s: &str) -> Result<Location, String> {
    let bad = || format!("expected host, cuda, cuda:N or cuda:N,M, got {s:?}");
    match s {
        "host" => return Ok(Location::Host),
        "cuda" | "gpu" => return Ok(Location::Cuda(None)),
        _ => {}
    }
    let rest = s.strip_prefix("cuda:").ok_or_else(bad)?;
    let ords: Vec<usize> =
        rest.split(',').map(|x| x.trim().parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
    match ords[..] {
        [n] => Ok(Location::Cuda(Some((n, n)))),
        [n, m] => Ok(Location::Cuda(Some((n, m)))),
        _ => Err(bad()),
    }
}

/// Bursts per size of the GPU rows: 3 (quick: 1).
pub fn reps(quick: bool) -> usize {
    if quick {
        1
    } else {
        3
    }
}

/// Bytes of each side's GPU region: a window of the largest size, at most 256 MiB (at least
/// the largest size); the writes sweep it (`Pattern::Cold`).
pub fn region_len(sizes: &[usize], window: usize) -> usize {
    let max = sizes.iter().copied().max().unwrap_or(1 << 20);
    (max * window).min(256 << 20).max(max)
}

/// The case of the CUDA IPC row at `size` (`bw --peer` puts its GPU rows beside it).
pub fn ipc_case(size: usize, send: usize, recv: usize) -> String {
    format!("GPU->GPU CUDA IPC {} cuda:{send}->cuda:{recv}", human(size))
}

/// Default GPU sweep: 1 MiB .. 256 MiB (quick: 4 MiB, 64 MiB, 256 MiB).
pub fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 20, 64 << 20, 256 << 20]
    } else {
        vec![1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    }
}

/// Why no GPU row can run here (no driver, no device, too few devices), or the ordinals.
pub fn resolve(loc: Option<(usize, usize)>) -> Result<(usize, usize), String> {
    let n = match cuda::available() {
        Ok(0) => return Err("no CUDA device (the driver sees none)".into()),
        Ok(n) => n,
        Err(fabric_async::Error::Unsupported(m)) => {
            return Err(format!("no CUDA driver ({})", m.strip_prefix("no CUDA driver: ").unwrap_or(&m)))
        }
        Err(e) => return Err(format!("no CUDA driver ({e})")),
    };
    let (s, r) = loc.unwrap_or(if n >= 2 { (0, 1) } else { (0, 0) });
    if s >= n || r >= n {
        return Err(format!("cuda:{s},{r} asked for, but the driver sees {n} device(s)"));
    }
    Ok((s, r))
}

/// Copy bandwidth (Gbit/s) of `iters` async copies of `size` bytes issued by `copy` on
/// `stream`, after one warm-up copy.
fn copy_bw(
    stream: &cuda::Stream,
    size: usize,
    iters: u64,
    copy: impl Fn() -> fabric_runtime::Result<()>,
) -> Res<f64> {
    copy()?;
    stream.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        copy()?;
    }
    stream.synchronize()?;
    Ok(gbps(size as u64 * iters, t0.elapsed()))
}

/// The copy ceilings at one size, Gbit/s.
struct Ceilings {
    d2h: f64,
    h2d: f64,
    d2d: f64,
    /// Peer copy sender → receiver (the D2D figure when both are one device).
    peer: f64,
}

fn ceilings(send: usize, recv: usize, size: usize, iters: u64) -> Res<Ceilings> {
    let (cs, cr) = (cuda::context(send)?, cuda::context(recv)?);
    if send != recv && cs.can_access_peer(&cr)? {
        cs.enable_peer_access(&cr)?;
        cr.enable_peer_access(&cs)?;
    }
    let src = Arc::new(cuda::DeviceBuffer::new(&cs, size)?);
    let dst_same = Arc::new(cuda::DeviceBuffer::new(&cs, size)?);
    let dst_peer = Arc::new(cuda::DeviceBuffer::new(&cr, size)?);
    let pin_s = Arc::new(cuda::PinnedHostBuffer::new(&cs, size)?);
    let pin_r = Arc::new(cuda::PinnedHostBuffer::new(&cr, size)?);
    let ss = cuda::Stream::new(&cs)?;
    let sr = cuda::Stream::new(&cr)?;
    let d2h = copy_bw(&ss, size, iters, || ss.copy_d2h(&pin_s, 0, &src, 0, size))?;
    let h2d = copy_bw(&sr, size, iters, || sr.copy_h2d(&dst_peer, 0, &pin_r, 0, size))?;
    let d2d = copy_bw(&ss, size, iters, || ss.copy_d2d(&dst_same, 0, &src, 0, size))?;
    let peer = if send == recv {
        d2d
    } else {
        copy_bw(&ss, size, iters, || ss.copy_d2d(&dst_peer, 0, &src, 0, size))?
    };
    Ok(Ceilings { d2h, h2d, d2d, peer })
}

/// The three ways a GPU region is written, one pass each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Staged,
    Direct,
    Ipc,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Staged => "staged",
            Pass::Direct => "GPUDirect",
            Pass::Ipc => "CUDA IPC",
        }
    }
}

/// An engine for `pass` with a GPU region of `len` bytes on `ordinal`, connected to the other
/// side's.
async fn gpu_side(ctx: &mut Ctx, pass: Pass, ordinal: usize, len: usize) -> Res<Side> {
    let ipc = pass == Pass::Ipc;
    let mut b = builder(&ctx.o).mode(ctx.o.mode).cuda_ipc(ipc).time_reactor(ctx.o.time_calls);
    match pass {
        Pass::Staged => b = b.libfabric_hmem(false),
        Pass::Direct => b = b.libfabric_hmem(true),
        Pass::Ipc => {}
    }
    // The reactor on this side's NIC CPU, as `bw`'s host engines: a reactor thread inherits
    // the affinity of the thread that starts it, which `bw` pinned to its one app CPU, and
    // sharing that CPU with the awaiting task cost the GPU rows 2-5x (the task's lingering
    // spin and the reactor's passes took turns on it).
    if let Some(p) = crate::pin::plan_bw() {
        b = b.pin_core(if ctx.lead { p[0] } else { p[2] });
    }
    let engine: Engine = b.build()?;
    let region = engine.alloc_in(len, MemoryLocation::Cuda { ordinal: ordinal as u32 }).await?;
    let chunk = vec![0x5au8; 4 << 20];
    let mut off = 0;
    while off < region.len() {
        let n = chunk.len().min(region.len() - off);
        region.write_at(off as u64, &chunk[..n])?;
        off += n;
    }
    let key = match pass {
        Pass::Staged => "gpu-staged",
        Pass::Direct => "gpu-direct",
        Pass::Ipc => "gpu-ipc",
    };
    let theirs = ctx.swap(key, region.descriptor().to_bytes()).await?;
    let remote = engine.remote_region(&theirs).await?;
    engine.imm(&remote, IMM_WARM).await?;
    engine.imm_counter(IMM_WARM).wait_for(1).await.expect("engine shut down during the benchmark");
    Ok(Side { engine, region, remote })
}

/// The GPU rows, after the host sweep (`host[k]`: the engine's host→host Gbit/s at
/// `sizes[k]`, the leader's; NaN on the peer).
pub async fn run(
    ctx: &mut Ctx,
    rep: &mut Report,
    loc: Option<(usize, usize)>,
    sizes: &[usize],
    host: &[f64],
    ops_of: impl Fn(usize) -> u64,
) -> Res<()> {
    let prov = ctx.o.provider.clone();
    // Both processes are on one machine, but let the leader decide for both.
    let mine = match resolve(loc) {
        Ok((s, r)) => format!("ok {s} {r}"),
        Err(why) => format!("skip {why}"),
    };
    let verdict = if ctx.lead {
        ctx.swap("gpu-verdict", mine.clone().into_bytes()).await?;
        mine
    } else {
        String::from_utf8(ctx.swap("gpu-verdict", Vec::new()).await?)?
    };
    let (send, recv) = match verdict
        .strip_prefix("ok ")
        .map(|r| r.split(' ').map(str::parse).collect::<Result<Vec<usize>, _>>())
    {
        Some(Ok(v)) => match v[..] {
            [s, r] => (s, r),
            _ => return Err(format!("bad GPU verdict {verdict}").into()),
        },
        _ => {
            let why = verdict.strip_prefix("skip ").unwrap_or(&verdict).to_string();
            if ctx.lead {
                if std::env::var_os("FABRIC_REQUIRE_CUDA").is_some_and(|v| v != "0") {
                    return Err(format!("--location cuda: FABRIC_REQUIRE_CUDA is set but: {why}").into());
                }
                ctx.note(&format!("GPU rows skipped: {why}"));
                for path in ["GPU->GPU staged", "GPU->GPU CUDA IPC"] {
                    // As an absent baseline: the row is there, its figures are not.
                    let short = why.split(" (").next().unwrap_or(&why);
                    let row = Row::new("bw", &format!("{path}: skipped: {short}"), "gbps", f64::NAN);
                    rep.push(row.baseline("-", f64::NAN));
                }
            }
            ctx.barrier("gpu-end").await?;
            return Ok(());
        }
    };
    let dir = format!("cuda:{send}->cuda:{recv}");
    let reps = reps(ctx.o.quick);
    let window = ctx.o.window;
    let len = region_len(sizes, window);
    let my_ord = if ctx.lead { send } else { recv };

    // Ceilings first, on the leader, while no engine runs.
    let mut ceil = Vec::new();
    if ctx.lead {
        for (k, &size) in sizes.iter().enumerate() {
            ctx.progress("bw", 0.0, &format!("GPU ceilings {}/{} {}", k + 1, sizes.len(), human(size)));
            let iters = (ops_of(size)).clamp(4, 64);
            ceil.push(tokio::task::spawn_blocking(move || ceilings(send, recv, size, iters)).await??);
        }
    }
    ctx.barrier("gpu-ceilings").await?;

    let mut staged = vec![f64::NAN; sizes.len()];
    for pass in [Pass::Staged, Pass::Direct, Pass::Ipc] {
        let (ipc, name) = (pass == Pass::Ipc, pass.name());
        let side = gpu_side(ctx, pass, my_ord, len).await?;
        let path = side.remote.gpu_path();
        if pass == Pass::Direct {
            // Both regions registered with the NIC, or the pass is skipped on both sides.
            let mine = side.region.gpu_path() == Some(GpuPath::GpuDirect) && path == Some(GpuPath::GpuDirect);
            let theirs = ctx.swap("gpu-direct-ok", vec![u8::from(mine)]).await?;
            if !(mine && theirs == [1]) {
                if ctx.lead {
                    let why = format!(
                        "skipped: the regions are {:?} / {path:?}, not GPUDirect (FABRIC_LIBFABRIC_HMEM needs a provider offering FI_HMEM and a libfabric built with CUDA: scripts/gpu-hmem-run.sh)",
                        side.region.gpu_path()
                    );
                    ctx.note(&format!("GPU->GPU GPUDirect {dir} over {prov}: {why}"));
                    let row = Row::new(
                        "bw",
                        &format!("GPU->GPU GPUDirect {dir}: skipped: not GPUDirect here"),
                        "gbps",
                        f64::NAN,
                    );
                    rep.push(row.baseline("-", f64::NAN));
                }
                ctx.barrier("gpu-pass-end").await?;
                continue;
            }
        }
        if ctx.lead {
            ctx.note(&format!("GPU->GPU {name} {dir} over {prov}: the writer's path is {path:?}"));
        }
        let mut e = vec![Vec::new(); sizes.len()];
        for (k, &size) in sizes.iter().enumerate() {
            let ops = ops_of(size);
            for r in 0..reps {
                let what = format!(
                    "GPU {name} {}/{} {} x{ops} rep {}/{reps}",
                    k + 1,
                    sizes.len(),
                    human(size),
                    r + 1
                );
                ctx.progress("bw", (k * reps + r) as f64 / (sizes.len() * reps) as f64, &what);
                let (g0, r0) = {
                    let st = side.engine.stats();
                    (st.gpu, st.reactor)
                };
                if ctx.lead {
                    e[k].push(gbps(
                        size as u64 * ops,
                        engine_stream(&side, size, ops, window, Pattern::Cold).await?,
                    ));
                } else {
                    engine_absorb(&side, ops, size).await?;
                }
                if r + 1 == reps {
                    // Where an operation's time goes (`EngineStats::gpu`), per gate, on both
                    // sides: the writer's copies and the receiver's (a staged pull's H2D).
                    let st = side.engine.stats();
                    let mine = gate_note(&g0, &st.gpu, &r0, &st.reactor, ops);
                    let theirs = ctx.swap("gpu-gate-note", mine.clone().into_bytes()).await?;
                    if ctx.lead {
                        ctx.note(&format!("GPU {name} {}, writer: {mine}", human(size)));
                        ctx.note(&format!(
                            "GPU {name} {}, receiver: {}",
                            human(size),
                            String::from_utf8_lossy(&theirs)
                        ));
                    }
                }
            }
        }
        ctx.barrier("gpu-pass-end").await?;
        drop(side);
        if !ctx.lead {
            continue;
        }
        for (k, &size) in sizes.iter().enumerate() {
            let c = &ceil[k];
            let bw = median(e[k].clone());
            let case = if ipc {
                ipc_case(size, send, recv)
            } else {
                format!("GPU->GPU {name} {} {dir}", human(size))
            };
            let row = Row::new("bw", &case, "gbps", bw).size(size);
            if pass == Pass::Staged {
                staged[k] = bw;
            }
            let row = if pass == Pass::Direct {
                row.baseline("staged", staged[k])
            } else if ipc {
                let base = if send == recv { "cuMemcpyDtoD" } else { "peer copy" };
                row.baseline(base, c.peer).ceiling("d2d", c.d2d).ceiling("peer_copy", c.peer)
            } else {
                let h = host.get(k).copied().unwrap_or(f64::NAN);
                let slowest = [c.d2h, c.h2d, h].into_iter().fold(f64::INFINITY, f64::min);
                row.baseline("min(D2H,H2D,host)", slowest)
                    .ceiling("d2h", c.d2h)
                    .ceiling("h2d", c.h2d)
                    .ceiling("host_write", h)
            };
            rep.push(row);
        }
    }
    if ctx.lead {
        for (k, &size) in sizes.iter().enumerate() {
            let c = &ceil[k];
            let h = human(size);
            rep.push(
                Row::new("gpu-ceiling", &format!("D2H pinned cuda:{send} {h}"), "gbps", c.d2h).size(size),
            );
            rep.push(
                Row::new("gpu-ceiling", &format!("H2D pinned cuda:{recv} {h}"), "gbps", c.h2d).size(size),
            );
            rep.push(
                Row::new("gpu-ceiling", &format!("cuMemcpyDtoD cuda:{send} {h}"), "gbps", c.d2d).size(size),
            );
            if send != recv {
                rep.push(Row::new("gpu-ceiling", &format!("peer copy {dir} {h}"), "gbps", c.peer).size(size));
            }
        }
    }
    ctx.barrier("gpu-end").await?;
    Ok(())
}

/// One side's per-gate breakdown between two snapshots of its engine's stats.
fn gate_note(
    g0: &fabric_async::GpuStats,
    g: &fabric_async::GpuStats,
    r0: &fabric_async::ReactorStats,
    rs: &fabric_async::ReactorStats,
    ops: u64,
) -> String {
    let n = (g.gates - g0.gates).max(1) as f64;
    let us = |a: std::time::Duration, b: std::time::Duration| (a - b).as_secs_f64() * 1e6 / n;
    let per_op = |a: std::time::Duration, b: std::time::Duration| (a - b).as_secs_f64() * 1e6 / ops as f64;
    format!(
        "per gate: hand-off {:.1} us, enqueue {:.1} us, enqueue -> seen done {:.1} us, event queries {:.1} us ({:.1} calls); {} gates, {:.2} passes ({:.2} callers') and {:.3} sleeps per op; per op in post {:.1} us, in poll {:.1} us, completing {:.1} us (waking {:.1} us), taking submissions {:.1} us",
        us(g.handoff, g0.handoff),
        us(g.enqueue, g0.enqueue),
        us(g.copy, g0.copy),
        us(g.polling, g0.polling),
        (g.queries - g0.queries) as f64 / n,
        g.gates - g0.gates,
        (rs.passes - r0.passes) as f64 / ops as f64,
        (rs.caller_passes - r0.caller_passes) as f64 / ops as f64,
        (rs.sleeps - r0.sleeps) as f64 / ops as f64,
        per_op(rs.in_post, r0.in_post),
        per_op(rs.in_poll, r0.in_poll),
        per_op(rs.completing, r0.completing),
        per_op(rs.waking, r0.waking),
        per_op(rs.taking, r0.taking),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse() {
        assert_eq!(parse_location("host"), Ok(Location::Host));
        assert_eq!(parse_location("cuda"), Ok(Location::Cuda(None)));
        assert_eq!(parse_location("cuda:1"), Ok(Location::Cuda(Some((1, 1)))));
        assert_eq!(parse_location("cuda:0,1"), Ok(Location::Cuda(Some((0, 1)))));
        for bad in ["", "cuda:", "cuda:a", "cuda:0,1,2", "gpu:0", "device"] {
            assert!(parse_location(bad).is_err(), "{bad}");
        }
    }
}
