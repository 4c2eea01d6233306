//! The byte formats of the verbs backend: its address and its connection handshake.
//!
//! * A [`PeerAddr`] is what the verbs backend's `Domain::address` returns and what
//!   `Domain::add_peer` reads: how to reach the peer's handshake UD QP.
//! * A [`Handshake`] (REQ or REP) travels in one UD datagram between two verbs domains and
//!   carries the sender's address and its two RC QPs (QPN + initial PSN each).
//!
//! Both are plain bytes from another machine: decoding never panics, and anything that is
//! not a valid encoding is [`Error::Malformed`] (`what` = `"verbs address"` or
//! `"verbs handshake"`, or `"verbs address"` for a bad address inside a handshake) with a
//! reason. The backend that sends and receives them, and the connection protocol, are in
//! `provider/verbs/` (see its module docs).
//!
//! # Wire format (version [`ADDR_VERSION`])
//!
//! All integers are big-endian.
//!
//! ```text
//! PeerAddr (ADDR_LEN = 36 bytes)         Handshake (HANDSHAKE_LEN = 64 bytes)
//! +------------------------------+       +------------------------------+
//! |  0 magic "FVRB"     4 bytes  |       |  0 magic "FVHS"     4 bytes  |
//! |  4 version 2        u8       |       |  4 version 2        u8       |
//! |  5 active MTU       u8       |       |  5 kind 1=REQ 2=REP u8       |
//! |    (ibv_mtu, 1..=5)          |       |  6 (unused)         2 bytes  |
//! |  6 LID              u16      |       |  8 sender's PeerAddr 36 bytes|
//! |  8 GID (not all-zero) 16 b   |       | 44 data QPN         u32      |
//! | 24 UD QPN (24-bit, != 0) u32 |       | 48 data PSN         u32      |
//! | 28 UD Q_Key         u32      |       | 52 echo QPN (REP)   u32      |
//! | 32 max message size u32      |       | 56 message QPN      u32      |
//! +------------------------------+       | 60 message PSN      u32      |
//!                                        | 64 epoch            u32      |
//!                                        +------------------------------+
//! ```
//!
//! An address must be exactly [`ADDR_LEN`] bytes; a handshake at least [`HANDSHAKE_LEN`]
//! (bytes after it are ignored, as are bytes 6..8).

use crate::error::Error;

const ADDR_MAGIC: [u8; 4] = *b"FVRB";
/// Version of the address and of the handshake it implies. 2: two RC QPs per peer (data +
/// message), both QPNs and PSNs in REQ/REP. 3: the handshake carries the connection's epoch
/// (a connection torn down by a bad remote access is re-established with the next one). A
/// peer of another version is refused by
/// [`PeerAddr::decode`] (so the backend's `add_peer` fails at once instead of hanging).
pub const ADDR_VERSION: u8 = 3;
/// Bytes of an encoded [`PeerAddr`].
pub const ADDR_LEN: usize = 36;

/// What a peer needs to reach a verbs domain: the bytes of its
/// [`Domain::address`](crate::provider::Domain::address).
///
/// Layout (big-endian integers): `"FVRB"`, version, active MTU (`ibv_mtu`), LID (2), GID (16),
/// UD QPN (4), UD Q_Key (4), max message size (4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    pub mtu: u8,
    pub lid: u16,
    pub gid: [u8; 16],
    pub ud_qpn: u32,
    pub qkey: u32,
    pub max_msg_size: u32,
}

