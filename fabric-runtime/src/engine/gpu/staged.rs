//! Transfer shapes with a staged GPU end, as jobs for the reactor's staging pool
//! (`reactor/core/gpu/send.rs`, `reactor/core/gpu/pull.rs`):
//!
//! ```text
//!  shape          staged end       pieces (each moved chunk by chunk)      arrivals at the target
//!  write(_imm)    source           one per shard, RDMA writes from slots   as for any write
//!  write(_imm)    destination      one PULL per chunk of a staged source   exactly one
//!  write_paged    source           one per page, RDMA writes from slots    as for any paged write
//!  write_paged    destination      one per page, PULLs; then a 0-byte PULL exactly one
//!  scatter        either           per entry, as above                     staged member: one
//!  read           local dest       chunk reads into slots, H2D             none (reads count nothing)
//!  read           remote source    push request: the owner writes it       none
//!                                  through its slots, then ACKs
//! ```
//!
//! "Exactly one" into staged GPU memory: pieces carry no imm and a last zero-length PULL
//! carries it once every piece is ACKed, i.e. in GPU memory; a single write carries it on
//! its last chunk, posted once the earlier chunks are in. `wait_for(n)` at the owner
//! therefore always means the bytes are in GPU memory.

use std::sync::Arc;

use crate::engine::op::OpFuture;
use crate::engine::region::{MemoryRegion, RemoteRegion};
use crate::engine::transfer::{PeerGroup, Plan, ScatterEntry, Transfers};
use crate::error::{Error, Result};
use crate::pure::control::{Pull, PullSource};
use crate::pure::route::{Arrivals, PageLayout, TransferOpts};
use crate::shared::notify::{Notify, OpState};
use crate::shared::queue::{OpKind, Piece, PieceDst, PieceSrc, StagedJob, Submission, Then};

/// The source of a piece at `off` of `src`: device memory to copy into slots, or memory
/// the NICs know.
pub(in crate::engine) fn piece_src(src: &MemoryRegion, off: u64) -> PieceSrc {
    match src.inner.staged() {
        Some(g) => PieceSrc::Device(g.ptr + off),
        None => PieceSrc::Registered {
            addr: src.inner.backing().addr() + off,
            sources: src
                .inner
                .regs
                .iter()
                .map(|r| PullSource { addr: r.remote_base.wrapping_add(off), key: r.remote_key })
                .collect(),
        },
    }
}

