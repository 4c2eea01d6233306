//! The control messages of the staged paths (PULL, Push, ACK) and the message-kind byte:
//! what the reactor decodes from any peer's two-sided messages.
#![no_main]

use fabric_runtime::pure::control::{Ack, MsgKind, Pull};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = MsgKind::of(data);
    if let Ok(p) = Pull::from_bytes(data) {
        assert_eq!(p.to_bytes(), data);
    }
    if let Ok(p) = Pull::push_from_bytes(data) {
        assert_eq!(p.to_push_bytes(), data);
    }
    if let Ok(a) = Ack::from_bytes(data) {
        assert_eq!(a.to_bytes(), data);
    }
});
