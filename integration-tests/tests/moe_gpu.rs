//! fabric-moe on real GPUs: dispatch and combine between two processes (this test binary,
//! re-run as `moe_child` for rank 1), every received row and every combined element checked
//! against the host reference (`fabric_moe::reference`) computed from the same seeds.
//!
//! - `moe_random_routing`: random top-k (k = 1..8, some ids -1), int32 and int64 ids,
//!   hidden 128, 100 (not a multiple of 8: the 2-byte path) and 7168 (DeepSeek-V3's, with
//!   128 experts per rank), 128 tokens per rank (and a step of 100);
//! - `moe_repeat_50_steps`: 50 steps launched back to back with no host wait in between
//!   (the per-step sequence flags and the reuse of every buffer), all 50 combines checked;
//! - `moe_uneven_routing`: every token of both ranks to expert 0, and the same past a
//!   bounded capacity (reported as `CapacityExceeded`);
//! - `moe_cuda_graph_replay`: a full step (GPU barrier, dispatch, experts, combine) captured
//!   in a CUDA graph, replayed with new inputs in the same buffers, alternating with eager
//!   steps: every step checked, and the step time of both printed;
//! - `moe_two_ranks_share_one_gpu`: both ranks on device 0 (CUDA IPC between processes of
//!   one GPU), whatever the machine has;
//! - `moe_proxy_random_routing`, `moe_proxy_repeat_50_steps`, `moe_proxy_cuda_graph_replay`:
//!   the same checks with `Transport::Proxy` (the kernels pack into an outbox and ring a
//!   doorbell, a proxy thread writes with the engine, `shm` provider, which takes CUDA IPC
//!   between processes of one host; receives wait on `GpuCounter`s, and are launched only
//!   once the proxy thread opened the stage's receive gate, checked at the end of each case
//!   to have opened on the arrivals, not on its timeout). With two ranks there
//!   is no mixed case (a rank reaches itself directly); `fabric-moe/emu` checks three ranks
//!   with one pair NVLink and two through the proxy.
//! - `moe_split_stages`: over NVLink `dispatch` and `combine` are one fused kernel each;
//!   this runs the four stages launched one by one (expert-major and rank-major, step by
//!   step and back to back). Every other NVLink test runs the fused kernels, the proxy tests
//!   the stages (the proxy does not fuse);
//! - `moe_streamed_combine`: the fused combine streaming (half its blocks send, a flag per
//!   row, while the others sum each token whose rows have landed; the default for prefill
//!   shapes), forced on at decode sizes: random and uneven routing, expert-major and
//!   rank-major, back to back, replayed from a CUDA graph, and with one rank launching the
//!   two stages while the other streams;
//! - `moe_rank_major`: `RecvLayout::RankMajor` receivers (rows left by source in the window,
//!   indices and weights per expert, the caller's summed rows sent back) on both ranks and
//!   on one, random and uneven routing, back to back, and replayed from a CUDA graph.
//!
//! `moe_random_routing`, `moe_rank_major` and `moe_proxy_random_routing` also dispatch the
//! same inputs three times with `Config::ordered_rows`: every step must leave the same rows
//! in the same order per expert (sources and bytes) as the first.
//!
//! Ranks go on devices `rank % devices`: two GPUs where there are two (NVLink or PCIe P2P),
//! else both on one; `FABRIC_REQUIRE_GPUS=2` makes a single GPU a failure. Without a CUDA
//! driver each test prints `skipped: ...` and passes; `FABRIC_REQUIRE_CUDA=1` makes that a
//! failure. On a GPU machine (no cargo there):
//!
//! ```sh
//! cargo test -p integration-tests --test moe_gpu --release --no-run   # target/release/deps/moe_gpu-<hash>
//! FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1 ./moe_gpu-<hash> --test-threads 1 --nocapture
//! ```

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::bootstrap::TcpStore;
use fabric_async::cuda::{self, DeviceBuffer, Stream};
use fabric_async::{Engine, Error};
use fabric_moe::reference::{self, check_combined, check_received, Inputs, Routing};
use fabric_moe::{AllToAll, Config, DispatchInput, MoeError, RecvLayout, TopkIdx, Transport};
use integration_tests::store;

