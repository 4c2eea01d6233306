//! NIXL's UCX held to the engine's transport: the `UCX_TLS` that matches each provider and
//! location ([`matched_tls`], [`ucx_tls`]), what UCX reported it used (its `UCX_PROTO_INFO`
//! put tables: [`put_ranges`], [`put_via`]), and the baseline's name ([`nixl_label`]).

use super::place::Place;

/// The `UCX_TLS` both NIXL processes run with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxTls {
    /// Its value (`tcp,self`).
    pub tls: String,
    /// Taken from fabric-bench's environment (an explicit `UCX_TLS` wins over the match).
    pub from_env: bool,
    /// `UCX_NET_DEVICES=lo` too (matched tcp: loopback only, as the engine on 127.0.0.1),
    /// unless the environment names the devices.
    pub net_lo: bool,
}

/// The engine's transport at `place` on `provider`, as the rows name it.
pub fn engine_transport(provider: &str, place: Place) -> String {
    match place {
        Place::Gpu { .. } => "CUDA IPC".into(),
        Place::Host if provider == "tcp" => "tcp;ofi_rxm".into(),
        Place::Host if crate::raw::is_verbs(provider) => "verbs RC".into(),
        Place::Host => provider.into(),
    }
}

/// The `UCX_TLS` that matches the engine's transport (pure): tcp → `tcp,self`; shm →
/// `sm,self` (posix/sysv for active messages, `cma` for the puts: UCX's shared memory);
/// verbs → `rc,self`; GPU memory → `cuda_ipc,cuda_copy,tcp,self`. `cuda_ipc` has puts and
/// gets only, no active messages, and NIXL's endpoints need those (wire-up, notifications):
/// `cuda_ipc,cuda_copy,self` fails to connect as `cma,self` does on host memory
/// ("no active messages transport"), so tcp carries them (as it did when UCX chose alone);
/// the VRAM puts still go to `cuda_ipc`, the fastest UCX finds for them.
pub fn matched_tls(provider: &str, place: Place) -> &'static str {
    match place {
        Place::Gpu { .. } => "cuda_ipc,cuda_copy,tcp,self",
        Place::Host if provider == "shm" => "sm,self",
        Place::Host if crate::raw::is_verbs(provider) => "rc,self",
        Place::Host => "tcp,self",
    }
}

/// The `UCX_TLS` of the NIXL peer at `place` (pure): `env` (fabric-bench's `UCX_TLS`, if set
/// and not blank) wins; else [`matched_tls`].
pub fn ucx_tls(provider: &str, place: Place, env: Option<&str>) -> UcxTls {
    match env.map(str::trim).filter(|t| !t.is_empty()) {
        Some(t) => UcxTls { tls: t.to_string(), from_env: true, net_lo: false },
        None => UcxTls {
            tls: matched_tls(provider, place).into(),
            from_env: false,
            net_lo: place == Place::Host && provider == "tcp",
        },
    }
}

impl UcxTls {
    /// Whether NIXL's UCX backend must run with `ucx_error_handling_mode=none`. NIXL creates
    /// its endpoints with peer error handling by default, which UCX's shared-memory
    /// transports lack (`posix/memory - no peer failure handler`): with no transport in the
    /// list that has it for active messages (tcp, rc, ud, dc, ib, all) the endpoint cannot be
    /// made. A list that excludes (`^...`) leaves the default.
    pub fn error_handling_none(&self) -> bool {
        if self.tls.starts_with('^') {
            return false;
        }
        let net = |t: &str| {
            let t = t.split(':').next().unwrap_or(t).trim();
            matches!(t, "tcp" | "ib" | "all") || ["rc", "ud", "dc"].iter().any(|p| t.starts_with(p))
        };
        !self.tls.split(',').any(net)
    }

