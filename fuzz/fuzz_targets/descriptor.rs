//! Region descriptors and engine addresses (wire format v2): what `Engine::remote_region`
//! and `Engine::add_peer` decode. Whatever decodes must encode back to the same bytes.
#![no_main]

use fabric_runtime::pure::descriptor::{EngineAddress, RegionDescriptor};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = RegionDescriptor::from_bytes(data) {
        assert_eq!(d.to_bytes(), data);
    }
    if let Ok(a) = EngineAddress::from_bytes(data) {
        assert_eq!(a.to_bytes(), data);
    }
});
