//! The submission queue: what callers hand the reactor thread, under one lock.

use std::sync::Arc;

use bytes::Bytes;

use super::memory::{Backing, RegionShared};
use super::notify::{FollowUp, Notify, Reply};
pub(crate) use super::request::{OpKind, OpReq};
use super::PeerId;
use crate::error::Error;
use crate::provider::{MemoryLocation, Registration};
use crate::pure::descriptor::EngineAddress;

impl From<FollowUp> for Submission {
    fn from(f: FollowUp) -> Submission {
        Submission::Op { req: f.req, keep: None, notify: f.notify }
    }
}

/// A submission posted on the caller's thread at once (`ReactorMode::Inline` with
/// `EngineBuilder::direct_post`), instead of queued for the reactor's next pass.
pub(crate) trait SubmitHere: Send + Sync {
    /// Posts an operation's submission here: one lock (the core's) instead of the queue's
    /// twice. Gives it back when another thread is in a pass, the engine is shutting down,
    /// or the submission is not an operation; the caller then queues it.
    fn submit_here(&self, s: Submission) -> Result<(), Submission>;
}

/// What callers hand the reactor.
pub(crate) enum Submission {
    Op {
        req: OpReq,
        keep: Option<Arc<RegionShared>>,
        notify: Notify,
    },
    Send {
        peer: PeerId,
        data: Bytes,
        notify: Notify,
    },
    Register {
        backing: Backing,
        location: MemoryLocation,
        reply: Reply<(Vec<Registration>, Backing)>,
    },
    Deregister {
        regs: Vec<Registration>,
        backing: Backing,
    },
    AddPeer {
        address: EngineAddress,
        reply: Reply<PeerId>,
    },
    RemovePeer {
        peer: PeerId,
        reply: Reply<()>,
    },
    /// `Engine::retire_counter`: the counter of `imm` leaves both tables; the reply is the
    /// arrivals it discarded.
    RetireCounter {
        imm: u32,
        reply: Reply<u64>,
    },
    /// `Engine::remote_region` on a transport whose target refuses a bad key silently: ask
    /// `peer` whether the descriptor (its `incarnation`, `len` and every NIC's (base, key))
    /// names a live region of its own (`reactor/core/vouch.rs`).
    Vouch {
        peer: PeerId,
        incarnation: u64,
        len: u64,
        regions: Vec<(u64, u64)>,
        reply: Reply<()>,
    },
    /// CUDA copies to run first, then follow-ups ([`GatedCopies`]).
    #[cfg(feature = "cuda")]
    Gated(Box<GatedCopies>),
    /// A transfer with a staged GPU end, run through the engine's staging pool.
    #[cfg(feature = "cuda")]
    Staged(Box<StagedJob>),
    /// A read from a peer's staged GPU region: ask its owner to write the bytes into
    /// `keep` (the registered destination, held until the ACK) with a push request.
    #[cfg(feature = "cuda")]
    Push {
        peer: PeerId,
        push: Box<crate::pure::control::Pull>,
        keep: Arc<RegionShared>,
        notify: Notify,
    },
    /// A read into a local staged GPU region: chunks read into pool slots, then copied
    /// host-to-device; `notify` completes after the last copy.
    #[cfg(feature = "cuda")]
    ReadStaged {
        peer: PeerId,
        region: Arc<RegionShared>,
        dst_off: u64,
        len: u64,
        /// The remote source, per NIC.
        sources: Vec<crate::pure::control::PullSource>,
        notify: Notify,
    },
}

/// CUDA copies to run first (on a stream of the reactor's for device `ordinal`); once their
/// event is ready, `then` is handled and `done` completed. `keep` holds the memory the
/// copies touch until then.
#[cfg(feature = "cuda")]
pub(crate) struct GatedCopies {
    pub(crate) ordinal: usize,
    pub(crate) copies: Vec<CudaCopy>,
    pub(crate) then: Vec<Submission>,
    pub(crate) done: Option<Notify>,
    pub(crate) keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    /// A user's CUDA event the copies (and `then`) wait for first (`Engine::after`): the
    /// reactor's stream waits on it, never a thread.
    pub(crate) after: Option<Arc<crate::cuda::Event>>,
    /// When the engine handed it over (`EngineStats::gpu`'s hand-off time).
    pub(crate) handed: std::time::Instant,
}

