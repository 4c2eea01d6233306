//! The control messages that keep a peer's descriptors honest: [`Revoke`] (an owner freed
//! regions: descriptors of them are stale) and its [`RevokeAck`] (shm: the peer's answer,
//! once what it had posted before is done), [`Hello`] (a new peer's engine address, so
//! that an owner knows every engine that may hold its descriptors and can tell it), and
//! [`Vouch`] / [`Vouched`] (on transports whose target refuses a bad key without telling
//! the writer, shm: "is this a live region of yours?", asked once per descriptor before it
//! is used, and the owner's answer).
//!
//! ```text
//!  writer                                        owner
//!   │ remote_region(descriptor): new peer          │
//!   │──────── Hello { writer's address } ─────────►│ add_peer(writer)
//!   │ (shm only:)                                  │
//!   │── Vouch { id, incarnation, len, [(base, key)] } ─►│ its live registrations
//!   │◄──────────── Vouched { id, verdict } ────────│ cover that range?
//!   │ RemoteRegion (or Error::RemoteAccess)        │
//!   │                                              │ ... drop(region): deregistered
//!   │◄── Revoke { incarnation, [(base, key)] } ────│ to every peer it knows
//!   │ RemoteRegion of it: revoked;                 │ (shm: still registered)
//!   │ write/read through it: Error::Stale,         │
//!   │ nothing posted                               │
//!   │ (shm:) once what was posted to the owner     │
//!   │ before the Revoke is done:                   │
//!   │── RevokeAck { incarnation, [(base, key)] } ─►│ every peer acked (or down,
//!   │                                              │ or 1 s): deregistered, freed
//! ```
//!
//! A region is named as its descriptor names it on NIC 0: the owner's incarnation, the
//! region's remote base and its remote key (a [`Vouch`] names every NIC's). Decoding treats
//! its input as hostile, as the rest of [`control`](super::control): never panics, bounds
//! every length.

use super::control::{decode, MsgKind, MAX_SENDER_ADDRESS};
use super::descriptor::MAX_DOMAINS;
use crate::error::Error;

const REVOKE_WHAT: &str = "revoke message";
const REVOKE_ACK_WHAT: &str = "revoke acknowledgement";
const HELLO_WHAT: &str = "hello message";
const VOUCH_WHAT: &str = "vouch message";
const VOUCHED_WHAT: &str = "vouched message";

/// The most regions one [`Revoke`] names (a message of 2 KiB and a bit).
pub const MAX_REVOKED: usize = 128;

/// A region as its descriptor names it on NIC 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionKey {
    /// The owner engine's incarnation (0: unknown, an older build).
    pub incarnation: u64,
    /// The region's remote base on NIC 0.
    pub base: u64,
    /// The region's remote key on NIC 0.
    pub key: u64,
}

/// "These regions of mine are freed": every descriptor of them is stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revoke {
    /// The sender's incarnation.
    pub incarnation: u64,
    /// (base, key) on NIC 0 of each freed region; at most [`MAX_REVOKED`].
    pub regions: Vec<(u64, u64)>,
}

/// "I am a peer of yours, at this engine address."
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The sender's engine address (`EngineAddress` bytes).
    pub address: Vec<u8>,
}

/// "Your [`Revoke`] arrived, and every operation I had posted to you before it is done":
/// the regions it names, as it named them. On shm the owner keeps those regions registered
/// until every peer it revoked them to has acknowledged (or is down, or a bound passed), so
/// that a write with immediate that raced the revocation still finds its key
/// (`docs/faults.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevokeAck(pub Revoke);

impl RevokeAck {
    /// The message, kind header included (as [`Revoke::to_bytes`], another kind).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.encode(MsgKind::RevokeAck)
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<RevokeAck, Error> {
        Revoke::decode(REVOKE_ACK_WHAT, bytes, MsgKind::RevokeAck).map(RevokeAck)
    }
}

