//! The workload examples (`moe`, `kv_transfer`, `rl_weights`) run small, as a user starts
//! them: each must exit 0 and print its success line, which it prints only after checking
//! every byte and count.
//!
//! And no example outlives a peer killed with SIGKILL: one process of `quickstart` and of
//! each workload example is killed mid-run (after it printed that it is up, or a round), and
//! every surviving process must exit within [`kill_bound`] of the kill, non-zero, saying which
//! peer is unreachable (the times are printed, `--nocapture`). Each run is a process group of
//! its own, killed whole on every path.
//!
//! The binaries are built by the test itself (`cargo build --workspace --example`, through
//! `$CARGO`, for the test's own profile; a no-op when they are up to date). Where the suite
//! runs on another provider than tcp or shm (verbs in the rxe VM, where these multi-process
//! runs would take minutes), the tests say SKIPPED on stderr and pass, except the two
//! `quickstart` kill tests, which run on verbs too (its keep-alive finds a dead peer that
//! nothing is posted to). Inside the VM nothing is built: the binaries must have been built
//! before (`scripts/test.sh` does). The runs take turns (one lock): each starts several
//! processes, and the machine may have two cores.

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
        if std::env::var_os("RXE_VM_GUEST").is_some() {
            // The rxe VM: no cargo in there (and a build under emulation would take minutes);
            // `scripts/test.sh` builds the examples before it boots the VM.
            return Ok(profile_dir.join("examples"));
        }
        let cargo = std::env::var("CARGO").map_err(|_| "CARGO is not set (not run by cargo test)")?;
        let mut build = Command::new(cargo);
        build.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        // The whole workspace, as `cargo test --workspace` selects it: `-p fabric-examples`
        // would resolve that package's features alone and overwrite the workspace crates'
        // artifacts, and the next workspace build would compile them all again.
        build.args(["build", "--quiet", "--workspace"]);
        for e in ["moe", "kv_transfer", "rl_weights", "quickstart"] {
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

/// How soon after a kill every surviving process must have exited: 1 s on tcp and shm; 3 s
/// on verbs, whose RC transport retries ~0.5 s before it reports a dead peer (and up to
/// 0.2 s more for a keep-alive probe of an idle one), in the emulated VM (docs/faults.md).
fn kill_bound(provider: &str) -> Duration {
    if provider.starts_with("verbs") {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(1)
    }
}
/// Longest a run may take to reach the point where its victim is killed.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The providers of the kill tests: the suite's tcp and shm (both by default).
fn kill_providers(test: &str) -> Vec<String> {
    let ps: Vec<String> =
        integration_tests::providers().into_iter().filter(|p| p == "tcp" || p == "shm").collect();
    if ps.is_empty() {
        skipped(test, &format!("the examples run on tcp or shm here, not on {}", primary()));
    }
    ps
}

/// [`kill_providers`] and verbs (the rxe VM): for `quickstart`, two processes, which the
/// emulated VM runs in seconds.
fn kill_providers_and_verbs(test: &str) -> Vec<String> {
    let ps: Vec<String> = integration_tests::providers()
        .into_iter()
        .filter(|p| p == "tcp" || p == "shm" || p.starts_with("verbs"))
        .collect();
    if ps.is_empty() {
        skipped(test, &format!("the examples run on tcp, shm or verbs here, not on {}", primary()));
    }
    ps
}

/// An example run whose processes form a process group of their own, with every output line
/// (stdout and stderr of all of them) collected. Dropping it kills the whole group.
struct Group {
    root: std::process::Child,
    lines: std::sync::Arc<Mutex<Vec<String>>>,
    /// The run's processes found so far (besides the root), whose shm regions are removed.
    pids: Vec<u32>,
    /// The provider it runs on.
    provider: String,
}

impl Group {
    fn start(name: &str, provider: &str, args: &[&str]) -> Group {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        let bin = example(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut root = Command::new(&bin)
            .args(args)
            .args(["--provider", provider])
            .env("FI_TCP_IFACE", "lo")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cannot start {}: {e}", bin.display()));
        let lines = std::sync::Arc::new(Mutex::new(Vec::new()));
        let out: Vec<Box<dyn std::io::Read + Send>> = vec![
            Box::new(root.stdout.take().expect("stdout")),
            Box::new(root.stderr.take().expect("stderr")),
        ];
        for o in out {
            let lines = lines.clone();
            // Ends when every process of the group closed it (they are killed at the latest).
            std::thread::spawn(move || {
                for l in std::io::BufReader::new(o).lines().map_while(Result::ok) {
                    lines.lock().unwrap_or_else(|p| p.into_inner()).push(l);
                }
            });
        }
        Group { root, lines, pids: Vec::new(), provider: provider.to_owned() }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits (bounded) until `ready` finds what it needs in the output.
    fn wait_for<T>(&mut self, what: &str, ready: impl Fn(&[String]) -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(t) = ready(&self.lines()) {
                return t;
            }
            let gone = self.root.try_wait().expect("try_wait").is_some();
            if gone || start.elapsed() > READY_TIMEOUT {
                panic!(
                    "{what}: not seen ({}), output:\n{}",
                    if gone { "the run ended" } else { "timed out" },
                    self.lines().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a negative pid signals the process group; no memory involved.
        unsafe { libc::kill(-(self.root.id() as libc::pid_t), libc::SIGKILL) };
        let _ = self.root.wait();
        // shm names its regions `PID:UID:N` in /dev/shm and a killed process never unlinks
        // them (docs/faults.md): those of this run's dead processes go.
        self.pids.push(self.root.id());
        let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let owner = name.split(':').next().and_then(|p| p.parse::<u32>().ok());
            if owner.is_some_and(|p| self.pids.contains(&p) && exited(p)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// The pid after `prefix` in the first line that has it.
fn pid_after(lines: &[String], prefix: &str) -> Option<u32> {
    lines.iter().find_map(|l| {
        let rest = &l[l.find(prefix)? + prefix.len()..];
        rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    })
}

/// Whether process `pid` (not necessarily our child) has exited: gone, or a zombie.
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()) == Some("Z"),
    }
}

/// Who dies: the root process of the run, or another one by pid.
enum Victim {
    Root,
    Pid(u32),
}

/// Kills `victim` and times the exit of every survivor (`root` if it is not the victim,
/// and the `others` pids); asserts each within [`kill_bound`], the root's status non-zero,
/// and that the output says why (`expect`: one of these texts; `Error::PeerUnreachable`
/// reads "peer N is unreachable: ...").
fn kill_and_time(test: &str, g: &mut Group, victim: Victim, others: &[(&str, u32)], expect: &[&str]) {
    let root_survives = matches!(victim, Victim::Pid(_));
    g.pids.extend(others.iter().map(|(_, p)| *p));
    if let Victim::Pid(p) = victim {
        g.pids.push(p);
    }
    let killed = Instant::now();
    match victim {
        Victim::Root => {
            let _ = g.root.kill();
            let _ = g.root.wait();
        }
        // SAFETY: kill(2) of a pid of this run's group.
        Victim::Pid(pid) => unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        },
    }
    let mut times: Vec<(String, Option<Duration>)> = Vec::new();
    let mut root_status = None;
    let mut left: Vec<(String, u32)> = others.iter().map(|(n, p)| (n.to_string(), *p)).collect();
    let deadline = Duration::from_secs(10);
    while killed.elapsed() < deadline {
        if root_survives && root_status.is_none() {
            if let Some(st) = g.root.try_wait().expect("try_wait") {
                root_status = Some(st);
                times.push(("root".into(), Some(killed.elapsed())));
            }
        }
        left.retain(|(n, p)| {
            let gone = exited(*p);
            if gone {
                times.push((format!("{n} (pid {p})"), Some(killed.elapsed())));
            }
            !gone
        });
        if left.is_empty() && (!root_survives || root_status.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    for (n, p) in &left {
        times.push((format!("{n} (pid {p})"), None));
    }
    if root_survives && root_status.is_none() {
        times.push(("root".into(), None));
    }
    // The last lines of the survivors are still in the pipes' reader threads.
    std::thread::sleep(Duration::from_millis(300));
    let out = g.lines().join("\n");
    let shown: Vec<String> = times
        .iter()
        .map(|(n, t)| {
            format!("{n} {}", t.map_or("still running".into(), |t| format!("{} ms", t.as_millis())))
        })
        .collect();
    println!("{test}: kill -> exit: {}", shown.join(", "));
    let bound = kill_bound(&g.provider);
    for (n, t) in &times {
        assert!(
            t.is_some_and(|t| t <= bound),
            "{test}: {n} did not exit within {bound:?} of the kill ({shown:?})\noutput:\n{out}"
        );
    }
    if let Some(st) = root_status {
        assert!(!st.success(), "{test}: the surviving root exited {st} after its peer was killed\n{out}");
    }
    assert!(
        expect.iter().any(|e| out.contains(e)),
        "{test}: no message naming the unreachable peer ({expect:?})\noutput:\n{out}"
    );
    if let Some(l) = out.lines().find(|l| l.contains("is unreachable")) {
        println!("{test}: {l}");
    }
}

/// The quickstart's processes: the root (sender) and the receiver, by pid, once a few rounds ran.
fn quickstart_mid_run(p: &str) -> (Group, u32) {
    let mut g = Group::start("quickstart", p, &["--size", "4", "--chunk", "256", "--rounds", "100000"]);
    let receiver = g.wait_for("quickstart round 2", |l| {
        l.iter().any(|l| l.starts_with("round 2:")).then(|| pid_after(l, "receiver: pid ")).flatten()
    });
    (g, receiver)
}

#[test]
fn quickstart_receiver_killed_ends_the_sender() {
    let test = "quickstart_receiver_killed_ends_the_sender";
    for p in kill_providers_and_verbs(test) {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let (mut g, receiver) = quickstart_mid_run(&p);
        kill_and_time(&format!("{test} {p}"), &mut g, Victim::Pid(receiver), &[], &["is unreachable"]);
    }
}

#[test]
fn quickstart_sender_killed_ends_the_receiver() {
    let test = "quickstart_sender_killed_ends_the_receiver";
    for p in kill_providers_and_verbs(test) {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let (mut g, receiver) = quickstart_mid_run(&p);
        kill_and_time(
            &format!("{test} {p}"),
            &mut g,
            Victim::Root,
            &[("receiver", receiver)],
            &["is unreachable"],
        );
    }
}

/// kv_transfer's prefill killed: every decode worker ends (a killed worker instead is
/// expected and re-routed: `kv_transfer_worker_killed_requests_rerouted`). A worker that
/// sees its parent gone before the engine reports the prefill down says so instead
/// (`exit_with_parent`, every 200 ms).
#[test]
fn kv_transfer_prefill_killed_ends_the_workers() {
    let test = "kv_transfer_prefill_killed_ends_the_workers";
    for p in kill_providers(test) {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let args = ["--requests", "100000", "--layers", "2", "--block-kib", "16", "--max-blocks", "8"];
        let mut g = Group::start("kv_transfer", &p, &args);
        let workers = g.wait_for("kv_transfer workers 0 and 1 up", |l| {
            Some([pid_after(l, "decode worker 0 up (pid ")?, pid_after(l, "decode worker 1 up (pid ")?])
        });
        std::thread::sleep(Duration::from_millis(500));
        let others = [("worker 0", workers[0]), ("worker 1", workers[1])];
        let expect = ["is unreachable", "the parent process is gone"];
        kill_and_time(&format!("{test} {p}"), &mut g, Victim::Root, &others, &expect);
    }
}

/// rl_weights: a worker killed ends the trainer (and with it the other worker).
#[test]
fn rl_weights_worker_killed_ends_the_trainer() {
    let test = "rl_weights_worker_killed_ends_the_trainer";
    for p in kill_providers(test) {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let args = ["--workers", "2", "--model-mib", "1", "--tensors", "4", "--versions", "100000"];
        let mut g = Group::start("rl_weights", &p, &args);
        let workers = g.wait_for("rl_weights workers at version 1", |l| {
            Some([pid_after(l, "worker 0 (pid ")?, pid_after(l, "worker 1 (pid ")?])
        });
        let expect = ["is unreachable"];
        kill_and_time(
            &format!("{test} {p}"),
            &mut g,
            Victim::Pid(workers[0]),
            &[("worker 1", workers[1])],
            &expect,
        );
    }
}

/// moe: rank 1 of 3 killed mid-steps (futures, then the spin path) ends ranks 0 and 2.
#[test]
fn moe_rank_killed_ends_the_others() {
    let test = "moe_rank_killed_ends_the_others";
    for p in kill_providers(test) {
        for mode in ["event", "spin"] {
            let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
            let args = ["--ranks", "3", "--steps", "1000000", "--tokens", "16", "--modes", mode];
            let mut g = Group::start("moe", &p, &args);
            let ranks = g.wait_for("moe ranks 1 and 2 up", |l| {
                Some([pid_after(l, "rank 1 (pid ")?, pid_after(l, "rank 2 (pid ")?])
            });
            std::thread::sleep(Duration::from_millis(300));
            let t = format!("{test} {p} {mode}");
            kill_and_time(&t, &mut g, Victim::Pid(ranks[0]), &[("rank 2", ranks[1])], &["is unreachable"]);
        }
    }
}
