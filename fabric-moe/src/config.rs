//! What an [`AllToAll`](crate::AllToAll) is built for: the shape of one step, fixed at
//! `new` (every buffer is sized by it once), and how inputs are given to a step.
#![forbid(unsafe_code)]

use std::time::Duration;

use crate::error::{MoeError, Result};

/// The most ranks one all-to-all spans (routing masks are 64-bit).
pub const MAX_RANKS: usize = 64;

/// Element type of the token rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dtype {
    /// bfloat16: rows move as raw 16-bit values, the weighted combine is done in f32.
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
        }
    }
}

/// How the ranks of an all-to-all reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Transport {
    /// NVLink (CUDA IPC) between ranks of one host, the proxy between hosts.
    #[default]
    Auto,
    /// NVLink only: a rank on another host is [`MoeError::OtherHost`].
    Nvlink,
    /// The proxy for every pair of ranks, on one host too (for tests and comparisons): the
    /// kernels pack rows into a local outbox and ring a doorbell, and a host thread writes
    /// them with the engine (`docs/moe.md`, "Phase 2").
    Proxy,
}

impl Transport {
    pub(crate) fn code(self) -> u8 {
        match self {
            Transport::Auto => 0,
            Transport::Nvlink => 1,
            Transport::Proxy => 2,
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto",
            Transport::Nvlink => "nvlink",
            Transport::Proxy => "proxy",
        })
    }
}

impl std::str::FromStr for Transport {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Transport> {
        match s {
            "auto" => Ok(Transport::Auto),
            "nvlink" => Ok(Transport::Nvlink),
            "proxy" => Ok(Transport::Proxy),
            other => Err(MoeError::Config(format!("transport {other:?} (auto, nvlink or proxy)"))),
        }
    }
}

/// Where a dispatch leaves the rows it received (a choice of each rank: the senders do the
/// same either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RecvLayout {
    /// Each received row is copied to every local expert it names: `recv_x` is
    /// `[experts_per_rank, capacity, hidden]`, so an expert reads its rows contiguously, and
    /// `combine_send` does the weighted sum over this rank's experts. The decode layout (a
    /// few rows, a grouped GEMM over contiguous rows).
    #[default]
    ExpertMajor,
    /// Rows stay where they arrived, by source: `recv_x` is `[ranks, max_tokens, hidden]`
    /// (source `s`'s rows at `[s][0..recv_count[s]]`); per local expert, `src_info` gives
    /// its rows' indices in `recv_x` and `recv_weight` their weights. The caller's experts
    /// write `expert_out` in the same `[ranks, max_tokens, hidden]` shape, one row per
    /// received row, already weighted and summed over this rank's experts, and
    /// `combine_send` sends those rows back as they are. No row is copied per expert: the
    /// prefill layout (many rows, where the copies would cost more than the transfer).
    RankMajor,
}

impl std::fmt::Display for RecvLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RecvLayout::ExpertMajor => "expert-major",
            RecvLayout::RankMajor => "rank-major",
        })
    }
}

impl std::str::FromStr for RecvLayout {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<RecvLayout> {
        match s {
            "expert" | "expert-major" => Ok(RecvLayout::ExpertMajor),
            "rank" | "rank-major" => Ok(RecvLayout::RankMajor),
            other => Err(MoeError::Config(format!("layout {other:?} (expert-major or rank-major)"))),
        }
    }
}

