//! The independent baseline: libfabric's own fabtests (1.17), from `--fabtests DIR`, run
//! beside the engine and the raw loop in the same run. Server and client are subprocesses of
//! this process on 127.0.0.1 (server `-B PORT -s 127.0.0.1`, client `-P PORT 127.0.0.1`, a
//! free port per run), both on the run's provider (`-p tcp`: libfabric picks `tcp;ofi_rxm`
//! for rdm endpoints, as the engine does; `-p shm`), `FI_TCP_IFACE=lo` inherited from the
//! bench. Every child is killed after [`RUN_LIMIT`].
//!
//! - `fi_rma_bw -e rdm -o writedata -W WINDOW -S SIZE -I OPS`: RMA writes with remote CQ
//!   data, every one from the same source buffer to the same remote address (the `hot`
//!   pattern), `WINDOW` posted and then all reaped (not a sliding window).
//! - `fi_rdm_pingpong -S SIZE -I ITERS`: send/recv ping-pong; its `usec/xfer` is ONE-WAY
//!   (two transfers per iteration), so a round trip is 2 x that, and a mean, not a median.
//!
//! Both print one result table (`show_perf` in fabtests' `common/shared.c`):
//!
//! ```text
//! bytes   iters   total       time     MB/sec    usec/xfer   Mxfers/sec
//! 64k     1k      62m         0.07s    979.32      66.92       0.01
//! ```
//!
//! where MB/sec is bytes per microsecond (10^6 bytes/s). [`parse_result`] reads it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::perftest::{pair_outcome, tail, Spawned};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = std::result::Result<T, BoxError>;

/// Longest one fabtests run (server and client) may take before both are killed.
pub const RUN_LIMIT: Duration = Duration::from_secs(120);
pub const RMA_BW: &str = "fi_rma_bw";
pub const PINGPONG: &str = "fi_rdm_pingpong";
/// What rows say when `--fabtests` was not given.
pub const SKIPPED: &str = "skipped: no --fabtests DIR";
/// Options appended to every fabtests command, server and client (experiments: `-U` asks
/// for delivery-complete, which the engine and the raw loop use on tcp unless
/// `FABRIC_DELIVERY_COMPLETE=0`).
pub const EXTRA_ARGS_VAR: &str = "FABRIC_BENCH_FABTESTS_ARGS";

/// The options of [`EXTRA_ARGS_VAR`], split on whitespace.
pub fn extra_args() -> Vec<String> {
    std::env::var(EXTRA_ARGS_VAR).unwrap_or_default().split_whitespace().map(String::from).collect()
}

/// `" -U"` when [`EXTRA_ARGS_VAR`] is `-U`: for the rows' labels.
pub fn extra_label() -> String {
    extra_args().iter().map(|a| format!(" {a}")).collect()
}

/// The fabtests binaries in a directory, for one provider.
#[derive(Debug, Clone)]
pub struct Fabtests {
    dir: PathBuf,
    provider: &'static str,
    /// The CPUs of the client and of the server (`Fabtests::pinned`); unset: the process's
    /// start mask.
    cpus: [Option<usize>; 2],
    /// Children run with glibc's `glibc.malloc.hugetlb=1` (`Fabtests::huge_pages`).
    huge: bool,
}

/// The figures of one result row.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// The transfer size, as printed ([`size_str`]: `64k`).
    pub bytes: String,
    /// MB/sec: 10^6 bytes per second.
    pub mb_per_sec: f64,
    /// Microseconds per transfer (one-way for the ping-pongs).
    pub usec_per_xfer: f64,
}

impl Figures {
    pub fn gbps(&self) -> f64 {
        self.mb_per_sec * 8.0 / 1e3
    }
}

/// fabtests' `-p` for the bench's `--provider`; verbs is not supported here.
pub fn provider_arg(provider: &str) -> Result<&'static str, String> {
    match provider {
        "tcp" => Ok("tcp"),
        "shm" => Ok("shm"),
        other => Err(format!(
            "--fabtests: provider {other} is not supported (only tcp and shm; on verbs the baseline is \
             perftest)"
        )),
    }
}