const CHILD_ENV: &str = "FABRIC_MOE_CHILD";
const TOKENS: usize = 128;
const SEED: u64 = 0x5eed;
/// Longest a test waits for its child (every GPU wait inside is bounded by the config's
/// timeout, far shorter).
const CHILD_LIMIT: Duration = Duration::from_secs(100);

/// Whether a GPU is usable; prints the skip line when not.
fn gpu(test: &str) -> bool {
    let why = match cuda::available() {
        Ok(0) => "no CUDA device (the driver sees none)".to_string(),
        Ok(_) => match cuda::context(0) {
            Ok(_) => return true,
            Err(e) => format!("no CUDA device (device 0: {e})"),
        },
        Err(Error::Unsupported(m)) => {
            format!("no CUDA driver ({})", m.strip_prefix("no CUDA driver: ").unwrap_or(&m))
        }
        Err(e) => format!("no CUDA driver ({e})"),
    };
    if std::env::var_os("FABRIC_REQUIRE_CUDA").is_some_and(|v| v != "0") {
        panic!("{test}: FABRIC_REQUIRE_CUDA is set but: {why}");
    }
    let _ = writeln!(std::io::stderr(), "skipped: {why}: {test}");
    false
}

/// Devices the two ranks use: one each where there are two, else both on 0.
fn spread() -> bool {
    let n = cuda::available().unwrap_or(0);
    if n < 2 && std::env::var("FABRIC_REQUIRE_GPUS").is_ok_and(|v| v.parse::<usize>().is_ok_and(|w| w >= 2)) {
        panic!("FABRIC_REQUIRE_GPUS=2 but the driver sees {n} CUDA device(s)");
    }
    n >= 2
}

/// One configuration run for some steps.
#[derive(Debug, Clone, Copy)]
struct Case {
    hidden: usize,
    topk: usize,
    experts_per_rank: usize,
    routing: Routing,
    steps: usize,
    idx64: bool,
    tokens: usize,
    /// `Some(c)`: capacity `c` per expert, and rank 0 must report an overflow.
    capacity: Option<usize>,
    /// Launch every step back to back, checking all of them at the end.
    pipelined: bool,
    /// Capture a step in a CUDA graph and replay it, alternating with eager steps.
    graph: bool,
    /// Bit r set: rank r receives rank-major (`RecvLayout::RankMajor`), else expert-major.
    rank_major: u8,
    /// Bit r set: rank r launches each stage on its own (`dispatch_send`, `dispatch_recv`,
    /// `combine_send`, `combine_recv`) instead of `dispatch` and `combine`, which over
    /// NVLink are one fused kernel each.
    split: u8,
    /// `Config::streamed_combine` (`None`: by shape, which for these 128-token steps is not
    /// streamed); `Some(true)` must stream.
    streamed: Option<bool>,
    /// Every step dispatches step 0's inputs, and must leave the same rows in the same
    /// order (sources and bytes per expert) as step 0 did: the route's places in a fixed
    /// order.
    same: bool,
}

const fn case(hidden: usize, topk: usize, experts_per_rank: usize, routing: Routing, steps: usize) -> Case {
    Case {
        hidden,
        topk,
        experts_per_rank,
        routing,
        steps,
        idx64: false,
        tokens: TOKENS,
        capacity: None,
        pipelined: false,
        graph: false,
        rank_major: 0,
        split: 0,
        streamed: None,
        same: false,
    }
}

const RANDOM: Routing = Routing::Random { masked: false };
const MASKED: Routing = Routing::Random { masked: true };

