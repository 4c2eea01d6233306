//! GPU state the engine and its reactor share: staged regions by key (a pull names its
//! destination by the key of its descriptor), CUDA IPC mappings of peers' regions, the path
//! chosen per device, and this host's identity (for CUDA IPC between its processes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use super::memory::RegionShared;
use crate::cuda::{IpcExport, IpcMapping};
use crate::error::Result;
use crate::pure::staging::GpuPath;
use crate::sync::lock;

/// Default chunk of a staged transfer (one bounce slot): the copy of chunk k+1 overlaps the
/// network transfer of chunk k.
pub(crate) const DEFAULT_STAGING_CHUNK: u64 = 4 << 20;
/// Default bytes of the pinned bounce pool (16 slots of 4 MiB).
pub(crate) const DEFAULT_STAGING_POOL: u64 = 64 << 20;

pub(crate) struct GpuShared {
    /// Staged GPU regions of this engine by their NIC-0 remote key.
    staged: Mutex<HashMap<u64, Weak<RegionShared>>>,
    /// Peers' regions opened through CUDA IPC, by their export.
    ipc: Mutex<HashMap<[u8; IpcExport::WIRE_LEN], Arc<IpcMapping>>>,
    /// The path the first GPU region of each device took.
    pub(crate) paths: Mutex<HashMap<u32, GpuPath>>,
    /// `/proc/sys/kernel/random/boot_id`: equal on two engines of one host (boot).
    pub(crate) host_id: Option<Vec<u8>>,
    /// Bytes per bounce slot: the chunk of every staged copy.
    pub(crate) chunk: u64,
    /// Number of bounce slots of the pool.
    pub(crate) slots: u32,
    /// The pinned bounce pool, registered with every NIC: allocated by the first staged GPU
    /// region (`pool_init` serializes that), then taken over by the reactor (which keeps it
    /// until shutdown; holding it here would be a cycle through `Shared`).
    pub(crate) pool: Mutex<Option<Arc<RegionShared>>>,
    pub(crate) pool_init: futures::lock::Mutex<bool>,
    /// Whether same-host GPU destinations are written through CUDA IPC.
    pub(crate) ipc_enabled: bool,
    /// `EngineBuilder::cuda_streams`: streams per device for the reactor's copies.
    pub(crate) streams: usize,
}

impl Default for GpuShared {
    fn default() -> Self {
        GpuShared {
            staged: Mutex::default(),
            ipc: Mutex::default(),
            paths: Mutex::default(),
            host_id: host_id(),
            chunk: DEFAULT_STAGING_CHUNK,
            slots: (DEFAULT_STAGING_POOL / DEFAULT_STAGING_CHUNK) as u32,
            pool: Mutex::default(),
            pool_init: futures::lock::Mutex::new(false),
            ipc_enabled: true,
            streams: 1,
        }
    }
}

/// This boot's identity, or `None` where the kernel does not say.
pub(crate) fn host_id() -> Option<Vec<u8>> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let s = s.trim();
    (!s.is_empty() && s.len() <= 64).then(|| s.as_bytes().to_vec())
}

impl GpuShared {
    pub(crate) fn track_staged(&self, key: u64, region: &Arc<RegionShared>) {
        lock(&self.staged).insert(key, Arc::downgrade(region));
    }

    /// Called by the region's drop: forgets it if `key` still names it.
    pub(crate) fn forget_staged(&self, key: u64, region: *const RegionShared) {
        let mut m = lock(&self.staged);
        if m.get(&key).is_some_and(|w| std::ptr::eq(w.as_ptr(), region)) {
            m.remove(&key);
        }
    }

    /// The live staged region with NIC-0 key `key`.
    pub(crate) fn staged(&self, key: u64) -> Option<Arc<RegionShared>> {
        lock(&self.staged).get(&key).and_then(Weak::upgrade)
    }

    /// The mapping of a peer's export, opened on device `ordinal` at first use and kept for
    /// the engine's life.
    pub(crate) fn ipc_mapping(&self, export: &IpcExport, ordinal: usize) -> Result<Arc<IpcMapping>> {
        let key = export.to_bytes();
        if let Some(m) = lock(&self.ipc).get(&key) {
            return Ok(m.clone());
        }
        let m = Arc::new(IpcMapping::open(&crate::cuda::context(ordinal)?, export)?);
        Ok(lock(&self.ipc).entry(key).or_insert(m).clone())
    }
}
