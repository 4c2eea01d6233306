//! Engine addresses and region descriptors, and their wire encoding.
//!
//! Two small values cross process boundaries before any RDMA can happen:
//!
//! * an [`EngineAddress`] says how to reach an engine: its transport name and one opaque
//!   address per NIC (domain), as given by [`Domain::address`](crate::provider::Domain::address);
//! * a [`RegionDescriptor`] says how to write into one registered region of that engine: its
//!   length and, for each of the owner's NICs, the remote address of byte 0 and the remote key.
//!
//! Both are sent by whatever means the application likes (a bootstrap store, a file, an RPC),
//! so both have a compact, versioned binary form ([`EngineAddress::to_bytes`],
//! [`RegionDescriptor::from_bytes`], ...). Decoding treats its input as hostile: it never
//! panics, checks every length against its limit before using it (so a forged length cannot
//! make it allocate more than the input plus a few kilobytes), and anything that is not
//! exactly a valid encoding is [`Error::Malformed`] with a reason saying what was wrong.
//!
//! # Wire format (addresses: version 2, 1 still read; descriptors: version 3, 2 and 1 still read)
//!
//! All integers are little-endian. `str16` is a `u16` length followed by that many UTF-8 bytes;
//! `bytes32` is a `u32` length followed by that many bytes.
//!
//! ```text
//! EngineAddress                         RegionDescriptor
//! +---------------------------+         +---------------------------+
//! | magic   "FABA"   4 bytes  |         | magic   "FABR"   4 bytes  |
//! | version 2 (or 1) u8       |         | version 3 (2, 1) u8       |
//! | transport        str16    |         | transport        str16    |
//! | domain count     u16      |         | region length    u64      |
//! | per domain:               |         | domain count     u16      |
//! |   address        bytes32  |         | per domain:               |
//! | version 2:                |         |   address        bytes32  |
//! |   incarnation    u64      |         |   base           u64      |
//! +---------------------------+         |   key            u64      |
//!                                       | version 2 and 3:          |
//!                                       | location u8 (0 host,      |
//!                                       |              1 CUDA)      |
//!                                       | CUDA only:                |
//!                                       |   ordinal        u32      |
//!                                       |   flags u8 (1 staged,     |
//!                                       |             2 IPC export) |
//!                                       |   [IPC export   80 bytes] |
//!                                       |   host id        bytes8   |
//!                                       | version 3:                |
//!                                       |   incarnation    u64      |
//!                                       +---------------------------+
//! ```
//!
//! The **incarnation** names one run of an engine: its start time in nanoseconds since the
//! Unix epoch, its low 16 bits random. A restarted peer has a new one even where its
//! transport address is the same, so descriptors of the process that died are told apart
//! from the new one's (`Error::Stale`); later incarnations compare greater. Version 1
//! addresses and versions 1-2 descriptors (older builds) read with incarnation 0, unknown.
//!
//! A version 1 descriptor (from an older build) reads as host memory. `bytes8` is a `u8`
//! length then that many bytes, at most [`MAX_HOST_ID_LEN`]; flag bits other than 1 and 2
//! are refused.
//!
//! Limits, enforced by decoding and by `validate`: a transport name is at most
//! [`MAX_TRANSPORT_LEN`] bytes, a list holds at most [`MAX_DOMAINS`] domains and one NIC
//! address is at most [`MAX_ADDRESS_LEN`] bytes. The encoding is canonical: if `from_bytes`
//! accepts some bytes, `to_bytes` of the result gives back exactly those bytes.

use super::reader::Reader;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The most domains (NICs) an address or descriptor may list.
pub const MAX_DOMAINS: usize = 64;
/// The longest NIC address, in bytes.
pub const MAX_ADDRESS_LEN: usize = 4096;
/// The longest transport name, in bytes.
pub const MAX_TRANSPORT_LEN: usize = 64;

/// The wire format version of engine addresses written by this crate; it also reads version
/// 1 (no incarnation).
pub const WIRE_VERSION: u8 = 2;
/// The wire format version of region descriptors written by this crate; it also reads
/// version 2 (no incarnation) and 1 (host memory, no incarnation).
pub const DESCRIPTOR_VERSION: u8 = 3;
/// The longest host identity a descriptor carries.
pub const MAX_HOST_ID_LEN: usize = 64;
/// Bytes of a CUDA IPC export (`cuda::IpcExport::WIRE_LEN`).
pub const IPC_EXPORT_LEN: usize = 80;

