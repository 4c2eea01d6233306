//! The verbs backend's wire formats: a peer's NIC address and the UD handshake.
#![no_main]

use fabric_runtime::pure::verbs_wire::{Handshake, PeerAddr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = PeerAddr::decode(data);
    let _ = Handshake::decode(data);
});
