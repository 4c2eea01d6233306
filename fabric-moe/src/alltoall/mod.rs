//! [`AllToAll`]: the buffers of one MoE all-to-all, its kernels, and the stages a step is
//! made of. Every stage is launched on the caller's stream and returns at once; nothing in
//! a launch waits for the GPU or touches another stream, so a whole step can be captured in
//! a CUDA graph.
//!
//! This file holds the all-to-all itself (its buffers, `new`, `close`); `stages.rs` the
//! stages' launches, `readback.rs` what the host reads back.

use std::fmt;
use std::sync::Arc;

use fabric_async::bootstrap::{all_gather, Rendezvous};
use fabric_async::cuda::{self, Context, DeviceBuffer, PinnedHostBuffer};
use fabric_async::Engine;

use crate::config::{Config, RecvLayout, Transport};
use crate::error::{MoeError, Result};
use crate::kernels::{CudaStream, Kernels, THREADS};
use crate::layout::Layout;
use crate::nvlink::{self, Peers};
use crate::proxy::{self, Links, Proxy, ProxyTimes, Stage};

mod readback;
mod stages;

pub use readback::Received;

/// Slots of the GPU clock that [`AllToAll::clock`] writes.
pub const CLOCK_SLOTS: usize = 256;

/// Probe points of a step (`kernels/`'s `PROBE`, [`AllToAll::probe_ns`]).
#[doc(hidden)]
pub const PROBES: usize = 24;

/// An MoE dispatch/combine between `ranks` processes, over NVLink (CUDA IPC) between ranks
/// of one host and through the proxy (the engine's writes, driven by a host thread)
/// between hosts or where [`Config::transport`] asks for it.
///
/// A step is [`dispatch_send`](Self::dispatch_send) → [`dispatch_recv`](Self::dispatch_recv)
/// → (the experts, reading [`recv_x`](Self::recv_x), writing their outputs in the same
/// layout) → [`combine_send`](Self::combine_send) → [`combine_recv`](Self::combine_recv),
/// every rank running the same stages in the same order. [`dispatch`](Self::dispatch) and
/// [`combine`](Self::combine) launch both halves.
///
/// # Layouts
///
/// After `dispatch_recv`, local expert `le` (global id `rank * experts_per_rank + le`) has
/// `n = recv_count[le]` rows at `recv_x[le][0..n]` (`[experts_per_rank, capacity, hidden]`),
/// and `src_info[le][i] = src_rank * max_tokens + token` says where row `i` came from. In
/// each local expert this rank's own rows come first, then rank + 1's, and so on. Within one
/// source the order is that of its route: by default not fixed from step to step (a shared
/// atomic), and with [`Config::ordered_rows`] on every rank fixed by the inputs, so that the
/// same inputs leave the same `recv_x` and `src_info`, byte for byte. `combine_send` reads `expert_out` in that same layout, and `combine_recv` leaves
/// `combined[t] = sum over k of topk_weights[t][k] * expert_out(topk_idx[t][k], t)` for
/// every token `t` of the dispatch (zeros for a token whose ids are all negative).
///
/// # Ordering between steps
///
/// Each stage reuses buffers of the step before, and peers write into this rank's window:
/// a step's `combine_recv` must be launched before the next `dispatch_send` on the stream
/// (as a step does), and the experts must finish reading `recv_x` before the next
/// `dispatch_send` (which places this rank's own rows there, expert-major). Two micro-batches in flight at once need two `AllToAll`s (two tags).
pub struct AllToAll {
    /// The proxy thread (ranks reached through the engine); stopped first on drop.
    proxy: Option<Proxy>,
    /// Mappings of the peers' windows; unmapped before our own buffers are freed.
    peers: Peers,
    /// The proxy's registered regions and counters (kept while kernels may use them).
    links: Option<Links>,
    kernels: Kernels,
    /// What peers write into (exported; registered with the engine for proxy peers, which
    /// then holds it too).
    window: Arc<DeviceBuffer>,
    /// This rank's state, routing, and outputs.
    private: DeviceBuffer,
    /// Error word the kernels (and the proxy thread) write (pinned, device-mapped).
    status: Arc<PinnedHostBuffer>,
    /// GPU clock stamps ([`clock`](Self::clock)).
    clocks: PinnedHostBuffer,
    layout: Layout,
    config: Config,
    device: usize,
    blocks: u32,
    /// Blocks of the dispatch stages and of the combine's send: their work items are (row,
    /// 2 KiB segment), so that a few rows of a wide hidden size still spread over the SMs.
    seg_blocks: u32,
    combine_recv_blocks: u32,
    /// [`dispatch`](Self::dispatch) and [`combine`](Self::combine) launch one kernel each
    /// (`seg_blocks` blocks, all resident at once) instead of their two stages: no proxy
    /// ranks, and the device holds the grid.
    fused: bool,
    /// Blocks of the fused combine that send when it streams (the others sum); 0: it does
    /// not ([`Config::streamed_combine`]).
    send_blocks: u32,
    /// The engine of the proxy transport (its thread holds a clone).
    _engine: Engine,
    /// Dropped last: every buffer above holds it too.
    ctx: Arc<Context>,
}

