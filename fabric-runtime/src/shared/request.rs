//! One operation as the reactor will post it: the part of a submission that the waiters of a
//! sharded transfer keep for their follow-ups (`notify.rs`), below both the queue and them.

use super::PeerId;
use crate::provider::RemoteSlice;

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
