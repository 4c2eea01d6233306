//! Region descriptors (wire format v3, v1-v2 still read) and engine addresses (v2, v1 still
//! read): what `Engine::remote_region` and `Engine::add_peer` decode. Whatever decodes in the
//! current version must encode back to the same bytes; an older version reads with
//! incarnation 0 (unknown).
#![no_main]

use fabric_runtime::pure::descriptor::{EngineAddress, RegionDescriptor, DESCRIPTOR_VERSION, WIRE_VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = RegionDescriptor::from_bytes(data) {
        if data[4] == DESCRIPTOR_VERSION {
            assert_eq!(d.to_bytes(), data);
        } else {
            assert_eq!(d.incarnation, 0);
        }
    }
    if let Ok(a) = EngineAddress::from_bytes(data) {
        if data[4] == WIRE_VERSION {
            assert_eq!(a.to_bytes(), data);
        } else {
            assert_eq!(a.incarnation, 0);
        }
    }
});