impl fmt::Debug for AllToAll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllToAll")
            .field("rank", &self.config.rank)
            .field("ranks", &self.config.ranks)
            .field("device", &self.device)
            .field("window_bytes", &self.layout.window_len)
            .field("private_bytes", &self.layout.private_len)
            .field("proxy_ranks", &format_args!("{:#x}", self.peers.proxy_mask))
            .finish_non_exhaustive()
    }
}

impl AllToAll {
    /// Allocates every buffer (once: nothing is allocated per step), compiles the kernels
    /// for this rank's device, and meets the other ranks through `world`: each publishes the
    /// CUDA IPC handle of its window and maps everybody else's on its host. Every rank must
    /// call it with the same shape, transport (and tag); it returns when all have published.
    ///
    /// `engine` is this rank's transfer engine, used by the proxy transport only (ranks on
    /// other hosts, or every rank with [`Transport::Proxy`]): then the window and an outbox
    /// of the same size are registered with it, their descriptors exchanged through
    /// `world` (the peers' engines become its peers), and a proxy thread started. Any
    /// provider works (the engine picks CUDA IPC, GPUDirect or staging per peer); a
    /// `ReactorMode::BusyPoll` engine answers the proxy's writes soonest.
    ///
    /// Errors: [`MoeError::Config`] (a bad or disagreeing config),
    /// [`MoeError::Cuda`] (no driver or device: `Unsupported`; NVRTC missing; IPC refused;
    /// the engine refused a registration or a peer),
    /// [`MoeError::OtherHost`] ([`Transport::Nvlink`] only), [`MoeError::Bootstrap`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future frees what it allocated and unmaps what it mapped, but the other
    /// ranks may already have mapped this rank's window and wait in their own `new` for this
    /// rank's last exchange: they fail at `world`'s timeout. Cancel it on every rank or none.
    pub async fn new(engine: &Engine, world: &dyn Rendezvous, config: Config) -> Result<AllToAll> {
        config.validate()?;
        let devices = cuda::available()?;
        if devices == 0 {
            return Err(fabric_async::Error::Unsupported("no CUDA device".into()).into());
        }
        let device = config.device.unwrap_or(config.rank % devices);
        let ctx = cuda::context(device)?;
        let layout = Layout::new(&config);
        let kernels = Kernels::load(&ctx)?;
        let len = |n: u64| {
            usize::try_from(n).map_err(|_| MoeError::Config(format!("{n} bytes do not fit this machine")))
        };
        let window = Arc::new(DeviceBuffer::new(&ctx, len(layout.window_len)?)?);
        let private = DeviceBuffer::new(&ctx, len(layout.private_len)?)?;
        // Word 0 the status, then the probes (`kernels/common.cu`'s PROBE).
        let status = Arc::new(PinnedHostBuffer::new(&ctx, 8 * (8 + PROBES))?);
        let clocks = PinnedHostBuffer::new(&ctx, 8 * CLOCK_SLOTS)?;
        let peers = nvlink::connect(world, &config, &ctx, &window).await?;
        let bases: Vec<u8> = peers.bases.iter().flat_map(|b| b.to_le_bytes()).collect();
        private.copy_from_host(layout.off_peers as usize, &bases)?;
        let links = match peers.any_proxy {
            true => proxy::connect(engine, world, &config, &ctx, &window, peers.proxy_mask).await?,
            false => None,
        };
        let words = match &links {
            // The counters' bases: their totals in `connect`, before any peer could write.
            Some(l) => {
                proxy::words(l.mask, l.outbox.device_ptr(), l.doorbells.device_ptr(), &l.counter_words())
            }
            None => proxy::words(0, 0, 0, &[]),
        };
        let words: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        private.copy_from_host(layout.off_proxy as usize, &words)?;
        let sms = ctx.multiprocessor_count()?;
        let blocks = sms.min(((config.ranks * config.max_tokens).div_ceil(8)) as u32).max(1);
        // As kernels/common.cu's row_seg_len splits a row at most: 32 chunks of 8 bf16 (512 B).
        let segs = config.hidden.div_ceil(8).div_ceil(32);
        // Two blocks per SM where every stage kernel fits twice (`__launch_bounds__(256, 2)`:
        // twice the loads in flight, which the latency-bound steps need), else one.
        let twice = [&kernels.dispatch, &kernels.combine, &kernels.dispatch_send, &kernels.combine_send]
            .iter()
            .try_fold(true, |ok, f| Ok::<_, MoeError>(ok && f.max_active_blocks_per_sm(THREADS, 0)? >= 2))?;
        let per_sm = if twice { 2 } else { 1 };
        let seg_blocks =
            (sms * per_sm).min((config.ranks * config.max_tokens * segs).div_ceil(8) as u32).max(1);
        let combine_recv_blocks = sms.min((config.max_tokens * segs).div_ceil(8) as u32).max(1);
        // A fused kernel's blocks wait for a flag its last block raises: the whole grid must
        // be resident at once.
        let resident = |f: &cuda::Function| -> Result<bool> {
            Ok(f.max_active_blocks_per_sm(THREADS, 0)?.saturating_mul(sms) >= seg_blocks)
        };
        let fused = links.is_none() && resident(&kernels.dispatch)? && resident(&kernels.combine)?;
        // The streamed combine: by default where the largest step gives every warp whole rows.
        let warps = seg_blocks as usize * (THREADS / 32) as usize;
        let streamed = fused
            && seg_blocks >= 2
            && config.streamed_combine.unwrap_or(config.ranks * config.max_tokens >= warps);
        // The zero-fills and the copy above went to the legacy default stream, which the
        // caller's (non-blocking) streams do not wait for, and a blocking copy from pageable
        // memory may return before its DMA has landed: finish them before any kernel or
        // peer can touch the buffers.
        ctx.synchronize()?;
        let proxy = match &links {
            Some(l) => Some(Proxy::start(engine.clone(), l, layout, &config, status.clone())?),
            None => None,
        };
        // Nobody writes into a window before every rank has mapped every window. The
        // combine streams only where every rank's does: a streaming rank waits for row flags
        // that only a streaming sender raises (a grid the device cannot hold, or another
        // `streamed_combine`, on any rank turns it off everywhere).
        let key = format!("{}/moe-ready", config.tag);
        let all = all_gather(world, &key, config.rank, config.ranks, vec![u8::from(streamed)]).await?;
        let streamed = streamed && all.iter().all(|v| v.first() == Some(&1));
        let send_blocks = if streamed { send_share(seg_blocks) } else { 0 };
        Ok(AllToAll {
            proxy,
            peers,
            links,
            kernels,
            window,
            private,
            status,
            clocks,
            layout,
            config,
            device,
            blocks,
            seg_blocks,
            combine_recv_blocks,
            fused,
            send_blocks,
            _engine: engine.clone(),
            ctx,
        })
    }

