//! Where a peer ran.

/// Where a peer ran: host memory, or GPU `send` → GPU `recv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Host,
    Gpu { send: usize, recv: usize },
}

impl Place {
    pub(super) fn label(self) -> String {
        match self {
            Place::Host => "host".into(),
            Place::Gpu { send, recv } => format!("cuda:{send}->cuda:{recv}"),
        }
    }
}