/// The shape of an all-to-all, the same on every rank except `rank` and `device`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Ranks (processes, one GPU each or several sharing one), at most [`MAX_RANKS`].
    pub ranks: usize,
    /// This process's rank, `0..ranks`.
    pub rank: usize,
    /// The CUDA device (ordinal) of this rank. Default: `rank % visible devices`.
    pub device: Option<usize>,
    /// Experts held by each rank: expert `e` (a global id in `0..ranks * experts_per_rank`)
    /// lives on rank `e / experts_per_rank` as local expert `e % experts_per_rank`.
    pub experts_per_rank: usize,
    /// Most tokens a rank dispatches in one step.
    pub max_tokens: usize,
    /// Elements per token row.
    pub hidden: usize,
    /// Experts per token (columns of `topk_idx` and `topk_weights`).
    pub topk: usize,
    /// Element type (bf16 only in this phase).
    pub dtype: Dtype,
    /// Rows each local expert can receive in one step. Default (`None`): `ranks *
    /// max_tokens`, which never overflows (every token of every rank); a smaller bound saves
    /// memory (`experts_per_rank * capacity * hidden` elements), and a step that routes more
    /// rows to one expert drops the excess and reports [`MoeError::CapacityExceeded`].
    pub expert_capacity: Option<usize>,
    /// Longest a receive stage waits for its peers before it gives up and reports
    /// [`MoeError::Timeout`] (a dead or stalled peer never hangs the GPU).
    pub timeout: Duration,
    /// How ranks reach each other (every rank must give the same). Default
    /// [`Transport::Auto`].
    pub transport: Transport,
    /// Where this rank's dispatch leaves the rows it received ([`RecvLayout`]; this rank's
    /// own choice). Default [`RecvLayout::ExpertMajor`].
    pub layout: RecvLayout,
    /// Prefix of the keys this all-to-all uses in the rendezvous store; distinct all-to-alls
    /// that meet through one store need distinct tags.
    pub tag: String,
    /// Whether the one-kernel [`combine`](crate::AllToAll::combine) streams: half of its
    /// blocks send the partial rows, each with a flag of its own in the destination's
    /// window, while the other half sum every token as soon as its rows have landed, so that
    /// the sums overlap the send instead of following it. It pays where the send is long
    /// (bandwidth-bound: prefill); a short one (decode) is faster with every block sending,
    /// then every block summing. Default (`None`): streamed where the largest step (`ranks *
    /// max_tokens` rows) gives every warp of the grid whole rows to send. The two stages
    /// launched one by one, and the proxy, never stream; nor does any rank where one rank
    /// does not (`new` agrees on it: a streaming rank waits for flags only a streaming
    /// sender raises).
    pub streamed_combine: Option<bool>,
    /// Rows in a fixed order: each rank's route gives its rows their places per expert in
    /// an order fixed by the inputs (by rounds of 256 tokens, 32 tokens at a time, by the
    /// expert's column in `topk_idx`, then by token) instead of by a shared atomic, so that
    /// the same inputs leave the same rows in the same places of `recv_x` (and `src_info`)
    /// every time, where every rank sets it. It costs the route a few microseconds (decode
    /// dispatch 28.6-29.4 -> 32.5-33.2 µs on two H200), hence off by default; `combined`
    /// does not depend on it. Needs `ranks * experts_per_rank <= 512`.
    pub ordered_rows: bool,
}

/// Global experts up to which [`Config::ordered_rows`] works (`kernels/dispatch.cu`'s
/// `ORDER_EXPERTS`).
pub const ORDERED_ROWS_MAX_EXPERTS: usize = 512;

impl Config {
    /// A config with the defaults: bf16, device `rank % devices`, capacity `ranks *
    /// max_tokens`, a 10 s timeout, transport `Auto`, expert-major rows, tag `"moe"`, the
    /// combine streamed by shape.
    pub fn new(
        ranks: usize,
        rank: usize,
        experts_per_rank: usize,
        max_tokens: usize,
        hidden: usize,
        topk: usize,
    ) -> Config {
        Config {
            ranks,
            rank,
            device: None,
            experts_per_rank,
            max_tokens,
            hidden,
            topk,
            dtype: Dtype::Bf16,
            expert_capacity: None,
            timeout: Duration::from_secs(10),
            transport: Transport::Auto,
            layout: RecvLayout::ExpertMajor,
            tag: "moe".into(),
            streamed_combine: None,
            ordered_rows: false,
        }
    }

    /// Rows per local expert (see [`expert_capacity`](Self::expert_capacity)).
    pub fn capacity(&self) -> usize {
        self.expert_capacity.unwrap_or(self.ranks * self.max_tokens)
    }

    /// Global experts (`ranks * experts_per_rank`).
    pub fn experts(&self) -> usize {
        self.ranks * self.experts_per_rank
    }

