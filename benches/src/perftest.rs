//! The verbs baselines: perftest's `ib_write_bw` and `ib_write_lat`, server and client as
//! subprocesses of this process on this machine (loopback QPs on one device, as
//! `scripts/rxe-vm.sh selftest` runs them), on the device, port and GID index the engine's
//! verbs domain picks. Their tables are parsed by column name; anything unexpected is an
//! error that names the tool and shows its output.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_runtime::provider::verbs::{PeerAddr, VerbsConfig, VerbsDomain};
use fabric_runtime::provider::Domain;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = std::result::Result<T, BoxError>;

/// Longest a single perftest run (server + client) may take.
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// perftest measures the CPU clock by sampling and, on a loaded (or emulated) machine, can get
/// it wrong and print `inf` or `0.00`: such a run is repeated this many times in all.
const TRIES: usize = 3;

/// Where perftest runs: the device, port and GID index of the verbs domain, and the IPv4
/// address its server is reached at (`$RXE_VM_GUEST_IP` in the test VM, else the address in
/// the domain's RoCE GID, else 127.0.0.1; perftest only uses it for its own TCP handshake).
#[derive(Debug, Clone)]
pub struct Target {
    pub device: String,
    pub port: u8,
    pub gid_index: u32,
    pub host: String,
}

impl Target {
    /// Opens the domain the engine would open for `provider` (`verbs`, `verbs:DEV`) to learn
    /// its device, port and GID, then closes it.
    pub fn for_provider(provider: &str) -> Res<Target> {
        let cfg = VerbsConfig::from_provider_name(provider)
            .ok_or_else(|| format!("perftest: {provider:?} is not a verbs provider name"))?;
        let dom = VerbsDomain::open(&cfg)?;
        let (device, port, gid_index) = dom.device();
        let gid = PeerAddr::decode(&dom.address())?.gid;
        let mapped_v4 = gid[..10].iter().all(|&b| b == 0) && gid[10..12] == [0xff, 0xff];
        let host = match std::env::var("RXE_VM_GUEST_IP") {
            Ok(ip) if !ip.is_empty() => ip,
            _ if mapped_v4 => Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15]).to_string(),
            _ => "127.0.0.1".into(),
        };
        Ok(Target { device: device.to_owned(), port, gid_index, host })
    }

    fn common_args(&self, size: usize, iters: u64) -> Vec<String> {
        let mut a: Vec<String> = ["-d", &self.device, "-i", &self.port.to_string()].map(String::from).into();
        a.extend(["-x".into(), self.gid_index.to_string(), "-s".into(), size.to_string()]);
        a.extend(["-n".into(), iters.max(5).to_string(), "-F".into()]);
        // For experiments (window, signalling): e.g. `-t 16 -Q 1`, to both server and client.
        if let Ok(extra) = std::env::var("FABRIC_BENCH_PERFTEST_ARGS") {
            a.extend(extra.split_whitespace().map(String::from));
        }
        a
    }
}