fn cases(kind: &str) -> Vec<Case> {
    match kind {
        "random" => vec![
            case(128, 2, 4, RANDOM, 3),
            Case { idx64: true, ..case(128, 3, 4, MASKED, 3) },
            case(128, 5, 8, RANDOM, 3),
            Case { idx64: true, tokens: 100, ..case(128, 8, 8, MASKED, 3) },
            case(128, 1, 2, RANDOM, 2),
            case(100, 4, 4, MASKED, 2),
            Case { idx64: true, ..case(7168, 2, 8, RANDOM, 2) },
            case(7168, 8, 128, MASKED, 2),
            Case { same: true, ..case(7168, 8, 128, MASKED, 3) },
            Case { same: true, idx64: true, ..case(128, 5, 8, RANDOM, 3) },
        ],
        "repeat" => vec![Case { pipelined: true, ..case(128, 4, 4, MASKED, 50) }],
        "uneven" => vec![
            case(7168, 2, 4, Routing::OneExpert, 3),
            case(128, 1, 4, Routing::OneExpert, 2),
            Case { capacity: Some(64), ..case(128, 2, 4, Routing::OneExpert, 1) },
        ],
        "graph" => vec![Case { graph: true, ..case(7168, 8, 8, RANDOM, 40) }],
        "shared" => vec![case(128, 4, 4, MASKED, 3), Case { idx64: true, ..case(7168, 8, 8, RANDOM, 2) }],
        "proxy-random" => vec![
            case(128, 2, 4, RANDOM, 3),
            Case { idx64: true, tokens: 100, ..case(128, 8, 8, MASKED, 3) },
            case(100, 4, 4, MASKED, 2),
            case(7168, 8, 128, MASKED, 2),
            case(7168, 2, 4, Routing::OneExpert, 2),
            Case { same: true, ..case(7168, 8, 128, MASKED, 3) },
        ],
        "proxy-repeat" => vec![Case { pipelined: true, ..case(128, 4, 4, MASKED, 50) }],
        "proxy-graph" => vec![Case { graph: true, ..case(7168, 8, 8, RANDOM, 40) }],
        // Rank-major receivers, on both ranks and on one (each rank's own choice).
        "rank-major" => vec![
            Case { rank_major: 3, ..case(128, 2, 4, RANDOM, 3) },
            Case { rank_major: 3, idx64: true, tokens: 100, ..case(128, 8, 8, MASKED, 3) },
            Case { rank_major: 1, ..case(100, 4, 4, MASKED, 2) },
            Case { rank_major: 3, ..case(7168, 8, 128, MASKED, 2) },
            Case { rank_major: 2, ..case(7168, 2, 4, Routing::OneExpert, 2) },
            Case { rank_major: 3, pipelined: true, ..case(128, 4, 4, MASKED, 20) },
            Case { rank_major: 3, graph: true, ..case(7168, 8, 8, RANDOM, 20) },
            Case { rank_major: 3, same: true, ..case(7168, 8, 128, MASKED, 3) },
        ],
        // The stages launched one by one over NVLink (the fused kernels are the default).
        "split" => vec![
            Case { split: 3, ..case(128, 5, 8, RANDOM, 3) },
            Case { split: 3, idx64: true, ..case(7168, 8, 128, MASKED, 2) },
            Case { split: 3, ..case(7168, 2, 4, Routing::OneExpert, 2) },
            Case { split: 3, rank_major: 3, ..case(7168, 8, 8, RANDOM, 3) },
            Case { split: 3, rank_major: 1, pipelined: true, ..case(128, 4, 4, MASKED, 20) },
        ],
        // The streamed combine (half the blocks send, a flag per row, the others sum behind
        // the flags), forced on at these decode sizes.
        "streamed" => vec![
            Case { streamed: Some(true), ..case(128, 5, 8, RANDOM, 3) },
            Case { streamed: Some(true), idx64: true, ..case(7168, 8, 128, MASKED, 2) },
            Case { streamed: Some(true), ..case(7168, 2, 4, Routing::OneExpert, 2) },
            Case { streamed: Some(true), rank_major: 3, ..case(7168, 8, 8, RANDOM, 3) },
            Case { streamed: Some(true), rank_major: 1, pipelined: true, ..case(128, 4, 4, MASKED, 20) },
            Case { streamed: Some(true), rank_major: 3, graph: true, ..case(7168, 8, 8, RANDOM, 10) },
            // Rank 1 launches the two stages (its send raises the row flags too, since the
            // ranks agreed to stream), rank 0 the streamed kernel; and the other way round.
            Case { streamed: Some(true), split: 2, ..case(7168, 8, 128, MASKED, 2) },
            Case {
                streamed: Some(true),
                split: 1,
                rank_major: 3,
                pipelined: true,
                ..case(7168, 8, 8, RANDOM, 10)
            },
        ],
        other => panic!("no case list {other}"),
    }
}