const FLAG_STAGED: u8 = 1;
const FLAG_IPC: u8 = 2;

const ADDRESS_MAGIC: [u8; 4] = *b"FABA";
const DESCRIPTOR_MAGIC: [u8; 4] = *b"FABR";

const ADDRESS_WHAT: &str = "engine address";
const DESCRIPTOR_WHAT: &str = "region descriptor";

/// How to reach an engine: its transport and one opaque address per domain (NIC).
///
/// Produced by the engine, sent to peers with [`to_bytes`](Self::to_bytes), read back with
/// [`from_bytes`](Self::from_bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineAddress {
    /// The transport name, e.g. `"tcp;ofi_rxm"` or `"verbs"`. Peers must use the same one.
    pub transport: String,
    /// One backend address per domain, in the engine's domain order.
    pub domains: Vec<Vec<u8>>,
    /// The engine's incarnation (see the [module docs](self)); 0: unknown.
    pub incarnation: u64,
}

/// One domain's part of a [`RegionDescriptor`]: what a peer needs to write through that NIC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainKey {
    /// The owner's NIC address (the matching entry of its [`EngineAddress::domains`]).
    pub address: Vec<u8>,
    /// The remote address of byte 0 of the region on this NIC.
    pub base: u64,
    /// The remote key of the region on this NIC.
    pub key: u64,
}

/// How to write into a registered region of a remote engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// The transport of the engine that registered the region.
    pub transport: String,
    /// The region's length in bytes.
    pub len: u64,
    /// One entry per domain of the owning engine, in its domain order.
    pub domains: Vec<DomainKey>,
    /// `Some` for a region in GPU memory.
    pub gpu: Option<GpuRegion>,
    /// The owning engine's incarnation (see the [module docs](self)); 0: unknown.
    pub incarnation: u64,
}

/// The GPU part of a [`RegionDescriptor`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRegion {
    /// The CUDA device ordinal at the owner.
    pub ordinal: u32,
    /// The owner's NICs cannot reach the GPU memory (it stages through bounce slots): a writer must use the
    /// pull protocol (`pure::control`) so that the bytes reach GPU memory before they count.
    pub staged: bool,
    /// A CUDA IPC export of the region (80 bytes: handle, offset, length), for a writer on
    /// the same host.
    pub ipc: Option<Vec<u8>>,
    /// The owner's host identity (its boot id): `ipc` can be opened where it is the same.
    pub host: Vec<u8>,
}

impl EngineAddress {
    /// Checks the limits that decoding enforces, so that an address that passes can be sent
    /// and read back. [`Error::Malformed`] says which limit is exceeded.
    pub fn validate(&self) -> Result<(), Error> {
        validate_common(ADDRESS_WHAT, &self.transport, self.domains.iter().map(Vec::len))
    }

    /// Fails with [`Error::Foreign`] unless this address was made by transport `expected`.
    pub fn check_transport(&self, expected: &str) -> Result<(), Error> {
        check_transport(ADDRESS_WHAT, &self.transport, expected)
    }

    /// Encodes the address in the wire format described in the [module docs](self).
    ///
    /// Call [`validate`](Self::validate) first if the value may exceed the limits: the bytes of
    /// an address that does not validate are rejected by [`from_bytes`](Self::from_bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode(WIRE_VERSION)
    }

    pub(crate) fn encode(&self, version: u8) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            4 + 1
                + 2
                + self.transport.len()
                + 2
                + self.domains.iter().map(|d| 4 + d.len()).sum::<usize>()
                + 8,
        );
        out.extend_from_slice(&ADDRESS_MAGIC);
        out.push(version);
        put_str16(&mut out, &self.transport);
        put_u16(&mut out, self.domains.len());
        for address in &self.domains {
            put_bytes32(&mut out, address);
        }
        if version >= 2 {
            out.extend_from_slice(&self.incarnation.to_le_bytes());
        }
        out
    }

    /// Decodes bytes made by [`to_bytes`](Self::to_bytes).
    ///
    /// Any input that is not exactly one valid encoding (truncated, trailing bytes, wrong
    /// magic, another version, a limit exceeded, a transport that is not UTF-8) is
    /// [`Error::Malformed`] with `what = "engine address"`. Never panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        decode(ADDRESS_WHAT, bytes, |r| {
            let version = r.header(ADDRESS_MAGIC, DESCRIPTOR_MAGIC, DESCRIPTOR_WHAT, &[1, WIRE_VERSION])?;
            let transport = r.transport()?;
            let count = r.domain_count()?;
            let mut domains = Vec::with_capacity(count);
            for i in 0..count {
                domains.push(r.address(i)?);
            }
            let incarnation = if version >= 2 { r.u64("incarnation")? } else { 0 };
            Ok(EngineAddress { transport, domains, incarnation })
        })
    }
}