/// Whether `tool` can be started at all (`Ok(false)`: not installed).
pub fn installed(tool: &str) -> bool {
    match Command::new(tool).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status() {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// `ib_write_bw -s size -n iters -t depth`: the average bandwidth in Gbit/s (10^9 bit/s, as
/// the bench's own figures). Read in MiB/s and converted rather than with `--report_gbits`,
/// which prints two decimals: 0.12 Gbit/s (Soft-RoCE in the VM) would be ±4%.
pub fn write_bw(t: &Target, size: usize, iters: u64, depth: usize) -> Res<f64> {
    let tool = "ib_write_bw";
    let mut args = t.common_args(size, iters);
    args.extend(["-t".into(), depth.to_string()]);
    retry(tool, || {
        let out = run_pair(tool, &args, &t.host)?;
        let gbps = bw_gbps(tool, &out, &parse_table(tool, &out, size)?)?;
        Ok((gbps, out))
    })
}

/// The `BW average` column in Gbit/s, from `[MB/sec]` (perftest's MB are MiB, its `--help`
/// says so) or `[Gb/sec]`.
fn bw_gbps(tool: &str, out: &str, row: &Table) -> Res<f64> {
    let (name, v) = row.column(tool, out, "BW average")?;
    if name.contains("[MB/sec]") {
        Ok(v * (1u64 << 20) as f64 * 8.0 / 1e9)
    } else if name.contains("[Gb/sec]") {
        Ok(v)
    } else {
        Err(format!("{tool}: unknown unit in column {name:?}; output:\n{}", tail(out, 20)).into())
    }
}

/// `ib_write_lat -s size -n iters`: (typical, 99th percentile) round trip / 2 in µs, as
/// perftest reports them (`t_typical` is its median). The 99th percentile is NaN when this
/// perftest does not print that column.
pub fn write_lat(t: &Target, size: usize, iters: u64) -> Res<(f64, f64)> {
    let tool = "ib_write_lat";
    let args = t.common_args(size, iters);
    let mut p99 = f64::NAN;
    let typical = retry(tool, || {
        let out = run_pair(tool, &args, &t.host)?;
        let row = parse_table(tool, &out, size)?;
        let (_, v) = row.column(tool, &out, "t_typical[usec]")?;
        p99 = row.find("99% percentile").unwrap_or(f64::NAN);
        Ok((v, out))
    })?;
    Ok((typical, p99))
}

/// Runs `f` until it yields a finite, positive figure (perftest's clock calibration can fail
/// on a loaded machine), at most [`TRIES`] times.
fn retry(tool: &str, mut f: impl FnMut() -> Res<(f64, String)>) -> Res<f64> {
    let mut last = String::new();
    for _ in 0..TRIES {
        let (v, out) = f()?;
        if v.is_finite() && v > 0.0 {
            return Ok(v);
        }
        last = out;
    }
    Err(format!(
        "{tool}: no valid figure in {TRIES} runs (perftest's CPU clock calibration fails on a loaded \
         machine); last output:\n{}",
        tail(&last, 20)
    )
    .into())
}

/// The data row of perftest's result table, by column name.
#[derive(Debug)]
pub struct Table {
    cols: Vec<(String, f64)>,
}

impl Table {
    /// The value of the column whose name contains `name`.
    fn find(&self, name: &str) -> Option<f64> {
        self.cols.iter().find(|(c, _)| c.contains(name)).map(|&(_, v)| v)
    }

    /// The full name and value of the column whose name contains `name`, or an error that
    /// names the tool and shows its output.
    fn column(&self, tool: &str, out: &str, name: &str) -> Res<(&str, f64)> {
        self.cols.iter().find(|(c, _)| c.contains(name)).map(|(c, v)| (c.as_str(), *v)).ok_or_else(|| {
            let cols: Vec<&str> = self.cols.iter().map(|(c, _)| c.as_str()).collect();
            format!("{tool}: no column {name:?} in its table (columns {cols:?}); output:\n{}", tail(out, 20))
                .into()
        })
    }
}

/// Finds the header (` #bytes  #iterations  BW peak[Gb/sec] ...`) and the row for `size`
/// below it. Column names contain single spaces (`BW average[Gb/sec]`, `99% percentile[usec]`),
/// so header words are joined until one starts with `#` or ends a `[unit]`.
pub fn parse_table(tool: &str, out: &str, size: usize) -> Res<Table> {
    let bad = |why: &str| -> BoxError { format!("{tool}: {why}; output:\n{}", tail(out, 20)).into() };
    let lines: Vec<&str> = out.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.split_whitespace().next() == Some("#bytes"))
        .ok_or_else(|| bad("no result table (no `#bytes` header)"))?;
    let mut names = Vec::new();
    let mut cur = String::new();
    for w in lines[h].split_whitespace() {
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.push_str(w);
        if w.starts_with('#') || w.contains(']') {
            names.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        names.push(cur);
    }
    let row = lines[h + 1..]
        .iter()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.first().and_then(|s| s.parse::<usize>().ok()) == Some(size))
        .ok_or_else(|| bad(&format!("no row for {size} bytes under the table header")))?;
    if row.len() < names.len() {
        return Err(bad(&format!("{} columns named but the row has {} values", names.len(), row.len())));
    }
    let mut cols = Vec::with_capacity(names.len());
    for (n, v) in names.into_iter().zip(row) {
        // `inf`, `-nan` parse as non-finite floats; anything else unparsable is an error.
        let x = v.parse::<f64>().map_err(|_| bad(&format!("column {n:?}: {v:?} is not a number")))?;
        cols.push((n, x));
    }
    Ok(Table { cols })
}

/// One perftest measurement: the server on a free TCP port in the background, the client
/// to `host` once the server listens. Returns the client's output (stdout and stderr).
fn run_pair(tool: &str, args: &[String], host: &str) -> Res<String> {
    let port = TcpListener::bind("0.0.0.0:0")?.local_addr()?.port();
    let mut args = args.to_vec();
    args.extend(["-p".into(), port.to_string()]);
    let deadline = Instant::now() + RUN_LIMIT;
    let mut server = Spawned::start(tool, &args)?;
    let listening = wait_listen(port, &mut server, deadline);
    if let Err(e) = listening {
        let out = server.finish(Instant::now());
        return Err(format!("{tool} server: {e}; its output:\n{}", tail(&out.1, 20)).into());
    }
    let mut cargs = args.clone();
    cargs.push(host.into());
    let client = Spawned::start(tool, &cargs)?.finish(deadline);
    let srv = server.finish(deadline + Duration::from_secs(5));
    pair_outcome(tool, client, srv, &format!("args {}", cargs.join(" ")))
}

/// The client's output when both halves of a server/client pair exited 0, else an error
/// with how each ended (`what`: the run's details) and the tails of both outputs.
pub(crate) fn pair_outcome(
    tool: &str,
    client: (Option<bool>, String),
    server: (Option<bool>, String),
    what: &str,
) -> Res<String> {
    match (client, server) {
        ((Some(true), out), (Some(true), _)) => Ok(out),
        ((c, cout), (s, sout)) => Err(format!(
            "{tool} failed (client: {}, server: {}; {what})\n-- client:\n{}\n-- server:\n{}",
            status_str(c),
            status_str(s),
            tail(&cout, 15),
            tail(&sout, 15)
        )
        .into()),
    }
}

pub(crate) fn status_str(s: Option<bool>) -> &'static str {
    match s {
        Some(true) => "ok",
        Some(false) => "exit status not 0",
        None => "killed after the time limit",
    }
}

