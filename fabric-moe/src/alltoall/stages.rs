//! The stages of a step, as [`AllToAll`] methods: each builds its kernel's arguments and
//! launches it on the caller's stream (and, with proxy ranks, closes or awaits the stage's
//! receive gate there); the barrier, the clock and the stand-in experts.

use std::sync::atomic::Ordering;

use super::{timeout_ns, AllToAll, CLOCK_SLOTS};
use crate::config::{DispatchInput, RecvLayout};
use crate::error::{MoeError, Result};
use crate::kernels::{launch, CudaStream, THREADS};
use crate::proxy::Stage;
use fabric_async::cuda::KernelArgs;

impl AllToAll {
    /// Routes this step's tokens by destination rank and writes each token once to every
    /// rank that holds one of its experts (with its expert ids and weights), straight into
    /// that rank's window (expert-major, a token for this rank's own experts goes straight
    /// to its places in [`recv_x`](Self::recv_x) instead); then raises this step's dispatch
    /// flag at every rank (also those that get no token: the flag carries the count). With
    /// ranks reached through the proxy, it first closes the stage's receive gate (a stream
    /// write, see [`dispatch_recv`](Self::dispatch_recv)).
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
        // this rank's flag; expert-major, this rank's own rows go to x_expert instead (places
        // checked against the capacity), with src_info, expert_w and recv_pos, all inside
        // `private`.
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
            .u64(self.proxy_words())
            .u64(self.private_ptr(l.off_x_expert))
            .u64(self.private_ptr(l.off_src_info))
            .u64(self.private_ptr(l.off_recv_pos))
            .u64(self.private_ptr(l.off_expert_w))
            .u32(l.capacity as u32)
            .u32(u32::from(c.layout == RecvLayout::RankMajor))
            .u32(u32::from(c.ordered_rows));
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
        let l = &self.layout;
        let args = self
            .dispatch_send_args(input)?
            .u64(self.window.device_ptr())
            .u64(self.private_ptr(l.off_expert_count))
            .u64(self.private_ptr(l.off_recv_count));
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
        let args = self.combine_send_args(expert_out).u64(self.combine_rows());
        // Before the kernel that rings this step's doorbell.
        self.close_gate(stream, Stage::Combine)?;
        // SAFETY: moe_combine_send's parameters in order; reads expert_out (rank-major: the
        // rows received, `expert_out_len`) at positions
        // placed by dispatch_recv (< capacity), this rank's window and private buffers, and
        // writes this rank's section of cx and its flag in each peer's window (and, where the
        // combine streams, its section of the row flags).
        unsafe { launch(&self.kernels.combine_send, stream, self.seg_blocks, THREADS, args) }
    }

    /// The streamed combine's row flags' offset, or 0.
    fn combine_rows(&self) -> u64 {
        if self.send_blocks > 0 {
            self.layout.off_crow
        } else {
            0
        }
    }

    /// `moe_combine_send`'s parameters up to `status` (the first ones of `moe_combine`).
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
    /// own rows from `expert_out` instead of copying them through its window; and where it
    /// streams ([`Config::streamed_combine`](crate::Config::streamed_combine)) half its blocks send while the others sum the
    /// tokens whose rows have landed.
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
            .u64(timeout_ns(c))
            .u32(self.send_blocks)
            .u64(self.combine_rows());
        // SAFETY: moe_combine's parameters in order (moe_combine_send's, then what
        // moe_combine_recv adds, then the streamed combine's senders and the offset of the
        // row flags, inside the windows' layout); it does what the two stages do (see
        // combine_send and combine_recv) in one launch that `new` checked the device holds
        // at once, except that, rank-major, it reads this rank's own rows from `expert_out`
        // (the caller's contract: not written until the kernel completes) instead of
        // copying them through the window, and that, streamed, it also writes this rank's
        // row flags (crow) in each peer's window.
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
}
