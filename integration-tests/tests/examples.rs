//! The workload examples (`moe`, `kv_transfer`, `rl_weights`) run small, as a user starts
//! them: each must exit 0 and print its success line, which it prints only after checking
//! every byte and count.
//!
//! The binaries are the ones `cargo test --workspace --all-targets` builds next to this test
//! (`target/<profile>/examples/NAME`). Where they were not built (`cargo test -p
//! integration-tests`), or where the suite runs on another provider than tcp or shm (verbs in
//! the rxe VM, where these multi-process runs would take minutes), the tests say SKIPPED on
//! stderr and pass. The runs take turns (one lock): each starts several processes, and the
//! machine may have two cores.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use integration_tests::{primary, skipped};

/// One example at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
/// Longest one run may take before it counts as hung.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// `target/<profile>/examples/NAME`, found from this test's own path
/// (`target/<profile>/deps/examples-<hash>`).
fn example(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    path.exists().then_some(path)
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
    let Some(bin) = example(name) else {
        skipped(
            test,
            &format!("examples/{name} was not built (cargo test --workspace --all-targets builds it)"),
        );
        return;
    };
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
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
    if p == "shm" {
        // Over shm, a SIGKILLed peer stalls the prefill's writes to the live workers too
        // (the example then fails within its deadlines instead of hanging).
        skipped(test, "on shm a killed peer stalls writes to the other peers (library issue)");
        return;
    }
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