impl Fabtests {
    /// The binaries in `dir` for the bench's `provider`: an error unless every one of `tools`
    /// is there (a file, executable).
    pub fn new(dir: &Path, provider: &str, tools: &[&str]) -> Res<Fabtests> {
        let provider = provider_arg(provider)?;
        for t in tools {
            let p = dir.join(t);
            let ok = std::fs::metadata(&p).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            });
            if !ok {
                return Err(format!(
                    "--fabtests {}: no executable {t} there (want fabtests 1.17 binaries: {}; \
                     docs/performance.md says how to build them)",
                    dir.display(),
                    tools.join(", ")
                )
                .into());
            }
        }
        Ok(Fabtests { dir: dir.to_path_buf(), provider, cpus: [None, None], huge: false })
    }

    /// Runs the client on `cpus[0]` and the server on `cpus[1]`, each on that CPU only (the
    /// CPUs of the raw loop it is compared with: fabtests' sides are one thread each).
    pub fn pinned(mut self, cpus: Option<[usize; 2]>) -> Fabtests {
        self.cpus = cpus.map_or([None, None], |[c, s]| [Some(c), Some(s)]);
        self
    }

    /// Runs both sides with glibc's malloc tunable `glibc.malloc.hugetlb=1` (glibc 2.35+;
    /// added to any `GLIBC_TUNABLES` of this process): their large buffers are advised to use
    /// transparent huge pages, as the engine's and the raw loop's are with `--huge-pages on`.
    /// fabtests has no option of its own for it.
    pub fn huge_pages(mut self, on: bool) -> Fabtests {
        self.huge = on;
        self
    }

    /// The environment of the children: [`Fabtests::huge_pages`]' tunable.
    fn env(&self) -> Vec<(&'static str, String)> {
        if !self.huge {
            return Vec::new();
        }
        let mut t = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if !t.is_empty() {
            t.push(':');
        }
        t.push_str("glibc.malloc.hugetlb=1");
        vec![("GLIBC_TUNABLES", t)]
    }

    /// `fi_rma_bw -e rdm -o writedata -W window -S size -I ops`: the writer's Gbit/s.
    pub fn rma_bw(&self, size: usize, ops: u64, window: usize) -> Res<f64> {
        let args = ["-e", "rdm", "-o", "writedata", "-W", &window.to_string()].map(String::from);
        let mut args = args.to_vec();
        args.extend(["-S".into(), size.to_string(), "-I".into(), ops.to_string()]);
        let out = self.run_pair(RMA_BW, &args)?;
        Ok(checked(RMA_BW, &out, size)?.gbps())
    }

    /// `fi_rdm_pingpong -S size -I iters`: the mean ONE-WAY latency in µs (half a round trip).
    pub fn pingpong(&self, size: usize, iters: u64) -> Res<f64> {
        let args = ["-S".into(), size.to_string(), "-I".into(), iters.to_string()];
        let out = self.run_pair(PINGPONG, &args)?;
        Ok(checked(PINGPONG, &out, size)?.usec_per_xfer)
    }

    /// Server in the background, then the client; both killed at the deadline. Returns the
    /// client's output.
    fn run_pair(&self, tool: &str, args: &[String]) -> Res<String> {
        let prog = self.dir.join(tool);
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
        // -p PROV, the test's options and FABRIC_BENCH_FABTESTS_ARGS, on both sides.
        let mut opts = vec!["-p".to_string(), self.provider.to_string()];
        opts.extend(args.iter().cloned());
        opts.extend(extra_args());
        let mut sargs = vec!["-B".into(), port.clone(), "-s".into(), "127.0.0.1".into()];
        sargs.extend(opts.iter().cloned());
        let mut cargs = vec!["-P".into(), port];
        cargs.extend(opts);
        cargs.push("127.0.0.1".into());
        let deadline = Instant::now() + RUN_LIMIT;
        let env = self.env();
        let mut server = Spawned::start_on(&prog, &sargs, self.cpus[1], &env)?;
        // The client retries until the server is up (tcp and shm alike); a head start only
        // saves it the retries.
        std::thread::sleep(Duration::from_millis(100));
        if server.exited() {
            let (_, out) = server.finish(Instant::now());
            return Err(format!(
                "{tool} server exited at once ({}); its output:\n{}",
                sargs.join(" "),
                tail(&out, 15)
            )
            .into());
        }
        let client = Spawned::start_on(&prog, &cargs, self.cpus[0], &env)?.finish(deadline);
        let srv = server.finish(if client.0.is_some() {
            deadline + Duration::from_secs(5)
        } else {
            Instant::now()
        });
        pair_outcome(tool, client, srv, &format!("limit {RUN_LIMIT:?}; client args {}", cargs.join(" ")))
    }
}

