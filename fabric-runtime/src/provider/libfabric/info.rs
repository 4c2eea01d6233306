//! The `fi_getinfo` hints: what the engine needs of a provider (an RDM endpoint with RMA and
//! remote CQ data), what it offers (the EFA `mr_mode` set) and what it asks for if it can
//! have it ([`Extras`]), and what a refusal means.

use std::ffi::{c_char, c_int, CString};
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use super::config::LibfabricConfig;
use super::error::{check, provider_error};
use super::fid::Info;
use super::IMM_BYTES;
use crate::error::Error;

/// The memory-registration modes offered to the provider (the EFA set); the provider answers
/// with the subset it needs, and [`LibfabricDomain`](super::LibfabricDomain) honours that answer.
const MR_MODE_OFFERED: u32 = sys::FI_MR_LOCAL
    | sys::FI_MR_VIRT_ADDR
    | sys::FI_MR_ALLOCATED
    | sys::FI_MR_PROV_KEY
    | sys::FI_MR_ENDPOINT;

/// Capabilities asked for. `FI_REMOTE_CQ_DATA` is deliberately absent: it is an operation
/// flag, and putting it in caps makes `fi_getinfo` fail with -61 (TESTBEDS.md §1).
const CAPS: u64 =
    (sys::FI_MSG | sys::FI_RMA | sys::FI_WRITE | sys::FI_REMOTE_WRITE | sys::FI_READ | sys::FI_REMOTE_READ)
        as u64;

/// Copies a Rust string into a `malloc`ed C string that `fi_freeinfo` may free.
fn strdup(s: &str) -> Result<*mut c_char, Error> {
    let c = CString::new(s).map_err(|_| Error::Config(format!("{s:?} contains a NUL byte")))?;
    // SAFETY: c is a valid NUL-terminated string; strdup copies it into malloc'ed memory.
    let p = unsafe { libc::strdup(c.as_ptr()) };
    if p.is_null() {
        return Err(provider_error("strdup", libc::ENOMEM));
    }
    Ok(p)
}

/// Optional asks of the hints, dropped when a provider refuses them.
///
/// * `delivery_complete`: writes complete locally only once the data has been placed at
///   the target (`FI_DELIVERY_COMPLETE` as the default op flag), as on verbs RC. Without it
///   `tcp;ofi_rxm` completes a write once it is sent, so a write the target rejects (a bad
///   key) would look successful. Measured on loopback tcp at 4 MiB writes: no visible
///   throughput cost. Asked of `tcp` only; whether it was granted is read back from the
///   `fi_info` the endpoint is opened with
///   ([`Domain::delivery_complete`](crate::provider::Domain::delivery_complete)), never
///   assumed.
/// * `source`: the `FI_SOURCE` capability, so received messages name their sender.
/// * `hmem`: the `FI_HMEM` capability and the `FI_MR_HMEM` registration mode, so GPU memory
///   is registered with the provider ([`LibfabricConfig::hmem`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Extras {
    pub(super) delivery_complete: bool,
    pub(super) source: bool,
    pub(super) hmem: bool,
}

impl Extras {
    pub(super) const NONE: Extras = Extras { delivery_complete: false, source: false, hmem: false };
    const BASE: [Extras; 4] = [
        Extras { delivery_complete: true, source: true, hmem: false },
        Extras { delivery_complete: true, source: false, hmem: false },
        Extras { delivery_complete: false, source: true, hmem: false },
        Extras::NONE,
    ];

    /// The asks in order of preference: with `FI_HMEM` first when `hmem`, then without.
    pub(super) fn preference(hmem: bool) -> Vec<Extras> {
        let with = Self::BASE.iter().filter(|_| hmem).map(|e| Extras { hmem: true, ..*e });
        with.chain(Self::BASE).collect()
    }
}

/// The inputs of one `fi_getinfo` call.
pub(super) struct Query {
    pub(super) prov_name: String,
    pub(super) node: Option<CString>,
    pub(super) flags: u64,
    pub(super) socket: bool,
}

