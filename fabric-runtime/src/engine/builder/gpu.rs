//! The GPU settings of [`EngineBuilder`]: the staging pool, CUDA IPC, the streams, and
//! whether libfabric registers GPU memory itself (`FI_HMEM`).

use super::EngineBuilder;
use crate::error::{Error, Result};

impl EngineBuilder {
    /// Chunk size of a staged GPU transfer, and so the size of one bounce slot of the
    /// staging pool (default 4 MiB): the copy engine moves chunk k+1 between GPU memory and
    /// a pinned slot while the NIC moves chunk k. Zero is refused by `build`
    /// ([`Error::Config`]). See `docs/gpu.md`.
    pub fn staging_chunk(mut self, bytes: u64) -> Self {
        self.staging_chunk = bytes;
        self
    }

    /// Bytes of pinned, NIC-registered host memory that staged GPU transfers bounce
    /// through (default 64 MiB: 16 slots of the default 4 MiB [`staging_chunk`]). Cut into
    /// `bytes / staging_chunk` slots (rounded down); one pool per engine, allocated by its
    /// first staged GPU region, shared by every staged transfer in both directions (a
    /// transfer waits for a free slot, never fails for lack of one). A staged region pins no
    /// host memory of its own size. `build` refuses ([`Error::Config`]) a pool smaller than
    /// one chunk or of more than 2^20 - 1 slots.
    ///
    /// [`staging_chunk`]: EngineBuilder::staging_chunk
    pub fn staging_pool(mut self, bytes: u64) -> Self {
        self.staging_pool = bytes;
        self
    }

    /// The staging pool's slot count and slot size these settings give, or why they are
    /// refused.
    pub(crate) fn staging_slots(&self) -> Result<(u32, u64)> {
        let chunk = self.staging_chunk;
        if chunk == 0 {
            return Err(Error::Config("staging_chunk(0): chunks need at least one byte".into()));
        }
        let slots = self.staging_pool / chunk;
        if slots == 0 {
            return Err(Error::Config(format!(
                "staging_pool({}) is smaller than one staging_chunk({chunk}): the pool needs at least one slot",
                self.staging_pool
            )));
        }
        if slots > (1 << 20) - 1 {
            return Err(Error::Config(format!(
                "staging_pool({}) / staging_chunk({chunk}) = {slots} slots; at most {} (raise the chunk)",
                self.staging_pool,
                (1u64 << 20) - 1
            )));
        }
        Ok((slots as u32, chunk))
    }

    /// Whether writes into a GPU region of an engine on this host go through CUDA IPC (the
    /// copy engine writes the peer's GPU memory directly; default `true`). With `false` they
    /// take the region's network path (staged or GPUDirect), as across hosts.
    pub fn cuda_ipc(mut self, enabled: bool) -> Self {
        self.cuda_ipc = enabled;
        self
    }

    /// libfabric transports: ask the provider for `FI_HMEM`, so GPU regions are registered
    /// with it (`fi_mr_regattr`, `FI_HMEM_CUDA`) and its NICs read and write GPU memory
    /// themselves (GPUDirect: EFA, or `shm`/`tcp` of a libfabric built with CUDA). A provider
    /// that refuses `FI_HMEM`, or a libfabric without CUDA (Debian's), leaves GPU regions
    /// staged as without it. Default: on for `efa`, off for `shm` and `tcp`, where on one host
    /// libfabric's own device-memory path was 7-10x slower than the engine's staging (and CUDA
    /// IPC is faster than both); `FABRIC_LIBFABRIC_HMEM=1` or `0` sets the default for every
    /// provider. See `docs/gpu.md`, "GPUDirect through libfabric".
    pub fn libfabric_hmem(mut self, enabled: bool) -> Self {
        self.libfabric_hmem = Some(enabled);
        self
    }

    /// CUDA streams per device that the engine's copies (CUDA IPC writes, staging copies)
    /// are spread over (default 4; 1 to 64, clamped). Copies of concurrent operations go
    /// to different streams (the one with the fewest copies in flight), so they overlap on
    /// the copy engines instead of queueing behind each other (and a lone copy finds an idle
    /// stream); the chunks of one staged transfer share a stream.
    /// Streams are created at the first copy on a device.
    pub fn cuda_streams(mut self, streams: usize) -> Self {
        self.cuda_streams = streams.clamp(1, 64);
        self
    }
}