impl PeerAddr {
    /// The [`ADDR_LEN`] bytes of this address.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(ADDR_LEN);
        b.extend_from_slice(&ADDR_MAGIC);
        b.push(ADDR_VERSION);
        b.push(self.mtu);
        b.extend_from_slice(&self.lid.to_be_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.ud_qpn.to_be_bytes());
        b.extend_from_slice(&self.qkey.to_be_bytes());
        b.extend_from_slice(&self.max_msg_size.to_be_bytes());
        b
    }

    /// Decodes bytes made by [`encode`](Self::encode). Anything else (another length, magic
    /// or version, an MTU code that is not an `ibv_mtu`, an all-zero GID, a UD QPN that is 0
    /// or wider than 24 bits) is [`Error::Malformed`] with `what = "verbs address"`. Never
    /// panics.
    pub fn decode(b: &[u8]) -> Result<PeerAddr, Error> {
        let malformed = |reason: String| Error::Malformed { what: "verbs address", reason };
        if b.len() != ADDR_LEN {
            return Err(malformed(format!("{} bytes, verbs addresses are {ADDR_LEN}", b.len())));
        }
        if b[..4] != ADDR_MAGIC {
            return Err(malformed(format!("bad magic {:02x?}", &b[..4])));
        }
        if b[4] != ADDR_VERSION {
            return Err(malformed(format!("version {} (this build speaks {ADDR_VERSION})", b[4])));
        }
        let mtu = b[5];
        if !(1..=5).contains(&mtu) {
            return Err(malformed(format!("MTU code {mtu} is not an ibv_mtu (1..=5)")));
        }
        let be32 = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        if gid == [0; 16] {
            return Err(malformed("all-zero GID".into()));
        }
        let ud_qpn = be32(24);
        if ud_qpn == 0 || ud_qpn > 0x00ff_ffff {
            return Err(malformed(format!("UD QPN {ud_qpn:#x} is not a 24-bit QP number")));
        }
        Ok(PeerAddr {
            mtu,
            lid: u16::from_be_bytes([b[6], b[7]]),
            gid,
            ud_qpn,
            qkey: be32(28),
            max_msg_size: be32(32),
        })
    }
}

const HS_MAGIC: [u8; 4] = *b"FVHS";
/// Bytes of an encoded [`Handshake`].
pub const HANDSHAKE_LEN: usize = 4 + 4 + ADDR_LEN + 24;

/// Which handshake message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HsKind {
    /// A connection request: "connect your QPs to these".
    Req = 1,
    /// The answer to a REQ: "mine are these, connected to yours".
    Rep = 2,
}

/// One handshake message, sent on the UD QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    pub kind: HsKind,
    /// The sender's address (so the receiver can answer and identify it).
    pub from: PeerAddr,
    /// The sender's data RC QP number and initial packet sequence number.
    pub qpn: u32,
    pub psn: u32,
    /// In a REP: the data QPN of the REQ being answered.
    pub echo_qpn: u32,
    /// The sender's message RC QP number and initial packet sequence number.
    pub msg_qpn: u32,
    pub msg_psn: u32,
    /// The connection's epoch: 0 for the first connection between two domains, one more
    /// each time either side re-establishes it (new QPs). A REQ of a lower epoch than the
    /// receiver's is stale; one of a higher epoch replaces the receiver's QPs.
    pub epoch: u32,
}

