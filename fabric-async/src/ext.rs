//! tokio conveniences around the runtime's futures.

use std::time::Duration;

use async_trait::async_trait;

use crate::bootstrap::{BootstrapError, Rendezvous};
use crate::{Engine, Error, ImmCounter, MemoryRegion, PeerId, RemoteRegion};

/// Deadlines for counter waits.
#[async_trait]
pub trait ImmCounterExt {
    /// Waits until `n` arrivals are available and consumes them (`Ok(true)`), or gives up
    /// after `timeout` having consumed nothing (`Ok(false)`). `Err(Error::Shutdown)` if the
    /// engine shut down first; `Err(Error::CounterLimit)` or `Err(Error::CounterRetired)` at
    /// once where [`ImmCounter::wait_for`] says.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, like [`ImmCounter::wait_for`]: a timed-out or dropped wait consumes
    /// nothing.
    async fn wait_for_timeout(&self, n: u64, timeout: Duration) -> Result<bool, Error>;

    /// Waits until `n` arrivals are available and consumes them, unless one of `peers` (the
    /// senders the arrivals come from) goes down or is removed first: then
    /// [`Error::PeerUnreachable`] for that peer, once the wait has not ended by itself within
    /// [`DOWN_GRACE`](crate::DOWN_GRACE) (arrivals already on their way still count). A wait
    /// tied to its senders, where [`ImmCounter::wait_for`] alone would wait for a dead one
    /// forever.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, like [`ImmCounter::wait_for`]: a failed or dropped wait consumes nothing.
    async fn wait_for_from(&self, engine: &Engine, peers: &[PeerId], n: u64) -> Result<(), Error>;
}

#[async_trait]
impl ImmCounterExt for ImmCounter {
    async fn wait_for_timeout(&self, n: u64, timeout: Duration) -> Result<bool, Error> {
        match tokio::time::timeout(timeout, self.wait_for(n)).await {
            Ok(r) => r.map(|()| true),
            Err(_elapsed) => Ok(false),
        }
    }

    async fn wait_for_from(&self, engine: &Engine, peers: &[PeerId], n: u64) -> Result<(), Error> {
        crate::down::unless_down(engine, peers, self.wait_for(n)).await
    }
}

/// Publishes `region`'s descriptor under `key` in a rendezvous store.
///
/// # Cancel safety
///
/// As the store's `put`.
pub async fn publish_region(
    store: &dyn Rendezvous,
    key: &str,
    region: &MemoryRegion,
) -> Result<(), BootstrapError> {
    store.put(key, region.descriptor().to_bytes()).await
}

/// Waits for a descriptor under `key` and turns it into a remote region of `engine`.
///
/// # Cancel safety
///
/// As the store's `get` followed by [`Engine::remote_region`].
pub async fn fetch_region(
    engine: &Engine,
    store: &dyn Rendezvous,
    key: &str,
) -> Result<RemoteRegion, FetchError> {
    let bytes = store.get(key).await?;
    Ok(engine.remote_region(&bytes).await?)
}

/// Why [`fetch_region`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The store did not deliver the descriptor.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// The descriptor was refused.
    #[error(transparent)]
    Fabric(#[from] Error),
}
