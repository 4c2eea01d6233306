//! The proxy transport: for ranks the kernels cannot store into (another host, or any rank
//! with `Transport::Proxy`), the send kernels pack rows into a local **outbox** (GPU memory,
//! the window's layout, section `d` for rank `d`) and ring a **doorbell** in pinned,
//! device-mapped host memory; a host thread sees it and writes those bytes with the engine
//! (`write_imm`: the engine picks CUDA IPC, GPUDirect or staging by itself); each write
//! raises an immediate that the destination's engine counts into a [`GpuCounter`], on which
//! the receive kernel waits. The GPU's SMs do not copy network bytes.
//!
//! ```text
//!  rank a                                                   rank b
//!  dispatch_send: rows, meta ─► outbox.rx[b], .meta[b]
//!    last block: outbox.dflag[b] = seq<<32|n,
//!    __threadfence_system, doorbell[dispatch][b] = same
//!  proxy thread (a): sees the doorbell change ─► write_imm outbox.meta[b] ─► window_b.meta[a]
//!                                                write_imm outbox.rx[b]   ─► window_b.rx[a]
//!                                                write_imm outbox.dflag[b] ─► window_b.dflag[a]
//!                                                (imm = imm(tag, dispatch, a), 3 per step)
//!                                                         engine b: GpuCounter(imm) += 1 each
//!                                                         dispatch_recv: counter - base >= 3 * seq,
//!                                                           then the flag, then the rows as NVLink
//! ```
//!
//! Combine is the same with its rows and flag (2 writes a step), the GPU barrier with its
//! flag only (1 write; its receiver spins on the flag word, which carries no data).
//!
//! **Receive gates.** A receive kernel that spins on the GPU while the proxy's writes are
//! under way slows them down (on one host the engine's CUDA IPC copies waited about a
//! scheduler time slice, ~1 ms, each). So the receive kernels of dispatch and combine are
//! not started before the arrivals are there: per stage a 32-bit **gate** word of pinned,
//! device-mapped host memory, which `dispatch_send` / `combine_send` close (a stream write of
//! 0 before the send kernel) and `dispatch_recv` / `combine_recv` wait for (a stream wait for
//! `>= 1` before the receive kernel), both stream memory operations (capturable in a CUDA
//! graph: the values are constants). The thread opens a gate (stores 1) once it has seen this
//! step's doorbell of the stage (rung after the stream closed the gate, so the opening cannot
//! be overwritten by this step's close) and every proxy source's counter holds the step's
//! arrivals ([`should_open`]); after the config's timeout of seeing it closed, after a
//! failed write, and when it stops, it opens it anyway: an early opening only lets the
//! kernel spin as before, and the kernel's own bounded waits stay the check and the timeout.
//!
//! ```text
//!  stream: gate = 0 ─► dispatch_send ─► doorbell ─► proxy thread: posts the writes; has
//!          wait gate >= 1 ◄──────────────────────── seen the doorbell and every source's
//!          dispatch_recv (its waits pass at once)   counter at the step's arrivals: gate = 1
//! ```
//!
//! Layout of the pure part: [`imm`], [`Doorbell`], [`plan`] (what to write for a doorbell),
//! [`arrived`] and [`should_open`] (the gates) are plain functions; [`connect`] registers
//! and exchanges the regions; [`Proxy`] is the thread. Errors of a write go to the status
//! word (`ERR_PROXY`) and the message to [`Proxy::error`]; the peer's receive kernel times
//! out, nothing hangs.
//!
//! Child modules: [`gate`] (the receive gates) and [`worker`] (the thread, [`Proxy`]); the rest is here.
//!
//! [`arrived`]: gate
//! [`should_open`]: gate::should_open

mod gate;
mod worker;

use std::fmt;
use std::sync::Arc;

use fabric_async::bootstrap::{all_gather, Rendezvous};
use fabric_async::cuda::{Context, DeviceBuffer, PinnedHostBuffer};
use fabric_async::{Engine, GpuCounter, MemoryRegion, RemoteRegion};

use crate::config::{Config, MAX_RANKS};
use crate::error::{MoeError, Result};
use crate::layout::{Layout, PX_BASE, PX_COUNTER, PX_DOORBELL, PX_MASK, PX_OUTBOX};

use gate::{open_all, GATED, GATE_STRIDE};
pub(crate) use worker::Proxy;
pub use worker::ProxyTimes;

/// The stages that go through the proxy (the doorbell rows, in `kernels/common.cu`'s order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    Dispatch = 0,
    Combine = 1,
    Barrier = 2,
}

