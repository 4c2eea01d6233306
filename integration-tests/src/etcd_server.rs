//! A real etcd server for the tests: Debian's `etcd-server` (`/usr/bin/etcd`, or
//! `FABRIC_ETCD_BIN`), on free loopback ports, with a temporary data dir, killed and removed
//! when the guard is dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd, killed (and its data dir removed) on drop.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    /// `127.0.0.1:PORT` of the client URL.
    pub endpoint: String,
}

/// Where the etcd binary is: `FABRIC_ETCD_BIN`, else `etcd` on the `PATH`, else `/usr/bin/etcd`.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FABRIC_ETCD_BIN") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .chain([PathBuf::from("/usr/bin/etcd")])
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Whether etcd at `endpoint` answers `GET /health` with `"health":"true"` (HTTP/1.0, so the
/// server closes the connection after the answer).
fn healthy(endpoint: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect(endpoint) else { return false };
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    if c.write_all(format!("GET /health HTTP/1.0\r\nHost: {endpoint}\r\n\r\n").as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = c.take(4096).read_to_string(&mut answer);
    answer.contains("\"health\":\"true\"")
}

impl EtcdServer {
    /// Starts `bin` on free 127.0.0.1 ports and waits (up to 20 s) until it serves: its
    /// `/health` answers `"health":"true"` (it has elected itself leader), not merely until
    /// its port accepts connections, so a test's first request does not wait for the
    /// election. Panics with etcd's log if it does not come up.
    pub fn start(bin: &Path) -> EtcdServer {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("fabric-etcd-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("etcd temp dir");
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("127.0.0.1:{client}");
        let log = std::fs::File::create(dir.join("etcd.log")).expect("etcd log file");
        let child = Command::new(bin)
            .args(["--name", "fabric-test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &format!("http://{endpoint}")])
            .args(["--advertise-client-urls", &format!("http://{endpoint}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("fabric-test=http://127.0.0.1:{peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let mut s = EtcdServer { child: Some(child), dir, endpoint };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if healthy(&s.endpoint) {
                return s;
            }
            if let Some(c) = s.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!("etcd exited at start ({status}):\n{}", s.log());
                }
            }
            if Instant::now() > deadline {
                panic!("etcd did not listen on {} within 20 s:\n{}", s.endpoint, s.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// etcd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