/// A child whose stdout and stderr are collected by threads (then joined: stdout, stderr).
pub(crate) struct Spawned {
    child: Child,
    readers: Vec<std::thread::JoinHandle<String>>,
}

impl Spawned {
    /// Starts `program` (a name looked up in `PATH`, or a path) with `args`.
    ///
    /// The child gets SIGKILL when the thread that started it ends (`PR_SET_PDEATHSIG`): a
    /// bench killed while a server waits for its client (fabtests' servers spin on their CQ)
    /// leaves no process behind. The thread outlives the child in every caller: it waits for
    /// the child in [`Spawned::finish`].
    pub(crate) fn start(program: impl AsRef<std::ffi::OsStr>, args: &[String]) -> Res<Spawned> {
        Spawned::start_on(program, args, None, &[])
    }

    /// [`Spawned::start`] with the child on `cpu` only (`None`: the process's start mask).
    pub(crate) fn start_on(
        program: impl AsRef<std::ffi::OsStr>,
        args: &[String],
        cpu: Option<usize>,
        env: &[(&str, String)],
    ) -> Res<Spawned> {
        use std::os::unix::process::CommandExt;
        let program = program.as_ref();
        let mut cmd = Command::new(program);
        crate::pin::child_on(&mut cmd, cpu)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and only calls prctl, which
        // is async-signal-safe; it allocates nothing and touches no lock.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child =
            cmd.spawn().map_err(|e| format!("cannot start {}: {e}", program.to_string_lossy()))?;
        let mut readers = Vec::new();
        let pipes: [Option<Box<dyn Read + Send>>; 2] = [
            child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
            child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        ];
        for mut p in pipes.into_iter().flatten() {
            readers.push(std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = p.read_to_end(&mut buf);
                String::from_utf8_lossy(&buf).into_owned()
            }));
        }
        Ok(Spawned { child, readers })
    }

    pub(crate) fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Waits until `deadline` (then kills it). `Some(success)`, or `None` if it was killed.
    pub(crate) fn finish(mut self, deadline: Instant) -> (Option<bool>, String) {
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s.success()),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        let out: Vec<String> = self.readers.into_iter().map(|r| r.join().unwrap_or_default()).collect();
        (status, out.concat())
    }
}

