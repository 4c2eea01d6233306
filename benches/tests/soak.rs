//! `fabric-bench soak` for a few seconds, as a user starts it: peers killed and restarted,
//! futures dropped, every byte and immediate checked; its exit status and summary say
//! whether anything was lost. The 60 s run is in `.ci/run`.

use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_fabric-bench");

/// Runs the soak with `args`; returns its stdout after checking it passed.
fn soak(args: &[&str]) -> String {
    soak_env(args, None)
}

/// [`soak`] with `FABRIC_FAULTS` set to `faults`.
fn soak_env(args: &[&str], faults: Option<&str>) -> String {
    let mut cmd = Command::new(BENCH);
    if let Some(f) = faults {
        cmd.env("FABRIC_FAULTS", f);
    }
    let out = cmd.arg("soak").args(args).env("FI_TCP_IFACE", "lo").output().expect("run fabric-bench soak");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "soak {args:?} failed ({}):\n{stdout}\n{stderr}", out.status);
    for line in ["bytes lost       0", "PASS"] {
        assert!(stdout.lines().any(|l| l.trim_end() == line.trim_end()), "no {line:?} in:\n{stdout}");
    }
    stdout
}

/// The count after `label` on the summary line that starts with `label`.
fn figure(out: &str, label: &str) -> u64 {
    let line =
        out.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label:?} in:\n{out}"));
    line[label.len()..].split_whitespace().next().and_then(|n| n.parse().ok()).expect("a number")
}

#[test]
fn ten_seconds_with_kills_drops_and_faults() {
    let out = soak(&[
        "--seconds",
        "10",
        "--kill-every",
        "3",
        "--report-every",
        "5",
        "--faults",
        "again=0.1,fail=0.02",
    ]);
    eprintln!("{out}");
    assert!(figure(&out, "ops posted") > 100, "traffic ran:\n{out}");
    assert!(figure(&out, "peers") >= 2, "peers were killed:\n{out}");
    assert!(figure(&out, "verified") > 0, "bytes were verified:\n{out}");
    assert!(out.contains("faults injected"), "{out}");
    // Bad remote accesses ran (the run itself fails if none went through a freed or a forged
    // descriptor).
    assert!(out.lines().any(|l| l.starts_with("stale ops") && l.contains("revoked (Stale")), "{out}");
    assert!(figure(&out, "forged ops") > 0, "forged descriptors were used:\n{out}");
}

#[test]
fn faults_from_the_environment() {
    let out = soak_env(&["--seconds", "3", "--kill-every", "0"], Some("again=0.2,fail=0.05,seed=9"));
    let line = out.lines().find(|l| l.starts_with("faults injected")).unwrap_or_else(|| panic!("{out}"));
    let n: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert!(n.len() == 2 && n[0] > 0 && n[1] > 0, "both kinds injected: {line}");
}

#[test]
fn lost_bytes_and_immediates_fail_the_run() {
    // `--tamper` misrecords one write's source and counts one immediate too many: the
    // checks must catch both and the run must fail.
    let out = Command::new(BENCH)
        .args(["soak", "--seconds", "2", "--kill-every", "0", "--tamper"])
        .env("FI_TCP_IFACE", "lo")
        .output()
        .expect("run fabric-bench soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("FAIL"), "{stdout}");
    assert!(stdout.contains("bytes lost: "), "the wrong write is named:\n{stdout}");
    assert!(stdout.contains("immediates arrived"), "the missing immediate is named:\n{stdout}");
    assert_ne!(figure(&stdout, "bytes lost"), 0, "{stdout}");
}

#[test]
fn an_error_fails_the_run() {
    let out = Command::new(BENCH)
        .args(["soak", "--seconds", "1", "--provider", "nope"])
        .env("FI_TCP_IFACE", "lo")
        .output()
        .expect("run fabric-bench soak");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
}
