//! The workload examples (`moe`, `kv_transfer`, `rl_weights`) run small, as a user starts
//! them: each must exit 0 and print its success line, which it prints only after checking
//! every byte and count.
//!
//! The binaries are built by the test itself (`cargo build --example`, through `$CARGO`, for
//! the test's own profile; a no-op when they are up to date). Where the suite runs on another
//! provider than tcp or shm (verbs in the rxe VM, where these multi-process runs would take
//! minutes), the tests say SKIPPED on stderr and pass. The runs take turns (one lock): each starts several processes, and the
//! machine may have two cores.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use integration_tests::{primary, skipped};

/// One example at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
/// Longest one run may take before it counts as hung.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// `target/<profile>/examples/NAME`, built (or found up to date) by `cargo build --example`
/// for the profile this test was built with; `target/<profile>` is found from this test's
/// own path (`target/<profile>/deps/examples-<hash>`). `cargo test --all-targets` builds the
/// examples only as test harnesses, so the runnable binaries are built here, once.
fn example(name: &str) -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let profile_dir =
            exe.parent().and_then(|d| d.parent()).ok_or("no target/<profile> above the test")?;
        let profile = profile_dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let cargo = std::env::var("CARGO").map_err(|_| "CARGO is not set (not run by cargo test)")?;
        let mut build = Command::new(cargo);
        build.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        build.args(["build", "--quiet", "-p", "fabric-examples"]);
        for e in ["moe", "kv_transfer", "rl_weights"] {
            build.args(["--example", e]);
        }
        match profile {
            "debug" => {}
            "release" => {
                build.arg("--release");
            }
            other => return Err(format!("unknown profile directory {other:?}")),
        }
        let status = build.status().map_err(|e| format!("cargo build: {e}"))?;
        if !status.success() {
            return Err(format!("cargo build of the examples: {status}"));
        }
        Ok(profile_dir.join("examples"))
    });
    let path = dir.clone()?.join(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!("{} is missing after cargo build", path.display()))
    }
}

/// The provider to run on, or `None` (and a SKIPPED line) if the suite's is not tcp or shm.
fn provider(test: &str) -> Option<String> {
    let p = primary();
    if p == "tcp" || p == "shm" {
        Some(p)
    } else {
        skipped(test, &format!("the examples run on tcp or shm here, not on {p}"));
        None
    }
}

/// Runs example `name` with `args` on `provider` and checks that it exited 0 within
/// [`RUN_TIMEOUT`] and that its output has every string of `expect`.
fn run(test: &str, name: &str, provider: &str, args: &[&str], expect: &[&str]) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let bin = example(name).unwrap_or_else(|e| panic!("{test}: {e}"));
    let mut child = Command::new(&bin)
        .args(args)
        .args(["--provider", provider])
        .env("FI_TCP_IFACE", "lo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: cannot start {}: {e}", bin.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{name} {args:?} hung for {} s\nstdout:\n{}\nstderr:\n{}",
                RUN_TIMEOUT.as_secs(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().expect("output");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        status.success() && expect.iter().all(|e| stdout.contains(e)),
        "{name} {args:?} on {provider}: {status}, expected lines with {expect:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}

#[test]
fn moe_every_token_checked_in_every_mode() {
    let Some(p) = provider("moe_every_token_checked_in_every_mode") else { return };
    let test = "moe_every_token_checked_in_every_mode";
    let args = ["--ranks", "3", "--steps", "10", "--tokens", "16"];
    // One line per mode, printed after the mode's steps checked every token.
    run(test, "moe", &p, &args, &["moe: spin ", "moe: inline ", "moe: event ", "every token checked"]);
}

#[test]
fn kv_transfer_worker_joins_and_leaves_cleanly() {
    let Some(p) = provider("kv_transfer_worker_joins_and_leaves_cleanly") else { return };
    let args =
        ["--requests", "40", "--layers", "2", "--block-kib", "16", "--max-blocks", "8", "--inflight", "4"];
    let ok =
        "kv_transfer: ok: 40 of 40 requests verified byte for byte; worker 2 joined, worker 0 left cleanly";
    run("kv_transfer", "kv_transfer", &p, &args, &[ok]);
}

#[test]
fn kv_transfer_worker_killed_requests_rerouted() {
    let test = "kv_transfer_worker_killed_requests_rerouted";
    let Some(p) = provider(test) else { return };
    let args = [
        "--requests",
        "40",
        "--layers",
        "2",
        "--block-kib",
        "16",
        "--max-blocks",
        "8",
        "--inflight",
        "4",
        "--kill",
        "--deadline-ms",
        "2000",
    ];
    let ok =
        "kv_transfer: ok: 40 of 40 requests verified byte for byte; worker 2 joined, worker 0 was killed";
    run(test, "kv_transfer", &p, &args, &[ok, "worker 0 killed (SIGKILL)"]);
}

#[test]
fn rl_weights_versions_land_whole() {
    let Some(p) = provider("rl_weights_versions_land_whole") else { return };
    let args = ["--workers", "2", "--model-mib", "8", "--tensors", "24", "--versions", "3"];
    run("rl_weights", "rl_weights", &p, &args, &["rl_weights: ok: 3 versions x 2 workers", "none torn"]);
}
