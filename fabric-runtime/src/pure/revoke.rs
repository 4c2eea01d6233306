//! The control messages that keep a peer's descriptors honest: [`Revoke`] (an owner freed
//! regions: descriptors of them are stale) and [`Hello`] (a new peer's engine address, so
//! that an owner knows every engine that may hold its descriptors and can tell it).
//!
//! ```text
//!  writer                                        owner
//!   │ remote_region(descriptor): new peer          │
//!   │──────── Hello { writer's address } ─────────►│ add_peer(writer)
//!   │                                              │ ... drop(region): deregistered
//!   │◄── Revoke { incarnation, [(base, key)] } ────│ to every peer it knows
//!   │ RemoteRegion of it: revoked;                 │
//!   │ write/read through it: Error::Stale,         │
//!   │ nothing posted                               │
//! ```
//!
//! A region is named as its descriptor names it on NIC 0: the owner's incarnation, the
//! region's remote base and its remote key. Decoding treats its input as hostile, as the
//! rest of [`control`](super::control): never panics, bounds every length.

use super::control::{decode, MsgKind, MAX_SENDER_ADDRESS};
use crate::error::Error;

const REVOKE_WHAT: &str = "revoke message";
const HELLO_WHAT: &str = "hello message";

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

impl Revoke {
    /// The message, kind header included. Regions past [`MAX_REVOKED`] are not encoded:
    /// split longer lists with `chunks(MAX_REVOKED)`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let n = self.regions.len().min(MAX_REVOKED);
        let mut out = Vec::with_capacity(11 + 16 * n);
        out.push(MsgKind::Revoke as u8);
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
        decode(REVOKE_WHAT, bytes, MsgKind::Revoke, |r| {
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
        let keys: Vec<RegionKey> = r.keys().collect();
        assert_eq!(keys[1], RegionKey { incarnation: r.incarnation, base: 4096, key: u64::MAX });
    }

    /// Truncations, extensions, random bytes and mutations: never a panic, and whatever is
    /// accepted re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics() {
        let seeds = [revoke().to_bytes(), Hello { address: b"fi_shm://1:2:3".to_vec() }.to_bytes()];
        for b in &seeds {
            for n in 0..b.len() {
                assert!(Revoke::from_bytes(&b[..n]).is_err() && Hello::from_bytes(&b[..n]).is_err());
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(Revoke::from_bytes(&longer).is_err() && Hello::from_bytes(&longer).is_err());
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
        }
    }
}
