//! Peer addresses: libfabric's are the provider's own bytes (a `sockaddr_in`, an shm name);
//! before one is handed to `fi_av_insert` its shape is checked against ours, so that the
//! provider never reads past what a peer sent.

use std::ffi::c_int;

use libfabric_sys as sys;

use super::error::{check, provider_error};
use super::fid::Fid;
use crate::error::Error;

/// `fi_getname` of the endpoint: our own address, as peers name us.
pub(super) fn getname(ep: &Fid<sys::fid_ep>) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; 128];
    for _ in 0..2 {
        let mut len = buf.len();
        // SAFETY: ep is open and enabled; buf is writable for len bytes; len is updated.
        let ret = unsafe { sys::fabric_shim_fi_getname(ep.fid(), buf.as_mut_ptr().cast(), &mut len) };
        if ret == -(sys::FI_ETOOSMALL as c_int) && len > buf.len() {
            buf.resize(len, 0);
            continue;
        }
        check("fi_getname", ret as isize)?;
        buf.truncate(len);
        return Ok(buf);
    }
    Err(provider_error("fi_getname", sys::FI_ETOOSMALL as i32))
}

/// Checks that `peer` can safely be handed to `fi_av_insert` as one address in `format`,
/// judged against our own address `ours`:
///
/// * `FI_ADDR_STR` (shm: `"fi_shm://PID:N:0\0"`, variable length): NUL-terminated (the provider
///   reads up to the NUL), no interior NUL, ASCII, same `scheme://` prefix, at most
///   `FI_NAME_MAX` bytes.
/// * every other (binary, fixed-size) format: exactly our length; for `FI_SOCKADDR_IN` also
///   the `AF_INET` family.
pub(super) fn validate_peer_address(
    format: u32,
    ours: &[u8],
    peer: &[u8],
    transport: &str,
) -> Result<(), Error> {
    let malformed = |reason: String| Err(Error::Malformed { what: "peer address", reason });
    if format == sys::FI_ADDR_STR {
        let max = sys::FI_NAME_MAX as usize;
        if peer.is_empty() || peer.len() > max {
            return malformed(format!("{} bytes, {transport} addresses are 1..={max}", peer.len()));
        }
        let Some((&0, text)) = peer.split_last() else {
            return malformed("string address is not NUL-terminated".into());
        };
        if text.contains(&0) || !text.is_ascii() {
            return malformed("string address has a NUL or non-ASCII byte inside".into());
        }
        let scheme = |a: &[u8]| a.windows(3).position(|w| w == b"://").map(|i| a[..i + 3].to_vec());
        let ours_text = ours.strip_suffix(&[0]).unwrap_or(ours);
        if scheme(text).is_none() || scheme(text) != scheme(ours_text) {
            return malformed(format!("{:?} is not a {transport} address", String::from_utf8_lossy(text)));
        }
        return Ok(());
    }
    if peer.len() != ours.len() {
        return malformed(format!(
            "{} bytes, but {transport} addresses are {} bytes",
            peer.len(),
            ours.len()
        ));
    }
    if format == sys::FI_SOCKADDR_IN {
        let family = u16::from_ne_bytes([peer[0], peer[1]]);
        if family != libc::AF_INET as u16 {
            return malformed(format!("address family {family} is not AF_INET"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_addresses_are_validated() {
        let shm = b"fi_shm://123:4:0\0";
        let ok = |a: &[u8]| validate_peer_address(sys::FI_ADDR_STR, shm, a, "shm");
        assert!(ok(b"fi_shm://123:10:0\0").is_ok(), "longer string addresses are fine");
        assert!(ok(b"fi_shm://123:4:0").is_err(), "no NUL");
        assert!(ok(b"fi_shm://1\x0023:4:0\0").is_err(), "interior NUL");
        assert!(ok(b"fi_sock://1.2.3.4\0").is_err(), "other scheme");
        assert!(ok(b"\0").is_err());
        assert!(ok(b"").is_err());
        assert!(ok(&[b'a'; 300]).is_err());
        let sin = [2u8, 0, 1, 2, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        let ok = |a: &[u8]| validate_peer_address(sys::FI_SOCKADDR_IN, &sin, a, "tcp;ofi_rxm");
        assert!(ok(&sin).is_ok());
        assert!(ok(&sin[..15]).is_err());
        let mut wrong = sin;
        wrong[0] = 10;
        assert!(ok(&wrong).is_err());
    }

    /// 100,000 peer addresses (noise, and mutations of valid shm and tcp addresses) through
    /// the check that guards `fi_av_insert`: never a panic, and what it accepts has the
    /// shape the provider reads (NUL-terminated with our scheme, or exactly our length).
    #[test]
    fn fuzz_peer_address_check_never_panics() {
        let mut rng = crate::pure::test_rng::Rng(0x2545_f491_4f6c_dd1d);
        let shm: &[u8] = b"fi_shm://123:4:0\0";
        let sin: &[u8] = &[2u8, 0, 1, 2, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        let mut accepted = 0;
        let mut input = Vec::new();
        for i in 0..100_000 {
            let (format, ours) =
                if i % 2 == 0 { (sys::FI_ADDR_STR, shm) } else { (sys::FI_SOCKADDR_IN, sin) };
            input.clear();
            if i % 5 == 0 {
                let len = rng.below(300);
                input.extend((0..len).map(|_| rng.next() as u8));
            } else {
                input.extend_from_slice(ours);
                for _ in 0..=rng.below(3) {
                    let at = rng.below(input.len());
                    input[at] =
                        if rng.next() & 1 == 0 { rng.next() as u8 } else { b'0' + rng.below(10) as u8 };
                }
                match rng.below(4) {
                    0 => input.truncate(rng.below(input.len() + 1)),
                    1 => input.extend((0..rng.below(8)).map(|_| b'0' + rng.below(10) as u8)),
                    _ => {}
                }
            }
            if validate_peer_address(format, ours, &input, "t").is_ok() {
                accepted += 1;
                if format == sys::FI_ADDR_STR {
                    assert_eq!(input.last(), Some(&0));
                    assert!(!input[..input.len() - 1].contains(&0));
                } else {
                    assert_eq!(input.len(), ours.len());
                }
            }
        }
        assert!(accepted > 0, "the loop reached valid addresses");
    }
}
