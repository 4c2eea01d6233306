//! How to open a [`LibfabricDomain`](super::LibfabricDomain): [`LibfabricConfig`], and how
//! user-facing provider names map to `fi_getinfo` ones.

use super::IMM_BYTES;

/// Default largest two-sided message, in bytes.
pub const DEFAULT_MAX_MSG_SIZE: usize = 8192;

/// How to open a [`LibfabricDomain`](super::LibfabricDomain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibfabricConfig {
    /// `"tcp"`, `"shm"`, `"udp"`, `"efa"`, or any `fi_info` provider name (`"tcp;ofi_rxm"`).
    pub provider: String,
    /// Address to bind to, for the socket-based providers (`tcp`, `udp`). Defaults to
    /// `127.0.0.1`. Ignored by `shm` (which needs a NULL node so each endpoint gets its own
    /// region name).
    pub node: Option<String>,
    /// Largest [`Op::Send`](crate::provider::Op::Send) accepted, capped by the provider's
    /// `ep_attr.max_msg_size`.
    pub max_msg_size: usize,
    /// Transmit queue depth hint (`tx_attr.size`); provider default when `None`.
    pub tx_depth: Option<usize>,
    /// Receive queue depth hint (`rx_attr.size`); provider default when `None`.
    pub rx_depth: Option<usize>,
    /// The libfabric domain (NIC) to open, by its `fi_info` domain name (EFA:
    /// `"rdmap16s27-rdm"`; `fi_info -p efa` lists them). `None`: the provider's first.
    pub domain: Option<String>,
    /// Bytes of remote CQ data every write must be able to carry: 4 (the 32-bit immediate)
    /// by default. A provider offering less is refused with
    /// [`Error::NoRemoteCqData`](crate::Error::NoRemoteCqData) (every provider of libfabric
    /// 1.17 offers 8, so asking for more is how that path is tested).
    pub cq_data_size: usize,
    /// Ask `tcp` for delivery-complete writes (see [`Domain::delivery_complete`](crate::provider::Domain::delivery_complete)).
    /// Default `true`; the environment variable `FABRIC_DELIVERY_COMPLETE=0` (or `off`, `false`,
    /// `no`) makes the
    /// default `false`, for measuring what the guarantee costs (without it a write to a bad
    /// key can look successful on tcp, and `Arrivals::One` over several NICs is refused).
    pub delivery_complete: bool,
    /// Ask for `FI_HMEM` (and offer `FI_MR_HMEM`), so that GPU memory is registered with the
    /// provider itself (`fi_mr_regattr` with `FI_HMEM_CUDA`: GPUDirect where the provider and
    /// the libfabric build can, e.g. EFA, or `shm`/`tcp` of a libfabric configured
    /// `--with-cuda`). Dropped when the provider refuses it. Default: on for `efa` (its NIC
    /// reads and writes GPU memory: the point of GPUDirect), off for `shm` and `tcp` (on one
    /// host, libfabric 1.17's `shm` moved GPU memory at 0.09-0.15x the engine's staged path;
    /// docs/gpu.md); `FABRIC_LIBFABRIC_HMEM=1` or `0` sets it for every provider. Without it,
    /// GPU regions are staged (or written through CUDA IPC).
    pub hmem: bool,
}

impl LibfabricConfig {
    /// The defaults, for `provider`.
    pub fn new(provider: impl Into<String>) -> Self {
        let provider = provider.into();
        LibfabricConfig {
            hmem: crate::env::switch("FABRIC_LIBFABRIC_HMEM", prov_name_for(&provider) == "efa"),
            provider,
            node: None,
            max_msg_size: DEFAULT_MAX_MSG_SIZE,
            tx_depth: None,
            rx_depth: None,
            domain: None,
            cq_data_size: IMM_BYTES,
            delivery_complete: crate::env::switch("FABRIC_DELIVERY_COMPLETE", true),
        }
    }
}

impl Default for LibfabricConfig {
    fn default() -> Self {
        LibfabricConfig::new("tcp")
    }
}

/// The `fi_getinfo` provider name for a user-facing one.
pub(super) fn prov_name_for(provider: &str) -> &str {
    match provider {
        "tcp" => "tcp;ofi_rxm",
        "udp" => "udp;ofi_rxd",
        other => other,
    }
}

/// Whether a provider is socket based (binds to an IP address on `node`).
pub(super) fn is_socket_provider(prov_name: &str) -> bool {
    let core = prov_name.split(';').next().unwrap_or(prov_name);
    matches!(core, "tcp" | "udp" | "sockets")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_names_map() {
        assert_eq!(prov_name_for("tcp"), "tcp;ofi_rxm");
        assert_eq!(prov_name_for("udp"), "udp;ofi_rxd");
        assert_eq!(prov_name_for("shm"), "shm");
        assert_eq!(prov_name_for("efa"), "efa");
        assert_eq!(prov_name_for("verbs;ofi_rxm"), "verbs;ofi_rxm");
        assert!(is_socket_provider("tcp;ofi_rxm"));
        assert!(!is_socket_provider("shm"));
    }
}
