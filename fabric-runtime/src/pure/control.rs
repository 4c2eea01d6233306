//! The engine's internal two-sided messages, and the one-byte kind header every message
//! carries.
//!
//! Two-sided messages share one path: user messages ([`Engine::send`](crate::Engine::send))
//! and the engine's own control messages of the **pull protocol** that moves bytes into a
//! staged GPU region (see `docs/gpu.md`):
//!
//! ```text
//!  sender                                   receiver (owns the staged GPU region)
//!   │ [per chunk of a GPU source: D2H copy into a bounce slot; one PULL per slot]
//!   │── PULL { op, sources per NIC, len, dst, imm, sender address } ──►│
//!   │                                       │ RDMA read source ─► slot (chunk k)
//!   │                                       │ H2D copy slot ─► GPU  (chunk k, overlaps read k+1)
//!   │                                       │ all copies done: count imm
//!   │◄────────────── ACK { op, status } ────│
//!   │ future completes
//! ```
//!
//! A `read` from a staged GPU region runs the other way: the reader sends a push request
//! ([`MsgKind::Push`], a [`Pull`]'s fields: the owner's region and range, the reader's
//! registered destination as `sources`), the owner writes the bytes there and ACKs.
//!
//! Every message starts with a [`MsgKind`] byte. Decoding treats its input as hostile:
//! never panics, bounds every length, and anything that is not exactly one valid encoding
//! is [`Error::Malformed`].

use super::reader::Reader;
use crate::error::Error;

/// The first byte of every two-sided message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MsgKind {
    /// A user message: handed to `Engine::recv` without its header.
    User = 0,
    /// A [`Pull`] request.
    Pull = 1,
    /// An [`Ack`] of a pull (or of a push).
    Ack = 2,
    /// A push request: a [`Pull`] encoding read the other way ("write `len` bytes of your
    /// staged region at `dst_off` into my `sources`, then ACK"), the reader's side of a
    /// `read` from a staged GPU region.
    Push = 3,
    /// A [`Revoke`](super::revoke::Revoke): regions the sender has freed.
    Revoke = 4,
    /// A [`Hello`](super::revoke::Hello): the sender's engine address, so that the receiver
    /// knows it as a peer (and tells it what it revokes).
    Hello = 5,
    /// A [`Vouch`](super::revoke::Vouch): "does this descriptor name a live region of yours?"
    Vouch = 6,
    /// A [`Vouched`](super::revoke::Vouched): the answer to a `Vouch`.
    Vouched = 7,
    /// A [`RevokeAck`](super::revoke::RevokeAck): "your `Revoke` arrived, and what I had
    /// posted to you before it is done" (shm: the owner keeps the regions registered until
    /// then).
    RevokeAck = 8,
}

impl MsgKind {
    /// The kind named by a message's first byte, `None` for an unknown one (or no byte).
    pub fn of(msg: &[u8]) -> Option<MsgKind> {
        match msg.first()? {
            0 => Some(MsgKind::User),
            1 => Some(MsgKind::Pull),
            2 => Some(MsgKind::Ack),
            3 => Some(MsgKind::Push),
            4 => Some(MsgKind::Revoke),
            5 => Some(MsgKind::Hello),
            6 => Some(MsgKind::Vouch),
            7 => Some(MsgKind::Vouched),
            8 => Some(MsgKind::RevokeAck),
            _ => None,
        }
    }
}

/// Bytes of the kind header.
pub const HEADER_LEN: usize = 1;
/// The most NICs a pull names (as descriptors: [`MAX_DOMAINS`](super::descriptor::MAX_DOMAINS)).
pub const MAX_SOURCES: usize = super::descriptor::MAX_DOMAINS;
/// The longest sender address a pull carries.
pub const MAX_SENDER_ADDRESS: usize = 16 * 1024;
/// The longest error text an ACK carries (longer texts are cut).
pub const MAX_ACK_MESSAGE: usize = 1024;

const PULL_WHAT: &str = "pull message";
const ACK_WHAT: &str = "ack message";
const PUSH_WHAT: &str = "push message";