/// [`parse_result`], and the row must be for `size`.
fn checked(tool: &str, out: &str, size: usize) -> Res<Figures> {
    let f = parse_result(out).map_err(|e| format!("{tool}: {e}; output:\n{}", tail(out, 20)))?;
    if f.bytes != size_str(size) {
        let want = size_str(size);
        return Err(format!(
            "{tool}: result row for {} bytes, not {want}; output:\n{}",
            f.bytes,
            tail(out, 20)
        )
        .into());
    }
    Ok(f)
}

/// The first result row under fabtests' `bytes iters total time MB/sec usec/xfer Mxfers/sec`
/// header (a leading `name` column, as some tests print, is allowed), read by column name.
pub fn parse_result(out: &str) -> Result<Figures, String> {
    let lines: Vec<&str> = out.lines().collect();
    let h = lines
        .iter()
        .position(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.contains(&"bytes") && w.contains(&"MB/sec") && w.contains(&"usec/xfer")
        })
        .ok_or("no result table (no `bytes ... MB/sec usec/xfer` header)")?;
    let names: Vec<&str> = lines[h].split_whitespace().collect();
    let row: Vec<&str> = lines[h + 1..]
        .iter()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| !w.is_empty())
        .ok_or("no row under the result table's header")?;
    // A `name` column may hold spaces: align on the right.
    if row.len() < names.len() {
        return Err(format!("{} columns named but the row has {} values", names.len(), row.len()));
    }
    let row = &row[row.len() - names.len()..];
    let col = |name: &str| -> Result<&str, String> {
        names.iter().position(|n| *n == name).map(|i| row[i]).ok_or_else(|| format!("no column {name:?}"))
    };
    let num = |name: &str| -> Result<f64, String> {
        let v = col(name)?;
        v.parse::<f64>().map_err(|_| format!("column {name}: {v:?} is not a number"))
    };
    Ok(Figures {
        bytes: col("bytes")?.to_string(),
        mb_per_sec: num("MB/sec")?,
        usec_per_xfer: num("usec/xfer")?,
    })
}