/// A transfer with a staged GPU end (see `reactor/core/gpu/send.rs`): pieces moved chunk by
/// chunk through bounce slots, then the follow-ups, then `notify`.
#[cfg(feature = "cuda")]
pub(crate) struct StagedJob {
    /// Device of the staged source, whose stream runs the device-to-host copies.
    pub(crate) ordinal: usize,
    pub(crate) pieces: Vec<Piece>,
    /// Posted once every piece succeeded, with `notify` as their (shared) waiter; the
    /// arrivals a receiver counts when they cannot ride on the pieces.
    pub(crate) then: Vec<Then>,
    /// The source region (and anything else the pieces touch), until the job is done.
    pub(crate) keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    /// The registered source of [`PieceSrc::Registered`] pieces written directly (its NIC
    /// descriptors).
    pub(crate) local: Option<Arc<RegionShared>>,
    pub(crate) notify: Notify,
}

/// One contiguous piece of a [`StagedJob`].
#[cfg(feature = "cuda")]
pub(crate) struct Piece {
    pub(crate) src: PieceSrc,
    pub(crate) len: u64,
    pub(crate) dst: PieceDst,
}

#[cfg(feature = "cuda")]
pub(crate) enum PieceSrc {
    /// Staged GPU memory at this device address: copied into a bounce slot per chunk.
    Device(u64),
    /// NIC-registered memory (host or GPUDirect): the local address, and per NIC where a
    /// peer reads it.
    Registered { addr: u64, sources: Vec<crate::pure::control::PullSource> },
}

#[cfg(feature = "cuda")]
pub(crate) enum PieceDst {
    /// An RDMA write (host or GPUDirect destination) starting at `req.remote`;
    /// `req.local_addr` is replaced per chunk, `req.imm` rides on the piece's last chunk.
    Write(OpReq),
    /// Into a staged GPU region of `peer`: one PULL per chunk (the template's `dst_off`,
    /// `imm` and destination; sources and length filled in per chunk).
    Pull { peer: PeerId, pull: Box<crate::pure::control::Pull> },
}

/// A follow-up of a [`StagedJob`].
#[cfg(feature = "cuda")]
pub(crate) enum Then {
    /// An imm-only write.
    Op(OpReq),
    /// A zero-length PULL that only counts its imm at the owner.
    Pull { peer: PeerId, pull: Box<crate::pure::control::Pull> },
}

/// One asynchronous CUDA copy of raw addresses (see `cuda::Stream::copy_*_raw`).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CudaCopy {
    pub(crate) dir: CopyDir,
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: usize,
}

#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyDir {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueState {
    Open,
    /// Shutdown requested: no new submissions; the reactor is draining.
    Closing,
    /// The reactor has closed every NIC object; memory may be freed directly.
    Closed,
}

pub(crate) struct Queue {
    pub(crate) state: QueueState,
    pub(crate) items: Vec<Submission>,
    /// The reactor is (about to be) asleep and must be woken through the eventfd.
    pub(crate) sleeping: bool,
    /// Memory of regions dropped while the reactor was closing: freed once it has closed
    /// the registrations.
    pub(crate) graveyard: Vec<Backing>,
}

impl Submission {
    /// The peer of an operation or a send.
    pub(crate) fn peer(&self) -> PeerId {
        match self {
            Submission::Op { req, .. } => req.peer,
            Submission::Send { peer, .. } => *peer,
            _ => unreachable!("only operations have a peer"),
        }
    }

    /// The NIC an operation or a send is posted on.
    pub(crate) fn nic(&self) -> usize {
        match self {
            Submission::Op { req, .. } => req.domain,
            _ => 0,
        }
    }

    /// Completes a submission that will never be posted.
    /// Whether this is one of the engine's own control messages (`Hello`, `Revoke`): a send
    /// nobody awaits. It is not counted in the operation statistics, which describe the
    /// application's operations.
    pub(crate) fn is_internal(&self) -> bool {
        matches!(self, Submission::Send { notify: Notify::None, .. })
    }

    pub(crate) fn fail(self, e: Error) {
        match self {
            Submission::Op { notify, .. } | Submission::Send { notify, .. } => notify.fail(e),
            Submission::Register { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::AddPeer { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::RemovePeer { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::RetireCounter { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::Vouch { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::Deregister { .. } => {}
            #[cfg(feature = "cuda")]
            Submission::Gated(g) => {
                let GatedCopies { then, done, .. } = *g;
                for s in then {
                    s.fail(e.clone());
                }
                if let Some(n) = done {
                    n.fail(e);
                }
            }
            #[cfg(feature = "cuda")]
            Submission::Staged(job) => job.notify.fail(e),
            #[cfg(feature = "cuda")]
            Submission::ReadStaged { notify, .. } | Submission::Push { notify, .. } => notify.fail(e),
        }
    }
}