    /// The config this all-to-all was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The CUDA device (ordinal) of this rank.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Whether [`combine`](Self::combine) streams (see [`Config::streamed_combine`]): one
    /// kernel whose blocks send and sum at once.
    pub fn streamed_combine(&self) -> bool {
        self.send_blocks > 0
    }

    /// How this rank reaches `rank`: [`Transport::Nvlink`] (itself included) or
    /// [`Transport::Proxy`].
    pub fn transport_to(&self, rank: usize) -> Transport {
        match self.peers.proxy_mask >> rank & 1 {
            1 => Transport::Proxy,
            _ => Transport::Nvlink,
        }
    }

    /// The proxy's times of the last dispatch and combine step (`None` without proxy
    /// peers): see [`ProxyTimes`].
    pub fn proxy_times(&self) -> Option<[ProxyTimes; 2]> {
        let p = self.proxy.as_ref()?;
        Some([p.times(Stage::Dispatch), p.times(Stage::Combine)])
    }

    /// For a rank reached through the proxy, the path the engine's writes into its window
    /// take (`GpuPath::Ipc` to another process of this host, else the NICs' GPUDirect or
    /// staged path); `None` for an NVLink rank.
    pub fn proxy_path(&self, rank: usize) -> Option<fabric_async::GpuPath> {
        self.proxy.as_ref()?.path(rank)
    }

