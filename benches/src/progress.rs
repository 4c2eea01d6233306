//! The progress display of the leader, on stderr.
//!
//! On a terminal: one line redrawn in place, `[bw]    [#####...............] 25%  3/8 1 MiB x1000
//! rep 2/3`. Anywhere else (CI logs, a pipe, a file): plain lines with no escape sequences,
//! one when a test starts and then at most one every [`PLAIN_EVERY`].

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Cells of the bar.
const WIDTH: usize = 20;
/// The shortest interval between two plain lines of the same test.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

pub struct Progress {
    /// Only the leader draws; the peer's calls do nothing.
    enabled: bool,
    tty: bool,
    /// The test and time of the last plain line.
    last: Option<(String, Instant)>,
    /// A bar is on screen (terminal), to be cleared before other output.
    drawn: bool,
}

/// `[#####.....]`: `frac` (clamped to 0..=1) of `width` cells filled.
pub fn bar(frac: f64, width: usize) -> String {
    let filled = ((frac.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}

impl Progress {
    pub fn new(enabled: bool) -> Progress {
        Progress { enabled, tty: std::io::stderr().is_terminal(), last: None, drawn: false }
    }

    /// Shows that `test` is at `frac` (0..1, the share of its steps already done) and is now
    /// running `what` (e.g. `3/8 1 MiB x1000 rep 2/3`).
    pub fn update(&mut self, test: &str, frac: f64, what: &str) {
        if !self.enabled {
            return;
        }
        let frac = if frac.is_finite() { frac } else { 0.0 };
        let pct = (frac.clamp(0.0, 1.0) * 100.0).floor();
        let mut err = std::io::stderr().lock();
        if self.tty {
            let tag = format!("[{test}]");
            let _ = write!(err, "\r\x1b[2K{tag:<8}{} {pct:>3}%  {what}", bar(frac, WIDTH));
            let _ = err.flush();
            self.drawn = true;
        } else {
            let due = match &self.last {
                Some((t, at)) => t != test || at.elapsed() >= PLAIN_EVERY,
                None => true,
            };
            if due {
                let _ = writeln!(err, "[{test}] {pct:.0}% {what}");
                self.last = Some((test.to_string(), Instant::now()));
            }
        }
    }

    /// Clears the bar (terminal only), so that the next output starts on a clean line.
    pub fn clear(&mut self) {
        if self.enabled && self.tty && self.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            self.drawn = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bar;

    #[test]
    fn bar_fills_by_fraction() {
        assert_eq!(bar(0.0, 10), "[..........]");
        assert_eq!(bar(0.5, 10), "[#####.....]");
        assert_eq!(bar(3.0 / 8.0, 8), "[###.....]");
        assert_eq!(bar(1.0, 4), "[####]");
        assert_eq!(bar(7.0, 4), "[####]");
        assert_eq!(bar(-1.0, 4), "[....]");
        assert_eq!(bar(f64::NAN, 4), "[....]");
    }
}
