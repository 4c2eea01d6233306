//! The transfer shapes: single writes and reads cut into shards over the engine's NICs,
//! paged writes (KV-cache blocks), scatter to a peer group, and barriers. Every shape is
//! checked completely before anything is posted, is posted as one batch of operations, and
//! resolves one [`OpFuture`] when all of them have completed.
//!
//! The sharding and arrival rules live in [`crate::pure::route`]; the `*_arrivals` methods
//! here apply them to a request, so a receiver can compute what its counter will see.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::op::OpFuture;
use super::region::{MemoryRegion, RemoteRegion};
use super::Engine;
use crate::error::{Error, Result, Side};
use crate::provider::RemoteSlice;
use crate::pure::route::{Arrivals, PageLayout, TransferOpts};
use crate::shared::memory::RegionShared;
use crate::shared::notify::{GroupState, Notify, OpState};
#[cfg(feature = "cuda")]
use crate::shared::queue::GatedCopies;
use crate::shared::queue::{OpKind, OpReq, Submission};
use crate::shared::Shared;

/// A set of remote regions, checked once, that scatter and barrier address by index.
///
/// Made by [`Engine::peer_group`]; only meaningful to that engine. Members may be regions
/// of the same peer (a barrier then sends that peer one imm-only write per member).
#[derive(Debug, Clone)]
pub struct PeerGroup {
    members: Vec<RemoteRegion>,
    engine: usize,
}

impl PeerGroup {
    /// The members, in the order given.
    pub fn members(&self) -> &[RemoteRegion] {
        &self.members
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the group has no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// One piece of a scatter: `len` bytes of the source at `src_off` into member `member`'s
/// region at `dst_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScatterEntry {
    /// Index into the [`PeerGroup`].
    pub member: usize,
    /// Offset in the local source region.
    pub src_off: u64,
    /// Offset in the member's region.
    pub dst_off: u64,
    /// Bytes to move.
    pub len: u64,
}

/// The engine's transfer methods under given [`TransferOpts`] (routing and arrivals).
/// Made by [`Engine::with`]; the engine's own methods use the builder's defaults.
#[derive(Debug, Clone, Copy)]
pub struct Transfers<'a> {
    pub(super) engine: &'a Engine,
    pub(super) opts: TransferOpts,
    /// A CUDA event the transfers start after (`Engine::after`).
    #[cfg(feature = "cuda")]
    pub(super) after: Option<&'a Arc<crate::cuda::Event>>,
}

/// Operations of one transfer, ready to submit.
pub(super) struct Plan {
    pub(super) ops: Vec<OpReq>,
    pub(super) keep: Option<Arc<RegionShared>>,
    /// Imm-only writes posted once every op has completed (`Arrivals::One`).
    pub(super) then: Vec<OpReq>,
}

impl Engine {
    /// The transfer methods with other routing or arrival options than the engine's
    /// defaults, for example `engine.with(TransferOpts::pinned(1)).write_imm(..)`.
    pub fn with(&self, opts: TransferOpts) -> Transfers<'_> {
        Transfers {
            engine: self,
            opts,
            #[cfg(feature = "cuda")]
            after: None,
        }
    }

    /// The transfer methods with the engine's default options.
    pub(crate) fn transfers(&self) -> Transfers<'_> {
        Transfers {
            engine: self,
            opts: self.shared().default_opts,
            #[cfg(feature = "cuda")]
            after: None,
        }
    }

    /// The routing and arrival options the engine's transfer methods use.
    pub fn transfer_opts(&self) -> TransferOpts {
        self.shared().default_opts
    }

    /// The number of NICs (domains) this engine drives.
    pub fn nics(&self) -> usize {
        self.shared().nics
    }

    /// Checks `members` once (they must have been made by this engine) and groups them for
    /// [`Transfers::scatter`] and [`Transfers::barrier`].
    pub fn peer_group(&self, members: Vec<RemoteRegion>) -> Result<PeerGroup> {
        let t = self.transfers();
        for m in &members {
            t.check_remote(m)?;
        }
        Ok(PeerGroup { members, engine: t.id() })
    }
}