    /// The environment of the two NIXL processes (pure): `UCX_TLS` unless it came from the
    /// environment, `UCX_NET_DEVICES=lo` with `net_lo`, and `UCX_PROTO_INFO=y` (UCX prints
    /// the protocols it chose, [`put_ranges`]); none of them where `set(name)` says the
    /// environment already has it.
    pub fn env(&self, set: impl Fn(&str) -> bool) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        if !self.from_env && !set("UCX_TLS") {
            v.push(("UCX_TLS", self.tls.clone()));
        }
        if self.net_lo && !set("UCX_NET_DEVICES") {
            v.push(("UCX_NET_DEVICES", "lo".into()));
        }
        if !set("UCX_PROTO_INFO") {
            v.push(("UCX_PROTO_INFO", "y".into()));
        }
        v
    }

    /// The script's options for it: `--ucx-error-handling none` where
    /// [`UcxTls::error_handling_none`].
    pub fn script_args(&self) -> Vec<String> {
        if self.error_handling_none() {
            vec!["--ucx-error-handling".into(), "none".into()]
        } else {
            Vec::new()
        }
    }

    /// `UCX_TLS=tcp,self`, and where it came from if not matched.
    pub fn describe(&self) -> String {
        let from = if self.from_env { " from the environment" } else { "" };
        format!("UCX_TLS={}{from}", self.tls)
    }
}

/// What UCX was given and what it reported for one NIXL sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ucx {
    pub tls: UcxTls,
    /// The initiator's put protocols ([`put_ranges`]).
    pub puts: Vec<PutRange>,
}

/// One row of a UCX protocol table (`UCX_PROTO_INFO=y`) of `remote memory write by ucp_put*`
/// on an endpoint to the other process: sizes `lo..=hi` go over `via` (`cma/memory`,
/// `tcp/lo`, `cuda_ipc/cuda`: transport/device, several when UCX splits a put over lanes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutRange {
    pub lo: u64,
    pub hi: u64,
    pub via: Vec<String>,
}