    /// Rows per local expert in [`recv_x`](Self::recv_x) and in `expert_out`.
    pub fn capacity(&self) -> usize {
        self.layout.capacity as usize
    }

    fn private_ptr(&self, off: u64) -> u64 {
        self.private.device_ptr() + off
    }

    /// Device address of the dispatched rows: `[experts_per_rank, capacity, hidden]`
    /// (expert-major), or `[ranks, max_tokens, hidden]` by source (rank-major: the window's
    /// rows themselves, source `s`'s at `[s][0..n]`; see [`RecvLayout`]).
    pub fn recv_x(&self) -> u64 {
        match self.config.layout {
            RecvLayout::RankMajor => self.window.device_ptr() + self.layout.off_rx,
            _ => self.private_ptr(self.layout.off_x_expert),
        }
    }

    /// Device address of each expert row's weight (the token's weight for that expert),
    /// `[experts_per_rank, capacity]` f32, beside [`src_info`](Self::src_info): what a
    /// rank-major caller weights its experts' outputs by (the expert-major combine does it
    /// itself).
    pub fn recv_weight(&self) -> u64 {
        self.private_ptr(self.layout.off_expert_w)
    }

    /// Device address of the rows per local expert, `[experts_per_rank]` i32.
    pub fn recv_count(&self) -> u64 {
        self.private_ptr(self.layout.off_expert_count)
    }

    /// Device address of where each row came from, `[experts_per_rank, capacity]` i32:
    /// `src_rank * max_tokens + token` (expert-major), or the row's index in
    /// [`recv_x`](Self::recv_x), `src_rank * max_tokens + slot` (rank-major).
    pub fn src_info(&self) -> u64 {
        self.private_ptr(self.layout.off_src_info)
    }

    /// Device address of the combined rows, `[max_tokens, hidden]` (the first `num_tokens`
    /// of the step are written).
    pub fn combined(&self) -> u64 {
        self.private_ptr(self.layout.off_combined)
    }

    /// Bytes of an `expert_out` buffer for [`combine_send`](Self::combine_send): the size of
    /// [`recv_x`](Self::recv_x).
    pub fn expert_out_len(&self) -> usize {
        let rows = match self.config.layout {
            RecvLayout::RankMajor => (self.config.ranks * self.config.max_tokens) as u64,
            _ => self.config.experts_per_rank as u64 * self.layout.capacity,
        };
        (rows * self.layout.row_bytes) as usize
    }

    fn check_stream(&self, stream: CudaStream<'_>) -> Result<()> {
        match stream.ordinal() {
            Some(o) if o != self.device => Err(MoeError::Argument(format!(
                "a stream of cuda:{o} for an all-to-all on cuda:{}",
                self.device
            ))),
            _ => Ok(()),
        }
    }

    /// The proxy words (`layout.rs`) every stage that sends or waits gets as its last
    /// argument.
    fn proxy_words(&self) -> u64 {
        self.private_ptr(self.layout.off_proxy)
    }

