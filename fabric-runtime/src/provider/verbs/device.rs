//! Which device, port and GID a domain uses: the device list, the port attributes, and the
//! choice of the GID to route with by type and address (never a fixed index).

use std::ffi::{c_int, CStr};
use std::sync::Arc;

use rdma_sys as sys;

use super::config::VerbsConfig;
use super::error::{check, check_ptr};
use super::owned::Context;
use super::TRANSPORT;
use crate::error::Error;

extern "C" {
    /// Exported by libibverbs ≥ 1.11 (rdma-core 31); `ibv_query_gid_ex` is its inline wrapper,
    /// which bindgen cannot see.
    fn _ibv_query_gid_ex(
        context: *mut sys::ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut sys::ibv_gid_entry,
        flags: u32,
        entry_size: usize,
    ) -> c_int;
}

/// The type of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    Ib,
    RoceV1,
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid_type: GidType,
    pub gid: [u8; 16],
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10] == [0; 10] && gid[10] == 0xff && gid[11] == 0xff
}

fn is_link_local(gid: &[u8; 16]) -> bool {
    gid[0] == 0xfe && gid[1] & 0xc0 == 0x80
}

/// Chooses the GID index to route with: RoCEv2 with an IPv4-mapped address first (routable,
/// what `rdma link add ... type rxe netdev ethX` gives for an IPv4 interface), then RoCEv2
/// with a global IPv6 address, RoCEv2 link-local, InfiniBand, then RoCEv1 in the same order.
/// All-zero (empty) entries are never chosen; ties go to the lowest index.
pub fn select_gid(entries: &[GidEntry]) -> Option<u32> {
    let rank = |e: &GidEntry| -> u32 {
        let addr = if is_ipv4_mapped(&e.gid) {
            0
        } else if !is_link_local(&e.gid) {
            1
        } else {
            2
        };
        match e.gid_type {
            GidType::RoceV2 => addr,
            GidType::Ib => 3,
            GidType::RoceV1 => 4 + addr,
        }
    };
    entries.iter().filter(|e| e.gid != [0; 16]).min_by_key(|e| (rank(e), e.index)).map(|e| e.index)
}

/// Parses a `gid_attrs/types/N` sysfs file ("RoCE v2", "IB/RoCE v1").
fn parse_gid_type(text: &str) -> Option<GidType> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("RoCE v2") {
        Some(GidType::RoceV2)
    } else if t.eq_ignore_ascii_case("IB/RoCE v1") || t.eq_ignore_ascii_case("RoCE v1") {
        Some(GidType::RoceV1)
    } else if t.eq_ignore_ascii_case("IB") {
        Some(GidType::Ib)
    } else {
        None
    }
}

/// [`Error::ProviderNotFound`] for the verbs transport: no usable device or port.
pub(super) fn not_found(reason: String) -> Error {
    Error::ProviderNotFound { provider: TRANSPORT.into(), reason: format!("no RDMA device: {reason}") }
}

/// Device and port chosen by `open`.
pub(super) struct Chosen {
    pub(super) ctx: Arc<Context>,
    pub(super) name: String,
    pub(super) port: u8,
    pub(super) attr: sys::ibv_device_attr,
    pub(super) port_attr: sys::ibv_port_attr,
}

fn query_port(ctx: &Context, port: u8) -> Result<sys::ibv_port_attr, Error> {
    // SAFETY: all-zero is a valid ibv_port_attr (plain integers).
    let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is live; pa is a valid out-struct of the size the library expects.
    check("ibv_query_port", unsafe { sys::___ibv_query_port(ctx.as_ptr(), port, &mut pa) })?;
    Ok(pa)
}

