//! Gates: CUDA copies the reactor waits for without blocking, on several streams per device.
//!
//! ```text
//!  start_gate(lane) ─► stream (lane % streams) ─► copies ─► event (a spare one, reused)
//!  each pass: per stream, the oldest gates whose event is ready, in order ─► what follows
//! ```
//!
//! Copies of concurrent operations go to different streams (`EngineBuilder::cuda_streams`;
//! the one with the fewest gates in flight), so they overlap on the copy engines instead of queueing behind each other;
//! the chunks of one staged job or pull share a stream (their lane), so they stay in order.
//! A pass queries only the oldest gate of each stream: gates of one stream complete in
//! order, so one query per stream tells everything a pass can act on. The last gate of a
//! stream has no event of its own: a query of the stream (`cuStreamQuery`) tells when it is
//! done, so a lone operation costs no `cuEventRecord`; a gate that follows it records the
//! event of the one before, at the current end of the stream, before its own copies. Events
//! are created once and reused (`cuEventCreate` per copy cost as much as the copy's
//! submission). Operations of their own (IPC writes) started on one stream between two polls
//! share the end of the last of them (at most [`MAX_GROUP`]): a burst of small writes costs
//! one record and one query per stream and pass, not one of each per write; each still
//! completes no earlier than its own copies.
//! This file is the leaf of the reactor's GPU folder: `send.rs`, `pull.rs` and `mod.rs` use
//! it; it uses none of them.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::cuda::{self, Event, EventStatus, Stream};
use crate::error::Result;
use crate::shared::notify::Notify;
use crate::shared::queue::{CopyDir, CudaCopy, Submission};

/// Internal tags: the kind in the top four bits.
const KIND_SHIFT: u32 = 60;
pub(crate) const LOW: u64 = (1 << KIND_SHIFT) - 1;
/// A PULL we sent (low bits: its op id).
pub(crate) const TAG_PULL_SENT: u64 = 1;
/// A chunk read of a pull (low bits: pull id, chunk index).
pub(crate) const TAG_READ: u64 = 2;
/// An ACK we sent.
pub(crate) const TAG_ACK_SENT: u64 = 3;
/// A chunk write of a staged job (low bits: job id, chunk index).
pub(crate) const TAG_CHUNK: u64 = 4;
/// In a tag, an id (job or pull) above these bits, a chunk index below.
pub(crate) const IDX_BITS: u32 = 32;
/// Ids wrap at this mask (far more than can be in flight at once).
pub(crate) const ID_MASK: u64 = (1 << (KIND_SHIFT - IDX_BITS)) - 1;

/// The tag of an internal operation of `kind` with `low` bits.
pub(crate) fn tag(kind: u64, low: u64) -> u64 {
    kind << KIND_SHIFT | (low & LOW)
}

/// The kind and low bits of an internal tag.
pub(crate) fn untag(tag: u64) -> (u64, u64) {
    (tag >> KIND_SHIFT, tag & LOW)
}

pub(crate) type Keep = Vec<Arc<dyn Any + Send + Sync>>;

/// What a gate releases once its copies are done.
pub(crate) enum GateThen {
    /// Handle these submissions, then complete `done` (if any).
    Submit(Vec<Submission>, Option<Notify>),
    /// Chunk `idx` of a staged job is in its bounce slot.
    JobChunk { job: u64, idx: u64 },
    /// Chunk `idx` of a pull is in GPU memory.
    PullChunk { pull: u64, idx: u64 },
}

/// Which stream of the device a gate's copies go to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Lane {
    /// The stream with the fewest gates in flight: an operation of its own (an IPC write).
    Next,
    /// The stream of this id: every gate of one staged job or pull, in order.
    Of(u64),
}

/// A gate whose copies are done (or failed), to be dispatched.
pub(crate) struct Done {
    pub(crate) then: GateThen,
    pub(crate) result: Result<()>,
    pub(crate) keep: Keep,
}

/// How a gate's end is seen.
enum End {
    /// Copies already done (emulated device memory, `cuda::is_emulated`).
    Done,
    /// The gate is its stream's last work: the stream's own query.
    Stream,
    /// An event recorded after its copies (a later gate followed it on the stream).
    Event(Event),
    /// Done when the next gate with an end of its own on the stream is (a later operation
    /// started on the stream before the next poll: they complete together).
    WithNext,
}

struct Gate {
    end: End,
    /// An operation of its own (`Lane::Next`), started at this poll epoch: a later one in the
    /// same epoch may take it into its group.
    group: Option<u64>,
    then: GateThen,
    /// The memory the copies touch, until the event is ready.
    keep: Keep,
    /// When the copies were enqueued.
    enqueued: Instant,
}

/// One stream of a device and the gates queued on it, oldest first. Field order is drop
/// order: the stream (whose drop waits for its copies) before the memory the gates hold.
struct StreamQueue {
    stream: Stream,
    gates: VecDeque<Gate>,
}