impl Stage {
    pub(crate) const ALL: [Stage; 3] = [Stage::Dispatch, Stage::Combine, Stage::Barrier];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Stage::Dispatch => "dispatch",
            Stage::Combine => "combine",
            Stage::Barrier => "barrier",
        }
    }

    /// Writes (so arrivals of its immediate) per step: `kernels/common.cu`'s `PX_WRITES`.
    pub(crate) fn writes(self) -> u64 {
        match self {
            Stage::Dispatch => 4,
            Stage::Combine => 2,
            Stage::Barrier => 1,
        }
    }

    fn from_index(i: u64) -> Option<Stage> {
        Stage::ALL.get(i as usize).copied()
    }
}

/// Error kind of the proxy in the status word (`kernels/common.cu` has 1..=5).
pub(crate) const ERR_PROXY: u64 = 6;

/// Doorbell words: `[stage][MAX_RANKS]`.
pub(crate) const DOORBELL_WORDS: usize = 3 * MAX_RANKS;

/// The immediate of `stage`'s writes from rank `src` in the all-to-all tagged `tag`:
/// `0xE` in the top 4 bits (other users of the engine should keep their immediates clear of
/// `0xE000_0000..=0xEFFF_FFFF`), 20 bits of a hash of the tag, the stage, the source rank.
pub(crate) fn imm(tag: &str, stage: Stage, src: usize) -> u32 {
    // FNV-1a, folded to 20 bits.
    let mut h: u32 = 0x811c_9dc5;
    for b in tag.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    let h = (h ^ (h >> 20)) & 0xf_ffff;
    0xE000_0000 | h << 8 | (stage as u32) << 6 | (src as u32 & 0x3f)
}

/// A doorbell word as the send kernel rings it: `seq << 32 | count` (rows for that rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Doorbell {
    pub seq: u32,
    pub count: u32,
}

impl Doorbell {
    pub(crate) fn decode(word: u64) -> Doorbell {
        Doorbell { seq: (word >> 32) as u32, count: word as u32 }
    }
}

/// One write of a step: `len` bytes from the outbox at `src_off` to the peer's window at
/// `dst_off` (0 bytes: an imm-only write, one arrival all the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Write {
    pub src_off: u64,
    pub dst_off: u64,
    pub len: u64,
}

/// What rank `me` writes to rank `dest` for a doorbell of `stage` announcing `count` rows:
/// always [`Stage::writes`] writes (so that the receiver's count of arrivals is a multiple
/// of the steps), the flag word last.
pub(crate) fn plan(l: &Layout, tokens: u64, stage: Stage, me: usize, dest: usize, count: u32) -> Vec<Write> {
    let (me, dest, n) = (me as u64, dest as u64, u64::from(count).min(tokens));
    let section = |f: &dyn Fn(u64) -> u64, bytes: u64| Write { src_off: f(dest), dst_off: f(me), len: bytes };
    let flag = |off: u64| Write { src_off: off + 8 * dest, dst_off: off + 8 * me, len: 8 };
    let writes = match stage {
        Stage::Dispatch => vec![
            section(&|s| l.ecount_section(s), l.ecount_bytes),
            section(&|s| l.meta_section(tokens, s), n * l.meta_words * 4),
            section(&|s| l.rx_section(tokens, s), n * l.row_bytes),
            flag(l.off_dflag),
        ],
        Stage::Combine => vec![section(&|s| l.cx_section(tokens, s), n * l.row_bytes), flag(l.off_cflag)],
        Stage::Barrier => vec![flag(l.off_bflag)],
    };
    debug_assert_eq!(writes.len() as u64, stage.writes());
    writes
}

/// The proxy words of the private buffer (`layout.rs`), as kernels read them.
pub(crate) fn words(
    mask: u64,
    outbox: u64,
    doorbells: u64,
    counters: &[[Option<(u64, u64)>; 2]],
) -> Vec<u64> {
    let mut w = vec![0u64; crate::layout::PROXY_WORDS as usize];
    w[PX_MASK] = mask;
    w[PX_OUTBOX] = outbox;
    w[PX_DOORBELL] = doorbells;
    for (s, pair) in counters.iter().enumerate() {
        for (stage, c) in pair.iter().enumerate() {
            if let Some((ptr, base)) = c {
                w[PX_COUNTER + stage * MAX_RANKS + s] = *ptr;
                w[PX_BASE + stage * MAX_RANKS + s] = *base;
            }
        }
    }
    w
}