impl Query {
    /// `fi_getinfo` with the full hints (`full`) or the minimal ones (RDM + provider name).
    /// `extras` adds the optional asks of [`Extras`] to the full hints.
    pub(super) fn getinfo(&self, cfg: &LibfabricConfig, full: bool, extras: Extras) -> Result<Info, Error> {
        let hints = Info::alloc()?;
        let h = hints.as_ptr();
        let prov = strdup(&self.prov_name)?;
        let domain_name = cfg.domain.as_deref().map(strdup).transpose()?;
        // SAFETY: fi_allocinfo allocated hints and all its attribute structs (non-null, zeroed);
        // the strings are malloc'ed and become owned by hints (freed by fi_freeinfo).
        unsafe {
            (*(*h).fabric_attr).prov_name = prov;
            if let Some(name) = domain_name {
                (*(*h).domain_attr).name = name;
            }
            (*(*h).ep_attr).type_ = sys::FI_EP_RDM;
            if self.socket {
                (*h).addr_format = sys::FI_SOCKADDR_IN;
            }
            if full {
                (*h).caps = CAPS;
                if extras.source {
                    (*h).caps |= sys::FI_SOURCE;
                }
                if extras.hmem {
                    (*h).caps |= sys::FI_HMEM;
                }
                if extras.delivery_complete && self.prov_name.starts_with("tcp") {
                    (*(*h).tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE as u64;
                }
                (*h).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
                let d = (*h).domain_attr;
                (*d).mr_mode = (MR_MODE_OFFERED | if extras.hmem { sys::FI_MR_HMEM } else { 0 }) as c_int;
                (*d).threading = sys::FI_THREAD_DOMAIN;
                (*d).cq_data_size = cfg.cq_data_size.max(IMM_BYTES);
                if let Some(n) = cfg.tx_depth {
                    (*(*h).tx_attr).size = n;
                }
                if let Some(n) = cfg.rx_depth {
                    (*(*h).rx_attr).size = n;
                }
            }
        }
        let mut out: *mut sys::fi_info = ptr::null_mut();
        let node = self.node.as_ref().map_or(ptr::null(), |n| n.as_ptr());
        // SAFETY: node is NULL or a live C string, service is NULL, hints is a valid fi_info,
        // out receives a list we own (wrapped in Info below).
        let ret = unsafe {
            sys::fi_getinfo(sys::fabric_shim_version(), node, ptr::null(), self.flags, h, &mut out)
        };
        check("fi_getinfo", ret as isize)?;
        NonNull::new(out).map(Info).ok_or_else(|| provider_error("fi_getinfo", sys::FI_ENODATA as i32))
    }
}

/// What a failed `fi_getinfo` with the full hints means, given the retry with minimal hints
/// (`FI_EP_RDM` and the provider name only): the provider exists but cannot do what the engine
/// needs (RMA with remote CQ data), or it does not exist here at all.
pub(super) fn getinfo_failure(provider: String, full_err: Error, minimal: Result<(), Error>) -> Error {
    match minimal {
        Ok(()) => Error::NoRemoteCqData {
            provider,
            reason: format!(
                "it offers FI_EP_RDM but not RMA with {IMM_BYTES}-byte remote CQ data under the \
                 required hints ({full_err})"
            ),
        },
        Err(min_err) => Error::ProviderNotFound { provider, reason: min_err.to_string() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getinfo_failures_are_classified() {
        let nodata = || provider_error("fi_getinfo", sys::FI_ENODATA as i32);
        assert!(matches!(
            getinfo_failure("x".into(), nodata(), Ok(())),
            Error::NoRemoteCqData { provider, .. } if provider == "x"
        ));
        assert!(matches!(
            getinfo_failure("x".into(), nodata(), Err(nodata())),
            Error::ProviderNotFound { provider, .. } if provider == "x"
        ));
    }
}
