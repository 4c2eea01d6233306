//! Where everything lives: the byte offsets of the exported window (what peers write into)
//! and of this rank's private buffer, computed once from the [`Config`]. Plain arithmetic,
//! no CUDA; the kernels get the offsets as arguments.
//!
//! ```text
//! window (exported through CUDA IPC, written by every rank):
//!   dflag[R] u64 | cflag[R] u64 | bflag[R] u64 | ecount[R][E] i32 | meta[R][T][1+3K] i32 | rx[R][T][H] bf16 | cx[R][T][H] bf16 | crow[R][T] u64
//!    dispatch      combine        barrier       rows per local    token, experts,         dispatched rows     partial sums        flags of the cx
//!    (seq<<32|n)   flags          flags         expert, by source weights, positions      by source, slot     by expert rank      rows (streamed
//!                                                                                                                                   combine: seq<<32)
//!
//! private (this rank only):
//!   state[16] u64 | peers[R] u64 | send_slot[T][R] | send_count[R] | recv_count[R] |
//!   recv_pos[R][T][K] | expert_count[E] | src_info[E][C] | x_expert[E][C][H] | combined[T][H] |
//!   send_pos[T][K] | send_ecount[R][E] | proxy[PROXY_WORDS] u64 | expert_w[E][C] f32
//!   (x_expert is empty with `RecvLayout::RankMajor`: the rows stay in the window's rx)
//!
//! outbox (proxy transport only, registered with the engine): the window's layout, section
//!   d holding what goes to rank d; the proxy writes section d of each region to section
//!   `rank` of rank d's window (`proxy::plan`).
//!
//! proxy words (u64; `kernels/common.cu` has the same numbers, `proxy/mod.rs` fills them):
//!   [0] mask of the ranks reached through the proxy | [1] outbox address |
//!   [2] doorbells address (pinned, mapped: [stage][MAX_RANKS] u64) |
//!   [3 + stage * MAX_RANKS + s] address of the GpuCounter of source s (dispatch, combine) |
//!   [3 + (2 + stage) * MAX_RANKS + s] that counter's total when the all-to-all was made
//! ```
//!
//! A row's place in a local expert is `sum of ecount[s'][le]` over the sources s' before
//! its own in the order `rank, rank + 1, ..., ranks - 1, 0, ...` (this rank's own rows
//! first), plus its position among its own source's rows for that expert (`meta`, from the
//! source's `send_pos`): no atomic on the receiving side, and every segment of every row can
//! be placed independently. Expert-major, `dispatch_send` places this rank's own rows itself
//! (their places need no peer's count), and only the peers' rows go through the window.
#![forbid(unsafe_code)]

use crate::config::{Config, RecvLayout};

/// Every region starts on this boundary (16 B rows need 16; 256 keeps regions apart in
/// cache lines).
const ALIGN: u64 = 256;

/// The words of the private `state` array (`kernels/common.cu` has the same numbers).
pub(crate) const STATE_WORDS: u64 = 16;

/// The words of the private `proxy` array (see the module docs).
pub(crate) const PROXY_WORDS: u64 = 3 + 4 * crate::config::MAX_RANKS as u64;
/// Word of the proxy mask, the outbox address, the doorbells' address.
pub(crate) const PX_MASK: usize = 0;
pub(crate) const PX_OUTBOX: usize = 1;
pub(crate) const PX_DOORBELL: usize = 2;
/// First word of the counters' addresses, then of their base totals.
pub(crate) const PX_COUNTER: usize = 3;
pub(crate) const PX_BASE: usize = 3 + 2 * crate::config::MAX_RANKS;

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Offsets and sizes, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub row_bytes: u64,
    pub meta_words: u64,
    pub capacity: u64,
    /// Bytes of one source's section of `ecount` (its rows per local expert).
    pub ecount_bytes: u64,
    // Window.
    pub off_dflag: u64,
    pub off_cflag: u64,
    pub off_bflag: u64,
    pub off_ecount: u64,
    pub off_meta: u64,
    pub off_rx: u64,
    pub off_cx: u64,
    pub off_crow: u64,
    pub window_len: u64,
    // Private.
    pub off_state: u64,
    pub off_peers: u64,
    pub off_send_slot: u64,
    pub off_send_count: u64,
    pub off_recv_count: u64,
    pub off_recv_pos: u64,
    pub off_expert_count: u64,
    pub off_src_info: u64,
    pub off_x_expert: u64,
    pub off_combined: u64,
    pub off_send_pos: u64,
    pub off_send_ecount: u64,
    pub off_proxy: u64,
    pub off_expert_w: u64,
    pub private_len: u64,
}

/// Lays out regions of the given sizes one after the other, each aligned; returns their
/// offsets and the total.
fn stack<const N: usize>(sizes: [u64; N]) -> ([u64; N], u64) {
    let mut offs = [0u64; N];
    let mut at = 0u64;
    for (o, s) in offs.iter_mut().zip(sizes) {
        *o = at;
        at = align(at + s.max(1));
    }
    (offs, at)
}