/// What [`connect`] sets up: this rank's registered window and outbox, the peers' windows,
/// the counters of arrivals from each proxy source.
pub(crate) struct Links {
    pub outbox: Arc<DeviceBuffer>,
    outbox_region: MemoryRegion,
    /// Kept registered: proxy peers write into it.
    _window_region: MemoryRegion,
    remotes: Vec<Option<RemoteRegion>>,
    /// `[source][dispatch, combine]`, for proxy sources.
    pub counters: Vec<[Option<GpuCounter>; 2]>,
    /// The counters' totals when they were made, before any peer could write: the kernels'
    /// and the gates' zero (an engine reused by an earlier all-to-all has counted before).
    bases: Vec<[u64; 2]>,
    pub doorbells: Arc<PinnedHostBuffer>,
    /// The receive gates of [`GATED`]'s stages, u32 words [`GATE_STRIDE`] bytes apart, made
    /// open (1); `None` where the driver has no stream memory operations (then the receive
    /// kernels spin from their launch, as without gates).
    pub gates: Option<Arc<PinnedHostBuffer>>,
    pub mask: u64,
}

impl Links {
    /// `(device address, base)` of each source's counters, for [`words`].
    pub(crate) fn counter_words(&self) -> Vec<[Option<(u64, u64)>; 2]> {
        self.counters
            .iter()
            .zip(&self.bases)
            .map(|(pair, base)| [0, 1].map(|i| pair[i].as_ref().map(|c| (c.device_ptr(), base[i]))))
            .collect()
    }

    /// The device address of `stage`'s gate word (`None`: the stage is not gated, or there
    /// are no gates).
    pub(crate) fn gate_ptr(&self, stage: Stage) -> Option<u64> {
        let i = GATED.iter().position(|&s| s == stage)?;
        Some(self.gates.as_ref()?.device_ptr() + (i * GATE_STRIDE) as u64)
    }
}

impl fmt::Debug for Links {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Links").field("mask", &format_args!("{:#x}", self.mask)).finish_non_exhaustive()
    }
}

/// Registers `window` and a new outbox with `engine`, publishes the window's descriptor
/// (every rank takes part, those with no proxy peer with an empty record), and turns the
/// proxy peers' descriptors into remote regions (which adds their engines as peers).
/// Returns `None` where this rank has no proxy peer.
pub(crate) async fn connect(
    engine: &Engine,
    world: &dyn Rendezvous,
    config: &Config,
    ctx: &Arc<Context>,
    window: &Arc<DeviceBuffer>,
    mask: u64,
) -> Result<Option<Links>> {
    let ordinal = ctx.ordinal() as u32;
    let mine = if mask == 0 {
        None
    } else {
        // SAFETY: `window` is device memory of `ordinal` (one allocation of its full length)
        // and the engine keeps the Arc (so the allocation) until the region and every
        // transfer into it are done.
        let region = unsafe {
            engine.register_cuda_owned(window.device_ptr(), window.len(), ordinal, window.clone()).await?
        };
        Some(region)
    };
    let record = mine.as_ref().map(|r| r.descriptor().to_bytes()).unwrap_or_default();
    let key = format!("{}/moe-proxy", config.tag);
    let all = all_gather(world, &key, config.rank, config.ranks, record).await?;
    let Some(window_region) = mine else { return Ok(None) };
    let outbox = Arc::new(DeviceBuffer::new(ctx, window.len())?);
    // SAFETY: as for the window: our allocation, kept alive by the engine through the Arc.
    let outbox_region = unsafe {
        engine.register_cuda_owned(outbox.device_ptr(), outbox.len(), ordinal, outbox.clone()).await?
    };
    let mut remotes = Vec::with_capacity(config.ranks);
    let mut counters = Vec::with_capacity(config.ranks);
    for (r, desc) in all.iter().enumerate() {
        if mask >> r & 1 == 0 {
            remotes.push(None);
            counters.push([None, None]);
            continue;
        }
        if desc.is_empty() {
            return Err(MoeError::Config(format!(
                "rank {r} published no proxy window (transports disagree)"
            )));
        }
        let remote = engine.remote_region(desc).await?;
        if remote.len() != window.len() as u64 {
            return Err(MoeError::Config(format!("rank {r}'s proxy window has {} bytes", remote.len())));
        }
        remotes.push(Some(remote));
        let counter = |stage| engine.gpu_counter(imm(&config.tag, stage, r), ordinal);
        counters.push([Some(counter(Stage::Dispatch)?), Some(counter(Stage::Combine)?)]);
    }
    // The totals now are the zero: no peer writes before `new`'s last exchange (`moe-ready`).
    let bases =
        counters.iter().map(|pair| pair.each_ref().map(|c| c.as_ref().map_or(0, |c| c.total()))).collect();
    let doorbells = Arc::new(PinnedHostBuffer::new(ctx, 8 * DOORBELL_WORDS)?);
    let gates = match fabric_async::cuda::stream_memops_supported() {
        true => {
            let g = PinnedHostBuffer::new(ctx, GATED.len() * GATE_STRIDE)?;
            open_all(&g);
            Some(Arc::new(g))
        }
        false => None,
    };
    Ok(Some(Links {
        outbox,
        outbox_region,
        _window_region: window_region,
        remotes,
        counters,
        bases,
        doorbells,
        gates,
        mask,
    }))
}

