//! The NVLink transport: every rank's window mapped into every other rank's address space
//! through CUDA IPC, so a kernel writes a peer's receive buffers and flags with plain
//! stores (over NVLink between GPUs, or within one GPU when ranks share it).
//!
//! ```text
//!  rank a: export(window_a) ─┐                        ┌─ export(window_b): rank b
//!                            ├─ rendezvous all_gather ┤
//!  rank a: open(window_b) ◄──┘   (boot id, shape,     └──► open(window_a): rank b
//!          peers[b] = mapped      IPC handle)               peers[a] = mapped
//! ```
//!
//! At `new` every rank publishes its host's boot id, the shape it was configured with and
//! the IPC export of its window; a rank with another shape fails the exchange with a clear
//! error instead of a wrong mapping. The same records decide which pairs of ranks take the
//! proxy transport instead (`proxy/`): those on different hosts (`Transport::Auto`), or
//! all (`Transport::Proxy`); every rank computes the same answer from the same records.
//! Those ranks' windows are not mapped.

use std::sync::Arc;

use fabric_async::bootstrap::{all_gather, Rendezvous};
use fabric_async::cuda::{Context, DeviceBuffer, IpcExport, IpcMapping};

use crate::config::{Config, Transport};
use crate::error::{MoeError, Result};

/// Every peer's window as this process addresses it.
#[derive(Debug)]
pub(crate) struct Peers {
    /// The mappings of the other ranks' windows (`None` for this rank); unmapped on drop
    /// or by [`unmap`](Self::unmap).
    mappings: Vec<Option<IpcMapping>>,
    /// Base address of every rank's window in this process, this rank's own included (0
    /// for a rank reached through the proxy).
    pub bases: Vec<u64>,
    /// Bit `r`: rank `r` is reached through the proxy (never this rank).
    pub proxy_mask: u64,
    /// Whether any pair of ranks (not only this rank's) takes the proxy: then every rank
    /// meets the others once more to exchange engine descriptors.
    pub any_proxy: bool,
}

/// Whether ranks whose hosts are `same_host` take the proxy under `transport`; `Err` for a
/// pair NVLink cannot reach.
fn proxied(transport: Transport, same_host: bool) -> std::result::Result<bool, ()> {
    match (transport, same_host) {
        (Transport::Proxy, _) => Ok(true),
        (Transport::Nvlink, false) => Err(()),
        (_, same) => Ok(!same),
    }
}

/// This host's identity: the kernel's boot id (unique per boot of a machine).
fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

/// `[len u32][bytes]` fields, one after the other.
fn pack(fields: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in fields {
        out.extend((f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

fn unpack(mut bytes: &[u8], n: usize, rank: usize) -> Result<Vec<Vec<u8>>> {
    let mut fields = Vec::with_capacity(n);
    for _ in 0..n {
        let malformed = || MoeError::Config(format!("rank {rank} published a malformed window record"));
        let len = bytes.get(..4).ok_or_else(malformed)?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let field = bytes.get(4..4 + len).ok_or_else(malformed)?;
        fields.push(field.to_vec());
        bytes = &bytes[4 + len..];
    }
    Ok(fields)
}

/// Publishes `window` and maps every other rank's.
pub(crate) async fn connect(
    world: &dyn Rendezvous,
    config: &Config,
    ctx: &Arc<Context>,
    window: &DeviceBuffer,
) -> Result<Peers> {
    let host = host_id();
    let export = window.ipc_export(0, window.len())?;
    let mine = pack(&[host.as_bytes(), &config.shape_bytes(), &export.to_bytes()]);
    let key = format!("{}/moe-window", config.tag);
    let all = all_gather(world, &key, config.rank, config.ranks, mine).await?;
    let mut mappings = Vec::with_capacity(config.ranks);
    let mut bases = Vec::with_capacity(config.ranks);
    let records = all.iter().enumerate().map(|(r, rec)| unpack(rec, 3, r)).collect::<Result<Vec<_>>>()?;
    let mut any_proxy = false;
    for (a, ra) in records.iter().enumerate() {
        for rb in &records[a + 1..] {
            // A pair NVLink cannot reach is reported below for this rank's own pairs.
            any_proxy |= proxied(config.transport, ra[0] == rb[0]).unwrap_or(true);
        }
    }
    let mut proxy_mask = 0u64;
    for (r, f) in records.iter().enumerate() {
        if r == config.rank {
            mappings.push(None);
            bases.push(window.device_ptr());
            continue;
        }
        if f[1] != config.shape_bytes() {
            return Err(MoeError::Config(format!(
                "rank {r} was configured with another shape (ranks, experts per rank, max tokens, hidden, top-k, dtype, capacity, transport)"
            )));
        }
        if proxied(config.transport, f[0] == host.as_bytes()).map_err(|()| MoeError::OtherHost { rank: r })? {
            proxy_mask |= 1 << r;
            mappings.push(None);
            bases.push(0);
            continue;
        }
        let export = IpcExport::from_bytes(&f[2])?;
        if export.len != window.len() as u64 {
            return Err(MoeError::Config(format!(
                "rank {r}'s window has {} bytes, ours {}",
                export.len,
                window.len()
            )));
        }
        let m = IpcMapping::open(ctx, &export)?;
        bases.push(fabric_async::cuda::DeviceMemory::device_ptr(&m));
        mappings.push(Some(m));
    }
    Ok(Peers { mappings, bases, proxy_mask, any_proxy })
}

impl Peers {
    /// Closes every mapping of a peer's window (before the peers free their windows).
    pub(crate) fn unmap(&mut self) {
        self.mappings.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let rec = pack(&[b"host", b"", &[1, 2, 3]]);
        assert_eq!(unpack(&rec, 3, 1).unwrap(), vec![b"host".to_vec(), vec![], vec![1, 2, 3]]);
        assert!(unpack(&rec[..rec.len() - 1], 3, 1).is_err());
    }

    #[test]
    fn transport_per_pair() {
        assert_eq!(proxied(Transport::Auto, true), Ok(false));
        assert_eq!(proxied(Transport::Auto, false), Ok(true));
        assert_eq!(proxied(Transport::Proxy, true), Ok(true));
        assert_eq!(proxied(Transport::Nvlink, true), Ok(false));
        assert_eq!(proxied(Transport::Nvlink, false), Err(()));
    }
}
