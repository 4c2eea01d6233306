//! Owners vouch for descriptors before they are used, on transports whose target refuses a
//! bad key without telling the writer (libfabric 1.17's shm: a write with immediate through
//! a forged key completes at the writer as if delivered, or never; `docs/faults.md`).
//!
//! ```text
//!  writer's reactor                                 owner's reactor
//!   Submission::Vouch (from remote_region)            │
//!   │── Vouch { id, incarnation, len, [(base, key)], address } ──►│ on_vouch: its live
//!   │   `vouching` (id, peer, deadline)                │ registrations, NIC by NIC
//!   │◄──────────────── Vouched { id, verdict } ────────│ (`Vouch::judge`)
//!   on_vouched: remote_region gets Ok, or Error::RemoteAccess
//! ```
//!
//! The owner answers from its reactor thread, whatever its application does. A question
//! whose peer goes down (or is removed) fails with `PeerUnreachable` (at once, or at the
//! next check: every pass while one waits); one unanswered after `op_timeout` (30 s without
//! one) marks the peer down, as an operation that outlived it would (an owner of an older
//! build drops the question unanswered). A child module of `core`, so it works on `Core`'s
//! fields directly.

use std::time::{Duration, Instant};

use super::Core;
use crate::error::Error;
use crate::provider::Domain;
use crate::pure::descriptor::EngineAddress;
use crate::pure::revoke::{Verdict, Vouch, Vouched};
use crate::shared::notify::{Notify, Reply};
use crate::shared::queue::Submission;
use crate::shared::PeerId;

/// How long an owner may take to answer when the engine has no `op_timeout`.
const VOUCH_BACKSTOP: Duration = Duration::from_secs(30);

/// A question sent and not answered yet.
pub(super) struct Vouching {
    id: u64,
    pub(super) peer: PeerId,
    since: Instant,
    /// What was asked, for the error's message.
    len: u64,
    regions: Vec<(u64, u64)>,
    reply: Reply<()>,
}

impl Vouching {
    /// Answers the `remote_region` waiting for it with `e`.
    pub(super) fn fail(self, e: Error) {
        let _ = self.reply.send(Err(e));
    }
}

impl<D: Domain> Core<D> {
    /// `Submission::Vouch`: asks `peer` about a descriptor; the reply waits for its answer.
    pub(super) fn vouch(
        &mut self,
        peer: PeerId,
        incarnation: u64,
        len: u64,
        regions: Vec<(u64, u64)>,
        reply: Reply<()>,
    ) {
        match self.peers.get(peer.0 as usize) {
            None => {
                let _ = reply.send(Err(Error::UnknownPeer { peer: peer.0 }));
                return;
            }
            Some(p) => {
                if let Some(message) = &p.failed {
                    let _ =
                        reply.send(Err(Error::PeerUnreachable { peer: peer.0, message: message.clone() }));
                    return;
                }
            }
        }
        let id = self.next_vouch;
        self.next_vouch += 1;
        let sender = self.shared.address.to_bytes();
        let msg = Vouch { id, incarnation, len, regions: regions.clone(), sender }.to_bytes();
        self.vouching.push(Vouching { id, peer, since: Instant::now(), len, regions, reply });
        self.handle(Submission::Send { peer, data: msg.into(), notify: Notify::None });
    }

    /// A peer asks whether a descriptor names a live region of ours: answer from the table
    /// of live registrations. Not once this engine is closing (its regions are going).
    pub(super) fn on_vouch(&mut self, msg: &[u8]) {
        if self.closing {
            return;
        }
        let q = match Vouch::from_bytes(msg) {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!(error = %e, "dropped a malformed vouch message");
                return;
            }
        };
        let peer = match EngineAddress::from_bytes(&q.sender) {
            Ok(a) if a.transport == self.shared.transport => match self.peer_of_sender(a) {
                Ok(peer) => peer,
                Err(e) => {
                    tracing::debug!(error = %e, "the sender of a vouch message could not be added");
                    return;
                }
            },
            Ok(a) => {
                tracing::warn!(transport = %a.transport, "dropped a vouch message of another transport");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "dropped a vouch message with a malformed sender");
                return;
            }
        };
        let nics = self.live.iter().map(|m| m.values().map(|l| (l.reg.remote_base, l.reg.remote_key, l.len)));
        let verdict = q.judge(self.shared.address.incarnation, nics);
        if verdict != Verdict::Known {
            tracing::debug!(peer = peer.0, ?verdict, "refused to vouch for a descriptor");
        }
        let data = Vouched { id: q.id, verdict }.to_bytes();
        self.handle(Submission::Send { peer, data: data.into(), notify: Notify::None });
    }

    /// An owner answered: the `remote_region` waiting for it learns its fate. An answer
    /// nobody waits for (or from another peer than was asked) is dropped.
    pub(super) fn on_vouched(&mut self, msg: &[u8], from: Option<PeerId>) {
        let a = match Vouched::from_bytes(msg) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "dropped a malformed vouched message");
                return;
            }
        };
        let Some(i) = self.vouching.iter().position(|v| v.id == a.id && from.is_none_or(|f| f == v.peer))
        else {
            tracing::debug!(id = a.id, "an answer to a vouch question nobody waits for");
            return;
        };
        let v = self.vouching.swap_remove(i);
        let r = match a.verdict.refusal() {
            None => Ok(()),
            Some(why) => Err(Error::RemoteAccess {
                peer: v.peer.0,
                op: "descriptor",
                message: format!(
                    "{why} (asked about {} bytes at {})",
                    v.len,
                    v.regions
                        .iter()
                        .map(|(base, key)| format!("base {base:#x} key {key:#x}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        };
        let _ = v.reply.send(r);
    }

    /// Fails the questions whose peer is down or removed, and those unanswered past their
    /// bound (marking the peer down). Run every pass while one waits.
    pub(super) fn check_vouches(&mut self) {
        let now = Instant::now();
        let limit = self.cfg.op_timeout.unwrap_or(VOUCH_BACKSTOP);
        let mut i = 0;
        while i < self.vouching.len() {
            let v = &self.vouching[i];
            let peer = v.peer;
            let failed = self.peers.get(peer.0 as usize).and_then(|p| p.failed.clone());
            let message = match failed {
                Some(m) => m,
                None if now.duration_since(v.since) >= limit => {
                    let m = format!("no answer to a vouch question within {limit:?}; peer marked failed");
                    tracing::warn!(peer = peer.0, %m, "descriptor check timed out");
                    self.mark_down(peer, &m);
                    m
                }
                None => {
                    i += 1;
                    continue;
                }
            };
            let v = self.vouching.swap_remove(i);
            let _ = v.reply.send(Err(Error::PeerUnreachable { peer: peer.0, message }));
        }
    }
}