impl Transfers<'_> {
    /// The PULL of `len` bytes into `dst` at `dst_off` (sources filled in by the reactor).
    pub(in crate::engine) fn pull_template(
        &self,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<Box<Pull>> {
        let key0 =
            dst.desc.domains.first().ok_or_else(|| Error::Config("a descriptor without NICs".into()))?;
        Ok(Box::new(Pull {
            op: 0,
            dst_key: key0.key,
            dst_base: key0.base,
            dst_off,
            len,
            imm,
            sources: Vec::new(),
            sender: self.shared().address.to_bytes(),
        }))
    }

    /// Hands a staged job to the reactor; its future completes when every piece and
    /// follow-up has.
    pub(in crate::engine) fn run_job(
        &self,
        src: &MemoryRegion,
        pieces: Vec<Piece>,
        then: Vec<Then>,
    ) -> Result<OpFuture> {
        if pieces.is_empty() && then.is_empty() {
            return Ok(OpFuture::done());
        }
        let state = Arc::new(OpState::default());
        let staged = src.inner.staged();
        let job = StagedJob {
            ordinal: staged.map_or(0, |g| g.ordinal as usize),
            pieces,
            then,
            keep: vec![src.inner.clone()],
            local: staged.is_none().then(|| src.inner.clone()),
            notify: Notify::Future(state.clone()),
        };
        self.hand(vec![Submission::Staged(Box::new(job))])?;
        Ok(OpFuture::pending(state).driven_by(self.engine.driver()).without_linger())
    }

    /// A plan of RDMA writes (host or GPUDirect destination) whose local addresses are
    /// made a piece source by `src_at`, run as a staged job (its `Arrivals::One`
    /// follow-ups as the job's).
    pub(in crate::engine) fn staged_writes(
        &self,
        src: &MemoryRegion,
        plan: Plan,
        src_at: impl Fn(u64) -> PieceSrc,
    ) -> Result<OpFuture> {
        let Plan { mut ops, then, .. } = plan;
        let mut then: Vec<_> = then.into_iter().map(Then::Op).collect();
        if ops.is_empty() {
            // Only imm-only follow-ups (zero bytes): they are the pieces.
            ops = then.drain(..).filter_map(|t| if let Then::Op(r) = t { Some(r) } else { None }).collect();
        } else if !then.is_empty() {
            self.opts.check_one_arrival(self.shared().nics, self.shared().delivery_complete)?;
        }
        let pieces = ops
            .into_iter()
            .map(|req| Piece { src: src_at(req.local_addr), len: req.len as u64, dst: PieceDst::Write(req) })
            .collect();
        self.run_job(src, pieces, then)
    }

    /// `write_paged` with a staged GPU end, or `None` when neither end is staged.
    pub(in crate::engine) fn staged_paged(
        &self,
        src: &MemoryRegion,
        dst: &RemoteRegion,
        layout: &PageLayout,
        src_pages: &[u32],
        dst_pages: &[u32],
        imm: Option<u32>,
    ) -> Option<OpFuture> {
        if super::ipc::via_ipc(dst) {
            return Some(
                self.ipc_paged(src, dst, layout, src_pages, dst_pages, imm).unwrap_or_else(OpFuture::failed),
            );
        }
        let src_staged = src.inner.staged().is_some();
        if !src_staged && !dst.pulled() {
            return None;
        }
        let r = (|| {
            if !dst.pulled() {
                // Staged source, host or GPUDirect destination: the usual pages (their
                // local addresses are device addresses), each through bounce slots.
                let plan = self.paged(src, dst, layout, src_pages, dst_pages, imm)?;
                return self.staged_writes(src, plan, PieceSrc::Device);
            }
            self.check_remote(dst)?;
            self.check_local(src)?;
            let pages = layout.resolve(src_pages, dst_pages, src.len() as u64, dst.len())?;
            let mut pieces = Vec::with_capacity(pages.len());
            for (so, doff) in &pages {
                let pull = self.pull_template(dst, *doff, layout.page_len, None)?;
                pieces.push(Piece {
                    src: piece_src(src, *so),
                    len: layout.page_len,
                    dst: PieceDst::Pull { peer: dst.peer, pull },
                });
            }
            let then = match imm {
                Some(imm) if !pages.is_empty() => {
                    vec![Then::Pull { peer: dst.peer, pull: self.pull_template(dst, 0, 0, Some(imm))? }]
                }
                _ => Vec::new(),
            };
            self.run_job(src, pieces, then)
        })();
        Some(r.unwrap_or_else(OpFuture::failed))
    }

    /// `scatter` with a staged GPU end (the source, or any member), or `None` without one.
    pub(in crate::engine) fn staged_scatter(
        &self,
        src: &MemoryRegion,
        group: &PeerGroup,
        entries: &[ScatterEntry],
        imm: Option<u32>,
    ) -> Option<OpFuture> {
        if Self::ipc_scatter_applies(group, entries) {
            return Some(self.ipc_scatter(src, group, entries, imm).unwrap_or_else(OpFuture::failed));
        }
        let src_staged = src.inner.staged().is_some();
        if !src_staged && !group.members().iter().any(RemoteRegion::pulled) {
            return None;
        }
        let r = (|| {
            self.check_local(src)?;
            self.check_entries(Some(src.len() as u64), group, entries)?;
            let nics = self.shared().nics;
            self.opts.validate(nics)?;
            let one = imm.is_some() && self.opts.arrivals == Arrivals::One;
            // Per entry into host or GPUDirect members: shards without their own follow-up.
            let per_entry =
                Transfers { opts: TransferOpts { arrivals: Arrivals::PerShard, ..self.opts }, ..*self };
            let mut pieces = Vec::new();
            let mut then = Vec::new();
            let mut told = vec![false; group.len()];
            let mut plain_then = false;
            for e in entries {
                let m = &group.members()[e.member];
                if m.pulled() {
                    let pull = self.pull_template(m, e.dst_off, e.len, None)?;
                    pieces.push(Piece {
                        src: piece_src(src, e.src_off),
                        len: e.len,
                        dst: PieceDst::Pull { peer: m.peer, pull },
                    });
                    if let (Some(imm), false) = (imm, told[e.member]) {
                        told[e.member] = true;
                        let pull = self.pull_template(m, 0, 0, Some(imm))?;
                        then.push(Then::Pull { peer: m.peer, pull });
                    }
                    continue;
                }
                let start = self.shared().next_start();
                let mut plan = Plan { ops: Vec::new(), keep: None, then: Vec::new() };
                let shard_imm = if one { None } else { imm };
                // Local addresses are offsets from the entry's start.
                per_entry.plan_contiguous(
                    &mut plan,
                    0,
                    m,
                    e.dst_off,
                    e.len,
                    shard_imm,
                    OpKind::Write,
                    start,
                )?;
                for req in plan.ops {
                    let off = if req.len == 0 { 0 } else { req.local_addr };
                    pieces.push(Piece {
                        src: piece_src(src, e.src_off + off),
                        len: req.len as u64,
                        dst: PieceDst::Write(req),
                    });
                }
                if one && !told[e.member] {
                    told[e.member] = true;
                    plain_then = true;
                    let nic = self.opts.nic_of(0, nics, start);
                    then.push(Then::Op(Self::req(nic, OpKind::Write, 0, 0, m, 0, imm)));
                }
            }
            if plain_then && !pieces.is_empty() {
                self.opts.check_one_arrival(nics, self.shared().delivery_complete)?;
            }
            self.run_job(src, pieces, then)
        })();
        Some(r.unwrap_or_else(OpFuture::failed))
    }

    /// `read` with a staged GPU end, or `None` without one. Into a local staged region:
    /// chunk reads into bounce slots, each copied host-to-device. From a peer's staged
    /// region into host or GPUDirect memory: a push request, which its owner serves by
    /// writing the bytes through its bounce slots and ACKing. Staged to staged:
    /// `Unsupported` (see `docs/gpu.md`).
    pub(in crate::engine) fn staged_read(
        &self,
        dst: &MemoryRegion,
        dst_off: u64,
        src: &RemoteRegion,
        src_off: u64,
        len: u64,
    ) -> Option<OpFuture> {
        let local_staged = dst.inner.staged().is_some();
        if !local_staged && !src.pulled() {
            return None;
        }
        let r = (|| {
            self.check_remote(src)?;
            self.check_local(dst)?;
            src.check(src_off, len)?;
            dst.check(dst_off, len)?;
            if len == 0 {
                return Ok(OpFuture::done());
            }
            if src.pulled() {
                if local_staged {
                    return Err(Error::Unsupported(
                        "read from a peer's staged GPU region into staged GPU memory: the owner can \
                         only write registered memory (read into host or GPUDirect memory, or have the \
                         owner write it)"
                            .into(),
                    ));
                }
                // Its owner copies the bytes out and writes them into `dst`.
                let mut push = self.pull_template(src, src_off, len, None)?;
                push.sources = dst
                    .inner
                    .regs
                    .iter()
                    .map(|r| PullSource { addr: r.remote_base.wrapping_add(dst_off), key: r.remote_key })
                    .collect();
                let state = Arc::new(OpState::default());
                let s = Submission::Push {
                    peer: src.peer,
                    push,
                    keep: dst.inner.clone(),
                    notify: Notify::Future(state.clone()),
                };
                self.hand(vec![s])?;
                return Ok(OpFuture::pending(state).driven_by(self.engine.driver()).without_linger());
            }
            let sources = src
                .desc
                .domains
                .iter()
                .map(|d| PullSource { addr: d.base.wrapping_add(src_off), key: d.key })
                .collect();
            let state = Arc::new(OpState::default());
            let s = Submission::ReadStaged {
                peer: src.peer,
                region: dst.inner.clone(),
                dst_off,
                len,
                sources,
                notify: Notify::Future(state.clone()),
            };
            self.hand(vec![s])?;
            Ok(OpFuture::pending(state).driven_by(self.engine.driver()).without_linger())
        })();
        Some(r.unwrap_or_else(OpFuture::failed))
    }
}