impl RegionDescriptor {
    /// Checks the limits that decoding enforces, so that a descriptor that passes can be sent
    /// and read back. [`Error::Malformed`] says which limit is exceeded.
    pub fn validate(&self) -> Result<(), Error> {
        validate_common(DESCRIPTOR_WHAT, &self.transport, self.domains.iter().map(|d| d.address.len()))?;
        if let Some(g) = &self.gpu {
            let malformed = |reason: String| Err(Error::Malformed { what: DESCRIPTOR_WHAT, reason });
            if g.host.len() > MAX_HOST_ID_LEN {
                return malformed(format!(
                    "host id is {} bytes, the limit is {MAX_HOST_ID_LEN}",
                    g.host.len()
                ));
            }
            if g.ipc.as_ref().is_some_and(|i| i.len() != IPC_EXPORT_LEN) {
                return malformed(format!("an IPC export must be {IPC_EXPORT_LEN} bytes"));
            }
        }
        Ok(())
    }

    /// The descriptor of `len` bytes at `offset` of this region: what a peer needs to reach
    /// that range alone, as if it had been registered by itself (its offset 0 is this
    /// region's `offset`). The owner vouches for it as for the whole (it lies inside a live
    /// registration). Host memory only: a GPU region's descriptor also names its IPC export
    /// and staging, which are the whole region's ([`Error::Unsupported`]).
    /// [`Error::OutOfBounds`] if the range does not fit, or is empty.
    pub fn narrow(&self, offset: u64, len: u64) -> Result<RegionDescriptor, Error> {
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::OutOfBounds {
                side: crate::error::Side::Local,
                offset,
                len,
                region_len: self.len,
            });
        }
        if self.gpu.is_some() {
            return Err(Error::Unsupported(
                "a range of GPU memory has no descriptor of its own: send the region's, and offsets into it"
                    .into(),
            ));
        }
        let mut d = self.clone();
        d.len = len;
        for k in &mut d.domains {
            k.base = k.base.checked_add(offset).ok_or_else(|| Error::Malformed {
                what: DESCRIPTOR_WHAT,
                reason: "the range's base address overflows".into(),
            })?;
        }
        Ok(d)
    }

    /// Where the region's memory lives at its owner.
    pub fn location(&self) -> crate::provider::MemoryLocation {
        match &self.gpu {
            None => crate::provider::MemoryLocation::Host,
            Some(g) => crate::provider::MemoryLocation::Cuda { ordinal: g.ordinal },
        }
    }

    /// Fails with [`Error::Foreign`] unless this descriptor was made by transport `expected`.
    pub fn check_transport(&self, expected: &str) -> Result<(), Error> {
        check_transport(DESCRIPTOR_WHAT, &self.transport, expected)
    }

    /// Fails with [`Error::Foreign`] unless the descriptor lists exactly `expected` domains,
    /// the number of domains of the engine that will use it. `found` and `expected` of the
    /// error name the transport and the two counts.
    pub fn check_domains(&self, expected: usize) -> Result<(), Error> {
        let found = self.domains.len();
        if found == expected {
            return Ok(());
        }
        Err(Error::Foreign {
            what: DESCRIPTOR_WHAT,
            found: format!("{} with {} domain(s)", self.transport, found),
            expected: format!("{} with {} domain(s)", self.transport, expected),
        })
    }

    /// Encodes the descriptor in the wire format described in the [module docs](self).
    ///
    /// Call [`validate`](Self::validate) first if the value may exceed the limits: the bytes of
    /// a descriptor that does not validate are rejected by [`from_bytes`](Self::from_bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode(DESCRIPTOR_VERSION)
    }

    pub(crate) fn encode(&self, version: u8) -> Vec<u8> {
        let per_domain: usize = self.domains.iter().map(|d| 4 + d.address.len() + 16).sum();
        let mut out = Vec::with_capacity(4 + 1 + 2 + self.transport.len() + 8 + 2 + per_domain + 100);
        out.extend_from_slice(&DESCRIPTOR_MAGIC);
        out.push(version);
        put_str16(&mut out, &self.transport);
        out.extend_from_slice(&self.len.to_le_bytes());
        put_u16(&mut out, self.domains.len());
        for d in &self.domains {
            put_bytes32(&mut out, &d.address);
            out.extend_from_slice(&d.base.to_le_bytes());
            out.extend_from_slice(&d.key.to_le_bytes());
        }
        if version < 2 {
            return out;
        }
        match &self.gpu {
            None => out.push(0),
            Some(g) => {
                out.push(1);
                out.extend_from_slice(&g.ordinal.to_le_bytes());
                let flags =
                    if g.staged { FLAG_STAGED } else { 0 } | if g.ipc.is_some() { FLAG_IPC } else { 0 };
                out.push(flags);
                if let Some(ipc) = &g.ipc {
                    out.extend_from_slice(ipc);
                }
                out.push(u8::try_from(g.host.len()).unwrap_or(u8::MAX));
                out.extend_from_slice(&g.host);
            }
        }
        if version >= 3 {
            out.extend_from_slice(&self.incarnation.to_le_bytes());
        }
        out
    }

    /// Decodes bytes made by [`to_bytes`](Self::to_bytes), or a version 1 or 2 descriptor
    /// of an older build (version 1: host memory; both: incarnation 0).
    ///
    /// Any input that is not exactly one valid encoding (truncated, trailing bytes, wrong
    /// magic, another version, a limit exceeded, a transport that is not UTF-8, unknown
    /// location or flags) is [`Error::Malformed`] with `what = "region descriptor"`. Never
    /// panics.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        decode(DESCRIPTOR_WHAT, bytes, |r| {
            let version =
                r.header(DESCRIPTOR_MAGIC, ADDRESS_MAGIC, ADDRESS_WHAT, &[1, 2, DESCRIPTOR_VERSION])?;
            let transport = r.transport()?;
            let len = r.u64("region length")?;
            let count = r.domain_count()?;
            let mut domains = Vec::with_capacity(count);
            for i in 0..count {
                let address = r.address(i)?;
                let base = r.u64("domain base address")?;
                let key = r.u64("domain remote key")?;
                domains.push(DomainKey { address, base, key });
            }
            let gpu = if version < 2 { None } else { r.gpu()? };
            let incarnation = if version < 3 { 0 } else { r.u64("incarnation")? };
            Ok(RegionDescriptor { transport, len, domains, gpu, incarnation })
        })
    }
}