/// One device's streams and its spare events.
struct Device {
    ordinal: usize,
    lanes: Vec<StreamQueue>,
    spare: Vec<Event>,
}

/// Spare events kept per device (each a few hundred bytes of driver state).
const SPARE_EVENTS: usize = 256;

/// The most gates that complete together on one stream (a group's first waits for the copies
/// of the others too: a few microseconds each at the sizes that group).
pub(crate) const MAX_GROUP: usize = 8;

/// What the timing of the gates found (`EngineStats::gpu`).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct GateTimes {
    /// ns inside the copy and record calls.
    pub(crate) enqueue_ns: u64,
    /// ns from the end of the enqueue to the pass that saw the event ready.
    pub(crate) copy_ns: u64,
    /// ns inside event queries, and how many.
    pub(crate) poll_ns: u64,
    pub(crate) queries: u64,
}

/// Every device's streams and gates.
#[derive(Default)]
pub(crate) struct Gates {
    devices: Vec<Device>,
    /// Emulated gates (done at once), dispatched by the next poll.
    ready: VecDeque<Gate>,
    count: usize,
    /// When a gate last started or finished: a reactor polls, not sleeps, shortly after.
    pub(crate) last_change: Option<Instant>,
    /// Polls so far: gates started between two polls may be grouped.
    epoch: u64,
}