impl<'a> Transfers<'a> {
    pub(super) fn shared(&self) -> &'a Arc<Shared> {
        self.engine.shared()
    }

    fn id(&self) -> usize {
        Arc::as_ptr(self.shared()) as usize
    }

    /// The options these methods use.
    pub fn opts(&self) -> TransferOpts {
        self.opts
    }

    pub(super) fn check_remote(&self, r: &RemoteRegion) -> Result<()> {
        if r.engine != self.id() {
            return Err(Error::Config("the remote region was made by another engine".into()));
        }
        if r.peer.0 >= self.shared().npeers.load(Ordering::Acquire) {
            return Err(Error::UnknownPeer { peer: r.peer.0 });
        }
        Ok(())
    }

    pub(super) fn check_local(&self, r: &MemoryRegion) -> Result<()> {
        if !Arc::ptr_eq(r.inner.engine(), self.shared()) {
            return Err(Error::Config("the local region belongs to another engine".into()));
        }
        Ok(())
    }

    /// Checks the local side of a transfer of `len` bytes: its address, and the region to
    /// keep alive until the NIC is done (none for imm-only writes).
    fn local(
        &self,
        local: Option<(&MemoryRegion, u64)>,
        len: u64,
    ) -> Result<(u64, Option<Arc<RegionShared>>)> {
        match local {
            Some((r, off)) => {
                self.check_local(r)?;
                r.check(off, len)?;
                // The address the NICs know (staged GPU regions never get here: their
                // transfers are staged jobs).
                Ok((r.inner.backing().addr() + off, Some(r.inner.clone())))
            }
            None => Ok((0, None)),
        }
    }

    fn check_group(&self, g: &PeerGroup) -> Result<()> {
        if g.engine != self.id() {
            return Err(Error::Config("the peer group was made by another engine".into()));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn req(
        nic: usize,
        kind: OpKind,
        local_addr: u64,
        len: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        imm: Option<u32>,
    ) -> OpReq {
        let key = &dst.desc.domains[nic];
        OpReq {
            domain: nic,
            peer: dst.peer,
            kind,
            local_addr,
            len: len as usize,
            remote: RemoteSlice { addr: key.base.wrapping_add(dst_off), key: key.key },
            imm,
        }
    }

    /// Cuts one contiguous write or read into shards.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn plan_contiguous(
        &self,
        plan: &mut Plan,
        local_addr: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
        kind: OpKind,
        start: usize,
    ) -> Result<()> {
        let nics = self.shared().nics;
        let one = kind == OpKind::Write && imm.is_some() && self.opts.arrivals == Arrivals::One;
        let shard_imm = if one { None } else { imm };
        for s in self.opts.shards(len, nics, start)? {
            if s.len == 0 && shard_imm.is_none() {
                continue; // nothing to move and nothing to count
            }
            plan.ops.push(Self::req(
                s.nic,
                kind,
                if s.len == 0 { 0 } else { local_addr + s.offset },
                s.len,
                dst,
                dst_off + s.offset,
                shard_imm,
            ));
        }
        if one {
            let nic = self.opts.nic_of(0, nics, start);
            plan.then.push(Self::req(nic, OpKind::Write, 0, 0, dst, 0, imm));
        }
        Ok(())
    }

    fn submit(&self, plan: Plan) -> OpFuture {
        let (subs, state) = match self.prepare(plan) {
            Ok(Some(p)) => p,
            Ok(None) => return OpFuture::done(),
            Err(e) => return OpFuture::failed(e),
        };
        match self.hand(subs) {
            Ok(()) => OpFuture::pending(state).driven_by(self.engine.driver()),
            Err(_) => OpFuture::failed(Error::Shutdown),
        }
    }

    /// The submissions of a plan and the state their future waits on; `None`: nothing to
    /// do.
    pub(super) fn prepare(&self, plan: Plan) -> Result<Option<(Vec<Submission>, Arc<OpState>)>> {
        let Plan { mut ops, keep, then } = plan;
        let shared = self.shared();
        if ops.is_empty() && then.is_empty() {
            return Ok(None);
        }
        if ops.is_empty() {
            // Only imm-only follow-ups (an `Arrivals::One` transfer of zero bytes): post
            // them directly.
            ops = then;
            return self.prepare(Plan { ops, keep, then: Vec::new() });
        }
        if !then.is_empty() {
            // Data shards with a follow-up (`Arrivals::One`): refused before anything is
            // posted if the arrival could overtake the data.
            self.opts.check_one_arrival(shared.nics, shared.delivery_complete)?;
        }
        // One event per transfer, not per shard; `enabled!` is a cached per-callsite check,
        // so with debug off this costs a load and a branch.
        if tracing::enabled!(tracing::Level::DEBUG) {
            let bytes: usize = ops.iter().map(|o| o.len).sum();
            let peer = ops[0].peer.0;
            tracing::debug!(peer, shards = ops.len(), follow_ups = then.len(), bytes, "transfer submitted");
        }
        let state = Arc::new(OpState::default());
        let done = Notify::Future(state.clone());
        let subs: Vec<Submission> = if ops.len() == 1 && then.is_empty() {
            let req = ops.pop().expect("one op");
            vec![Submission::Op { req, keep, notify: done }]
        } else {
            let group = GroupState::new(ops.len(), done, then);
            ops.into_iter()
                .map(|req| Submission::Op { req, keep: keep.clone(), notify: Notify::Group(group.clone()) })
                .collect()
        };
        Ok(Some((subs, state)))
    }

    /// Hands a transfer's submissions to the reactor, behind the [`Engine::after`] event
    /// when one is set (one gate for the whole transfer: nothing of it is posted or copied
    /// before the event's work is done).
    pub(super) fn hand(&self, subs: Vec<Submission>) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(ev) = self.after {
            let gate = Submission::Gated(Box::new(GatedCopies {
                ordinal: ev.ordinal(),
                copies: Vec::new(),
                then: subs,
                done: None,
                keep: Vec::new(),
                after: Some(ev.clone()),
                handed: std::time::Instant::now(),
            }));
            return self.shared().submit(gate).map_err(|_| Error::Shutdown);
        }
        self.shared().submit_all(subs).map_err(|_| Error::Shutdown)
    }

    pub(super) fn contiguous(
        &self,
        local: Option<(&MemoryRegion, u64)>,
        remote: &RemoteRegion,
        remote_off: u64,
        len: u64,
        imm: Option<u32>,
        kind: OpKind,
    ) -> Result<Plan> {
        self.check_remote(remote)?;
        remote.check(remote_off, len)?;
        let (local_addr, keep) = self.local(local, len)?;
        let mut plan = Plan { ops: Vec::new(), keep, then: Vec::new() };
        let start = self.shared().next_start();
        self.plan_contiguous(&mut plan, local_addr, remote, remote_off, len, imm, kind, start)?;
        Ok(plan)
    }

    /// A write (with or without an immediate) that is one operation on one NIC: posted
    /// with one allocation, its future's state, where a plan costs four (its shard list,
    /// its operations, its submissions, the state). `None` where it is not one operation
    /// (sharded over several NICs, `Arrivals::One`'s follow-up, a CUDA event gate), or the
    /// checks failed: the plan path then reports the same error.
    fn one_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Option<OpFuture> {
        #[cfg(feature = "cuda")]
        if self.after.is_some() {
            return None;
        }
        // (Zero bytes and no immediate is nothing to post: the plan path's done future.)
        if imm.is_some() && self.opts.arrivals == Arrivals::One
            || len == 0 && imm.is_none()
            || self.opts.shard_count(len, self.shared().nics).ok()? != 1
        {
            return None;
        }
        let (req, keep) = self.single(Some((src, src_off)), dst, dst_off, len, imm).ok()?;
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(peer = dst.peer.0, shards = 1, follow_ups = 0, bytes = len, "transfer submitted");
        }
        let state = Arc::new(OpState::default());
        let notify = Notify::Future(state.clone());
        Some(match self.engine.submit_op(Submission::Op { req, keep, notify }) {
            Ok(()) => OpFuture::pending(state).driven_by(self.engine.driver()),
            Err(_) => OpFuture::failed(Error::Shutdown),
        })
    }

    pub(super) fn run(&self, plan: Result<Plan>) -> OpFuture {
        match plan {
            Ok(p) => self.submit(p),
            Err(e) => OpFuture::failed(e),
        }
    }

    /// Writes `len` bytes of `src` at `src_off` into `dst` at `dst_off`, sharded over the
    /// NICs. Both ranges are bounds-checked before anything is posted.
    ///
    /// # Cancel safety
    ///
    /// See [`OpFuture`]: dropping the future does not cancel the write, and the source stays
    /// registered and allocated until the NIC is done with it.
    pub fn write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
    ) -> OpFuture {
        #[cfg(feature = "cuda")]
        if let Some(f) = self.gpu_write(src, src_off, dst, dst_off, len, None) {
            return f;
        }
        if let Some(f) = self.one_write(src, src_off, dst, dst_off, len, None) {
            return f;
        }
        self.run(self.contiguous(Some((src, src_off)), dst, dst_off, len, None, OpKind::Write))
    }

    /// Like [`Transfers::write`], and the target counts arrivals of `imm` once the bytes
    /// have landed: [`Transfers::write_arrivals`] of them (one per shard, or exactly one
    /// with `Arrivals::One`). `Arrivals::One` sharded over several NICs whose writes are not
    /// delivery-complete fails with [`Error::Unsupported`] before anything is posted (see
    /// [`TransferOpts::check_one_arrival`]; the same holds for paged writes and scatters).
    ///
    /// # Cancel safety
    ///
    /// As for [`Transfers::write`]: the write and its immediate still happen.
    #[allow(clippy::too_many_arguments)]
    pub fn write_imm(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: u32,
    ) -> OpFuture {
        #[cfg(feature = "cuda")]
        if let Some(f) = self.gpu_write(src, src_off, dst, dst_off, len, Some(imm)) {
            return f;
        }
        if let Some(f) = self.one_write(src, src_off, dst, dst_off, len, Some(imm)) {
            return f;
        }
        self.run(self.contiguous(Some((src, src_off)), dst, dst_off, len, Some(imm), OpKind::Write))
    }

    /// An imm-only write: zero bytes, exactly one arrival of `imm` at the owner of `dst`.
    ///
    /// # Cancel safety
    ///
    /// As for [`Transfers::write`].
    pub fn imm(&self, dst: &RemoteRegion, imm: u32) -> OpFuture {
        let plan = self.contiguous(None, dst, 0, 0, Some(imm), OpKind::Write).map(|mut p| {
            // An imm-only write is its own single arrival: no follow-up needed.
            p.ops.append(&mut p.then);
            p
        });
        self.run(plan)
    }

    /// Reads `len` bytes of the remote region `src` at `src_off` into `dst` at `dst_off`,
    /// sharded over the NICs like a write (`fi_read` / `IBV_WR_RDMA_READ`). Reads produce
    /// no arrivals at the remote side.
    ///
    /// GPU memory (`docs/gpu.md`): into a local staged GPU region the chunks are read into
    /// bounce slots and copied to the GPU; from a peer's staged GPU region (into host or
    /// GPUDirect memory) its owner writes the range through its own slots and ACKs; from
    /// staged into staged GPU memory is [`Error::Unsupported`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not cancel the read: `dst` keeps being written until the
    /// NIC completes it, or the owner of a staged source ACKs (the region stays allocated
    /// until then).
    pub fn read(
        &self,
        dst: &MemoryRegion,
        dst_off: u64,
        src: &RemoteRegion,
        src_off: u64,
        len: u64,
    ) -> OpFuture {
        #[cfg(feature = "cuda")]
        if let Some(f) = self.staged_read(dst, dst_off, src, src_off, len) {
            return f;
        }
        self.run(self.contiguous(Some((dst, dst_off)), src, src_off, len, None, OpKind::Read))
    }

    /// Arrivals of `imm` that [`Transfers::write_imm`] of `len` bytes into `dst` produces
    /// at its owner. A pure function of the options, `len` and the descriptor's NIC count:
    /// the receiver can call it with its own [`TransferOpts`] knowledge and the length.
    ///
    /// Into a staged GPU region or through CUDA IPC (see `docs/gpu.md`): exactly one.
    pub fn write_arrivals(&self, dst: &RemoteRegion, len: u64) -> Result<u64> {
        #[cfg(feature = "cuda")]
        if matches!(
            dst.gpu_path(),
            Some(crate::pure::staging::GpuPath::Staged | crate::pure::staging::GpuPath::Ipc)
        ) {
            return Ok(1);
        }
        self.opts.write_arrivals(len, dst.desc.domains.len())
    }

    /// Writes pages of `src` into pages of `dst` in one call (KV-cache blocks): page
    /// `src_pages[i]` of the source goes to page `dst_pages[i]` of the destination, with
    /// the geometry of `layout`. Each page is one write (never split), and pages are dealt
    /// round-robin over the NICs (or all on the pinned one). With `imm`, the target counts
    /// one arrival per page, or exactly one with `Arrivals::One` (see
    /// [`Transfers::paged_arrivals`]).
    ///
    /// Everything is checked before anything is posted: equal list lengths, strides of at
    /// least a page, every page inside its region, no destination page twice.
    ///
    /// With a staged GPU end (`docs/gpu.md`) pages move through bounce slots (a page larger
    /// than a slot in several chunks, its imm on the last); into staged GPU memory the
    /// owner pulls each page and counts exactly one arrival once all are in GPU memory. Into
    /// a GPU region of another process on this host (CUDA IPC), every page is a copy of one
    /// gate on the copy engine and the owner counts exactly one arrival, after the last.
    ///
    /// # Cancel safety
    ///
    /// As for [`Transfers::write`].
    pub fn write_paged(
        &self,
        src: &MemoryRegion,
        dst: &RemoteRegion,
        layout: &PageLayout,
        src_pages: &[u32],
        dst_pages: &[u32],
        imm: Option<u32>,
    ) -> OpFuture {
        #[cfg(feature = "cuda")]
        if let Some(f) = self.staged_paged(src, dst, layout, src_pages, dst_pages, imm) {
            return f;
        }
        self.run(self.paged(src, dst, layout, src_pages, dst_pages, imm))
    }

    pub(super) fn paged(
        &self,
        src: &MemoryRegion,
        dst: &RemoteRegion,
        layout: &PageLayout,
        src_pages: &[u32],
        dst_pages: &[u32],
        imm: Option<u32>,
    ) -> Result<Plan> {
        self.check_remote(dst)?;
        self.check_local(src)?;
        let nics = self.shared().nics;
        self.opts.validate(nics)?;
        let pages = layout.resolve(src_pages, dst_pages, src.len() as u64, dst.len())?;
        let one = imm.is_some() && self.opts.arrivals == Arrivals::One;
        let page_imm = if one { None } else { imm };
        let start = self.shared().next_start();
        let base = src_base(src);
        let mut plan =
            Plan { ops: Vec::with_capacity(pages.len()), keep: Some(src.inner.clone()), then: Vec::new() };
        for (i, (so, doff)) in pages.into_iter().enumerate() {
            let nic = self.opts.nic_of(i, nics, start);
            plan.ops.push(Self::req(nic, OpKind::Write, base + so, layout.page_len, dst, doff, page_imm));
        }
        if one && !plan.ops.is_empty() {
            plan.then.push(Self::req(self.opts.nic_of(0, nics, start), OpKind::Write, 0, 0, dst, 0, imm));
        }
        Ok(plan)
    }

    /// Arrivals of the immediate that [`Transfers::write_paged`] of `pages` pages into `dst`
    /// produces at its owner.
    ///
    /// Into a staged GPU region, or a GPU region written through CUDA IPC (see
    /// `docs/gpu.md`): exactly one (none for no pages).
    pub fn paged_arrivals(&self, dst: &RemoteRegion, pages: usize) -> Result<u64> {
        #[cfg(feature = "cuda")]
        if dst.pulled() || dst.gpu_path() == Some(crate::pure::staging::GpuPath::Ipc) {
            return Ok(u64::from(pages > 0));
        }
        self.opts.paged_arrivals(pages, dst.desc.domains.len())
    }

    /// Writes pieces of one source region to the members of a peer group (MoE dispatch, a
    /// weight shard per rank), each piece sharded like [`Transfers::write_imm`]. With `imm`,
    /// each member counts [`Transfers::scatter_arrivals`] arrivals. One future for all.
    ///
    /// Everything is checked before anything is posted: member indices, both ranges of
    /// every entry, and that no two entries overlap in the same member's region.
    ///
    /// With a staged GPU end (`docs/gpu.md`) entries move through bounce slots; a member
    /// whose region is staged GPU memory pulls its entries and counts exactly one arrival.
    ///
    /// # Cancel safety
    ///
    /// As for [`Transfers::write`].
    pub fn scatter(
        &self,
        src: &MemoryRegion,
        group: &PeerGroup,
        entries: &[ScatterEntry],
        imm: Option<u32>,
    ) -> OpFuture {
        #[cfg(feature = "cuda")]
        if let Some(f) = self.staged_scatter(src, group, entries, imm) {
            return f;
        }
        self.run(self.scatter_plan(src, group, entries, imm))
    }

    pub(super) fn check_entries(
        &self,
        src_len: Option<u64>,
        group: &PeerGroup,
        entries: &[ScatterEntry],
    ) -> Result<()> {
        self.check_group(group)?;
        let mut ranges: Vec<(usize, u64, u64)> = Vec::with_capacity(entries.len());
        for e in entries {
            let Some(m) = group.members.get(e.member) else {
                return Err(Error::Config(format!(
                    "scatter entry names member {} of a {}-member group",
                    e.member,
                    group.len()
                )));
            };
            m.check(e.dst_off, e.len)?;
            if let Some(src_len) = src_len {
                super::region::check_range(Side::Local, e.src_off, e.len, src_len)?;
            }
            if e.len > 0 {
                ranges.push((e.member, e.dst_off, e.dst_off + e.len));
            }
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.0 == b.0 && b.1 < a.2 {
                return Err(Error::Config(format!(
                    "scatter entries overlap in member {}'s region: [{}, {}) and [{}, {})",
                    a.0, a.1, a.2, b.1, b.2
                )));
            }
        }
        Ok(())
    }

    fn scatter_plan(
        &self,
        src: &MemoryRegion,
        group: &PeerGroup,
        entries: &[ScatterEntry],
        imm: Option<u32>,
    ) -> Result<Plan> {
        self.check_local(src)?;
        self.check_entries(Some(src.len() as u64), group, entries)?;
        let nics = self.shared().nics;
        self.opts.validate(nics)?;
        let one = imm.is_some() && self.opts.arrivals == Arrivals::One;
        let base = src.inner.backing().addr();
        let mut plan = Plan { ops: Vec::new(), keep: Some(src.inner.clone()), then: Vec::new() };
        let mut told = vec![false; group.len()];
        for e in entries {
            let dst = &group.members[e.member];
            let start = self.shared().next_start();
            // Per entry, without its own follow-up: `Arrivals::One` means one per member.
            let per_entry =
                Transfers { opts: TransferOpts { arrivals: Arrivals::PerShard, ..self.opts }, ..*self };
            let shard_imm = if one { None } else { imm };
            per_entry.plan_contiguous(
                &mut plan,
                base + e.src_off,
                dst,
                e.dst_off,
                e.len,
                shard_imm,
                OpKind::Write,
                start,
            )?;
            if one && !told[e.member] {
                told[e.member] = true;
                plan.then.push(Self::req(self.opts.nic_of(0, nics, start), OpKind::Write, 0, 0, dst, 0, imm));
            }
        }
        Ok(plan)
    }

    /// Arrivals of the immediate that [`Transfers::scatter`] with `entries` produces at each
    /// member, indexed like the group. A member whose region is staged GPU memory counts
    /// exactly one (if it has an entry); so does every member when all members with an entry
    /// are reached through CUDA IPC (the scatter is then one gate of copies and one imm-only
    /// write per member).
    pub fn scatter_arrivals(&self, group: &PeerGroup, entries: &[ScatterEntry]) -> Result<Vec<u64>> {
        self.check_entries(None, group, entries)?;
        let mut out = vec![0u64; group.len()];
        #[cfg(feature = "cuda")]
        if !entries.is_empty()
            && entries
                .iter()
                .all(|e| group.members[e.member].gpu_path() == Some(crate::pure::staging::GpuPath::Ipc))
        {
            // Every member through CUDA IPC: one gate, one arrival per member named.
            for e in entries {
                out[e.member] = 1;
            }
            return Ok(out);
        }
        for e in entries {
            #[cfg(feature = "cuda")]
            if group.members[e.member].pulled() {
                // Into staged GPU memory: one arrival per member, once all its bytes are in.
                out[e.member] = 1;
                continue;
            }
            let nics = group.members[e.member].desc.domains.len();
            let n = self.opts.write_arrivals(e.len, nics)?;
            out[e.member] = match self.opts.arrivals {
                Arrivals::One => 1,
                _ => out[e.member] + n,
            };
        }
        Ok(out)
    }

    /// One imm-only write of `imm` to every member of `group`: each member counts exactly
    /// one arrival per barrier. A full barrier among N ranks: every rank calls this with the
    /// group of the others and then waits for N-1 arrivals of `imm` on its own counter (use
    /// a new `imm`, or the cumulative count, per round).
    ///
    /// # Cancel safety
    ///
    /// As for [`Transfers::write`].
    pub fn barrier(&self, group: &PeerGroup, imm: u32) -> OpFuture {
        let plan = (|| {
            self.check_group(group)?;
            let nics = self.shared().nics;
            self.opts.validate(nics)?;
            let start = self.shared().next_start();
            let ops = group
                .members
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    Self::req(self.opts.nic_of(i, nics, start), OpKind::Write, 0, 0, m, 0, Some(imm))
                })
                .collect();
            Ok(Plan { ops, keep: None, then: Vec::new() })
        })();
        self.run(plan)
    }

    /// The request of the synchronous fast path and of [`Transfers::one_write`]: one
    /// operation on one NIC, never sharded (so one completion and one arrival per call).
    /// Builds the request directly, with no plan or shard list, so posting allocates nothing.
    pub(crate) fn single(
        &self,
        src: Option<(&MemoryRegion, u64)>,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<(OpReq, Option<Arc<RegionShared>>)> {
        self.check_remote(dst)?;
        dst.check(dst_off, len)?;
        #[cfg(feature = "cuda")]
        if len > 0 {
            self.refuse_staged("post_write_imm", src.map(|s| s.0), Some(dst))?;
        }
        let nics = self.shared().nics;
        self.opts.validate(nics)?;
        let (local_addr, keep) = self.local(src, len)?;
        let nic = self.opts.nic_of(0, nics, self.shared().next_start());
        let local_addr = if len == 0 { 0 } else { local_addr };
        tracing::trace!(peer = dst.peer().0, nic, len, ?imm, "fast-path write submitted");
        Ok((Self::req(nic, OpKind::Write, local_addr, len, dst, dst_off, imm), keep))
    }
}

/// Where a region's bytes start for the plans: its host (or GPUDirect) address, or, for a
/// staged GPU region, its device address (the reactor copies from there into bounce slots).
fn src_base(src: &MemoryRegion) -> u64 {
    #[cfg(feature = "cuda")]
    if let Some(g) = src.inner.staged() {
        return g.ptr;
    }
    src.inner.backing().addr()
}