/// A new incarnation for an engine starting now: nanoseconds since the Unix epoch with the
/// low 16 bits random, so that later incarnations compare greater and two engines started
/// in the same instant still differ. Never 0 (which means unknown).
pub fn new_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    // std's RandomState is seeded from the OS once per process and advanced per instance.
    let r = std::collections::hash_map::RandomState::new().build_hasher().finish();
    ((now & !0xffff) | (r & 0xffff)).max(1)
}

fn check_transport(what: &'static str, found: &str, expected: &str) -> Result<(), Error> {
    if found == expected {
        Ok(())
    } else {
        Err(Error::Foreign { what, found: found.to_owned(), expected: expected.to_owned() })
    }
}

fn validate_common(
    what: &'static str,
    transport: &str,
    address_lens: impl ExactSizeIterator<Item = usize>,
) -> Result<(), Error> {
    let malformed = |reason: String| Err(Error::Malformed { what, reason });
    if transport.len() > MAX_TRANSPORT_LEN {
        return malformed(format!(
            "transport name is {} bytes, the limit is {MAX_TRANSPORT_LEN}",
            transport.len()
        ));
    }
    if address_lens.len() > MAX_DOMAINS {
        return malformed(format!("{} domains listed, the limit is {MAX_DOMAINS}", address_lens.len()));
    }
    for (i, len) in address_lens.enumerate() {
        if len > MAX_ADDRESS_LEN {
            return malformed(format!(
                "address of domain {i} is {len} bytes, the limit is {MAX_ADDRESS_LEN}"
            ));
        }
    }
    Ok(())
}