fn bytes_of<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// One step's inputs in device memory.
struct DeviceInputs {
    x: DeviceBuffer,
    idx: DeviceBuffer,
    weights: DeviceBuffer,
    idx64: bool,
    tokens: usize,
}

impl DeviceInputs {
    fn upload(ctx: &Arc<cuda::Context>, c: &Config, inp: &Inputs, idx64: bool) -> Result<Self, MoeError> {
        let x = DeviceBuffer::new(ctx, c.max_tokens * c.hidden * 2)?;
        let idx = DeviceBuffer::new(ctx, c.max_tokens * c.topk * 8)?;
        let weights = DeviceBuffer::new(ctx, c.max_tokens * c.topk * 4)?;
        let d = DeviceInputs { x, idx, weights, idx64, tokens: inp.tokens };
        d.write(ctx, inp)?;
        Ok(d)
    }

    /// Overwrites the buffers with `inp` (same token count), blocking until it has landed.
    fn write(&self, ctx: &cuda::Context, inp: &Inputs) -> Result<(), MoeError> {
        self.x.copy_from_host(0, &bytes_of(&inp.x, u16::to_le_bytes))?;
        if self.idx64 {
            self.idx.copy_from_host(0, &bytes_of(&inp.topk_idx, i64::to_le_bytes))?;
        } else {
            self.idx.copy_from_host(0, &bytes_of(&inp.topk_idx, |e| (e as i32).to_le_bytes()))?;
        }
        self.weights.copy_from_host(0, &bytes_of(&inp.topk_weights, f32::to_le_bytes))?;
        // A copy from pageable memory may return before its DMA has landed, and the stages
        // run on a non-blocking stream that does not wait for it (nor for the zero-fills of
        // DeviceBuffer::new).
        ctx.synchronize()?;
        Ok(())
    }

    fn input(&self) -> DispatchInput {
        let p = self.idx.device_ptr();
        DispatchInput {
            x: self.x.device_ptr(),
            topk_idx: if self.idx64 { TopkIdx::I64(p) } else { TopkIdx::I32(p) },
            topk_weights: self.weights.device_ptr(),
            num_tokens: self.tokens,
        }
    }
}

/// The transport of a case list: `proxy-*` through the proxy (on an `shm` engine), the
/// others NVLink.
fn transport(kind: &str) -> Transport {
    if kind.starts_with("proxy") {
        Transport::Proxy
    } else {
        Transport::Nvlink
    }
}

/// Runs every case of `kind` as `rank` of 2; both ranks run the same code.
async fn run_rank(store: &TcpStore, kind: &str, rank: usize, spread: bool) -> Result<(), String> {
    let provider = if transport(kind) == Transport::Proxy { "shm" } else { "tcp" };
    let engine = Engine::builder().provider(provider).build().map_err(|e| e.to_string())?;
    for (ci, case) in cases(kind).into_iter().enumerate() {
        let started = Instant::now();
        run_case(&engine, store, kind, ci, case, rank, spread)
            .await
            .map_err(|e| format!("{kind} case {ci} {case:?}: {e}"))?;
        if rank == 0 {
            println!(
                "moe {kind} case {ci} ({}): hidden {} top-{} {} experts/rank {:?} {} steps of {} tokens: ok in {:?}",
                transport(kind),
                case.hidden,
                case.topk,
                case.experts_per_rank,
                case.routing,
                case.steps,
                case.tokens,
                started.elapsed()
            );
        }
    }
    Ok(())
}

