//! What can go wrong, with what a caller can act on.
#![forbid(unsafe_code)]

use fabric_async::BootstrapError;

/// The result type of this crate.
pub type Result<T, E = MoeError> = std::result::Result<T, E>;

/// Errors of [`AllToAll`](crate::AllToAll).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MoeError {
    /// The config is inconsistent, or the ranks do not agree on it.
    #[error("moe config: {0}")]
    Config(String),
    /// A CUDA call failed, or there is no usable CUDA driver or device
    /// (`fabric_async::Error::Unsupported`).
    #[error("moe: {0}")]
    Cuda(#[from] fabric_async::Error),
    /// Meeting the other ranks through the rendezvous store failed.
    #[error("moe rendezvous: {0}")]
    Bootstrap(#[from] BootstrapError),
    /// A rank is on another host and the config asked for [`Transport::Nvlink`]
    /// (`Transport::Auto` takes the proxy transport to it).
    ///
    /// [`Transport::Nvlink`]: crate::Transport::Nvlink
    #[error("moe: rank {rank} is on another host; the nvlink transport needs every rank on this one (use Transport::Auto or Proxy)")]
    OtherHost {
        /// The rank on another host.
        rank: usize,
    },
    /// A receive stage (or the GPU barrier) gave up waiting for its peers: a peer died,
    /// stalled, or did not run the matching stage. The all-to-all is unusable afterwards.
    #[error("moe: {stage} timed out waiting for its peers")]
    Timeout {
        /// `dispatch_recv`, `combine_recv` or `barrier`.
        stage: &'static str,
    },
    /// More rows were routed to local expert `expert` than `expert_capacity`; the excess
    /// was dropped.
    #[error("moe: local expert {expert} received more rows than its capacity")]
    CapacityExceeded {
        /// The local expert index.
        expert: usize,
    },
    /// `topk_idx` held an expert id past `ranks * experts_per_rank` (token `token`); it
    /// was ignored.
    #[error("moe: token {token} names an expert id out of range")]
    BadExpert {
        /// The token index of the step.
        token: usize,
    },
    /// The proxy thread could not write a stage's rows to a rank (an engine error: the peer
    /// is gone, a registration was refused, ...). The receiving rank's wait then times out;
    /// the all-to-all is unusable afterwards.
    #[error("moe: proxy write of {stage} to rank {rank} failed: {message}")]
    Transport {
        /// `dispatch`, `combine` or `barrier`.
        stage: &'static str,
        /// The destination rank.
        rank: usize,
        /// The engine's error.
        message: String,
    },
    /// A launch argument is out of range (`num_tokens` above `max_tokens`, ...).
    #[error("moe: {0}")]
    Argument(String),
}