/// One NIC's view of the source of a pull: where the receiver reads it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullSource {
    /// Remote address of the first byte to read (base already added).
    pub addr: u64,
    /// Remote key of the source registration on that NIC.
    pub key: u64,
}

/// "Read `len` bytes from me into your region at `dst_off`, then count `imm` and ACK `op`".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pull {
    /// The sender's operation id, echoed in the ACK.
    pub op: u64,
    /// The destination region: its NIC-0 key and base, as in its descriptor.
    pub dst_key: u64,
    /// The destination's NIC-0 base address (checked with the key).
    pub dst_base: u64,
    /// Offset in the destination region.
    pub dst_off: u64,
    /// Bytes to move.
    pub len: u64,
    /// Immediate to count once the bytes are in GPU memory.
    pub imm: Option<u32>,
    /// One source per NIC of the sender, in NIC order.
    pub sources: Vec<PullSource>,
    /// The sender's engine address (bytes of `EngineAddress`), so the receiver can reach it
    /// even if it never added the sender as a peer.
    pub sender: Vec<u8>,
}

/// The answer to a [`Pull`]: `Ok` once the bytes are in GPU memory and counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// The pull's operation id.
    pub op: u64,
    /// `None`: done; `Some(text)`: why it failed.
    pub error: Option<String>,
}

impl Pull {
    /// The message, kind header included.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode(MsgKind::Pull)
    }

    /// The same fields as a push request ([`MsgKind::Push`]): the receiver owns the staged
    /// region named by `dst_key`/`dst_base` and writes its `len` bytes at `dst_off` into
    /// `sources` (the sender's registered memory, per NIC), then ACKs `op`.
    pub fn to_push_bytes(&self) -> Vec<u8> {
        self.encode(MsgKind::Push)
    }

    /// Decodes a whole push request (kind header included). Never panics.
    pub fn push_from_bytes(bytes: &[u8]) -> Result<Pull, Error> {
        Self::decode_kind(PUSH_WHAT, bytes, MsgKind::Push)
    }

    fn encode(&self, kind: MsgKind) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + 16 * self.sources.len() + self.sender.len());
        out.push(kind as u8);
        for v in [self.op, self.dst_key, self.dst_base, self.dst_off, self.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        match self.imm {
            Some(i) => {
                out.push(1);
                out.extend_from_slice(&i.to_le_bytes());
            }
            None => out.push(0),
        }
        out.extend_from_slice(&(self.sources.len().min(u16::MAX as usize) as u16).to_le_bytes());
        for s in &self.sources {
            out.extend_from_slice(&s.addr.to_le_bytes());
            out.extend_from_slice(&s.key.to_le_bytes());
        }
        out.extend_from_slice(&(self.sender.len().min(u32::MAX as usize) as u32).to_le_bytes());
        out.extend_from_slice(&self.sender);
        out
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Pull, Error> {
        Self::decode_kind(PULL_WHAT, bytes, MsgKind::Pull)
    }

    fn decode_kind(what: &'static str, bytes: &[u8], kind: MsgKind) -> Result<Pull, Error> {
        decode(what, bytes, kind, |r| {
            let op = r.u64("op id")?;
            let dst_key = r.u64("destination key")?;
            let dst_base = r.u64("destination base")?;
            let dst_off = r.u64("destination offset")?;
            let len = r.u64("length")?;
            let imm = match r.u8("imm flag")? {
                0 => None,
                1 => Some(r.u32("imm")?),
                f => return Err(format!("imm flag {f} is neither 0 nor 1")),
            };
            let n = usize::from(r.u16("source count")?);
            if n > MAX_SOURCES {
                return Err(format!("source count {n} exceeds the limit of {MAX_SOURCES}"));
            }
            let mut sources = Vec::with_capacity(n);
            for _ in 0..n {
                sources.push(PullSource { addr: r.u64("source address")?, key: r.u64("source key")? });
            }
            let alen = r.u32("sender address length")?;
            if u64::from(alen) > MAX_SENDER_ADDRESS as u64 {
                return Err(format!("sender address of {alen} bytes exceeds {MAX_SENDER_ADDRESS}"));
            }
            let sender = r.take(alen as usize, "sender address")?.to_vec();
            Ok(Pull { op, dst_key, dst_base, dst_off, len, imm, sources, sender })
        })
    }
}

