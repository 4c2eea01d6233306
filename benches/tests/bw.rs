//! `fabric-bench bw` over the real tcp transport (loopback), as a user starts it: `--buffer`
//! rows for the engine and the raw loop, `--domains` lists, and `--fabtests DIR` (a DIR
//! without the binaries must fail clearly; the real fabtests, beside bw, lat and rtt, only
//! where `FABRIC_FABTESTS_DIR` names them; rtt's rows without them). Every run is killed
//! after [`LIMIT`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BENCH: &str = env!("CARGO_BIN_EXE_fabric-bench");
const LIMIT: Duration = Duration::from_secs(180);

/// Runs fabric-bench with `args`, killed after [`LIMIT`]: (success, stdout, stderr).
fn bench(args: &[&str]) -> (bool, String, String) {
    let dir = std::env::temp_dir();
    let tag = format!("{}-{}", std::process::id(), args.join("_").replace(['/', ' ', ','], "-"));
    let (out, err) = (dir.join(format!("fb-test-{tag}.out")), dir.join(format!("fb-test-{tag}.err")));
    let mut child = Command::new(BENCH)
        .args(args)
        .env("FI_TCP_IFACE", "lo")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("start fabric-bench");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fabric-bench {args:?} ran past {LIMIT:?}: {}", std::fs::read_to_string(&err).unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |p: &PathBuf| {
        let s = std::fs::read_to_string(p).unwrap_or_default();
        let _ = std::fs::remove_file(p);
        s
    };
    (status.success(), read(&out), read(&err))
}

/// Runs fabric-bench with `args` plus `--json`, checks it passed; the report's rows and the
/// run's standard output.
fn run_json(name: &str, args: &[&str]) -> (Vec<Value>, String) {
    let json = temp_path(&format!("{name}.json"));
    let mut a = args.to_vec();
    a.extend(["--json", json.to_str().unwrap()]);
    let (ok, out, err) = bench(&a);
    assert!(ok, "fabric-bench {a:?} failed:\n{out}\n{err}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    (doc["results"].as_array().unwrap().clone(), out)
}

/// [`run_json`]'s rows.
fn json_rows(name: &str, args: &[&str]) -> Vec<Value> {
    run_json(name, args).0
}

/// rtt's rows of one path kind: `p50` (every path's but fabtests') or `mean round trip`.
fn rtt_rows<'a>(rows: &'a [Value], stat: &str) -> Vec<&'a Value> {
    rows.iter().filter(|r| r["test"] == "rtt" && r["case"].as_str().unwrap().contains(stat)).collect()
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fabric-bench-test-{}-{name}", std::process::id()))
}

/// Runs bw with `args` plus `--json`, checks it passed; the sweep's rows of the JSON.
fn bw_rows(name: &str, args: &[&str]) -> Vec<Value> {
    let (rows, out) = report_rows(name, args);
    // The sweep's rows (not iperf3's, which has no pattern).
    let rows: Vec<Value> =
        rows.into_iter().filter(|r| r["test"] == "bw" && r.get("pattern").is_some()).collect();
    assert!(!rows.is_empty(), "no bw rows:\n{out}");
    rows
}

/// Runs bw with `args` plus `--json`, checks it passed: every row of the JSON, and stdout.
fn report_rows(name: &str, args: &[&str]) -> (Vec<Value>, String) {
    let plot = temp_path(&format!("{name}.png"));
    let mut a = vec!["bw", "--plot", plot.to_str().unwrap()];
    a.extend_from_slice(args);
    let (rows, out) = run_json(name, &a);
    let _ = std::fs::remove_file(&plot);
    eprintln!("{out}");
    (rows, out)
}

fn positive(r: &Value, key: &str) -> bool {
    r[key].as_f64().is_some_and(|v| v.is_finite() && v > 0.0)
}