impl Revoke {
    /// The message, kind header included. Regions past [`MAX_REVOKED`] are not encoded:
    /// split longer lists with `chunks(MAX_REVOKED)`.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode(MsgKind::Revoke)
    }

    fn encode(&self, kind: MsgKind) -> Vec<u8> {
        let n = self.regions.len().min(MAX_REVOKED);
        let mut out = Vec::with_capacity(11 + 16 * n);
        out.push(kind as u8);
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for (base, key) in &self.regions[..n] {
            out.extend_from_slice(&base.to_le_bytes());
            out.extend_from_slice(&key.to_le_bytes());
        }
        out
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Revoke, Error> {
        Revoke::decode(REVOKE_WHAT, bytes, MsgKind::Revoke)
    }

    fn decode(what: &'static str, bytes: &[u8], kind: MsgKind) -> Result<Revoke, Error> {
        decode(what, bytes, kind, |r| {
            let incarnation = r.u64("incarnation")?;
            let n = usize::from(r.u16("region count")?);
            if n > MAX_REVOKED {
                return Err(format!("region count {n} exceeds the limit of {MAX_REVOKED}"));
            }
            let mut regions = Vec::with_capacity(n);
            for _ in 0..n {
                regions.push((r.u64("region base")?, r.u64("region key")?));
            }
            Ok(Revoke { incarnation, regions })
        })
    }

    /// The regions as [`RegionKey`]s.
    pub fn keys(&self) -> impl Iterator<Item = RegionKey> + '_ {
        self.regions.iter().map(|&(base, key)| RegionKey { incarnation: self.incarnation, base, key })
    }
}

impl Hello {
    /// The message, kind header included.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + self.address.len());
        out.push(MsgKind::Hello as u8);
        out.extend_from_slice(&(self.address.len().min(u32::MAX as usize) as u32).to_le_bytes());
        out.extend_from_slice(&self.address);
        out
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Hello, Error> {
        decode(HELLO_WHAT, bytes, MsgKind::Hello, |r| {
            let n = r.u32("address length")?;
            if u64::from(n) > MAX_SENDER_ADDRESS as u64 {
                return Err(format!("address of {n} bytes exceeds {MAX_SENDER_ADDRESS}"));
            }
            Ok(Hello { address: r.take(n as usize, "address")?.to_vec() })
        })
    }
}

/// "Does this name a live region of yours?": what a writer asks a descriptor's owner before
/// it first uses the descriptor, on transports whose target refuses a bad key without
/// telling the writer (libfabric 1.17's shm; `docs/faults.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vouch {
    /// The asker's number for the question, echoed in the [`Vouched`].
    pub id: u64,
    /// The owner's incarnation, as the descriptor says.
    pub incarnation: u64,
    /// The descriptor's length: the range `base..base + len` of every NIC.
    pub len: u64,
    /// (base, key) per NIC, in NIC order; at most [`MAX_DOMAINS`].
    pub regions: Vec<(u64, u64)>,
    /// The asker's engine address (`EngineAddress` bytes), so that the owner can answer a
    /// question that arrives before it knows the asker as a peer.
    pub sender: Vec<u8>,
}

/// The owner's answer to a [`Vouch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Verdict {
    /// Every NIC's (base, key) names a live registration of the owner that covers
    /// `base..base + len`.
    Known = 0,
    /// Some NIC's key is not the key of any live registration of the owner there (never
    /// given out, or its region was freed).
    UnknownKey = 1,
    /// The key is live, but the range leaves its region (a base or length that was altered).
    OutOfRange = 2,
    /// The descriptor names another incarnation of the owner.
    OtherIncarnation = 3,
    /// The descriptor names another number of NICs than the owner has.
    NicCount = 4,
}

impl Verdict {
    fn of(b: u8) -> Option<Verdict> {
        Some(match b {
            0 => Verdict::Known,
            1 => Verdict::UnknownKey,
            2 => Verdict::OutOfRange,
            3 => Verdict::OtherIncarnation,
            4 => Verdict::NicCount,
            _ => return None,
        })
    }

    /// Why the owner refused, in words (`None` for [`Verdict::Known`]).
    pub fn refusal(self) -> Option<&'static str> {
        match self {
            Verdict::Known => None,
            Verdict::UnknownKey => Some(
                "it does not know this key: no live region of its own has it (never given out, or freed)",
            ),
            Verdict::OutOfRange => {
                Some("the key is of a live region of its own, but the descriptor's range leaves that region")
            }
            Verdict::OtherIncarnation => Some("the descriptor names another incarnation of it"),
            Verdict::NicCount => Some("the descriptor names another number of NICs than it has"),
        }
    }
}