/// `dispatch`, or its two stages (`case.split`).
///
/// # Safety
///
/// As `AllToAll::dispatch`.
unsafe fn dispatch(
    a2a: &AllToAll,
    stream: &Stream,
    input: &DispatchInput,
    split: bool,
) -> Result<(), MoeError> {
    // SAFETY: the caller's contract.
    unsafe {
        if split {
            a2a.dispatch_send(stream, input)?;
            a2a.dispatch_recv(stream)
        } else {
            a2a.dispatch(stream, input)
        }
    }
}

/// `combine`, or its two stages (`case.split`).
///
/// # Safety
///
/// As `AllToAll::combine`.
unsafe fn combine(a2a: &AllToAll, stream: &Stream, expert_out: u64, split: bool) -> Result<(), MoeError> {
    // SAFETY: the caller's contract.
    unsafe {
        if split {
            a2a.combine_send(stream, expert_out)?;
            a2a.combine_recv(stream)
        } else {
            a2a.combine(stream, expert_out)
        }
    }
}

async fn run_case(
    engine: &Engine,
    store: &TcpStore,
    kind: &str,
    ci: usize,
    case: Case,
    rank: usize,
    spread: bool,
) -> Result<(), String> {
    let s = |e: MoeError| e.to_string();
    let mut c = Config::new(2, rank, case.experts_per_rank, TOKENS, case.hidden, case.topk);
    c.tag = format!("{kind}/{ci}");
    c.timeout = Duration::from_secs(10);
    c.device = Some(if spread { rank } else { 0 });
    c.expert_capacity = case.capacity;
    c.transport = transport(kind);
    if case.rank_major >> rank & 1 == 1 {
        c.layout = RecvLayout::RankMajor;
    }
    c.streamed_combine = case.streamed;
    c.ordered_rows = case.same;
    let a2a = AllToAll::new(engine, store, c.clone()).await.map_err(s)?;
    if case.streamed.is_some_and(|on| on != a2a.streamed_combine()) {
        return Err(format!("rank {rank}: streamed combine {}, asked {case:?}", a2a.streamed_combine()));
    }
    if a2a.transport_to(1 - rank) != c.transport || a2a.transport_to(rank) != Transport::Nvlink {
        return Err(format!("rank {rank}: transport to the peer is {}", a2a.transport_to(1 - rank)));
    }
    let ctx = cuda::context(a2a.device()).map_err(|e| e.to_string())?;
    let stream = Stream::new(&ctx).map_err(|e| e.to_string())?;
    let out = DeviceBuffer::new(&ctx, a2a.expert_out_len()).map_err(|e| e.to_string())?;
    let all_inputs = |step: usize| -> Vec<Inputs> {
        (0..2).map(|r| reference::inputs(&c, case.routing, SEED + ci as u64, r, step, case.tokens)).collect()
    };
    let row_bytes = case.hidden * 2;
    if case.graph {
        graph_steps(&a2a, &c, &ctx, &stream, &out, case, ci, rank).map_err(|e| e.to_string())?;
    } else if case.pipelined {
        // Every step's inputs and a copy of every step's combined rows, so that nothing is
        // overwritten while the steps run back to back.
        let inputs: Vec<Vec<Inputs>> = (0..case.steps).map(all_inputs).collect();
        let dev: Vec<DeviceInputs> = inputs
            .iter()
            .map(|all| DeviceInputs::upload(&ctx, &c, &all[rank], case.idx64))
            .collect::<Result<_, _>>()
            .map_err(s)?;
        let results =
            DeviceBuffer::new(&ctx, case.steps * case.tokens * row_bytes).map_err(|e| e.to_string())?;
        // Its zero-fill (and `out`'s) ran on the legacy stream, which `stream` does not wait for.
        ctx.synchronize().map_err(|e| e.to_string())?;
        for (step, d) in dev.iter().enumerate() {
            // SAFETY: `d`, `out` and `results` live until the stream is synchronized below;
            // the combined rows are copied out of `a2a` before the next step reuses them.
            unsafe {
                dispatch(&a2a, &stream, &d.input(), case.split >> rank & 1 == 1).map_err(s)?;
                a2a.toy_experts(&stream, out.device_ptr()).map_err(s)?;
                combine(&a2a, &stream, out.device_ptr(), case.split >> rank & 1 == 1).map_err(s)?;
                stream
                    .copy_d2d_raw(
                        results.device_ptr() + (step * case.tokens * row_bytes) as u64,
                        a2a.combined(),
                        case.tokens * row_bytes,
                    )
                    .map_err(|e| e.to_string())?;
            }
        }
        stream.synchronize().map_err(|e| e.to_string())?;
        a2a.check().map_err(s)?;
        let last = a2a.read_received().map_err(s)?;
        check_received(&c, &inputs[case.steps - 1], rank, &last.sources, &last.rows)?;
        let mut bytes = vec![0u8; case.steps * case.tokens * row_bytes];
        results.copy_to_host(0, &mut bytes).map_err(|e| e.to_string())?;
        let got: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        for (step, all) in inputs.iter().enumerate() {
            let n = case.tokens * case.hidden;
            check_combined(&c, &all[rank], rank, &got[step * n..(step + 1) * n])
                .map_err(|e| format!("step {step}: {e}"))?;
        }
    } else {
        let mut first = None;
        for step in 0..case.steps {
            let all = all_inputs(if case.same { 0 } else { step });
            let d = DeviceInputs::upload(&ctx, &c, &all[rank], case.idx64).map_err(s)?;
            // SAFETY: `d` and `out` live until the stream is synchronized below.
            unsafe { dispatch(&a2a, &stream, &d.input(), case.split >> rank & 1 == 1).map_err(s)? };
            stream.synchronize().map_err(|e| e.to_string())?;
            let status = a2a.check();
            if case.capacity.is_some() {
                match (rank, status) {
                    (0, Err(MoeError::CapacityExceeded { expert: 0 })) | (1, Ok(())) => {}
                    (r, other) => return Err(format!("rank {r}: overflow case reported {other:?}")),
                }
            } else {
                status.map_err(s)?;
                let got = a2a.read_received().map_err(s)?;
                check_received(&c, &all, rank, &got.sources, &got.rows)
                    .map_err(|e| format!("step {step}: {e}"))?;
                if case.same {
                    match &first {
                        None => first = Some(got),
                        Some(f) if f == &got => {}
                        Some(f) => {
                            let le = (0..f.sources.len()).find(|&le| f.sources[le] != got.sources[le]);
                            return Err(format!(
                                "rank {rank} step {step}: the same inputs left rows in another order than \
                                 step 0 (first differing expert {le:?})"
                            ));
                        }
                    }
                }
            }
            // SAFETY: as above.
            unsafe {
                a2a.toy_experts(&stream, out.device_ptr()).map_err(s)?;
                combine(&a2a, &stream, out.device_ptr(), case.split >> rank & 1 == 1).map_err(s)?;
            }
            stream.synchronize().map_err(|e| e.to_string())?;
            if case.capacity.is_none() {
                a2a.check().map_err(s)?;
                let got = a2a.read_combined(case.tokens).map_err(s)?;
                check_combined(&c, &all[rank], rank, &got).map_err(|e| format!("step {step}: {e}"))?;
            }
        }
    }
    // Through the proxy, the receive gates opened for the last step on its arrivals, not on
    // the proxy's timeout (a driver without stream memory operations has no gates).
    if let (Some(times), true) = (a2a.proxy_times(), cuda::stream_memops_supported()) {
        for (t, stage) in times.iter().zip(["dispatch", "combine"]) {
            let waited = Duration::from_nanos(t.gate_ns.saturating_sub(t.seen_ns));
            if t.gate_ns == 0 || waited >= c.timeout {
                return Err(format!("rank {rank}: the {stage} gate: {t:?} (waited {waited:?})"));
            }
        }
    }
    drop(stream);
    a2a.close(store).await.map_err(s)
}

