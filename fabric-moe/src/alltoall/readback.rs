//! What the host reads back from an [`AllToAll`]: the kernels' status word, the probes, and
//! the received and combined rows (cold paths: tests, examples).

use std::sync::atomic::Ordering;

use super::{AllToAll, PROBES};
use crate::config::RecvLayout;
use crate::error::{MoeError, Result};
use crate::proxy::{self, Proxy};

/// What the host reads back after a dispatch ([`AllToAll::read_received`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Per local expert: `(source rank, source token)` of each row, in row order.
    pub sources: Vec<Vec<(usize, usize)>>,
    /// Per local expert: its rows, `count * hidden` raw 16-bit values.
    pub rows: Vec<Vec<u16>>,
}

impl AllToAll {
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
}