/// The answer to the [`Vouch`] numbered `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vouched {
    /// The question's number.
    pub id: u64,
    /// The owner's answer.
    pub verdict: Verdict,
}

/// A registration as its owner knows it, on one NIC: (remote base, remote key, length).
pub type LiveRegion = (u64, u64, u64);

impl Vouch {
    /// The message, kind header included. Regions past [`MAX_DOMAINS`] are not encoded.
    pub fn to_bytes(&self) -> Vec<u8> {
        let n = self.regions.len().min(MAX_DOMAINS);
        let mut out = Vec::with_capacity(35 + 16 * n + self.sender.len());
        out.push(MsgKind::Vouch as u8);
        for v in [self.id, self.incarnation, self.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for (base, key) in &self.regions[..n] {
            out.extend_from_slice(&base.to_le_bytes());
            out.extend_from_slice(&key.to_le_bytes());
        }
        out.extend_from_slice(&(self.sender.len().min(u32::MAX as usize) as u32).to_le_bytes());
        out.extend_from_slice(&self.sender);
        out
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Vouch, Error> {
        decode(VOUCH_WHAT, bytes, MsgKind::Vouch, |r| {
            let id = r.u64("id")?;
            let incarnation = r.u64("incarnation")?;
            let len = r.u64("length")?;
            let n = usize::from(r.u16("region count")?);
            if n > MAX_DOMAINS {
                return Err(format!("region count {n} exceeds the limit of {MAX_DOMAINS}"));
            }
            let mut regions = Vec::with_capacity(n);
            for _ in 0..n {
                regions.push((r.u64("region base")?, r.u64("region key")?));
            }
            let alen = r.u32("sender address length")?;
            if u64::from(alen) > MAX_SENDER_ADDRESS as u64 {
                return Err(format!("sender address of {alen} bytes exceeds {MAX_SENDER_ADDRESS}"));
            }
            let sender = r.take(alen as usize, "sender address")?.to_vec();
            Ok(Vouch { id, incarnation, len, regions, sender })
        })
    }

    /// The owner's answer: `incarnation` is the owner's own, `nics` its live registrations,
    /// NIC by NIC. A descriptor of incarnation 0 (an older build's) is not held to the
    /// owner's.
    pub fn judge<I>(&self, incarnation: u64, nics: impl ExactSizeIterator<Item = I>) -> Verdict
    where
        I: IntoIterator<Item = LiveRegion>,
    {
        if self.incarnation != 0 && self.incarnation != incarnation {
            return Verdict::OtherIncarnation;
        }
        if nics.len() != self.regions.len() {
            return Verdict::NicCount;
        }
        let mut verdict = Verdict::Known;
        for (live, &(base, key)) in nics.zip(&self.regions) {
            let mut key_seen = false;
            let covered = live.into_iter().any(|(b, k, len)| {
                key_seen |= k == key;
                k == key
                    && base >= b
                    && base.checked_add(self.len).zip(b.checked_add(len)).is_some_and(|(end, lim)| end <= lim)
            });
            if !covered {
                let v = if key_seen { Verdict::OutOfRange } else { Verdict::UnknownKey };
                if verdict == Verdict::Known || v == Verdict::UnknownKey {
                    verdict = v;
                }
            }
        }
        verdict
    }
}

impl Vouched {
    /// The message, kind header included.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(10);
        out.push(MsgKind::Vouched as u8);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.push(self.verdict as u8);
        out
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Vouched, Error> {
        decode(VOUCHED_WHAT, bytes, MsgKind::Vouched, |r| {
            let id = r.u64("id")?;
            let v = r.u8("verdict")?;
            let verdict = Verdict::of(v).ok_or_else(|| format!("unknown verdict {v}"))?;
            Ok(Vouched { id, verdict })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revoke() -> Revoke {
        Revoke { incarnation: 0x1234_5678_9abc, regions: vec![(0x7f00_0000_0000, 7), (4096, u64::MAX)] }
    }

    #[test]
    fn round_trips_and_limits() {
        let r = revoke();
        assert_eq!(Revoke::from_bytes(&r.to_bytes()).unwrap(), r);
        let h = Hello { address: vec![3; 40] };
        assert_eq!(Hello::from_bytes(&h.to_bytes()).unwrap(), h);
        assert_eq!(MsgKind::of(&r.to_bytes()), Some(MsgKind::Revoke));
        assert_eq!(MsgKind::of(&h.to_bytes()), Some(MsgKind::Hello));
        // Neither takes the other.
        assert!(Revoke::from_bytes(&h.to_bytes()).is_err() && Hello::from_bytes(&r.to_bytes()).is_err());
        // A longer list is cut at the limit, and a count over it is refused.
        let long = Revoke { incarnation: 1, regions: (0..300).map(|i| (i, i)).collect() };
        assert_eq!(Revoke::from_bytes(&long.to_bytes()).unwrap().regions.len(), MAX_REVOKED);
        let mut b = Revoke { incarnation: 1, regions: vec![] }.to_bytes();
        b[9..11].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(Revoke::from_bytes(&b).unwrap_err().to_string().contains("exceeds"));
        let mut b = Hello { address: vec![] }.to_bytes();
        b[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Hello::from_bytes(&b).unwrap_err().to_string().contains("exceeds"));
        let a = RevokeAck(r.clone());
        assert_eq!(RevokeAck::from_bytes(&a.to_bytes()).unwrap(), a);
        assert_eq!(MsgKind::of(&a.to_bytes()), Some(MsgKind::RevokeAck));
        assert!(Revoke::from_bytes(&a.to_bytes()).is_err() && RevokeAck::from_bytes(&r.to_bytes()).is_err());
        let keys: Vec<RegionKey> = r.keys().collect();
        assert_eq!(keys[1], RegionKey { incarnation: r.incarnation, base: 4096, key: u64::MAX });
    }

    fn vouch() -> Vouch {
        Vouch {
            id: 9,
            incarnation: 0x1234,
            len: 4096,
            regions: vec![(0x7f00_0000_0000, 7), (0, u64::MAX)],
            sender: b"fi_shm://1:2:3".to_vec(),
        }
    }

    #[test]
    fn vouch_round_trips_and_limits() {
        let v = vouch();
        assert_eq!(Vouch::from_bytes(&v.to_bytes()).unwrap(), v);
        assert_eq!(MsgKind::of(&v.to_bytes()), Some(MsgKind::Vouch));
        for verdict in [
            Verdict::Known,
            Verdict::UnknownKey,
            Verdict::OutOfRange,
            Verdict::OtherIncarnation,
            Verdict::NicCount,
        ] {
            let a = Vouched { id: u64::MAX, verdict };
            assert_eq!(Vouched::from_bytes(&a.to_bytes()).unwrap(), a);
            assert_eq!(verdict.refusal().is_none(), verdict == Verdict::Known);
        }
        let mut b = Vouched { id: 1, verdict: Verdict::Known }.to_bytes();
        b[9] = 5;
        assert!(Vouched::from_bytes(&b).unwrap_err().to_string().contains("unknown verdict 5"));
        // Neither takes the other, nor a hello.
        assert!(Vouched::from_bytes(&v.to_bytes()).is_err() && Vouch::from_bytes(&b).is_err());
        assert!(Vouch::from_bytes(&Hello { address: vec![] }.to_bytes()).is_err());
        let mut b = Vouch { regions: vec![], sender: vec![], ..vouch() }.to_bytes();
        b[25..27].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(Vouch::from_bytes(&b).unwrap_err().to_string().contains("exceeds"));
        let mut b = Vouch { regions: vec![], sender: vec![], ..vouch() }.to_bytes();
        let n = b.len();
        b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Vouch::from_bytes(&b).unwrap_err().to_string().contains("exceeds"));
    }

    #[test]
    fn the_owner_vouches_only_for_ranges_of_its_live_keys() {
        let q = |base: u64, key: u64, len: u64| Vouch {
            id: 1,
            incarnation: 5,
            len,
            regions: vec![(base, key)],
            sender: vec![],
        };
        let live = [(0x1000, 7, 0x2000), (0x8000, 8, 0x1000)];
        let judge = |v: &Vouch| v.judge(5, std::iter::once(live));
        assert_eq!(judge(&q(0x1000, 7, 0x2000)), Verdict::Known);
        assert_eq!(judge(&q(0x1800, 7, 0x800)), Verdict::Known, "a range inside the region");
        assert_eq!(judge(&q(0x1000, 7, 0x2001)), Verdict::OutOfRange, "a longer length");
        assert_eq!(judge(&q(0x0800, 7, 0x100)), Verdict::OutOfRange, "a base before it");
        assert_eq!(judge(&q(0x8000, 7, 0x100)), Verdict::OutOfRange, "another region's range");
        assert_eq!(judge(&q(u64::MAX, 7, 2)), Verdict::OutOfRange, "a wrapping range");
        assert_eq!(judge(&q(0x1000, 9, 0x10)), Verdict::UnknownKey);
        assert_eq!(q(0x1000, 7, 1).judge(6, std::iter::once(live)), Verdict::OtherIncarnation);
        assert_eq!(
            Vouch { incarnation: 0, ..q(0x1000, 7, 1) }.judge(6, std::iter::once(live)),
            Verdict::Known,
            "an older build's descriptor has no incarnation to compare"
        );
        assert_eq!(q(0x1000, 7, 1).judge(5, [live, live].into_iter()), Verdict::NicCount);
        // Every NIC must vouch; an unknown key outweighs a range.
        let two = Vouch { regions: vec![(0x1000, 7), (0x8000, 9)], ..q(0, 0, 0x10) };
        assert_eq!(two.judge(5, [live, live].into_iter()), Verdict::UnknownKey);
        let two = Vouch { regions: vec![(0x1000, 7), (0x8000, 8)], ..q(0, 0, 0x10) };
        assert_eq!(two.judge(5, [live, live].into_iter()), Verdict::Known);
        assert_eq!(q(0x1000, 7, 1).judge(5, std::iter::once([])), Verdict::UnknownKey);
    }

    /// Truncations, extensions, random bytes and mutations: never a panic, and whatever is
    /// accepted re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics() {
        let seeds = [
            revoke().to_bytes(),
            Hello { address: b"fi_shm://1:2:3".to_vec() }.to_bytes(),
            vouch().to_bytes(),
            Vouched { id: 3, verdict: Verdict::OutOfRange }.to_bytes(),
            RevokeAck(revoke()).to_bytes(),
        ];
        for b in &seeds {
            for n in 0..b.len() {
                assert!(Revoke::from_bytes(&b[..n]).is_err() && Hello::from_bytes(&b[..n]).is_err());
                assert!(Vouch::from_bytes(&b[..n]).is_err() && Vouched::from_bytes(&b[..n]).is_err());
                assert!(RevokeAck::from_bytes(&b[..n]).is_err());
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(Revoke::from_bytes(&longer).is_err() && Hello::from_bytes(&longer).is_err());
            assert!(Vouch::from_bytes(&longer).is_err() && Vouched::from_bytes(&longer).is_err());
        }
        let mut rng = crate::pure::test_rng::Rng(0x5eed_1234_abcd);
        let mut b = Vec::new();
        for i in 0..100_000 {
            if i % 3 == 0 {
                b = (0..rng.below(64)).map(|_| rng.next() as u8).collect();
            } else {
                rng.mutate(&seeds[i % seeds.len()], &mut b);
            }
            if let Ok(r) = Revoke::from_bytes(&b) {
                assert_eq!(r.to_bytes(), b);
            }
            if let Ok(h) = Hello::from_bytes(&b) {
                assert_eq!(h.to_bytes(), b);
            }
            if let Ok(v) = Vouch::from_bytes(&b) {
                assert_eq!(v.to_bytes(), b);
            }
            if let Ok(v) = Vouched::from_bytes(&b) {
                assert_eq!(v.to_bytes(), b);
            }
            if let Ok(a) = RevokeAck::from_bytes(&b) {
                assert_eq!(a.to_bytes(), b);
            }
        }
    }
}