impl Ack {
    /// The message, kind header included. An error text longer than [`MAX_ACK_MESSAGE`]
    /// bytes is cut (at a character boundary).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.error.as_ref().map_or(0, String::len));
        out.push(MsgKind::Ack as u8);
        out.extend_from_slice(&self.op.to_le_bytes());
        match &self.error {
            None => out.push(0),
            Some(text) => {
                let mut end = text.len().min(MAX_ACK_MESSAGE);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                out.push(1);
                out.extend_from_slice(&(end as u16).to_le_bytes());
                out.extend_from_slice(&text.as_bytes()[..end]);
            }
        }
        out
    }

    /// Decodes a whole message (kind header included). Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Ack, Error> {
        decode(ACK_WHAT, bytes, MsgKind::Ack, |r| {
            let op = r.u64("op id")?;
            let error = match r.u8("status")? {
                0 => None,
                1 => {
                    let n = usize::from(r.u16("error length")?);
                    if n > MAX_ACK_MESSAGE {
                        return Err(format!("error text of {n} bytes exceeds {MAX_ACK_MESSAGE}"));
                    }
                    let raw = r.take(n, "error text")?;
                    Some(
                        std::str::from_utf8(raw)
                            .map_err(|e| format!("error text is not UTF-8: {e}"))?
                            .to_owned(),
                    )
                }
                s => return Err(format!("status {s} is neither 0 nor 1")),
            };
            Ok(Ack { op, error })
        })
    }
}