/// Opens the configured device (or the first with an ACTIVE port) and picks the port.
pub(super) fn choose_device(cfg: &VerbsConfig) -> Result<Chosen, Error> {
    let mut n: c_int = 0;
    // SAFETY: n is a valid out-pointer; the list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(not_found(format!("ibv_get_device_list failed: {e} (no RDMA support in this kernel?)")));
    }
    struct List(*mut *mut sys::ibv_device);
    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: the list came from ibv_get_device_list and is freed once; contexts opened
            // from it stay valid.
            unsafe { sys::ibv_free_device_list(self.0) }
        }
    }
    let list = List(list);
    let mut seen = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds n device pointers.
        let dev = unsafe { *list.0.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a live device of the list; the name is a NUL-terminated string in it.
        let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
        if cfg.device.as_ref().is_some_and(|d| *d != name) {
            seen.push(name);
            continue;
        }
        // SAFETY: dev is a live device of the list.
        let ctx = match check_ptr("ibv_open_device", unsafe { sys::ibv_open_device(dev) }) {
            Ok(p) => Arc::new(Context { ptr: p }),
            Err(e) => {
                tracing::debug!(device = %name, error = %e, "cannot open RDMA device");
                seen.push(format!("{name} (cannot open: {e})"));
                continue;
            }
        };
        // SAFETY: all-zero is a valid ibv_device_attr.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live, attr a valid out-struct.
        check("ibv_query_device", unsafe { sys::ibv_query_device(ctx.as_ptr(), &mut attr) })?;
        let ports: Vec<u8> = match cfg.port {
            Some(p) => vec![p],
            None => (1..=attr.phys_port_cnt).collect(),
        };
        for port in ports {
            match query_port(&ctx, port) {
                Ok(pa) if pa.state == sys::ibv_port_state::IBV_PORT_ACTIVE => {
                    return Ok(Chosen { ctx, name, port, attr, port_attr: pa });
                }
                Ok(pa) => seen.push(format!("{name} port {port} (state {})", pa.state)),
                Err(e) => seen.push(format!("{name} port {port} ({e})")),
            }
        }
    }
    Err(not_found(if seen.is_empty() {
        match &cfg.device {
            Some(d) => format!("no device named {d:?} (none found)"),
            None => "ibv_get_device_list found none (load a driver: mlx5_ib, or rdma_rxe + `rdma link add`)"
                .into(),
        }
    } else {
        match &cfg.device {
            Some(d) => format!("{d:?} has no ACTIVE port (devices: {})", seen.join(", ")),
            None => format!("no ACTIVE port on any device ({})", seen.join(", ")),
        }
    }))
}

/// The GID table of a port, with types (`ibv_query_gid_ex`, else `ibv_query_gid` + sysfs).
pub(super) fn gid_table(ctx: &Context, device: &str, port: u8, len: i32) -> Vec<GidEntry> {
    let mut out = Vec::new();
    for index in 0..len.max(0) as u32 {
        // SAFETY: all-zero is a valid ibv_gid_entry.
        let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live; e is a valid out-struct of the size passed.
        let ret = unsafe {
            _ibv_query_gid_ex(ctx.as_ptr(), port.into(), index, &mut e, 0, std::mem::size_of_val(&e))
        };
        let entry = if ret == 0 {
            let gid_type = match e.gid_type {
                sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                sys::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                _ => GidType::Ib,
            };
            // SAFETY: raw is the byte view of the 16-byte GID union.
            Some(GidEntry { index, gid_type, gid: unsafe { e.gid.raw } })
        } else {
            // Older kernels: query the GID and read its type from sysfs.
            // SAFETY: all-zero is a valid ibv_gid.
            let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: ctx is live, gid a valid out-union.
            let r = unsafe { sys::ibv_query_gid(ctx.as_ptr(), port, index as c_int, &mut gid) };
            let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
            let t = std::fs::read_to_string(path).ok().and_then(|t| parse_gid_type(&t));
            match (r, t) {
                // SAFETY: raw is the byte view of the GID union.
                (0, Some(gid_type)) => Some(GidEntry { index, gid_type, gid: unsafe { gid.raw } }),
                _ => None,
            }
        };
        if let Some(e) = entry.filter(|e| e.gid != [0; 16]) {
            out.push(e);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(index: u32, gid_type: GidType, gid: [u8; 16]) -> GidEntry {
        GidEntry { index, gid_type, gid }
    }

    #[test]
    fn gid_selection_prefers_rocev2_ipv4() {
        let ll = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = 1;
            g
        };
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 2, 15];
        let global6 = {
            let mut g = [0u8; 16];
            g[0] = 0x20;
            g[1] = 0x01;
            g[15] = 5;
            g
        };
        // rxe0: 0 = link-local v1, 1 = link-local v2, 2 = v4 v1, 3 = v4 v2.
        let rxe = [
            e(0, GidType::RoceV1, ll),
            e(1, GidType::RoceV2, ll),
            e(2, GidType::RoceV1, v4),
            e(3, GidType::RoceV2, v4),
        ];
        assert_eq!(select_gid(&rxe), Some(3));
        // The order seen in TESTBEDS (v2 IPv4 at index 1).
        let rxe2 = [e(0, GidType::RoceV1, v4), e(1, GidType::RoceV2, v4)];
        assert_eq!(select_gid(&rxe2), Some(1));
        assert_eq!(select_gid(&[e(0, GidType::RoceV2, ll), e(4, GidType::RoceV2, global6)]), Some(4));
        assert_eq!(select_gid(&[e(0, GidType::RoceV1, v4), e(2, GidType::RoceV2, ll)]), Some(2));
        assert_eq!(select_gid(&[e(0, GidType::Ib, ll), e(1, GidType::RoceV1, v4)]), Some(0));
        // Empty entries are never chosen.
        assert_eq!(select_gid(&[e(0, GidType::RoceV2, [0; 16])]), None);
        assert_eq!(select_gid(&[]), None);
        assert_eq!(parse_gid_type("RoCE v2\n"), Some(GidType::RoceV2));
        assert_eq!(parse_gid_type("IB/RoCE v1\n"), Some(GidType::RoceV1));
        assert_eq!(parse_gid_type("bogus"), None);
    }
}