    /// With proxy peers, closes `stage`'s receive gate in stream order (a stream write of 0
    /// into pinned memory, before the send kernel that rings the doorbell): see
    /// `proxy/gate.rs`. Nothing without gates.
    fn close_gate(&self, stream: CudaStream<'_>, stage: Stage) -> Result<()> {
        let Some(gate) = self.links.as_ref().and_then(|l| l.gate_ptr(stage)) else { return Ok(()) };
        // SAFETY: `gate` is a word of the links' pinned, device-mapped gate buffer, which
        // lives until Drop has synchronized the context (so past this operation); `stream`
        // is a stream of this device (the caller's contract, checked where it can be).
        unsafe { self.ctx.write_value32_raw(stream.handle(), gate, 0)? };
        Ok(())
    }

    /// With proxy peers, makes the stream wait for `stage`'s receive gate (`>= 1`) before
    /// what follows (the receive kernel): the proxy thread opens it once this step's
    /// arrivals are counted, after the timeout, on a failure and when it stops, so the wait
    /// always ends. Nothing without gates, or once the thread has ended (a panic): the
    /// kernel then spins, bounded, as without gates.
    fn await_gate(&self, stream: CudaStream<'_>, stage: Stage) -> Result<()> {
        if !self.proxy.as_ref().is_some_and(Proxy::running) {
            return Ok(());
        }
        let Some(gate) = self.links.as_ref().and_then(|l| l.gate_ptr(stage)) else { return Ok(()) };
        // SAFETY: as in `close_gate`; the proxy thread (stopped only after opening every
        // gate) or teardown opens the gate, so the wait ends.
        unsafe { self.ctx.wait_value32_raw(stream.handle(), gate, 1, cuda::WaitValue::Geq)? };
        Ok(())
    }

    fn common(&self) -> (u64, u64) {
        (self.private_ptr(self.layout.off_state), self.status.device_ptr())
    }

    /// Ends the all-to-all in step with the other ranks: waits for this device's work and
    /// for every rank to get there (nobody writes any more), unmaps the peers' windows,
    /// waits for every rank to have done so, then frees everything. CUDA requires that
    /// memory exported through IPC is not freed while another process has it open; a plain
    /// drop cannot know that, so end a run with `close`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the all-to-all (it was moved in) as a plain drop would: this
    /// rank's buffers are freed without waiting for the other ranks, which is what `close`
    /// exists to avoid. Let it run to the end.
    pub async fn close(mut self, world: &dyn Rendezvous) -> Result<()> {
        // A stream still queued behind a receive gate must not wait for more than the
        // kernels' own bounded waits.
        if let Some(p) = &self.proxy {
            p.open_gates();
        }
        self.ctx.synchronize()?;
        let (tag, rank, ranks) = (self.config.tag.clone(), self.config.rank, self.config.ranks);
        all_gather(world, &format!("{tag}/moe-quiet"), rank, ranks, Vec::new()).await?;
        // Every peer's kernels are done, so every proxy write has landed. The engine's
        // remote regions of the peers' windows hold its CUDA IPC mappings of them (proxy
        // peers on this host): they go before the peers free their windows, as ours do.
        if let Some(p) = self.proxy.as_mut() {
            p.stop();
        }
        self.links = None;
        self.peers.unmap();
        all_gather(world, &format!("{tag}/moe-unmapped"), rank, ranks, Vec::new()).await?;
        Ok(())
    }
}

impl Drop for AllToAll {
    fn drop(&mut self) {
        // Every kernel of ours ends by itself (receive waits are bounded by the timeout), and
        // so does a stream's wait for a receive gate: opened here (an early opening only
        // lets the kernel spin), and by the proxy thread, still running, for a step still
        // queued behind us. Once the device is idle no launch uses the buffers freed below.
        if let Some(p) = &self.proxy {
            p.open_gates();
        }
        let _ = self.ctx.synchronize();
    }
}

fn timeout_ns(c: &Config) -> u64 {
    u64::try_from(c.timeout.as_nanos()).unwrap_or(u64::MAX)
}

/// Blocks of a streamed combine's grid of `grid` blocks that send (the others sum): half,
/// or `FABRIC_MOE_SEND_SHARE` percent (1-99, for tuning), at least one of each.
fn send_share(grid: u32) -> u32 {
    let percent = std::env::var("FABRIC_MOE_SEND_SHARE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|p| (1..=99).contains(p))
        .unwrap_or(50);
    (grid * percent / 100).clamp(1, grid - 1)
}
