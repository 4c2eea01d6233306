//! The C API from C: `tests/c/two_procs.c` compiled against `include/fabric.h` and
//! `libfabric_c.so` with the system's C compiler (`CC`, else `cc`), then run as two
//! processes over real libfabric tcp and shm on loopback. The initiator writes 4 MiB
//! (write_imm and a batch), the target counts the immediates and checks every byte, the
//! initiator reads it all back (read and a batch) and checks it, bad arguments get their
//! error codes, and a SIGKILLed target fails the next writes instead of hanging them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/deps`: where cargo builds `libfabric_c.so` for this test (beside the
/// test; `cargo build` alone copies it one folder up).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().expect("target/<profile>/deps/<test>").to_path_buf()
}

fn compile(out: &Path) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    assert!(lib.join("libfabric_c.so").exists(), "no libfabric_c.so in {}", lib.display());
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"])
        .arg("-I")
        .arg(dir.join("include"))
        .arg(dir.join("tests/c/two_procs.c"))
        .arg("-o")
        .arg(out)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lfabric_c")
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
    assert!(status.success(), "{cc} failed on tests/c/two_procs.c");
}

/// Waits for `child` at most `limit`, killing it after; its exit status and output.
fn finish(mut child: std::process::Child, limit: Duration) -> (Option<i32>, String) {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            let out = child.wait_with_output().expect("output");
            let text =
                String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            return (s.code(), text);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            return (None, String::from_utf8_lossy(&out.stderr).to_string());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(provider: &str) {
    let work = std::env::temp_dir().join(format!("fabric-c-{provider}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let exe = work.join("two_procs");
    compile(&exe);
    let spawn = |role: &str| {
        Command::new(&exe)
            .args([role, provider, work.to_str().unwrap()])
            .env("FI_TCP_IFACE", "lo")
            // cargo's LD_LIBRARY_PATH names target/<profile> first, where an older
            // libfabric_c.so of `cargo build` may lie: the rpath (this test's build) decides.
            .env_remove("LD_LIBRARY_PATH")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn two_procs")
    };
    let target = spawn("target");
    let initiator = spawn("initiator");
    let (icode, iout) = finish(initiator, Duration::from_secs(60));
    let (tcode, tout) = finish(target, Duration::from_secs(5));
    println!("{provider}: initiator:\n{iout}\ntarget:\n{tout}");
    assert_eq!(icode, Some(0), "initiator over {provider}: {iout}");
    // Killed by the initiator with SIGKILL once it had verified everything.
    assert_eq!(tcode, None, "the target over {provider} was not killed: {tout}");
    assert!(tout.contains("bytes checked"), "{tout}");
    assert!(iout.contains("read back") && iout.contains("killed peer seen"), "{iout}");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn c_program_over_tcp() {
    run("tcp");
}

#[test]
fn c_program_over_shm() {
    run("shm");
}