// Lengths beyond the prefix width saturate; such values exceed the limits and are rejected
// on decoding (and by `validate`), so saturation never yields a different valid value.
fn put_u16(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u16::try_from(n).unwrap_or(u16::MAX).to_le_bytes());
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    put_u16(out, s.len());
    out.extend_from_slice(s.as_bytes());
}

fn put_bytes32(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(b);
}

/// Runs `body` over a reader of `bytes`, then insists that every byte was used.
fn decode<T>(
    what: &'static str,
    bytes: &[u8],
    body: impl FnOnce(&mut Reader<'_>) -> Result<T, String>,
) -> Result<T, Error> {
    let mut r = Reader::new(bytes, 0);
    let value = body(&mut r).map_err(|reason| Error::Malformed { what, reason })?;
    let left = bytes.len() - r.pos;
    if left != 0 {
        return Err(Error::Malformed {
            what,
            reason: format!("{left} trailing byte(s) after the end of the encoding at offset {}", r.pos),
        });
    }
    Ok(value)
}

/// A bounds-checked cursor. Every method returns a reason string on failure.
impl Reader<'_> {
    /// Magic and version. `other` is the magic of the other kind of value, for a better message
    /// when the two are mixed up.
    fn header(
        &mut self,
        magic: [u8; 4],
        other: [u8; 4],
        other_what: &str,
        versions: &[u8],
    ) -> Result<u8, String> {
        let found: [u8; 4] = self.array("magic")?;
        if found == other {
            return Err(format!("these bytes are an encoded {other_what}"));
        }
        if found != magic {
            return Err(format!(
                "bad magic {:?}, expected {:?}",
                found.escape_ascii().to_string(),
                magic.escape_ascii().to_string()
            ));
        }
        let [version] = self.array("version")?;
        if !versions.contains(&version) {
            return Err(format!("unknown version {version}, this build reads version(s) {versions:?}"));
        }
        Ok(version)
    }

    /// The location part of a version 2 descriptor.
    fn gpu(&mut self) -> Result<Option<GpuRegion>, String> {
        match self.array::<1>("location")? {
            [0] => Ok(None),
            [1] => {
                let ordinal = self.u32("CUDA ordinal")?;
                let [flags] = self.array("GPU flags")?;
                if flags & !(FLAG_STAGED | FLAG_IPC) != 0 {
                    return Err(format!("unknown GPU flags {flags:#04x}"));
                }
                let ipc = if flags & FLAG_IPC != 0 {
                    Some(self.take(IPC_EXPORT_LEN, "CUDA IPC export")?.to_vec())
                } else {
                    None
                };
                let [n] = self.array("host id length")?;
                if usize::from(n) > MAX_HOST_ID_LEN {
                    return Err(format!("host id length {n} exceeds the limit of {MAX_HOST_ID_LEN}"));
                }
                let host = self.take(usize::from(n), "host id")?.to_vec();
                Ok(Some(GpuRegion { ordinal, staged: flags & FLAG_STAGED != 0, ipc, host }))
            }
            [other] => Err(format!("unknown location {other}")),
        }
    }

    fn transport(&mut self) -> Result<String, String> {
        let len = usize::from(self.u16("transport name length")?);
        if len > MAX_TRANSPORT_LEN {
            return Err(format!(
                "transport name length {len} exceeds the limit of {MAX_TRANSPORT_LEN} bytes"
            ));
        }
        let raw = self.take(len, "transport name")?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(format!("transport name is not UTF-8: {e}")),
        }
    }

    fn domain_count(&mut self) -> Result<usize, String> {
        let count = usize::from(self.u16("domain count")?);
        if count > MAX_DOMAINS {
            return Err(format!("domain count {count} exceeds the limit of {MAX_DOMAINS}"));
        }
        Ok(count)
    }

    fn address(&mut self, domain: usize) -> Result<Vec<u8>, String> {
        let len = self.u32("domain address length")?;
        // Compare in u64 so that the check holds on every pointer width.
        if u64::from(len) > MAX_ADDRESS_LEN as u64 {
            return Err(format!("address of domain {domain} is {len} bytes, the limit is {MAX_ADDRESS_LEN}"));
        }
        Ok(self.take(len as usize, "domain address")?.to_vec())
    }
}

#[cfg(test)]
#[path = "descriptor_tests.rs"]
mod tests;
