//! How to open a [`VerbsDomain`](super::VerbsDomain): [`VerbsConfig`] and its defaults.

use std::time::Duration;

/// Default largest two-sided message, in bytes (the engine's default too).
pub const DEFAULT_MAX_MSG_SIZE: usize = 8192;

/// Default [`VerbsConfig::keepalive`]: a connected peer that completed nothing for this long
/// gets a keep-alive probe (see "Faults" in the module docs).
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_millis(100);

/// Default [`VerbsConfig::revive_timeout`]: how long a peer the engine marked down has to
/// answer the handshake of its revival (tcp's revival waits up to 1 s for a connection).
pub const DEFAULT_REVIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How to open a [`VerbsDomain`](super::VerbsDomain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Device name (`"rxe0"`, `"mlx5_0"`); `None`: the first device with an ACTIVE port.
    pub device: Option<String>,
    /// Port number; `None`: the first ACTIVE port of the device.
    pub port: Option<u8>,
    /// GID index; `None`: chosen by type and address (RoCEv2 with an IPv4-mapped address
    /// first, see [`select_gid`](super::select_gid)).
    pub gid_index: Option<u32>,
    /// Largest [`Op::Send`](crate::provider::Op::Send) accepted, and the size of each message
    /// receive slot.
    pub max_msg_size: usize,
    /// Zero-length receives kept posted on the imm SRQ, which every peer's data QP shares:
    /// one is consumed per `RDMA_WRITE_WITH_IMM` that arrives (capped by the device's
    /// `max_srq_wr`). They name no memory.
    pub recv_slots: usize,
    /// Message receive slots of `max_msg_size` bytes kept posted on the message SRQ, which
    /// every peer's message QP shares: one is consumed per arriving
    /// [`Op::Send`](crate::provider::Op::Send) (capped by the device's `max_srq_wr`). These are
    /// the backend's only registered receive memory.
    pub msg_slots: usize,
    /// Send queue depth of each RC QP, data and message QP alike (capped by the device's
    /// `max_qp_wr`).
    pub sq_depth: u32,
    /// Completion queue size (capped by the device's `max_cqe`). It must hold one entry per
    /// receive of both SRQs and of the UD QP, plus every send in flight: what is left after
    /// the receives bounds the sends in flight over all QPs, so that the CQ can never overflow.
    pub cq_depth: u32,
    /// How long a peer may take to answer the connection handshake.
    pub connect_timeout: Duration,
    /// How long a peer the engine marked down may take to answer the handshake of its
    /// revival ([`Domain::revive_peer`](crate::provider::Domain::revive_peer), the engine's
    /// `add_peer` of it): past it the revival fails and the peer stays down. Shorter than
    /// `connect_timeout`, because `add_peer` waits for it. Default [`DEFAULT_REVIVE_TIMEOUT`]
    /// (2 s).
    pub revive_timeout: Duration,
    /// Keep-alive: a connected peer with nothing in flight that has completed nothing for
    /// this long gets a probe, a zero-length RDMA write on its data QP (at most one in flight
    /// per peer; internal, never an engine operation). A dead peer's QP no longer answers, so
    /// the probe fails after the transport's retries (`IBV_WC_RETRY_EXC_ERR`, ~0.5 s) and the
    /// peer is reported down ([`Completion::PeerDown`](crate::provider::Completion::PeerDown))
    /// even when nothing is posted to it. A live peer's NIC acknowledges the probe without
    /// its process. `None` (or zero): no probes (a dead peer is found by the next operation to it).
    /// Default [`DEFAULT_KEEPALIVE`] (100 ms).
    pub keepalive: Option<Duration>,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: None,
            gid_index: None,
            max_msg_size: DEFAULT_MAX_MSG_SIZE,
            recv_slots: 2048,
            msg_slots: 64,
            sq_depth: 512,
            cq_depth: 16384,
            connect_timeout: Duration::from_secs(30),
            revive_timeout: DEFAULT_REVIVE_TIMEOUT,
            keepalive: Some(DEFAULT_KEEPALIVE),
        }
    }
}

impl VerbsConfig {
    /// The config for an engine provider name: `"verbs"` or `"verbs:DEVICE"`.
    pub fn from_provider_name(name: &str) -> Option<VerbsConfig> {
        let device = match name.strip_prefix("verbs") {
            Some("") => None,
            Some(rest) => Some(rest.strip_prefix(':').filter(|d| !d.is_empty())?.to_owned()),
            None => return None,
        };
        Some(VerbsConfig { device, ..VerbsConfig::default() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_names_parse() {
        assert_eq!(VerbsConfig::from_provider_name("verbs").unwrap().device, None);
        assert_eq!(VerbsConfig::from_provider_name("verbs:rxe0").unwrap().device.as_deref(), Some("rxe0"));
        assert!(VerbsConfig::from_provider_name("verbs:").is_none());
        assert!(VerbsConfig::from_provider_name("verbsx").is_none());
        assert!(VerbsConfig::from_provider_name("tcp").is_none());
    }
}