pub(crate) fn decode<T>(
    what: &'static str,
    bytes: &[u8],
    kind: MsgKind,
    body: impl FnOnce(&mut Reader<'_>) -> Result<T, String>,
) -> Result<T, Error> {
    let malformed = |reason: String| Error::Malformed { what, reason };
    if MsgKind::of(bytes) != Some(kind) {
        return Err(malformed(format!("kind byte {:?}, expected {}", bytes.first(), kind as u8)));
    }
    let mut r = Reader::new(bytes, HEADER_LEN);
    let v = body(&mut r).map_err(malformed)?;
    if r.pos != bytes.len() {
        return Err(malformed(format!("{} trailing byte(s)", bytes.len() - r.pos)));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pull() -> Pull {
        Pull {
            op: 7,
            dst_key: 0xdead,
            dst_base: 0x7f00_0000_1000,
            dst_off: 4096,
            len: 1 << 30,
            imm: Some(42),
            sources: vec![PullSource { addr: 1, key: 2 }, PullSource { addr: u64::MAX, key: 0 }],
            sender: vec![9; 33],
        }
    }

    #[test]
    fn round_trips() {
        let p = pull();
        assert_eq!(Pull::from_bytes(&p.to_bytes()).unwrap(), p);
        let q = Pull { imm: None, sources: vec![], sender: vec![], ..pull() };
        assert_eq!(Pull::from_bytes(&q.to_bytes()).unwrap(), q);
        // A push is the same fields under its own kind, and neither decoder takes the other.
        assert_eq!(Pull::push_from_bytes(&p.to_push_bytes()).unwrap(), p);
        assert_eq!(MsgKind::of(&p.to_push_bytes()), Some(MsgKind::Push));
        assert!(matches!(
            Pull::from_bytes(&p.to_push_bytes()),
            Err(Error::Malformed { what: PULL_WHAT, .. })
        ));
        assert!(matches!(
            Pull::push_from_bytes(&p.to_bytes()),
            Err(Error::Malformed { what: PUSH_WHAT, .. })
        ));
        assert_eq!(p.to_push_bytes()[1..], p.to_bytes()[1..]);
        for a in [Ack { op: 1, error: None }, Ack { op: u64::MAX, error: Some("out of bounds: é".into()) }] {
            assert_eq!(Ack::from_bytes(&a.to_bytes()).unwrap(), a);
        }
        assert_eq!(MsgKind::of(&p.to_bytes()), Some(MsgKind::Pull));
        assert_eq!(MsgKind::of(&[0, 1, 2]), Some(MsgKind::User));
        assert_eq!(MsgKind::of(&[]), None);
        assert_eq!(MsgKind::of(&[9]), None);
        assert_eq!(MsgKind::of(&[4]), Some(MsgKind::Revoke));
        assert_eq!(MsgKind::of(&[5]), Some(MsgKind::Hello));
        assert_eq!(MsgKind::of(&[7]), Some(MsgKind::Vouched));
        assert_eq!(MsgKind::of(&[8]), Some(MsgKind::RevokeAck));
    }

    #[test]
    fn long_ack_text_is_cut_at_a_char_boundary() {
        let a = Ack { op: 3, error: Some("é".repeat(MAX_ACK_MESSAGE)) };
        let back = Ack::from_bytes(&a.to_bytes()).unwrap();
        let text = back.error.unwrap();
        assert!(text.len() <= MAX_ACK_MESSAGE && text.chars().all(|c| c == 'é'), "{}", text.len());
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        for bytes in
            [pull().to_bytes(), pull().to_push_bytes(), Ack { op: 1, error: Some("x".into()) }.to_bytes()]
        {
            for n in 0..bytes.len() {
                assert!(Pull::from_bytes(&bytes[..n]).is_err() && Ack::from_bytes(&bytes[..n]).is_err());
                assert!(Pull::push_from_bytes(&bytes[..n]).is_err());
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(Pull::from_bytes(&longer).is_err() && Ack::from_bytes(&longer).is_err());
            assert!(Pull::push_from_bytes(&longer).is_err());
        }
    }

    #[test]
    fn wrong_kind_flags_and_limits_are_malformed() {
        let mut b = pull().to_bytes();
        b[0] = 2;
        assert!(matches!(Pull::from_bytes(&b), Err(Error::Malformed { what: PULL_WHAT, .. })));
        let mut b = pull().to_bytes();
        b[1 + 40] = 5; // imm flag
        assert!(Pull::from_bytes(&b).is_err());
        // A source count over the limit is refused before reading sources.
        let mut b = Pull { sources: vec![], sender: vec![], ..pull() }.to_bytes();
        let at = 1 + 40 + 5;
        b[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        let e = Pull::from_bytes(&b).unwrap_err().to_string();
        assert!(e.contains("source count 65535"), "{e}");
        // A huge sender address length does not allocate.
        let mut b = Pull { sources: vec![], sender: vec![], ..pull() }.to_bytes();
        let n = b.len();
        b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Pull::from_bytes(&b).unwrap_err().to_string().contains("exceeds"));
        let mut b = Ack { op: 1, error: Some("x".into()) }.to_bytes();
        b[9] = 7;
        assert!(Ack::from_bytes(&b).is_err());
        let mut b = Ack { op: 1, error: Some("xy".into()) }.to_bytes();
        b[12] = 0xff;
        assert!(Ack::from_bytes(&b).unwrap_err().to_string().contains("UTF-8"));
    }

    /// Random bytes and random mutations of valid messages: never a panic, and whatever is
    /// accepted re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics() {
        let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let seeds = [
            pull().to_bytes(),
            pull().to_push_bytes(),
            Ack { op: 5, error: Some("no".into()) }.to_bytes(),
            Ack { op: 5, error: None }.to_bytes(),
        ];
        for i in 0..100_000 {
            let mut b = if i % 3 == 0 {
                (0..next() % 96).map(|_| next() as u8).collect::<Vec<u8>>()
            } else {
                seeds[i % seeds.len()].clone()
            };
            for _ in 0..1 + next() % 4 {
                if b.is_empty() {
                    break;
                }
                let at = (next() as usize) % b.len();
                b[at] = next() as u8;
            }
            if next() % 4 == 0 {
                b.truncate((next() as usize) % (b.len() + 1));
            }
            if let Ok(p) = Pull::from_bytes(&b) {
                assert_eq!(p.to_bytes(), b);
            }
            if let Ok(p) = Pull::push_from_bytes(&b) {
                assert_eq!(p.to_push_bytes(), b);
            }
            if let Ok(a) = Ack::from_bytes(&b) {
                assert_eq!(a.to_bytes(), b);
            }
        }
    }
}
