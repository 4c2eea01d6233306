//! [`AllToAll`]: the buffers of one MoE all-to-all, its kernels, and the stages a step is
//! made of. Every stage is launched on the caller's stream and returns at once; nothing in
//! a launch waits for the GPU or touches another stream, so a whole step can be captured in
//! a CUDA graph.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use fabric_async::bootstrap::{all_gather, Rendezvous};
use fabric_async::cuda::{self, Context, DeviceBuffer, KernelArgs, PinnedHostBuffer};
use fabric_async::Engine;

use crate::config::{Config, DispatchInput, RecvLayout, Transport};
use crate::error::{MoeError, Result};
use crate::kernels::{launch, CudaStream, Kernels, THREADS};
use crate::layout::Layout;
use crate::nvlink::{self, Peers};
use crate::proxy::{self, Links, Proxy, ProxyTimes, Stage};

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
/// and `src_info[le][i] = src_rank * max_tokens + token` says where row `i` came from. The
/// order of rows within an expert is the order they were placed in (not fixed from step to
/// step). `combine_send` reads `expert_out` in that same layout, and `combine_recv` leaves
/// `combined[t] = sum over k of topk_weights[t][k] * expert_out(topk_idx[t][k], t)` for
/// every token `t` of the dispatch (zeros for a token whose ids are all negative).
///
/// # Ordering between steps
///
/// Each stage reuses buffers of the step before, and peers write into this rank's window:
/// a step's `combine_recv` must be launched before the next `dispatch_send` on the stream
/// (as a step does), and the experts must finish reading `recv_x` before the next
/// `dispatch_recv`. Two micro-batches in flight at once need two `AllToAll`s (two tags).
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