/// fabtests' `size_str` (`common/shared.c`): `8`, `64k`, `1m`, `1.5m`, `2g`; tenths below
/// 10 units, truncated.
pub fn size_str(size: usize) -> String {
    let (base, mag) = match size {
        s if s >= 1 << 30 => (1usize << 30, "g"),
        s if s >= 1 << 20 => (1 << 20, "m"),
        s if s >= 1 << 10 => (1 << 10, "k"),
        _ => (1, ""),
    };
    let fraction = if size / base < 10 { (size % base) * 10 / base } else { 0 };
    if fraction > 0 {
        format!("{}.{fraction}{mag}", size / base)
    } else {
        format!("{}{mag}", size / base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real output of the fabtests 1.17 binaries in target/ship-fabtests on this machine
    // (libfabric 1.17, FI_TCP_IFACE=lo), client side.
    const RMA_BW_TCP_64K: &str = "\
bytes   iters   total       time     MB/sec    usec/xfer   Mxfers/sec
64k     1k      62m         0.07s    979.32      66.92       0.01
";
    const RMA_BW_SHM_1M: &str = "\
bytes   iters   total       time     MB/sec    usec/xfer   Mxfers/sec
1m      200     200m        0.13s   1641.94     638.62       0.00
";
    const PINGPONG_SHM_8: &str = "\
bytes   iters   total       time     MB/sec    usec/xfer   Mxfers/sec
8       2k      31k         0.06s      0.58      13.83       0.07
";

    #[test]
    fn parses_real_output() {
        let f = parse_result(RMA_BW_TCP_64K).unwrap();
        assert_eq!(f, Figures { bytes: "64k".into(), mb_per_sec: 979.32, usec_per_xfer: 66.92 });
        assert!((f.gbps() - 7.83456).abs() < 1e-9, "{}", f.gbps());
        let f = parse_result(RMA_BW_SHM_1M).unwrap();
        assert_eq!((f.bytes.as_str(), f.mb_per_sec), ("1m", 1641.94));
        let f = parse_result(PINGPONG_SHM_8).unwrap();
        assert_eq!((f.bytes.as_str(), f.usec_per_xfer), ("8", 13.83));
        assert!(checked(PINGPONG, PINGPONG_SHM_8, 8).is_ok());
        let e = checked(RMA_BW, RMA_BW_SHM_1M, 65536).unwrap_err();
        assert!(e.to_string().contains("1m bytes, not 64k"), "{e}");
    }

    #[test]
    fn named_rows_and_noise_around_the_table() {
        let out = format!("some warning\n{:<50}{}", "", RMA_BW_TCP_64K)
            .replace("bytes   iters", "name bytes   iters")
            .replace("64k     1k", "fi_rma_bw (write data) 64k     1k");
        let f = parse_result(&out).unwrap();
        assert_eq!((f.bytes.as_str(), f.mb_per_sec), ("64k", 979.32));
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        assert!(parse_result("fi_getinfo(): -61 (No data available)\n")
            .unwrap_err()
            .contains("no result table"));
        let head_only = RMA_BW_TCP_64K.lines().next().unwrap();
        assert!(parse_result(head_only).unwrap_err().contains("no row"));
        assert!(parse_result(&RMA_BW_TCP_64K.replace("979.32", "n/a")).unwrap_err().contains("not a number"));
        assert!(parse_result(&RMA_BW_TCP_64K.replace("0.01\n", "\n")).unwrap_err().contains("columns named"));
    }

    #[test]
    fn sizes_as_fabtests_prints_them() {
        assert_eq!(size_str(8), "8");
        assert_eq!(size_str(4096), "4k");
        assert_eq!(size_str(65536), "64k");
        assert_eq!(size_str(1 << 20), "1m");
        assert_eq!(size_str(3 << 19), "1.5m");
        assert_eq!(size_str(5 << 18), "1.2m");
        assert_eq!(size_str(64 << 20), "64m");
        assert_eq!(size_str(1 << 30), "1g");
        assert_eq!(size_str(31 << 10 | 512), "31k");
    }

    #[test]
    fn missing_binaries_and_providers_are_clear_errors() {
        let dir = std::env::temp_dir().join(format!("fabric-bench-ft-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = Fabtests::new(&dir, "tcp", &[RMA_BW]).unwrap_err().to_string();
        assert!(e.contains("no executable fi_rma_bw"), "{e}");
        let e = Fabtests::new(&dir, "verbs", &[RMA_BW]).unwrap_err().to_string();
        assert!(e.contains("verbs is not supported"), "{e}");
        assert_eq!(provider_arg("shm"), Ok("shm"));
        // --huge-pages on: both sides get glibc's malloc tunable, after any of this process.
        let ft = Fabtests { dir: dir.clone(), provider: "shm", cpus: [None, None], huge: false };
        assert!(ft.env().is_empty());
        let env = ft.huge_pages(true).env();
        assert_eq!(env.len(), 1);
        assert_eq!(env[0].0, "GLIBC_TUNABLES");
        assert!(env[0].1.ends_with("glibc.malloc.hugetlb=1"), "{env:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