    /// Checks the values against each other and the kernels' limits.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(MoeError::Config(why));
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return bad(format!("ranks {} not in 1..={MAX_RANKS}", self.ranks));
        }
        if self.rank >= self.ranks {
            return bad(format!("rank {} of {} ranks", self.rank, self.ranks));
        }
        if self.experts_per_rank == 0 || self.max_tokens == 0 || self.hidden == 0 || self.topk == 0 {
            return bad("experts_per_rank, max_tokens, hidden and topk must be at least 1".into());
        }
        if self.topk > self.experts() {
            return bad(format!("top-{} of {} experts", self.topk, self.experts()));
        }
        if self.capacity() == 0 {
            return bad("expert_capacity 0".into());
        }
        // Rows, slots and source ids are 32-bit in the kernels.
        let rows = (self.ranks * self.max_tokens) as u64;
        if rows * self.topk as u64 > i32::MAX as u64 || self.experts() as u64 > i32::MAX as u64 {
            return bad("ranks * max_tokens * topk must fit in 31 bits".into());
        }
        if self.hidden as u64 * self.dtype.bytes() as u64 > u32::MAX as u64 {
            return bad(format!("hidden {} too large", self.hidden));
        }
        if self.tag.is_empty() {
            return bad("empty tag".into());
        }
        if self.ordered_rows && self.experts() > ORDERED_ROWS_MAX_EXPERTS {
            return bad(format!(
                "ordered_rows with {} experts (at most {ORDERED_ROWS_MAX_EXPERTS})",
                self.experts()
            ));
        }
        Ok(())
    }

    /// The fields every rank must agree on, as bytes for the exchange at `new`.
    pub(crate) fn shape_bytes(&self) -> Vec<u8> {
        let words = [
            self.ranks,
            self.experts_per_rank,
            self.max_tokens,
            self.hidden,
            self.topk,
            self.dtype.bytes(),
            self.capacity(),
            self.transport.code() as usize,
        ];
        words.iter().flat_map(|w| (*w as u64).to_le_bytes()).collect()
    }
}

/// The expert ids of a step, `[num_tokens, topk]` row-major in device memory: global expert
/// ids, or -1 (or any negative value) for "no expert" in that column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkIdx {
    /// `int32` ids at this device address.
    I32(u64),
    /// `int64` ids (PyTorch's `topk` indices) at this device address.
    I64(u64),
}

impl TopkIdx {
    pub(crate) fn parts(self) -> (u64, u32) {
        match self {
            TopkIdx::I32(p) => (p, 0),
            TopkIdx::I64(p) => (p, 1),
        }
    }
}

/// The inputs of one dispatch, as device addresses on this rank's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchInput {
    /// Token rows, `[num_tokens, hidden]` of the dtype, row-major (16-byte aligned rows move
    /// 16 bytes per thread, others 2).
    pub x: u64,
    /// Expert ids, `[num_tokens, topk]`.
    pub topk_idx: TopkIdx,
    /// Weights, `[num_tokens, topk]` f32: what the combine multiplies each expert's output by.
    pub topk_weights: u64,
    /// Tokens this step, at most `max_tokens`.
    pub num_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(Config::new(2, 0, 128, 128, 7168, 8).validate().is_ok());
        assert!(Config::new(2, 2, 4, 8, 8, 2).validate().is_err());
        assert!(Config::new(65, 0, 4, 8, 8, 2).validate().is_err());
        assert!(Config::new(2, 0, 1, 8, 8, 3).validate().is_err(), "top-3 of 2 experts");
        let mut c = Config::new(2, 0, 4, 8, 8, 2);
        c.expert_capacity = Some(0);
        assert!(c.validate().is_err());
        // Ordered rows: DeepSeek-V3's 256 experts, not 1024.
        let mut c = Config::new(2, 0, 128, 128, 7168, 8);
        c.ordered_rows = true;
        assert!(c.validate().is_ok());
        c.experts_per_rank = 512;
        assert!(matches!(c.validate(), Err(MoeError::Config(why)) if why.contains("ordered_rows")));
        assert_eq!(Config::new(2, 0, 4, 8, 8, 2).capacity(), 16);
    }

    #[test]
    fn transport_names_round_trip() {
        for t in [Transport::Auto, Transport::Nvlink, Transport::Proxy] {
            assert_eq!(t.to_string().parse::<Transport>().unwrap(), t);
        }
        assert!("ib".parse::<Transport>().is_err());
        let mut c = Config::new(2, 0, 4, 8, 8, 2);
        let auto = c.shape_bytes();
        c.transport = Transport::Proxy;
        assert_ne!(c.shape_bytes(), auto, "ranks must agree on the transport");
    }
}