/// Waits until something listens on TCP `port` (read from /proc/net/tcp{,6}: no process
/// started, which is slow in the test VM), or the server exits, or the deadline.
fn wait_listen(port: u16, server: &mut Spawned, deadline: Instant) -> Res<()> {
    let hex = format!(":{port:04X}");
    loop {
        for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let table = std::fs::read_to_string(f).unwrap_or_default();
            let listening = table.lines().skip(1).any(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                w.len() > 3 && w[1].ends_with(&hex) && w[3] == "0A"
            });
            if listening {
                return Ok(());
            }
        }
        if server.exited() {
            return Err("exited before listening".into());
        }
        if Instant::now() > deadline {
            return Err(format!("not listening on port {port} after {RUN_LIMIT:?}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    // Output of perftest 4.5 (Debian 12) in the test VM, trimmed.
    const BW_MIB: &str = "\
 RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : rxe0
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      64               32.32              30.22  \t\t   0.000484
---------------------------------------------------------------------------------------
";
    // The same with --report_gbits.
    const BW: &str = "\
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      2000             0.37               0.36   \t\t   0.000687
---------------------------------------------------------------------------------------
";
    const LAT: &str = "\
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 8       1000          17.23          150.12       31.40     \t       35.00        \t10.00   \t\t80.00   \t\t140.00  
---------------------------------------------------------------------------------------
";

    #[test]
    fn parses_bw_and_lat_tables() {
        let t = parse_table("ib_write_bw", BW, 65536).unwrap();
        assert_eq!(t.find("BW average[Gb/sec]"), Some(0.36));
        assert_eq!(t.find("BW peak"), Some(0.37));
        let t = parse_table("ib_write_lat", LAT, 8).unwrap();
        assert_eq!(t.find("t_typical[usec]"), Some(31.40));
        assert_eq!(t.find("99% percentile"), Some(80.0));
        assert_eq!(t.find("99.9% percentile"), Some(140.0));
    }

    #[test]
    fn converts_mib_per_second() {
        let t = parse_table("ib_write_bw", BW_MIB, 65536).unwrap();
        let g = bw_gbps("ib_write_bw", BW_MIB, &t).unwrap();
        assert!((g - 30.22 * 1048576.0 * 8.0 / 1e9).abs() < 1e-12, "{g}");
        let t = parse_table("ib_write_bw", BW, 65536).unwrap();
        assert_eq!(bw_gbps("ib_write_bw", BW, &t).unwrap(), 0.36);
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        let e = parse_table("ib_write_bw", "Couldn't connect to 10.0.2.15:18515\n", 65536).unwrap_err();
        assert!(e.to_string().starts_with("ib_write_bw: no result table"), "{e}");
        let e = parse_table("ib_write_bw", BW, 4096).unwrap_err();
        assert!(e.to_string().contains("no row for 4096 bytes"), "{e}");
        let garbled = BW.replace("0.36", "n/a");
        let e = parse_table("ib_write_bw", &garbled, 65536).unwrap_err();
        assert!(e.to_string().contains("is not a number"), "{e}");
        let inf = BW.replace("0.36", "inf");
        assert_eq!(parse_table("ib_write_bw", &inf, 65536).unwrap().find("BW average"), Some(f64::INFINITY));
    }
}