/// One step on `stream`: a GPU barrier, clock 0, dispatch, toy experts, combine, clock 1.
///
/// # Safety
///
/// `d` and `out` must outlive the step's execution (and every replay of a graph it was
/// captured into).
unsafe fn step(
    a2a: &AllToAll,
    stream: &Stream,
    d: &DeviceInputs,
    out: &DeviceBuffer,
) -> Result<(), MoeError> {
    a2a.barrier(stream)?;
    a2a.clock(stream, 0)?;
    // SAFETY: the caller's contract.
    unsafe {
        a2a.dispatch(stream, &d.input())?;
        a2a.toy_experts(stream, out.device_ptr())?;
        a2a.combine(stream, out.device_ptr())?;
    }
    a2a.clock(stream, 1)
}

/// A step captured in a CUDA graph (once), then `steps` steps alternating eager launches and
/// replays, new inputs in the same buffers each time, every one checked; prints the step
/// times of both (GPU clock, from the barrier to the combine's end).
#[allow(clippy::too_many_arguments)]
fn graph_steps(
    a2a: &AllToAll,
    c: &Config,
    ctx: &Arc<cuda::Context>,
    stream: &Stream,
    out: &DeviceBuffer,
    case: Case,
    ci: usize,
    rank: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let inputs = |step: usize| -> Vec<Inputs> {
        (0..2).map(|r| reference::inputs(c, case.routing, SEED + ci as u64, r, step, case.tokens)).collect()
    };
    let first = inputs(0);
    let d = DeviceInputs::upload(ctx, c, &first[rank], case.idx64)?;
    // SAFETY: `d` and `out` outlive every launch and replay below (synchronized each step).
    unsafe { step(a2a, stream, &d, out)? };
    stream.synchronize()?;
    stream.begin_capture()?;
    // SAFETY: as above; captured, not run (a failed capture still has to be ended).
    let captured = unsafe { step(a2a, stream, &d, out) };
    let graph = stream.end_capture()?;
    captured?;
    let (mut eager, mut replay) = (Vec::new(), Vec::new());
    for i in 1..=case.steps {
        let all = inputs(i);
        d.write(ctx, &all[rank])?;
        if i % 2 == 0 {
            // SAFETY: as above.
            unsafe { graph.launch(stream)? };
        } else {
            // SAFETY: as above.
            unsafe { step(a2a, stream, &d, out)? };
        }
        stream.synchronize()?;
        a2a.check()?;
        let got = a2a.read_received()?;
        check_received(c, &all, rank, &got.sources, &got.rows).map_err(|e| format!("step {i}: {e}"))?;
        check_combined(c, &all[rank], rank, &a2a.read_combined(case.tokens)?)
            .map_err(|e| format!("step {i}: {e}"))?;
        let took = a2a.clock_ns(1).saturating_sub(a2a.clock_ns(0));
        if i % 2 == 0 {
            replay.push(took)
        } else {
            eager.push(took)
        }
    }
    let p50 = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2] as f64 / 1e3
    };
    println!(
        "moe graph ({}): rank {rank}: step (barrier to combined) p50 eager {:.1} us, CUDA graph replay {:.1} us ({} each, every step checked)",
        c.transport,
        p50(&mut eager),
        p50(&mut replay),
        eager.len()
    );
    Ok(())
}