/// `--rounds 6`: six bursts of engine and raw loop (the raw loop first in every second), and
/// a row with the median of the six per-round ratios: JSON `rounds`, `ci95` inside `range`
/// and around the median, the same figures in its label, and a shape `check_json.py` takes.
#[test]
fn rounds_give_a_row_of_per_round_ratios() {
    let rows = bw_rows(
        "rounds",
        &["--quick", "--rounds", "6", "--buffer", "hot", "--provider", "tcp", "--sizes", "64K"],
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    let r =
        rows.iter().find(|r| r.get("engine_x").is_some()).unwrap_or_else(|| panic!("no ratio row: {rows:?}"));
    let case = r["case"].as_str().unwrap();
    assert!(case.contains("median of 6 per-round ratios"), "{case}");
    assert_eq!(r["rounds"], 6, "{r}");
    let pair = |k: &str| -> Vec<f64> {
        r[k].as_array().unwrap_or_else(|| panic!("no {k}: {r}")).iter().map(|v| v.as_f64().unwrap()).collect()
    };
    let (ci, range) = (pair("ci95"), pair("range"));
    let m = r["engine_x"].as_f64().unwrap();
    assert!(range[0] > 0.0 && range[0] <= ci[0] && ci[0] <= ci[1] && ci[1] <= range[1], "{r}");
    assert!(ci[0] <= m && m <= ci[1], "{m} outside the CI: {r}");
    // With 6 rounds the interval is the smallest and largest ratio (P(X = 0) = 1/64).
    assert_eq!(ci, range, "{r}");
    let label = format!("95% CI {:.2}-{:.2}, range {:.2}-{:.2}", ci[0], ci[1], range[0], range[1]);
    assert!(case.contains(&label), "{case} lacks {label}");
    if let Some(o) = check_json("rounds-check", &rows) {
        assert!(o.status.success(), "check_json.py: {}", String::from_utf8_lossy(&o.stderr));
        // And it refuses an interval that does not hold the median.
        let mut bad = rows.clone();
        for r in bad.iter_mut().filter(|r| r.get("engine_x").is_some()) {
            r["ci95"] = serde_json::json!([m + 1.0, m + 2.0]);
            r["range"] = serde_json::json!([0.0, m + 3.0]);
        }
        let o = check_json("rounds-check-bad", &bad).expect("python3 ran a moment ago");
        assert!(!o.status.success(), "check_json.py took a CI without its median");
        assert!(String::from_utf8_lossy(&o.stderr).contains("outside ci95"), "{o:?}");
    }
}

/// `--time-calls`: for the size, each side's `bw-time` rows: the NIC thread's microseconds
/// in the provider's post and poll calls per write (engine beside raw loop, both timed), its
/// busy share of the burst (at most the whole burst; a little over only by a call that began
/// before the burst did), the engine's completion work per write, and its reactor's sleeps
/// per write. Without the flag there are none.
#[test]
fn time_calls_account_for_each_sides_nic_thread() {
    let args = ["--quick", "--rounds", "2", "--buffer", "hot", "--provider", "tcp", "--sizes", "64K"];
    let (rows, out) = report_rows("time-calls", &[&args[..], &["--time-calls"]].concat());
    let t: Vec<&Value> = rows.iter().filter(|r| r["test"] == "bw-time").collect();
    assert_eq!(t.len(), 8, "{out}");
    for side in ["sender", "receiver"] {
        let row = |what: &str| {
            let case = format!("64 KiB hot {side}: {what}");
            *t.iter()
                .find(|r| r["case"] == case.as_str())
                .unwrap_or_else(|| panic!("no row {case:?}:\n{out}"))
        };
        let nic = row("NIC calls per write");
        assert!(
            positive(nic, "engine_us") && positive(nic, "baseline_us") && positive(nic, "ratio"),
            "{nic}"
        );
        let busy = row("busy share");
        for k in ["engine_pct", "baseline_pct"] {
            let v = busy[k].as_f64().unwrap_or(f64::NAN);
            assert!(v > 0.0 && v <= 105.0, "{side} {k} {v}: {busy}");
        }
        assert!(positive(row("completing per write"), "engine_us"), "{side}:\n{out}");
        let sleeps = row("reactor sleeps per write")["engine_sleeps"].as_f64().unwrap_or(f64::NAN);
        assert!((0.0..1e6).contains(&sleeps), "{side} reactor sleeps per write {sleeps}:\n{out}");
    }
    if let Some(o) = check_json("time-calls-check", &rows) {
        assert!(o.status.success(), "check_json.py: {}", String::from_utf8_lossy(&o.stderr));
    }
    let (rows, _) = report_rows("untimed", &args);
    assert!(rows.iter().all(|r| r["test"] != "bw-time"), "bw-time rows without --time-calls");
}

/// `benches/check_json.py` run on a report of `rows` (tcp); `None` where there is no python3.
fn check_json(name: &str, rows: &[Value]) -> Option<std::process::Output> {
    let json = temp_path(&format!("{name}.json"));
    std::fs::write(&json, serde_json::json!({"provider": "tcp", "results": rows}).to_string()).unwrap();
    let o = Command::new("python3").arg("benches/check_json.py").arg(&json).current_dir(crate_dir()).output();
    let _ = std::fs::remove_file(&json);
    o.ok()
}

#[test]
fn hot_and_cold_rows_for_engine_and_raw() {
    let rows =
        bw_rows("hot-cold", &["--quick", "--buffer", "hot,cold", "--provider", "tcp", "--sizes", "64K,1M"]);
    for pat in ["hot", "cold"] {
        for size in [64u64 << 10, 1 << 20] {
            let r = rows
                .iter()
                .find(|r| r["pattern"] == pat && r["size"] == size)
                .unwrap_or_else(|| panic!("no {pat} row at {size}: {rows:?}"));
            assert!(positive(r, "engine_gbps"), "{r}");
            assert_eq!(r["baseline"], "raw", "{r}");
            assert!(positive(r, "baseline_gbps"), "{r}");
            assert_eq!(r["domains"], 1, "{r}");
            // Without --fabtests the rows say so.
            assert_eq!(r["fabtests"], "skipped: no --fabtests DIR", "{r}");
        }
    }
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(
        rows.iter().all(|r| !r["case"].as_str().unwrap().contains("pages")),
        "huge pages by default: {rows:?}"
    );
    // The shape CI checks (benches/check_json.py, when python3 is there).
    if let Some(o) = check_json("hot-cold-check", &rows) {
        assert!(o.status.success(), "check_json.py: {}", String::from_utf8_lossy(&o.stderr));
    }
}

/// `--huge-pages off`: engine and raw loop in 4 KiB pages, and the rows say so.
#[test]
fn huge_pages_off_is_said_in_the_rows() {
    let rows =
        bw_rows("small-pages", &["--quick", "--buffer", "hot", "--sizes", "4M", "--huge-pages", "off"]);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert!(r["case"].as_str().unwrap().ends_with("[4 KiB pages]"), "{r}");
    assert!(positive(r, "engine_gbps") && positive(r, "baseline_gbps"), "{r}");
}

#[test]
fn a_list_of_domain_counts() {
    let rows = bw_rows("domains", &["--quick", "--buffer", "hot", "--sizes", "1M", "--domains", "1,2"]);
    for d in [1, 2] {
        let r =
            rows.iter().find(|r| r["domains"] == d).unwrap_or_else(|| panic!("no {d}-domain row: {rows:?}"));
        assert!(positive(r, "engine_gbps") && positive(r, "baseline_gbps"), "{r}");
        assert_eq!(r["pattern"], "hot");
    }
    let (ok, _, err) = bench(&["lat", "--quick", "--domains", "1,2"]);
    assert!(!ok && err.contains("a list is accepted by bw only"), "{err}");
}

#[test]
fn fabtests_dir_without_the_binaries_is_a_clear_error() {
    let dir = temp_path("empty-fabtests");
    std::fs::create_dir_all(&dir).unwrap();
    let t0 = Instant::now();
    let (ok, out, err) = bench(&["bw", "--quick", "--sizes", "64K", "--fabtests", dir.to_str().unwrap()]);
    // rtt runs fi_rdm_pingpong: the same check, before any test.
    let (rtt_ok, rtt_out, rtt_err) = bench(&["rtt", "--quick", "--fabtests", dir.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!ok, "accepted an empty --fabtests dir:\n{out}");
    assert!(err.contains("no executable fi_rma_bw"), "the missing binary is named:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!rtt_ok, "rtt accepted an empty --fabtests dir:\n{rtt_out}");
    assert!(rtt_err.contains("no executable fi_rdm_pingpong") && !rtt_err.contains("panicked"), "{rtt_err}");
    assert!(t0.elapsed() < Duration::from_secs(20), "they failed before running anything");
    let (ok, _, err) = bench(&["bw", "--provider", "verbs", "--fabtests", "/nonexistent"]);
    assert!(!ok && err.contains("verbs is not supported"), "{err}");
}

/// With the real fabtests 1.17 binaries (`FABRIC_FABTESTS_DIR`, e.g. target/ship-fabtests).
#[test]
fn beside_the_real_fabtests() {
    let Some(dir) = std::env::var_os("FABRIC_FABTESTS_DIR") else {
        println!("skipped: FABRIC_FABTESTS_DIR not set (a directory of fabtests 1.17 binaries)");
        return;
    };
    let dir = Path::new(&dir).to_str().unwrap().to_string();
    for provider in ["tcp", "shm"] {
        let args =
            ["--quick", "--buffer", "hot,cold", "--provider", provider, "--sizes", "64K", "--fabtests", &dir];
        let rows = bw_rows(&format!("ft-{provider}"), &args);
        assert_eq!(rows.len(), 2, "{rows:?}");
        for r in &rows {
            assert!(
                r["fabtests"].as_str().unwrap().starts_with("fi_rma_bw -e rdm -o writedata -W 16"),
                "{r}"
            );
            for k in ["fabtests_gbps", "ratio_engine_fabtests", "ratio_raw_fabtests"] {
                assert!(positive(r, k), "{provider} {k}: {r}");
            }
        }
    }
    let rows = json_rows("ft-lat", &["lat", "--quick", "--iters", "100", "--fabtests", &dir]);
    let p50: Vec<&Value> = rows.iter().filter(|r| r["case"].as_str().unwrap().contains("p50")).collect();
    assert_eq!(p50.len(), 3, "{rows:?}");
    for r in p50 {
        assert!(positive(r, "fabtests_us"), "{r}");
    }
    // rtt: fi_rdm_pingpong is a path of its own in every round; every engine path's row
    // carries its median beside the raw loop's.
    for provider in ["tcp", "shm"] {
        let args = ["rtt", "--quick", "--iters", "100", "--provider", provider, "--fabtests", &dir];
        let rows = json_rows(&format!("ft-rtt-{provider}"), &args);
        let ft = rtt_rows(&rows, "mean round trip");
        assert_eq!(ft.len(), 1, "{provider}: {rows:?}");
        assert!(ft[0]["case"].as_str().unwrap().starts_with("fi_rdm_pingpong 8 B"), "{}", ft[0]);
        assert!(positive(ft[0], "engine_us") && positive(ft[0], "ratio"), "{}", ft[0]);
        let paths = rtt_rows(&rows, " p50,");
        assert!(paths.len() >= 4, "{provider}: {rows:?}");
        for r in paths.iter().filter(|r| !r["case"].as_str().unwrap().starts_with("raw loop")) {
            assert_eq!(r["fabtests_us"], ft[0]["engine_us"], "{provider}: {r}");
            assert!(positive(r, "ratio_raw_fabtests") && positive(r, "ratio_engine_fabtests"), "{r}");
        }
    }
}

/// rtt without `--fabtests` (a real tcp ping-pong per path): no fabtests path runs, and every
/// engine path's row says why there is no fabtests figure beside it.
#[test]
fn rtt_rows_say_when_fabtests_did_not_run() {
    let rows = json_rows("rtt-noft", &["rtt", "--quick", "--iters", "50", "--provider", "tcp"]);
    assert!(rtt_rows(&rows, "fi_rdm_pingpong").is_empty(), "{rows:?}");
    let paths = rtt_rows(&rows, " p50,");
    assert!(paths.len() >= 4, "{rows:?}");
    for r in paths {
        assert!(positive(r, "engine_us"), "{r}");
        if r["case"].as_str().unwrap().starts_with("raw loop") {
            assert!(r.get("fabtests").is_none(), "{r}");
        } else {
            assert_eq!(r["fabtests"], "skipped: no --fabtests DIR", "{r}");
        }
    }
}

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}