impl Layout {
    pub(crate) fn new(c: &Config) -> Layout {
        let (r, t, k, e) = (c.ranks as u64, c.max_tokens as u64, c.topk as u64, c.experts_per_rank as u64);
        let row_bytes = c.hidden as u64 * c.dtype.bytes() as u64;
        let meta_words = 1 + 3 * k;
        let capacity = c.capacity() as u64;
        let ([off_dflag, off_cflag, off_bflag, off_ecount, off_meta, off_rx, off_cx, off_crow], window_len) =
            stack([
                8 * r,
                8 * r,
                8 * r,
                4 * r * e,
                4 * r * t * meta_words,
                r * t * row_bytes,
                r * t * row_bytes,
                8 * r * t,
            ]);
        let (
            [off_state, off_peers, off_send_slot, off_send_count, off_recv_count, off_recv_pos, off_expert_count, off_src_info, off_x_expert, off_combined, off_send_pos, off_send_ecount, off_proxy, off_expert_w],
            private_len,
        ) = stack([
            8 * STATE_WORDS,
            8 * r,
            4 * t * r,
            4 * r,
            4 * r,
            4 * r * t * k,
            4 * e,
            4 * e * capacity,
            if c.layout == RecvLayout::RankMajor { 0 } else { e * capacity * row_bytes },
            t * row_bytes,
            4 * t * k,
            4 * r * e,
            8 * PROXY_WORDS,
            4 * e * capacity,
        ]);
        Layout {
            row_bytes,
            meta_words,
            capacity,
            ecount_bytes: 4 * e,
            off_dflag,
            off_cflag,
            off_bflag,
            off_ecount,
            off_meta,
            off_rx,
            off_cx,
            off_crow,
            window_len,
            off_state,
            off_peers,
            off_send_slot,
            off_send_count,
            off_recv_count,
            off_recv_pos,
            off_expert_count,
            off_src_info,
            off_x_expert,
            off_combined,
            off_send_pos,
            off_send_ecount,
            off_proxy,
            off_expert_w,
            private_len,
        }
    }

    /// Offset of section `sec` (a source rank in a window, a destination in the outbox)
    /// of the dispatch meta rows, and of the dispatch and combine rows.
    pub(crate) fn ecount_section(&self, sec: u64) -> u64 {
        self.off_ecount + sec * self.ecount_bytes
    }

    pub(crate) fn meta_section(&self, t: u64, sec: u64) -> u64 {
        self.off_meta + sec * t * self.meta_words * 4
    }

    pub(crate) fn rx_section(&self, t: u64, sec: u64) -> u64 {
        self.off_rx + sec * t * self.row_bytes
    }

    pub(crate) fn cx_section(&self, t: u64, sec: u64) -> u64 {
        self.off_cx + sec * t * self.row_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_and_disjoint() {
        let c = Config::new(2, 0, 128, 128, 7168, 8);
        let l = Layout::new(&c);
        assert_eq!(l.row_bytes, 14336);
        assert_eq!(l.capacity, 256);
        let window = [
            l.off_dflag,
            l.off_cflag,
            l.off_bflag,
            l.off_ecount,
            l.off_meta,
            l.off_rx,
            l.off_cx,
            l.off_crow,
            l.window_len,
        ];
        assert!(window.windows(2).all(|w| w[0] < w[1] && w[0] % ALIGN == 0));
        assert_eq!(l.off_cx - l.off_rx, 2 * 128 * 14336);
        assert_eq!(l.off_crow - l.off_cx, 2 * 128 * 14336);
        assert_eq!(l.window_len - l.off_crow, 2 * 128 * 8);
        let private = [
            l.off_state,
            l.off_peers,
            l.off_send_slot,
            l.off_send_count,
            l.off_recv_count,
            l.off_recv_pos,
            l.off_expert_count,
            l.off_src_info,
            l.off_x_expert,
            l.off_combined,
            l.off_send_pos,
            l.off_send_ecount,
            l.off_proxy,
            l.off_expert_w,
            l.private_len,
        ];
        assert!(private.windows(2).all(|w| w[0] < w[1] && w[0] % ALIGN == 0));
        assert_eq!(l.off_combined - l.off_x_expert, 128 * 256 * 14336);
        assert_eq!(l.meta_words, 25);
        assert_eq!(l.off_expert_w - l.off_proxy, align(8 * PROXY_WORDS));
        assert_eq!(l.meta_section(128, 1) - l.off_meta, 128 * 25 * 4);
        assert_eq!(l.ecount_section(1) - l.off_ecount, 128 * 4);
        assert_eq!(l.cx_section(128, 1) - l.rx_section(128, 1), l.off_cx - l.off_rx);
    }

    #[test]
    fn capacity_can_be_bounded() {
        let mut c = Config::new(2, 1, 4, 64, 128, 2);
        c.expert_capacity = Some(10);
        let l = Layout::new(&c);
        assert_eq!(l.capacity, 10);
        assert_eq!(l.off_combined - l.off_x_expert, align(4 * 10 * 256));
    }
}