/// The second rank: this binary, running `moe_child`.
struct ChildProc(Option<Child>);

impl ChildProc {
    fn spawn(store: std::net::SocketAddr, kind: &str, spread: bool) -> ChildProc {
        let c = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "moe_child", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, format!("{store}|{kind}|{spread}"))
            .stdin(Stdio::null())
            .spawn()
            .expect("re-run this test binary as the child");
        ChildProc(Some(c))
    }

    async fn wait_success(&mut self, timeout: Duration) -> bool {
        let Some(c) = self.0.as_mut() else { return false };
        let deadline = Instant::now() + timeout;
        loop {
            match c.try_wait() {
                Ok(Some(s)) => {
                    self.0 = None;
                    return s.success();
                }
                Ok(None) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
                _ => return false,
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let f: Vec<&str> = spec.split('|').collect();
    let [addr, kind, spread] = f[..] else { panic!("bad child spec {spec}") };
    let store = TcpStore::connect(addr.parse().unwrap()).await.expect("store").with_timeout(CHILD_LIMIT);
    if let Err(e) = run_rank(&store, kind, 1, spread == "true").await {
        panic!("moe rank 1: {e}");
    }
}

/// Rank 0 here, rank 1 in a child process; both must succeed.
async fn two_ranks(test: &str, kind: &str, spread: bool) {
    let (_server, store, addr) = store().await;
    let store = store.with_timeout(CHILD_LIMIT);
    let mut child = ChildProc::spawn(addr, kind, spread);
    let mine = tokio::time::timeout(CHILD_LIMIT, run_rank(&store, kind, 0, spread)).await;
    let child_ok = child.wait_success(CHILD_LIMIT).await;
    match mine {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{test}: rank 0: {e}"),
        Err(_) => panic!("{test}: rank 0 did not finish in {CHILD_LIMIT:?}"),
    }
    assert!(child_ok, "{test}: rank 1 (the child) failed; its panic is above");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_random_routing() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_random_routing") {
        return;
    }
    two_ranks("moe_random_routing", "random", spread()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_repeat_50_steps() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_repeat_50_steps") {
        return;
    }
    two_ranks("moe_repeat_50_steps", "repeat", spread()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_uneven_routing() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_uneven_routing") {
        return;
    }
    two_ranks("moe_uneven_routing", "uneven", spread()).await;
}

/// A full step captured in a CUDA graph and replayed with new inputs in the same buffers:
/// the same results as eager launches (all checked), and the step time of both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_cuda_graph_replay() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_cuda_graph_replay") {
        return;
    }
    two_ranks("moe_cuda_graph_replay", "graph", spread()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_two_ranks_share_one_gpu() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_two_ranks_share_one_gpu") {
        return;
    }
    two_ranks("moe_two_ranks_share_one_gpu", "shared", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_proxy_random_routing() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_proxy_random_routing") {
        return;
    }
    two_ranks("moe_proxy_random_routing", "proxy-random", spread()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_proxy_repeat_50_steps() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_proxy_repeat_50_steps") {
        return;
    }
    two_ranks("moe_proxy_repeat_50_steps", "proxy-repeat", spread()).await;
}

