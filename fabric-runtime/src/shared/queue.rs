//! The submission queue: what callers hand the reactor thread, under one lock.

use std::sync::Arc;

use bytes::Bytes;

use super::memory::{Backing, RegionShared};
use super::notify::{Notify, Reply};
use super::PeerId;
use crate::error::Error;
use crate::provider::{MemoryLocation, Registration, RemoteSlice};
use crate::pure::descriptor::EngineAddress;

/// One operation as the reactor will post it.
pub(crate) struct OpReq {
    pub(crate) domain: usize,
    pub(crate) peer: PeerId,
    pub(crate) kind: OpKind,
    /// Local address and length (`0, 0` for an imm-only write).
    pub(crate) local_addr: u64,
    pub(crate) len: usize,
    pub(crate) remote: RemoteSlice,
    pub(crate) imm: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Write,
    Read,
}

impl OpKind {
    pub(crate) fn name(self, imm: Option<u32>) -> &'static str {
        match (self, imm) {
            (OpKind::Write, Some(_)) => "write_imm",
            (OpKind::Write, None) => "write",
            (OpKind::Read, _) => "read",
        }
    }
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
    /// CUDA copies to run first (on the reactor's stream of device `ordinal`); once their
    /// event is ready, `then` is handled and `done` completed. `keep` holds the memory the
    /// copies touch until then.
    #[cfg(feature = "cuda")]
    Gated {
        ordinal: usize,
        copies: Vec<CudaCopy>,
        then: Vec<Submission>,
        done: Option<Notify>,
        keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
        /// A user's CUDA event the copies (and `then`) wait for first
        /// (`Engine::after`): the reactor's stream waits on it, never a thread.
        after: Option<Arc<crate::cuda::Event>>,
    },
    /// A write into a peer's staged GPU region: send it a PULL and complete `notify` on its
    /// ACK. `keep` is the source, which the peer reads until then.
    #[cfg(feature = "cuda")]
    Pull {
        peer: PeerId,
        pull: Box<crate::pure::control::Pull>,
        keep: Arc<RegionShared>,
        notify: Notify,
    },
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
            #[cfg(feature = "cuda")]
            Submission::Pull { peer, .. } => *peer,
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
    pub(crate) fn fail(self, e: Error) {
        match self {
            Submission::Op { notify, .. } | Submission::Send { notify, .. } => notify.fail(e),
            Submission::Register { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::AddPeer { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Submission::Deregister { .. } => {}
            #[cfg(feature = "cuda")]
            Submission::Gated { then, done, .. } => {
                for s in then {
                    s.fail(e.clone());
                }
                if let Some(n) = done {
                    n.fail(e);
                }
            }
            #[cfg(feature = "cuda")]
            Submission::Pull { notify, .. } => notify.fail(e),
        }
    }
}
