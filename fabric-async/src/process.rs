//! Ranks as processes of one launcher: a rank that exits when its launcher is gone, and a
//! launcher that waits for its ranks without blocking the runtime and never forever. Used by
//! the examples (`fabric-examples`) and `fabric_moe::harness`, which start their ranks as
//! copies of themselves.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The error of [`wait_child`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// In a process started by another: exits (status 1) as soon as the parent process is gone,
/// so a parent that failed or was killed never leaves its ranks behind. Checks every 200 ms
/// on a tokio task (call it inside a runtime).
pub fn exit_with_parent(who: &'static str) {
    let parent = std::os::unix::process::parent_id();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if std::os::unix::process::parent_id() != parent {
                eprintln!("{who}: the parent process is gone; exiting");
                std::process::exit(1);
            }
        }
    });
}

/// Waits up to `timeout` for `child` to exit, without blocking the runtime; after that, kills
/// it (SIGKILL) and returns an error (a stuck rank is a failure, not a hang).
///
/// # Cancel safety
///
/// Cancel safe: dropping the future leaves the child running and `child` usable.
pub async fn wait_child(child: &mut Child, timeout: Duration) -> Result<ExitStatus, BoxError> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("process {} did not exit within {} s", child.id(), timeout.as_secs()).into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