impl Handshake {
    /// The [`HANDSHAKE_LEN`] bytes of this message.
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut b = [0u8; HANDSHAKE_LEN];
        b[..4].copy_from_slice(&HS_MAGIC);
        b[4] = ADDR_VERSION;
        b[5] = self.kind as u8;
        b[8..8 + ADDR_LEN].copy_from_slice(&self.from.encode());
        let o = 8 + ADDR_LEN;
        b[o..o + 4].copy_from_slice(&self.qpn.to_be_bytes());
        b[o + 4..o + 8].copy_from_slice(&self.psn.to_be_bytes());
        b[o + 8..o + 12].copy_from_slice(&self.echo_qpn.to_be_bytes());
        b[o + 12..o + 16].copy_from_slice(&self.msg_qpn.to_be_bytes());
        b[o + 16..o + 20].copy_from_slice(&self.msg_psn.to_be_bytes());
        b[o + 20..o + 24].copy_from_slice(&self.epoch.to_be_bytes());
        b
    }

    /// Decodes a message made by [`encode`](Self::encode) (bytes after the first
    /// [`HANDSHAKE_LEN`] are ignored). A message of another version is [`Error::Malformed`]
    /// whose reason starts with `"version"`; other bad headers or kinds are `Malformed` with
    /// `what = "verbs handshake"`; a bad sender address is `PeerAddr::decode`'s error. Never
    /// panics.
    pub fn decode(b: &[u8]) -> Result<Handshake, Error> {
        let malformed = |reason: String| Error::Malformed { what: "verbs handshake", reason };
        if b.len() >= 5 && b[..4] == HS_MAGIC && b[4] != ADDR_VERSION {
            return Err(malformed(format!("version {} (this build speaks {ADDR_VERSION})", b[4])));
        }
        if b.len() < HANDSHAKE_LEN || b[..4] != HS_MAGIC {
            return Err(malformed(format!("{} bytes without a version-{ADDR_VERSION} header", b.len())));
        }
        let kind = match b[5] {
            1 => HsKind::Req,
            2 => HsKind::Rep,
            k => return Err(malformed(format!("unknown message kind {k}"))),
        };
        let from = PeerAddr::decode(&b[8..8 + ADDR_LEN])?;
        let o = 8 + ADDR_LEN;
        let be32 = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(Handshake {
            kind,
            from,
            qpn: be32(o),
            psn: be32(o + 4),
            echo_qpn: be32(o + 8),
            msg_qpn: be32(o + 12),
            msg_psn: be32(o + 16),
            epoch: be32(o + 20),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> PeerAddr {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 2, 15]);
        PeerAddr { mtu: 3, lid: 0, gid, ud_qpn: 0x11, qkey: 0x1f4b_5642, max_msg_size: 8192 }
    }

    fn handshake() -> Handshake {
        Handshake {
            kind: HsKind::Rep,
            from: addr(),
            qpn: 0x123456,
            psn: 0xabcdef,
            echo_qpn: 77,
            msg_qpn: 0x123457,
            msg_psn: 0x0fedcb,
            epoch: 0x0102_0304,
        }
    }

    #[test]
    fn address_round_trips() {
        let a = addr();
        let b = a.encode();
        assert_eq!(b.len(), ADDR_LEN);
        assert_eq!(PeerAddr::decode(&b).unwrap(), a);
    }

    #[test]
    fn encodings_are_big_endian_at_fixed_offsets() {
        let b = addr().encode();
        assert_eq!(&b[..6], b"FVRB\x03\x03");
        assert_eq!(&b[24..28], &[0, 0, 0, 0x11]);
        assert_eq!(&b[28..32], &[0x1f, 0x4b, 0x56, 0x42]);
        assert_eq!(&b[32..36], &[0, 0, 0x20, 0]);
        let h = handshake().encode();
        assert_eq!(h.len(), 68);
        assert_eq!(&h[..8], b"FVHS\x03\x02\0\0");
        assert_eq!(&h[8..44], addr().encode().as_slice());
        assert_eq!(&h[44..48], &[0, 0x12, 0x34, 0x56]);
        assert_eq!(&h[60..64], &[0, 0x0f, 0xed, 0xcb]);
        assert_eq!(&h[64..68], &[1, 2, 3, 4]);
    }

    #[test]
    fn malformed_addresses_are_refused() {
        let good = addr().encode();
        let bad = |b: &[u8]| match PeerAddr::decode(b) {
            Err(Error::Malformed { what, reason }) => {
                assert_eq!(what, "verbs address");
                reason
            }
            other => panic!("{other:?}"),
        };
        assert!(bad(&good[..ADDR_LEN - 1]).contains("bytes"));
        assert!(bad(&[]).contains("bytes"));
        let mut b = good.clone();
        b.push(0);
        bad(&b);
        let mut b = good.clone();
        b[0] = b'X';
        assert!(bad(&b).contains("magic"));
        let mut b = good.clone();
        b[4] = 9;
        assert!(bad(&b).contains("version"));
        let mut b = good.clone();
        b[5] = 0;
        assert!(bad(&b).contains("MTU"));
        let mut b = good.clone();
        b[8..24].fill(0);
        assert!(bad(&b).contains("GID"));
        let mut b = good.clone();
        b[24..28].copy_from_slice(&0x0100_0000u32.to_be_bytes());
        assert!(bad(&b).contains("QPN"));
        // A libfabric address is refused cleanly.
        assert!(bad(b"fi_shm://123:4:0\0").contains("bytes"));
    }

    #[test]
    fn handshake_round_trips() {
        let m = handshake();
        assert_eq!(Handshake::decode(&m.encode()).unwrap(), m);
        let req = Handshake { kind: HsKind::Req, echo_qpn: 0, ..m };
        assert_eq!(Handshake::decode(&req.encode()).unwrap(), req);
        let mut b = m.encode();
        b[5] = 3;
        assert!(Handshake::decode(&b).is_err());
        assert!(Handshake::decode(&b[..10]).is_err());
        // A handshake of another version (v1: one QP per peer; v2: no epoch) is refused by
        // name, and a v2-sized message (64 bytes, no epoch) is too short.
        for v in [1, 2] {
            let mut b = m.encode();
            b[4] = v;
            match Handshake::decode(&b) {
                Err(Error::Malformed { reason, .. }) => {
                    assert!(reason.starts_with(&format!("version {v}")), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(Handshake::decode(&m.encode()[..64]).is_err());
    }

    #[test]
    fn an_address_of_another_version_is_a_clear_error() {
        let mut b = addr().encode();
        b[4] = 1;
        match PeerAddr::decode(&b) {
            Err(Error::Malformed { reason, .. }) => {
                assert_eq!(reason, format!("version 1 (this build speaks {ADDR_VERSION})"));
            }
            other => panic!("{other:?}"),
        }
    }

    use super::super::test_rng::Rng;

    /// Fills `input` with case `i` of a bounded fuzz run over `seed` (a valid encoding whose
    /// first `header` bytes are a valid header): pure noise of up to `max_len` bytes, the
    /// header then noise, or `seed` with a few bytes replaced or bits flipped, then maybe
    /// truncated or extended.
    fn fuzz_case(rng: &mut Rng, i: usize, seed: &[u8], header: usize, max_len: usize, input: &mut Vec<u8>) {
        input.clear();
        match i % 4 {
            0 => {
                let len = rng.below(max_len + 1);
                input.extend((0..len).map(|_| rng.next() as u8));
            }
            1 => {
                input.extend_from_slice(&seed[..header]);
                let len = rng.below(max_len + 1 - header);
                input.extend((0..len).map(|_| rng.next() as u8));
            }
            _ => rng.mutate(seed, input),
        }
    }

    #[test]
    fn fuzz_address_decode_never_panics() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let seed = addr().encode();
        let (mut accepted, mut input) = (0, Vec::new());
        for i in 0..100_000 {
            fuzz_case(&mut rng, i, &seed, 5, 2 * ADDR_LEN, &mut input);
            match PeerAddr::decode(&input) {
                // The encoding is canonical: what is accepted re-encodes to the same bytes.
                Ok(a) => {
                    assert_eq!(a.encode(), input);
                    accepted += 1;
                }
                Err(Error::Malformed { what: "verbs address", .. }) => {}
                Err(e) => panic!("{input:02x?}: {e:?}"),
            }
        }
        // Mutations of the LID, GID, Q_Key or size bytes stay valid; the loop reached them.
        assert!(accepted > 1000, "{accepted}");
    }

    #[test]
    fn fuzz_handshake_decode_never_panics() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let seed = handshake().encode();
        let (mut accepted, mut input) = (0, Vec::new());
        for i in 0..100_000 {
            fuzz_case(&mut rng, i, &seed, 8, 2 * HANDSHAKE_LEN, &mut input);
            match Handshake::decode(&input) {
                // Accepted: the first HANDSHAKE_LEN bytes re-encode, except the unused 6..8.
                Ok(m) => {
                    let mut again = m.encode();
                    again[6..8].copy_from_slice(&input[6..8]);
                    assert_eq!(again.as_slice(), &input[..HANDSHAKE_LEN]);
                    accepted += 1;
                }
                Err(Error::Malformed { what: "verbs handshake" | "verbs address", .. }) => {}
                Err(e) => panic!("{input:02x?}: {e:?}"),
            }
        }
        assert!(accepted > 1000, "{accepted}");
    }
}