/// `0`, `16515`, `inf`, `8K` (UCX's memunits) as bytes.
fn memunits(s: &str) -> Option<u64> {
    let s = s.trim();
    if s == "inf" {
        return Some(u64::MAX);
    }
    let (num, mult) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        (i, 'T' | 't') => (&s[..i], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

/// The put rows of the UCX protocol tables in a process's output (pure). UCX prints each
/// table once per endpoint configuration and operation, every line prefixed with
/// `[time] [host:pid:thread]`:
///
/// ```text
/// | ucp_context_0 intra-node cfg#1                           |
/// | remote memory write by ucp_put* from host memory to host |
/// | Range  | Description |              Config               |
/// | 0..inf | zero-copy   | cma/memory                        |
/// ```
///
/// Tables of the endpoint to itself (`self cfg#0`) and of other operations are skipped, as
/// are lines that are not table lines.
pub fn put_ranges(out: &str) -> Vec<PutRange> {
    let mut v: Vec<PutRange> = Vec::new();
    let (mut other_process, mut put) = (false, false);
    for line in out.lines() {
        let mut t = line.trim();
        while t.starts_with('[') {
            match t.find(']') {
                Some(i) => t = t[i + 1..].trim_start(),
                None => break,
            }
        }
        let Some(inner) = t.strip_prefix('|').and_then(|t| t.strip_suffix('|')) else { continue };
        let cells: Vec<&str> = inner.split('|').map(str::trim).collect();
        match cells.as_slice() {
            [title] if title.contains(" cfg#") => {
                other_process = !title.contains(" self cfg#");
                put = false;
            }
            [title] => put = title.starts_with("remote memory write by ucp_put"),
            [range, _, config] if put && other_process => {
                let (lo, hi) = match range.split_once("..") {
                    Some((a, b)) => (memunits(a), memunits(b)),
                    None => (memunits(range), memunits(range)),
                };
                let (Some(lo), Some(hi)) = (lo, hi) else { continue };
                let via: Vec<String> = config
                    .split(|c: char| c.is_whitespace() || c == ',')
                    .filter(|w| {
                        w.split_once('/').is_some_and(|(tl, dev)| {
                            !tl.is_empty()
                                && !dev.is_empty()
                                && tl.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        })
                    })
                    .map(String::from)
                    .collect();
                let r = PutRange { lo, hi, via };
                if !r.via.is_empty() && !v.contains(&r) {
                    v.push(r);
                }
            }
            _ => {}
        }
    }
    v
}

/// The transports UCX reported for puts of `size` bytes (`cma/memory`, `tcp/lo+tcp/eth0`), if
/// it reported any.
pub fn put_via(puts: &[PutRange], size: usize) -> Option<String> {
    let size = size as u64;
    let mut via: Vec<&str> = Vec::new();
    for r in puts.iter().filter(|r| r.lo <= size && size <= r.hi) {
        for w in &r.via {
            if !via.contains(&w.as_str()) {
                via.push(w);
            }
        }
    }
    (!via.is_empty()).then(|| via.join("+"))
}

/// A NIXL row's baseline name (pure): the probe's `NIXL 1.5.1 UCX`, the transport UCX reported
/// for the size's puts, and the `UCX_TLS` it ran with: `NIXL 1.5.1 UCX tcp/lo (UCX_TLS=tcp,self)`.
pub fn nixl_label(label: &str, tls: &UcxTls, via: Option<&str>) -> String {
    match via {
        Some(via) => format!("{label} {via} ({})", tls.describe()),
        None => format!("{label} ({}; no UCX protocol table)", tls.describe()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_tls_matches_the_engine() {
        let gpu = Place::Gpu { send: 0, recv: 1 };
        let m = |provider: &str, place| {
            let t = ucx_tls(provider, place, None);
            (t.error_handling_none(), t.tls, t.net_lo, engine_transport(provider, place))
        };
        assert_eq!(m("tcp", Place::Host), (false, "tcp,self".into(), true, "tcp;ofi_rxm".into()));
        assert_eq!(m("shm", Place::Host), (true, "sm,self".into(), false, "shm".into()));
        assert_eq!(m("verbs", Place::Host), (false, "rc,self".into(), false, "verbs RC".into()));
        assert_eq!(m("verbs:rxe0", Place::Host), (false, "rc,self".into(), false, "verbs RC".into()));
        // GPU memory: CUDA IPC whatever the host provider, tcp only for active messages.
        for p in ["tcp", "shm"] {
            assert_eq!(m(p, gpu), (false, "cuda_ipc,cuda_copy,tcp,self".into(), false, "CUDA IPC".into()));
        }
        // An explicit UCX_TLS wins (blank is not explicit), and the label says so.
        let t = ucx_tls("shm", Place::Host, Some(" tcp "));
        assert_eq!(t, UcxTls { tls: "tcp".into(), from_env: true, net_lo: false });
        assert_eq!(ucx_tls("shm", Place::Host, Some("  ")), ucx_tls("shm", Place::Host, None));
        assert_eq!(
            nixl_label("NIXL 1.4.1 UCX", &t, Some("tcp/lo")),
            "NIXL 1.4.1 UCX tcp/lo (UCX_TLS=tcp from the environment)"
        );
        assert_eq!(
            nixl_label("NIXL 1.4.1 UCX", &ucx_tls("shm", Place::Host, None), None),
            "NIXL 1.4.1 UCX (UCX_TLS=sm,self; no UCX protocol table)"
        );
    }

    #[test]
    fn ucx_error_handling_and_environment() {
        let t = |tls: &str| UcxTls { tls: tls.into(), from_env: true, net_lo: false };
        // Shared memory alone has no peer failure handler: NIXL's default (peer) cannot connect.
        for none in ["sm,self", "shm", "posix,cma,self", "cuda_ipc,cuda_copy,sm,self", "self"] {
            assert!(t(none).error_handling_none(), "{none}");
        }
        for peer in ["tcp", "tcp,self", "rc,self", "rc_mlx5,ud_mlx5:aux", "dc_x,sm", "all", "^tcp", "ib"] {
            assert!(!t(peer).error_handling_none(), "{peer}");
        }
        // Matched: UCX_TLS, UCX_NET_DEVICES=lo (tcp), UCX_PROTO_INFO=y, each unless already set.
        let tcp = ucx_tls("tcp", Place::Host, None);
        let names =
            |v: Vec<(&str, String)>| v.into_iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
        assert_eq!(names(tcp.env(|_| false)), ["UCX_TLS=tcp,self", "UCX_NET_DEVICES=lo", "UCX_PROTO_INFO=y"]);
        assert_eq!(names(tcp.env(|k| k != "UCX_PROTO_INFO")), ["UCX_PROTO_INFO=y"]);
        let shm = ucx_tls("shm", Place::Host, None);
        assert_eq!(names(shm.env(|_| false)), ["UCX_TLS=sm,self", "UCX_PROTO_INFO=y"]);
        // From the environment: inherited as it is.
        let env = ucx_tls("tcp", Place::Host, Some("tcp,cma"));
        assert_eq!(names(env.env(|k| k == "UCX_TLS")), ["UCX_PROTO_INFO=y"]);
    }

    /// What NIXL 1.4.1's initiator printed with UCX_PROTO_INFO=y (UCX 1.22, default UCX_TLS):
    /// the endpoint to itself, active messages over tcp, puts to the target over cma.
    const PROTO_INFO: &str = "\
[1795864348.173149] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.173149] [vm:11470:0]   | ucp_context_0 self cfg#0                                 |
[1795864348.173149] [vm:11470:0]   | remote memory write by ucp_put* from host memory to host |
[1795864348.173149] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.173149] [vm:11470:0]   | Range  | Description |              Config               |
[1795864348.173149] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.173149] [vm:11470:0]   | 0..inf | zero-copy   | self/memory                       |
[1795864348.173149] [vm:11470:0]   +--------+-------------+-----------------------------------+
fabric-peer peer=nixl pattern=hot size=65536 ops=1024 bytes=67108864 seconds=0.036524497 gbps=14.699
[1795864348.174340] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.174340] [vm:11470:0]   | ucp_context_0 intra-node cfg#1                           |
[1795864348.174340] [vm:11470:0]   | remote memory write by ucp_put* from host memory to host |
[1795864348.174340] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.174340] [vm:11470:0]   | Range  | Description |              Config               |
[1795864348.174340] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.174340] [vm:11470:0]   | 0..inf | zero-copy   | cma/memory                        |
[1795864348.174340] [vm:11470:0]   +--------+-------------+-----------------------------------+
[1795864348.175043] [vm:11470:0]   +------------+--------------------+---------------+
[1795864348.175043] [vm:11470:0]   | ucp_context_0 intra-node cfg#1                  |
[1795864348.175043] [vm:11470:0]   | active message by ucp_am_send* from host memory |
[1795864348.175043] [vm:11470:0]   +------------+--------------------+---------------+
[1795864348.175043] [vm:11470:0]   |   Range    |    Description     |    Config     |
[1795864348.175043] [vm:11470:0]   +------------+--------------------+---------------+
[1795864348.175043] [vm:11470:0]   |          0 | short              | tcp/lo        |
[1795864348.175043] [vm:11470:0]   |   1..16515 | zero-copy          | tcp/lo        |
[1795864348.175043] [vm:11470:0]   | 16516..inf | multi-frag copy-in | tcp/lo        |
[1795864348.175043] [vm:11470:0]   +------------+--------------------+---------------+
";

    #[test]
    fn ucx_protocol_tables_parse() {
        let puts = put_ranges(PROTO_INFO);
        assert_eq!(puts, [PutRange { lo: 0, hi: u64::MAX, via: vec!["cma/memory".into()] }]);
        assert_eq!(put_via(&puts, 65536).as_deref(), Some("cma/memory"));
        // Split ranges, a put split over two lanes, memunits, a table repeated (same rows once).
        let split = "\
  | ucp_context_0 intra-node cfg#2 |
  | remote memory write by ucp_put* from host memory to host |
  | Range | Description | Config |
  | 0..8184 | short | tcp/lo |
  | 8185..64K | zero-copy | 52% on tcp/lo and 48% on tcp/eth0 |
  | 65537..inf | zero-copy | cuda_ipc/cuda, tcp/lo |
  | ucp_context_0 intra-node cfg#2 |
  | remote memory write by ucp_put* from host memory to host |
  | 0..8184 | short | tcp/lo |
  | ucp_context_0 inter-node cfg#3 |
  | remote memory read by ucp_get* from host memory to host |
  | 0..inf | zero-copy | rc_mlx5/mlx5_0:1 |
";
        let puts = put_ranges(split);
        assert_eq!(puts.len(), 3, "{puts:?}");
        assert_eq!(put_via(&puts, 0).as_deref(), Some("tcp/lo"));
        assert_eq!(put_via(&puts, 8184).as_deref(), Some("tcp/lo"));
        assert_eq!(put_via(&puts, 65536).as_deref(), Some("tcp/lo+tcp/eth0"));
        assert_eq!(put_via(&puts, 65537).as_deref(), Some("cuda_ipc/cuda+tcp/lo"));
        // No tables (UCX_PROTO_INFO off, or the run failed first): nothing reported.
        assert!(put_ranges("fabric-peer peer=nixl\n| not | a table |\n").is_empty());
        assert_eq!(put_via(&[], 4096), None);
        assert_eq!((memunits("8K"), memunits("1M"), memunits("x")), (Some(8192), Some(1 << 20), None));
    }
}