/// What the host reads back after a dispatch ([`AllToAll::read_received`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Per local expert: `(source rank, source token)` of each row, in row order.
    pub sources: Vec<Vec<(usize, usize)>>,
    /// Per local expert: its rows, `count * hidden` raw 16-bit values.
    pub rows: Vec<Vec<u16>>,
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
        // The zero-fills and the copy above went to the legacy default stream, which the
        // caller's (non-blocking) streams do not wait for, and a blocking copy from pageable
        // memory may return before its DMA has landed: finish them before any kernel or
        // peer can touch the buffers.
        ctx.synchronize()?;
        let proxy = match &links {
            Some(l) => Some(Proxy::start(engine.clone(), l, layout, &config, status.clone())?),
            None => None,
        };
        // Nobody writes into a window before every rank has mapped every window.
        let key = format!("{}/moe-ready", config.tag);
        all_gather(world, &key, config.rank, config.ranks, Vec::new()).await?;
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
    /// `proxy.rs`, "Receive gates". Nothing without gates.
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

    /// Routes this step's tokens by destination rank and writes each token once to every
    /// rank that holds one of its experts (with its expert ids and weights), straight into
    /// that rank's window; then raises this step's dispatch flag at every rank (also those
    /// that get no token: the flag carries the count). With ranks reached through the
    /// proxy, it first closes the stage's receive gate (a stream write, see
    /// [`dispatch_recv`](Self::dispatch_recv)).
    ///
    /// # Safety
    ///
    /// `input`'s addresses must be device memory of this rank's device holding
    /// `num_tokens` rows of `x` (`hidden` bf16 each), `topk_idx` (`topk` ids each) and
    /// `topk_weights` (`topk` f32 each), not written until the launched kernels complete
    /// (the stream's next work). `stream` must be a live stream of this device.
    pub unsafe fn dispatch_send<'s>(
        &self,
        stream: impl Into<CudaStream<'s>>,
        input: &DispatchInput,
    ) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        let send = self.dispatch_send_args(input)?;
        // Before the kernel that rings this step's doorbell.
        self.close_gate(stream, Stage::Dispatch)?;
        // SAFETY: moe_dispatch_send's parameters in order. Its block 0 reads num_tokens *
        // topk ids (the caller's contract) and writes send_slot (max_tokens * ranks),
        // send_count (ranks), send_pos (max_tokens * topk), send_ecount (ranks *
        // experts_per_rank) and the state, all inside `private` (layout.rs), and the status
        // word; then every block reads the caller's rows, ids and weights of the tokens so
        // routed, and writes, in each peer's window (mapped for the life of `self`, same
        // layout) or this rank's outbox, only this rank's section of ecount, meta and rx and
        // this rank's flag.
        unsafe { launch(&self.kernels.dispatch_send, stream, self.seg_blocks, THREADS, send) }
    }

    /// `moe_dispatch_send`'s parameters (the first ones of `moe_dispatch`).
    fn dispatch_send_args(&self, input: &DispatchInput) -> Result<KernelArgs> {
        if input.num_tokens > self.config.max_tokens {
            return Err(MoeError::Argument(format!(
                "{} tokens, max_tokens is {}",
                input.num_tokens, self.config.max_tokens
            )));
        }
        let (c, l) = (&self.config, &self.layout);
        let (state, status) = self.common();
        let (idx, idx64) = input.topk_idx.parts();
        let send = KernelArgs::new()
            .u64(input.x)
            .u64(idx)
            .u32(idx64)
            .u64(input.topk_weights)
            .u64(self.private_ptr(l.off_send_slot))
            .u64(self.private_ptr(l.off_send_count))
            .u64(self.private_ptr(l.off_send_pos))
            .u64(self.private_ptr(l.off_send_ecount))
            .u64(self.private_ptr(l.off_peers))
            .u64(state)
            .u64(status)
            .u32(input.num_tokens as u32)
            .u32(c.rank as u32)
            .u32(c.ranks as u32)
            .u32(c.max_tokens as u32)
            .u32(c.topk as u32)
            .u32(c.experts_per_rank as u32)
            .u32(l.row_bytes as u32)
            .u64(l.off_dflag)
            .u64(l.off_ecount)
            .u64(l.off_meta)
            .u64(l.off_rx)
            .u64(timeout_ns(c))
            .u64(self.proxy_words());
        Ok(send)
    }

    /// Waits (on the GPU) for every rank's dispatch flag of this step, then places the
    /// received rows by local expert in [`recv_x`](Self::recv_x), with
    /// [`recv_count`](Self::recv_count) and [`src_info`](Self::src_info). A wait longer than
    /// the config's timeout ends the kernel and is reported by [`check`](Self::check).
    ///
    /// With ranks reached through the proxy, the kernel does not start before the proxy
    /// thread has counted this step's writes from every one of them: the stream first waits
    /// (a stream memory operation, no kernel spinning on the GPU while the proxy's copies
    /// run) for the stage's receive gate, which the thread opens then, or after the timeout,
    /// on a failed write, or when it stops. Drivers older than CUDA 11.7 have no gates.
    pub fn dispatch_recv<'s>(&self, stream: impl Into<CudaStream<'s>>) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        let (c, l) = (&self.config, &self.layout);
        let (state, status) = self.common();
        let args = KernelArgs::new()
            .u64(self.window.device_ptr())
            .u64(self.private_ptr(l.off_x_expert))
            .u64(self.private_ptr(l.off_expert_count))
            .u64(self.private_ptr(l.off_src_info))
            .u64(self.private_ptr(l.off_recv_pos))
            .u64(self.private_ptr(l.off_recv_count))
            .u64(state)
            .u64(status)
            .u32(c.rank as u32)
            .u32(c.ranks as u32)
            .u32(c.max_tokens as u32)
            .u32(c.topk as u32)
            .u32(c.experts_per_rank as u32)
            .u32(l.capacity as u32)
            .u32(l.row_bytes as u32)
            .u64(l.off_dflag)
            .u64(l.off_ecount)
            .u64(l.off_meta)
            .u64(l.off_rx)
            .u64(timeout_ns(c))
            .u64(self.private_ptr(l.off_expert_w))
            .u32(u32::from(c.layout == RecvLayout::RankMajor))
            .u64(self.proxy_words());
        self.await_gate(stream, Stage::Dispatch)?;
        // SAFETY: moe_dispatch_recv's parameters in order; it reads this rank's window and
        // writes x_expert (positions checked against the capacity; none rank-major, where it
        // is empty), expert_w, counts, src_info,
        // recv_pos and recv_count, all inside buffers `self` owns until Drop synchronizes.
        unsafe { launch(&self.kernels.dispatch_recv, stream, self.seg_blocks, THREADS, args) }
    }

    /// [`dispatch_send`](Self::dispatch_send) then [`dispatch_recv`](Self::dispatch_recv),
    /// the same bytes and results. Without proxy ranks it is **one kernel** (`moe_dispatch`:
    /// a block that has sent its rows goes on to wait and place, one launch and one kernel
    /// boundary less than the two stages); its blocks must all be resident at once, which
    /// `new` checked, so a kernel of another stream that never ends (one waiting for this
    /// step's rows) delays it until it ends. Call the two stages to overlap micro-batches.
    ///
    /// # Safety
    ///
    /// As [`dispatch_send`](Self::dispatch_send).
    pub unsafe fn dispatch<'s>(
        &self,
        stream: impl Into<CudaStream<'s>>,
        input: &DispatchInput,
    ) -> Result<()> {
        let stream = stream.into();
        if !self.fused {
            // SAFETY: the caller's contract.
            unsafe { self.dispatch_send(stream, input)? };
            return self.dispatch_recv(stream);
        }
        self.check_stream(stream)?;
        let (c, l) = (&self.config, &self.layout);
        let args = self
            .dispatch_send_args(input)?
            .u64(self.window.device_ptr())
            .u64(self.private_ptr(l.off_x_expert))
            .u64(self.private_ptr(l.off_expert_count))
            .u64(self.private_ptr(l.off_src_info))
            .u64(self.private_ptr(l.off_recv_pos))
            .u64(self.private_ptr(l.off_recv_count))
            .u32(l.capacity as u32)
            .u64(self.private_ptr(l.off_expert_w))
            .u32(u32::from(c.layout == RecvLayout::RankMajor));
        // SAFETY: moe_dispatch's parameters in order (moe_dispatch_send's, then what
        // moe_dispatch_recv adds); it does what the two stages do (see dispatch_send and
        // dispatch_recv) in one launch of `seg_blocks` blocks, which `new` checked the device
        // holds at once (its blocks wait for a flag the last one raises).
        unsafe { launch(&self.kernels.dispatch, stream, self.seg_blocks, THREADS, args) }
    }

    /// For every row received in this step's dispatch, the weighted sum of its local
    /// experts' outputs (f32, then bf16), written straight into the source rank's window;
    /// then raises this step's combine flag at every rank. With ranks reached through the
    /// proxy, it first closes the stage's receive gate, as
    /// [`dispatch_send`](Self::dispatch_send) does.
    ///
    /// # Safety
    ///
    /// `expert_out` must be device memory of this device of
    /// [`expert_out_len`](Self::expert_out_len) bytes in the layout of
    /// [`recv_x`](Self::recv_x) (it may be `recv_x` itself: identity experts), not written
    /// until the kernel completes. `stream` must be a live stream of this device.
    pub unsafe fn combine_send<'s>(&self, stream: impl Into<CudaStream<'s>>, expert_out: u64) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        let args = self.combine_send_args(expert_out);
        // Before the kernel that rings this step's doorbell.
        self.close_gate(stream, Stage::Combine)?;
        // SAFETY: moe_combine_send's parameters in order; reads expert_out (rank-major: the
        // rows received, `expert_out_len`) at positions
        // placed by dispatch_recv (< capacity), this rank's window and private buffers, and
        // writes this rank's section of cx and its flag in each peer's window.
        unsafe { launch(&self.kernels.combine_send, stream, self.seg_blocks, THREADS, args) }
    }

    /// `moe_combine_send`'s parameters (the first ones of `moe_combine`).
    fn combine_send_args(&self, expert_out: u64) -> KernelArgs {
        let (c, l) = (&self.config, &self.layout);
        let (state, status) = self.common();
        KernelArgs::new()
            .u64(expert_out)
            .u64(self.window.device_ptr())
            .u64(self.private_ptr(l.off_recv_pos))
            .u64(self.private_ptr(l.off_recv_count))
            .u64(self.private_ptr(l.off_peers))
            .u64(state)
            .u32(c.rank as u32)
            .u32(c.ranks as u32)
            .u32(c.max_tokens as u32)
            .u32(c.topk as u32)
            .u32(c.experts_per_rank as u32)
            .u32(l.capacity as u32)
            .u32(c.hidden as u32)
            .u64(l.off_cflag)
            .u64(l.off_meta)
            .u64(l.off_cx)
            .u32(u32::from(c.layout == RecvLayout::RankMajor))
            .u64(self.proxy_words())
            .u64(status)
    }

    /// Waits for every rank's combine flag of this step, then writes
    /// [`combined`](Self::combined): each token's partial sums from the ranks it was sent
    /// to, added in f32, as bf16. With ranks reached through the proxy, the kernel waits for
    /// the stage's receive gate first, as in [`dispatch_recv`](Self::dispatch_recv).
    pub fn combine_recv<'s>(&self, stream: impl Into<CudaStream<'s>>) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        let (c, l) = (&self.config, &self.layout);
        let (state, status) = self.common();
        let args = KernelArgs::new()
            .u64(self.private_ptr(l.off_combined))
            .u64(self.window.device_ptr())
            .u64(self.private_ptr(l.off_send_slot))
            .u64(state)
            .u64(status)
            .u32(c.rank as u32)
            .u32(c.ranks as u32)
            .u32(c.max_tokens as u32)
            .u32(c.hidden as u32)
            .u64(l.off_cflag)
            .u64(l.off_cx)
            .u64(timeout_ns(c))
            .u64(self.proxy_words());
        let blocks = self.combine_recv_blocks;
        self.await_gate(stream, Stage::Combine)?;
        // SAFETY: moe_combine_recv's parameters in order; reads this rank's window and
        // send_slot, writes the first num_tokens rows of `combined`, all owned by `self`.
        unsafe { launch(&self.kernels.combine_recv, stream, blocks, THREADS, args) }
    }

    /// [`combine_send`](Self::combine_send) then [`combine_recv`](Self::combine_recv),
    /// the same results. Without proxy ranks it is one kernel (`moe_combine`), as
    /// [`dispatch`](Self::dispatch); with [`RecvLayout::RankMajor`] it also reads this rank's
    /// own rows from `expert_out` instead of copying them through its window.
    ///
    /// # Safety
    ///
    /// As [`combine_send`](Self::combine_send).
    pub unsafe fn combine<'s>(&self, stream: impl Into<CudaStream<'s>>, expert_out: u64) -> Result<()> {
        let stream = stream.into();
        if !self.fused {
            // SAFETY: the caller's contract.
            unsafe { self.combine_send(stream, expert_out)? };
            return self.combine_recv(stream);
        }
        self.check_stream(stream)?;
        let (c, l) = (&self.config, &self.layout);
        let args = self
            .combine_send_args(expert_out)
            .u64(self.private_ptr(l.off_combined))
            .u64(self.private_ptr(l.off_send_slot))
            .u64(timeout_ns(c));
        // SAFETY: moe_combine's parameters in order (moe_combine_send's, then what
        // moe_combine_recv adds); it does what the two stages do (see combine_send and
        // combine_recv) in one launch that `new` checked the device holds at once, except
        // that, rank-major, it reads this rank's own rows from `expert_out` (the caller's
        // contract: not written until the kernel completes) instead of copying them through
        // the window.
        unsafe { launch(&self.kernels.combine, stream, self.seg_blocks, THREADS, args) }
    }

    /// A barrier of all ranks on the GPU: the kernel raises this rank's flag at every peer
    /// and waits for theirs. For timing a step from a common start.
    pub fn barrier<'s>(&self, stream: impl Into<CudaStream<'s>>) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        let (state, status) = self.common();
        let args = KernelArgs::new()
            .u64(self.window.device_ptr())
            .u64(self.private_ptr(self.layout.off_peers))
            .u64(state)
            .u64(status)
            .u32(self.config.rank as u32)
            .u32(self.config.ranks as u32)
            .u64(self.layout.off_bflag)
            .u64(timeout_ns(&self.config))
            .u64(self.proxy_words());
        let threads = (self.config.ranks as u32).div_ceil(32) * 32;
        // SAFETY: moe_barrier's parameters in order; writes this rank's barrier flag in each
        // window (mapped for the life of `self`) and the state word.
        unsafe { launch(&self.kernels.barrier, stream, 1, threads, args) }
    }

    /// Writes the GPU's clock (ns, `%globaltimer`) into slot `slot` when the stream gets
    /// there; read it with [`clock_ns`](Self::clock_ns) once the stream is done.
    pub fn clock<'s>(&self, stream: impl Into<CudaStream<'s>>, slot: usize) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        if slot >= CLOCK_SLOTS {
            return Err(MoeError::Argument(format!("clock slot {slot} of {CLOCK_SLOTS}")));
        }
        let args = KernelArgs::new().u64(self.clocks.device_ptr() + 8 * slot as u64);
        // SAFETY: moe_clock(u64*) writes one word, inside `clocks` (checked), which lives
        // until Drop synchronizes.
        unsafe { launch(&self.kernels.clock, stream, 1, 1, args) }
    }

    /// The value [`clock`](Self::clock) wrote into `slot` (0 if never).
    pub fn clock_ns(&self, slot: usize) -> u64 {
        self.clocks.atomic_u64s().get(slot).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Stand-in experts for tests and examples: local expert `le` (global id `e`) outputs
    /// each of its rows times `1 + (e % 8) / 8`, rounded to bf16 (see
    /// [`reference::toy_expert`](crate::reference::toy_expert)), into `expert_out`.
    ///
    /// # Safety
    ///
    /// As [`combine_send`](Self::combine_send) for `expert_out`, which this writes.
    pub unsafe fn toy_experts<'s>(&self, stream: impl Into<CudaStream<'s>>, expert_out: u64) -> Result<()> {
        let stream = stream.into();
        self.check_stream(stream)?;
        let (c, l) = (&self.config, &self.layout);
        if c.layout == RecvLayout::RankMajor {
            let args = KernelArgs::new()
                .u64(self.window.device_ptr())
                .u64(expert_out)
                .u64(self.private_ptr(l.off_recv_count))
                .u32(c.rank as u32)
                .u32(c.ranks as u32)
                .u32(c.max_tokens as u32)
                .u32(c.topk as u32)
                .u32(c.experts_per_rank as u32)
                .u32(c.hidden as u32)
                .u64(l.off_meta)
                .u64(l.off_rx);
            // SAFETY: moe_toy_experts_rank's parameters in order; reads the window's meta and
            // rows below each source's count (owned), writes the same rows of expert_out
            // (`expert_out_len`, the caller's contract).
            return unsafe { launch(&self.kernels.toy_experts_rank, stream, self.blocks, THREADS, args) };
        }
        let args = KernelArgs::new()
            .u64(self.private_ptr(l.off_x_expert))
            .u64(expert_out)
            .u64(self.private_ptr(l.off_expert_count))
            .u32(c.rank as u32)
            .u32(c.experts_per_rank as u32)
            .u32(l.capacity as u32)
            .u32(c.hidden as u32);
        // SAFETY: moe_toy_experts' parameters in order; reads x_expert and the counts
        // (owned), writes the rows below each count in expert_out (the caller's contract).
        unsafe { launch(&self.kernels.toy_experts, stream, self.blocks, THREADS, args) }
    }

    /// Errors the kernels reported since `new` (a wait that timed out, a capacity overflow,
    /// an expert id out of range), or the proxy thread (a write that failed:
    /// [`MoeError::Transport`]). Reads one word of pinned memory: cheap, never blocks.
    pub fn check(&self) -> Result<()> {
        let word = self.status.atomic_u64s()[0].load(Ordering::Acquire);
        let detail = (word & 0xffff_ffff) as usize;
        match word >> 32 {
            0 => Ok(()),
            1 => Err(MoeError::Timeout { stage: "dispatch_recv" }),
            2 => Err(MoeError::Timeout { stage: "combine_recv" }),
            3 => Err(MoeError::CapacityExceeded { expert: detail }),
            4 => Err(MoeError::BadExpert { token: detail }),
            5 => Err(MoeError::Timeout { stage: "barrier" }),
            proxy::ERR_PROXY => Err(self.proxy.as_ref().and_then(Proxy::error).unwrap_or_else(|| {
                let (stage, rank) = proxy::decode_status(detail as u64);
                MoeError::Transport { stage, rank, message: "(no message)".into() }
            })),
            k => Err(MoeError::Argument(format!("unknown kernel status {k}:{detail}"))),
        }
    }

    /// The GPU clock (ns) at each probe point of the last step (`kernels/`'s `PROBE`; zeros
    /// unless `FABRIC_MOE_PROBE` was set when the kernels were compiled): for breakdowns of
    /// a step by the harness. Read after the stream is synchronized.
    #[doc(hidden)]
    pub fn probe_ns(&self) -> [u64; PROBES] {
        let words = self.status.atomic_u64s();
        std::array::from_fn(|i| words[8 + i].load(Ordering::Acquire))
    }

    /// Reads the dispatch's results to the host (cold path: tests, examples). Call it only
    /// once the stream the stages ran on is synchronized: the copies are blocking copies on
    /// the legacy default stream, which does not wait for other streams.
    pub fn read_received(&self) -> Result<Received> {
        let (c, l) = (&self.config, &self.layout);
        let counts = self.read_i32s(l.off_expert_count, c.experts_per_rank)?;
        let mut out = Received { sources: Vec::new(), rows: Vec::new() };
        if c.layout == RecvLayout::RankMajor {
            return self.read_received_rank_major(&counts);
        }
        for (le, &n) in counts.iter().enumerate() {
            let n = (n.max(0) as usize).min(self.capacity());
            let info = self.read_i32s(l.off_src_info + 4 * le as u64 * l.capacity, n)?;
            let t = c.max_tokens;
            out.sources.push(info.iter().map(|&v| (v as usize / t, v as usize % t)).collect());
            let mut rows = vec![0u8; n * l.row_bytes as usize];
            let off = l.off_x_expert + le as u64 * l.capacity * l.row_bytes;
            self.private.copy_to_host(off as usize, &mut rows)?;
            out.rows.push(rows.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect());
        }
        Ok(out)
    }

    /// `read_received` of a rank-major dispatch: each expert's rows by their indices into
    /// the window's rows, their source tokens from the window's meta.
    fn read_received_rank_major(&self, counts: &[i32]) -> Result<Received> {
        let (c, l) = (&self.config, &self.layout);
        let (t, rb) = (c.max_tokens, l.row_bytes as usize);
        let mut meta = vec![0u8; c.ranks * t * l.meta_words as usize * 4];
        self.window.copy_to_host(l.off_meta as usize, &mut meta)?;
        let mut rx = vec![0u8; c.ranks * t * rb];
        self.window.copy_to_host(l.off_rx as usize, &mut rx)?;
        let token = |i: usize| {
            let at = i * l.meta_words as usize * 4;
            i32::from_le_bytes([meta[at], meta[at + 1], meta[at + 2], meta[at + 3]]) as usize
        };
        let mut out = Received { sources: Vec::new(), rows: Vec::new() };
        for (le, &n) in counts.iter().enumerate() {
            let n = (n.max(0) as usize).min(self.capacity());
            let info = self.read_i32s(l.off_src_info + 4 * le as u64 * l.capacity, n)?;
            let mut sources = Vec::with_capacity(n);
            let mut rows = Vec::with_capacity(n * c.hidden);
            for &v in &info {
                let i = (v.max(0) as usize).min(c.ranks * t - 1);
                sources.push((i / t, token(i)));
                rows.extend(
                    rx[i * rb..(i + 1) * rb].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])),
                );
            }
            out.sources.push(sources);
            out.rows.push(rows);
        }
        Ok(out)
    }

    /// The first `num_tokens` combined rows, as raw bf16 (cold path; as
    /// [`read_received`](Self::read_received), after synchronizing).
    pub fn read_combined(&self, num_tokens: usize) -> Result<Vec<u16>> {
        let n = num_tokens.min(self.config.max_tokens) * self.layout.row_bytes as usize;
        let mut bytes = vec![0u8; n];
        self.private.copy_to_host(self.layout.off_combined as usize, &mut bytes)?;
        Ok(bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
    }

    fn read_i32s(&self, off: u64, n: usize) -> Result<Vec<i32>> {
        let mut bytes = vec![0u8; 4 * n];
        self.private.copy_to_host(off as usize, &mut bytes)?;
        Ok(bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
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
