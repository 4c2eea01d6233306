//! The soak's bad remote accesses: operations through the descriptors of regions their
//! owner has freed (stale) and through forged descriptors of live regions. Each must end
//! with the error the engine promises for it, never reach a region the leader checks, and
//! never make a live peer `Down` (`Error::Stale`, `Error::RemoteAccess`,
//! `Error::ConnectionLost`; `integration-tests/tests/isolation.rs` makes the same accesses
//! once each).
//!
//! **Stale**: every peer process keeps allocating a short-lived extra region
//! (`--extra-size`, every `--extra-every-ms`), publishes its descriptor under `<name>/x`
//! (generation first), and frees it once the leader puts that generation under
//! `<name>/xfree`. The leader ([`cycle_extras`](super::extras::cycle_extras)) resolves each descriptor while the region
//! lives, hands it to the traffic tasks ([`Target::extras`]), and after a random while asks
//! for the free. An operation through such a descriptor is classified by what the task knew
//! when it created it ([`Phase`]):
//!
//! * `Live`: the free was not requested yet (the leader waits until no such operation is in
//!   flight before asking): it must succeed.
//! * `Racing`: the free was requested but the descriptor is not revoked here yet: the owner
//!   may not have freed it yet (`Ok`: the bytes land in memory the owner no longer reads),
//!   may have (`RemoteAccess` on shm, `ConnectionLost` on tcp), or its revocation may
//!   arrive before the operation is posted (`Stale`).
//! * `Revoked`: `is_revoked()` was true: it must fail with `Stale` (nothing is posted).
//!
//! **Forged**: [`forge`] flips the key bits of a live region's descriptor. On tcp and verbs
//! an operation through it goes to a range of the real region that the same task wrote
//! (awaited, `Ok`) this round, with other source bytes: it must fail (`RemoteAccess`,
//! `ConnectionLost`), and if it landed anyway, the ledger's exact byte check of that write
//! fails. On shm the owner refuses to vouch for it: `remote_region` fails with
//! `RemoteAccess` (counted once per incarnation as a forged access), and nothing can be
//! posted through it.
//!
//! shm: no write_imm through a stale descriptor that may already be freed (libfabric 1.17's
//! shm target refuses it without answering the writer, which then waits for `op_timeout`;
//! the revocation is what protects it): only through live (`Live`) and revoked ones.

use std::sync::Mutex;
use std::time::Duration;

use fabric_async::faults::{INJECTED_ERRNO, INJECTED_MESSAGE};
use fabric_async::{Error, RegionDescriptor, RemoteRegion};

use crate::pair::Res;

/// The immediate of every write_imm through a stale or forged descriptor: the peer counts
/// it apart from [`super::peer::IMM`], and nobody checks that count.
pub const IMM_BAD: u32 = 78;

/// How many of a peer's latest extra regions the traffic tasks pick from.
pub const KEEP: usize = 6;

/// When, relative to the free of its region, an operation through a stale descriptor was
/// created (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Live = 0,
    Racing = 1,
    Revoked = 2,
}

pub const PHASES: [&str; 3] = ["before the free", "racing the free", "revoked"];

/// How a bad access ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadOutcome {
    Ok = 0,
    Stale = 1,
    RemoteAccess = 2,
    ConnectionLost = 3,
    /// The injected failure (`--faults`).
    Injected = 4,
    /// Any other error, or no answer within the bound: a violation where the peer lives.
    Other = 5,
}

pub const BAD_OUTCOMES: usize = 6;
pub const OUTCOMES: [&str; BAD_OUTCOMES] =
    ["ok", "Stale", "RemoteAccess", "ConnectionLost", "injected", "other"];

impl BadOutcome {
    pub fn of(r: &fabric_async::Result<()>) -> BadOutcome {
        match r {
            Ok(()) => BadOutcome::Ok,
            Err(Error::Stale { .. }) => BadOutcome::Stale,
            Err(Error::RemoteAccess { .. }) => BadOutcome::RemoteAccess,
            Err(Error::ConnectionLost { .. }) => BadOutcome::ConnectionLost,
            Err(Error::Completion { errno, message, .. })
                if *errno == INJECTED_ERRNO && message.starts_with(INJECTED_MESSAGE) =>
            {
                BadOutcome::Injected
            }
            Err(_) => BadOutcome::Other,
        }
    }
}

/// Whether the engine counted the failure `r` in the peer's error count: everything that
/// was handed to it (not `Stale`, `OutOfBounds` and the like, refused before).
pub fn engine_counted(r: &fabric_async::Result<()>) -> bool {
    !matches!(
        r,
        Ok(()) | Err(Error::Stale { .. } | Error::OutOfBounds { .. } | Error::Config(_) | Error::Shutdown)
    )
}

/// One short-lived region of a peer, as the leader holds it.
pub struct Extra {
    pub remote: RemoteRegion,
    /// (free requested, operations of phase `Live` in flight).
    state: Mutex<(bool, u64)>,
}

impl Extra {
    /// A freshly resolved extra region, not yet asked to be freed.
    pub fn new(remote: RemoteRegion) -> Extra {
        Extra { remote, state: Mutex::new((false, 0)) }
    }

    /// The phase of an operation about to be created through it; a `Live` one must be
    /// ended with [`Extra::live_done`].
    pub fn phase(&self) -> Phase {
        if self.remote.is_revoked() {
            return Phase::Revoked;
        }
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 {
            Phase::Racing
        } else {
            s.1 += 1;
            Phase::Live
        }
    }

    pub fn live_done(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.1 -= 1;
    }

    /// Marks the free as requested once no `Live` operation is in flight.
    pub async fn request_free(&self) {
        loop {
            {
                let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if s.1 == 0 {
                    s.0 = true;
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// A forged copy of `desc` (see the module docs): key bits flipped.
pub fn forge(desc: &RegionDescriptor) -> Res<Vec<u8>> {
    let mut forged = RegionDescriptor::from_bytes(&desc.to_bytes())?;
    for d in &mut forged.domains {
        d.key ^= 0x5a5a_0000_1234;
    }
    Ok(forged.to_bytes())
}

/// The generation in a value published under `<name>/x` or `<name>/xfree`, and the rest.
pub fn split_gen(v: &[u8]) -> Option<(u64, &[u8])> {
    let (g, rest) = v.split_at_checked(8)?;
    Some((u64::from_le_bytes(g.try_into().ok()?), rest))
}