/// The stage and rank of a status word's detail from the proxy.
pub(crate) fn decode_status(detail: u64) -> (&'static str, usize) {
    let stage = Stage::from_index(detail >> 8 & 0xff).map_or("unknown stage", Stage::name);
    (stage, (detail & 0xff) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_are_distinct_per_stage_and_source() {
        let mut seen = std::collections::HashSet::new();
        for stage in Stage::ALL {
            for src in 0..MAX_RANKS {
                let i = imm("moe", stage, src);
                assert_eq!(i >> 28, 0xE);
                assert!(seen.insert(i), "{stage:?} {src}");
            }
        }
        assert_ne!(imm("moe", Stage::Dispatch, 1), imm("moe2", Stage::Dispatch, 1));
        assert_eq!(imm("a/1", Stage::Combine, 3), imm("a/1", Stage::Combine, 3));
    }

    #[test]
    fn doorbells_decode() {
        assert_eq!(Doorbell::decode(7 << 32 | 128), Doorbell { seq: 7, count: 128 });
        assert_eq!(Doorbell::decode(u64::MAX), Doorbell { seq: u32::MAX, count: u32::MAX });
        assert_eq!(decode_status((Stage::Combine as u64) << 8 | 5), ("combine", 5));
    }

    #[test]
    fn plans_move_the_outbox_section_of_the_destination_to_the_section_of_the_source() {
        let c = Config::new(3, 1, 4, 16, 64, 2);
        let l = Layout::new(&c);
        let t = 16;
        let p = plan(&l, t, Stage::Dispatch, 1, 2, 5);
        assert_eq!(p.len() as u64, Stage::Dispatch.writes());
        assert_eq!(p[0], Write { src_off: l.ecount_section(2), dst_off: l.ecount_section(1), len: 4 * 4 });
        assert_eq!(
            p[1],
            Write { src_off: l.meta_section(t, 2), dst_off: l.meta_section(t, 1), len: 5 * 7 * 4 }
        );
        assert_eq!(p[2], Write { src_off: l.rx_section(t, 2), dst_off: l.rx_section(t, 1), len: 5 * 128 });
        assert_eq!(p[3], Write { src_off: l.off_dflag + 16, dst_off: l.off_dflag + 8, len: 8 });
        let p = plan(&l, t, Stage::Combine, 0, 2, 0);
        assert_eq!(p.len() as u64, Stage::Combine.writes());
        assert_eq!(p[0], Write { src_off: l.cx_section(t, 2), dst_off: l.cx_section(t, 0), len: 0 });
        assert_eq!(p[1], Write { src_off: l.off_cflag + 16, dst_off: l.off_cflag, len: 8 });
        let p = plan(&l, t, Stage::Barrier, 2, 0, 0);
        assert_eq!(p, vec![Write { src_off: l.off_bflag, dst_off: l.off_bflag + 16, len: 8 }]);
        // A count past the section (a corrupt doorbell) never writes past it.
        assert_eq!(plan(&l, t, Stage::Combine, 0, 1, u32::MAX)[0].len, t * l.row_bytes);
        // Every write stays inside the window.
        for stage in Stage::ALL {
            for w in plan(&l, t, stage, 2, 1, t as u32) {
                assert!(w.src_off + w.len <= l.window_len && w.dst_off + w.len <= l.window_len);
            }
        }
    }

    #[test]
    fn proxy_words_put_counters_by_stage_and_source() {
        let mut counters = vec![[None, None]; 3];
        counters[2] = [Some((0x1000, 7)), Some((0x2000, 9))];
        let w = words(0b100, 0xa, 0xb, &counters);
        assert_eq!(w.len() as u64, crate::layout::PROXY_WORDS);
        assert_eq!((w[PX_MASK], w[PX_OUTBOX], w[PX_DOORBELL]), (4, 0xa, 0xb));
        assert_eq!(w[PX_COUNTER + 2], 0x1000);
        assert_eq!(w[PX_COUNTER + MAX_RANKS + 2], 0x2000);
        assert_eq!(w[PX_BASE + 2], 7);
        assert_eq!(w[PX_BASE + MAX_RANKS + 2], 9);
        assert_eq!(w[PX_COUNTER], 0);
    }
}