/// Each stage launched on its own over NVLink (`dispatch` and `combine` are one fused
/// kernel each there): the same bytes and sums, expert-major and rank-major, step by step and
/// back to back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_split_stages() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_split_stages") {
        return;
    }
    two_ranks("moe_split_stages", "split", spread()).await;
}

/// The streamed combine (`Config::streamed_combine`, the default for prefill shapes): the
/// same sums, expert-major and rank-major, uneven, back to back and replayed from a graph.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_streamed_combine() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_streamed_combine") {
        return;
    }
    two_ranks("moe_streamed_combine", "streamed", spread()).await;
}

/// `RecvLayout::RankMajor` (the prefill layout): the same checks of the received rows (by
/// their indices into the window's rows) and of the combined rows, on both ranks and on one,
/// launched back to back and replayed from a CUDA graph.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_rank_major() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_rank_major") {
        return;
    }
    two_ranks("moe_rank_major", "rank-major", spread()).await;
}

/// A captured step replays through the proxy too: the proxy reacts to the doorbells the
/// replayed kernels ring, nothing of it is in the graph.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_proxy_cuda_graph_replay() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("moe_proxy_cuda_graph_replay") {
        return;
    }
    two_ranks("moe_proxy_cuda_graph_replay", "proxy-graph", spread()).await;
}

/// Without a driver, `AllToAll::new` says so instead of panicking (runs everywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_without_cuda_is_unsupported() {
    if std::env::var_os(CHILD_ENV).is_some() || cuda::available().is_ok_and(|n| n > 0) {
        return;
    }
    let (_server, store, _) = store().await;
    let engine = Engine::builder().provider("tcp").build().unwrap();
    let e = AllToAll::new(&engine, &store, Config::new(1, 0, 2, 8, 8, 1)).await.unwrap_err();
    assert!(matches!(e, MoeError::Cuda(Error::Unsupported(_))), "{e}");
}