impl Gates {
    /// Gates in flight.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    fn device(&mut self, ordinal: usize, streams: usize) -> Result<&mut Device> {
        let i = match self.devices.iter().position(|d| d.ordinal == ordinal) {
            Some(i) => i,
            None => {
                let ctx = cuda::context(ordinal)?;
                let lanes = (0..streams.max(1))
                    .map(|_| Stream::new(&ctx).map(|stream| StreamQueue { stream, gates: VecDeque::new() }))
                    .collect::<Result<Vec<_>>>()?;
                self.devices.push(Device { ordinal, lanes, spare: Vec::new() });
                self.devices.len() - 1
            }
        };
        Ok(&mut self.devices[i])
    }

    /// Enqueues `copies` (after the user's `after` event, if any) on a stream of device
    /// `ordinal` chosen by `lane`, and a gate that releases `then` once they are done.
    /// On an error the gate is not started: the caller fails `then` (copies already queued
    /// on the stream are waited for here first, so their memory may go).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        &mut self,
        ordinal: usize,
        streams: usize,
        lane: Lane,
        after: Option<&Event>,
        copies: &[CudaCopy],
        then: GateThen,
        keep: Keep,
        times: &mut GateTimes,
    ) -> std::result::Result<(), Box<(GateThen, Keep, crate::error::Error)>> {
        let t0 = Instant::now();
        self.last_change = Some(t0);
        if cuda::is_emulated(ordinal) && after.is_none() {
            for c in copies {
                // SAFETY: emulated device memory is host memory that the gate's `keep` (or
                // the region's operation) holds; the engine bounds-checked every range.
                unsafe { cuda::emulated_copy(c.dst, c.src, c.len) };
            }
            self.ready.push_back(Gate { end: End::Done, group: None, then, keep, enqueued: t0 });
            self.count += 1;
            return Ok(());
        }
        let epoch = self.epoch;
        let dev = match self.device(ordinal, streams) {
            Ok(d) => d,
            Err(e) => return Err(Box::new((then, keep, e))),
        };
        let (i, group) = match lane {
            // The stream with the fewest gates, the first of those: concurrent operations
            // spread out, and a lone one always finds the same idle (warm) stream.
            Lane::Next => (
                dev.lanes.iter().enumerate().min_by_key(|(_, l)| l.gates.len()).map_or(0, |(i, _)| i),
                Some(epoch),
            ),
            Lane::Of(id) => ((id % dev.lanes.len() as u64) as usize, None),
        };
        let lane = &mut dev.lanes[i];
        // The gate before, the stream's last work until now: an operation of its own started
        // since the last poll joins this one's group (up to MAX_GROUP); else it gets its event
        // here, recorded at the current end of the stream, before this gate's copies.
        let grouped = group.is_some() && {
            let run = lane.gates.iter().rev().skip(1).take_while(|g| matches!(g.end, End::WithNext)).count();
            let back = lane.gates.back().filter(|g| matches!(g.end, End::Stream) && g.group == group);
            back.is_some() && run + 1 < MAX_GROUP
        };
        if grouped {
            if let Some(prev) = lane.gates.back_mut() {
                prev.end = End::WithNext;
            }
        } else if let Some(prev) = lane.gates.back_mut().filter(|g| matches!(g.end, End::Stream)) {
            let ev = match dev.spare.pop() {
                Some(ev) => Ok(ev),
                None => Event::new(lane.stream.context()),
            };
            match ev.and_then(|ev| ev.record(&lane.stream).map(|()| ev)) {
                Ok(ev) => prev.end = End::Event(ev),
                Err(e) => {
                    // A context that cannot record an event is broken: wait for what is
                    // queued (the gate before is then done, or failed with its copies), and
                    // fail this gate.
                    let _ = lane.stream.synchronize();
                    prev.end = End::Done;
                    return Err(Box::new((then, keep, e)));
                }
            }
        }
        let r = (|| {
            let stream = &lane.stream;
            if let Some(ev) = after {
                // The device waits, not a thread: what follows on the stream starts once
                // the user's work recorded in `ev` is done.
                stream.wait(ev)?;
            }
            for c in copies {
                // SAFETY: the engine bounds-checked every user range against its region when
                // it planned the transfer, and bounce-slot ranges lie inside the pool; the
                // gate keeps those regions (and IPC mappings, and the pool) until the event
                // recorded below is ready, or the stream is synchronized.
                unsafe {
                    match c.dir {
                        CopyDir::HostToDevice => stream.copy_h2d_raw(c.dst, c.src as *const u8, c.len)?,
                        CopyDir::DeviceToHost => stream.copy_d2h_raw(c.dst as *mut u8, c.src, c.len)?,
                        CopyDir::DeviceToDevice => stream.copy_d2d_raw(c.dst, c.src, c.len)?,
                    }
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => {
                let now = Instant::now();
                times.enqueue_ns += now.saturating_duration_since(t0).as_nanos() as u64;
                lane.gates.push_back(Gate { end: End::Stream, group, then, keep, enqueued: now });
                self.count += 1;
                Ok(())
            }
            Err(e) => {
                // Some copies may be queued: wait for them before the memory may go. Every
                // gate queued before is then done (or failed with its copies); a group that
                // waited for this gate's end ends with the stream.
                let _ = lane.stream.synchronize();
                if let Some(b) = lane.gates.back_mut().filter(|g| matches!(g.end, End::WithNext)) {
                    b.end = End::Stream;
                }
                Err(Box::new((then, keep, e)))
            }
        }
    }

    /// The gates whose copies are done, in order per stream; never blocks. An error (a
    /// failed copy: the context is then unusable) finishes its gate with that error.
    pub(crate) fn poll(&mut self, out: &mut Vec<Done>, times: &mut GateTimes) {
        if self.count == 0 {
            return;
        }
        self.epoch = self.epoch.wrapping_add(1);
        let before = out.len();
        while let Some(g) = self.ready.pop_front() {
            out.push(Done { then: g.then, result: Ok(()), keep: g.keep });
        }
        let mut now = None;
        let t0 = Instant::now();
        for dev in &mut self.devices {
            for lane in &mut dev.lanes {
                // The oldest group (a gate, or gates up to the first with an end of its own).
                while let Some(k) = lane.gates.iter().position(|g| !matches!(g.end, End::WithNext)) {
                    times.queries += 1;
                    let status = match &lane.gates[k].end {
                        End::Done => Ok(EventStatus::Ready),
                        End::Stream => lane.stream.query(),
                        End::Event(ev) => ev.query(),
                        End::WithNext => unreachable!("found by position"),
                    };
                    let result = match status {
                        Ok(EventStatus::NotReady) => break,
                        Ok(EventStatus::Ready) => Ok(()),
                        Err(e) => Err(e),
                    };
                    let t = *now.get_or_insert_with(Instant::now);
                    for g in lane.gates.drain(..=k) {
                        times.copy_ns += t.saturating_duration_since(g.enqueued).as_nanos() as u64;
                        if let (End::Event(ev), true) = (g.end, result.is_ok()) {
                            if dev.spare.len() < SPARE_EVENTS {
                                dev.spare.push(ev);
                            }
                        }
                        out.push(Done { then: g.then, result: result.clone(), keep: g.keep });
                    }
                }
            }
        }
        times.poll_ns += t0.elapsed().as_nanos() as u64;
        let n = out.len() - before;
        if n > 0 {
            self.count -= n;
            self.last_change = now.or_else(|| Some(Instant::now()));
        }
    }

    /// Shutdown: waits for every copy engine, and hands back every gate (done or not).
    pub(crate) fn close(&mut self) -> Vec<(GateThen, Keep)> {
        let mut out = Vec::new();
        for dev in &mut self.devices {
            for lane in &mut dev.lanes {
                if let Err(e) = lane.stream.synchronize() {
                    tracing::warn!(error = %e, "waiting for staging copies at shutdown failed");
                }
                out.extend(lane.gates.drain(..).map(|g| (g.then, g.keep)));
            }
        }
        out.extend(self.ready.drain(..).map(|g| (g.then, g.keep)));
        self.count = 0;
        out
    }
}
