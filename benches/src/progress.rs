//! The progress display of the leader, on stderr.
//!
//! On a terminal: an `indicatif` bar redrawn in place, `[bw]    [#####...............]  25%  3/8
//! 1 MiB x1000 rep 2/3`. Anywhere else (CI logs, a pipe, a file): plain lines with no escape
//! sequences, one when a test starts and then at most one every [`PLAIN_EVERY`]. The peer shows
//! nothing.
//!
//! The bar is redrawn only when a test reports a step (no steady tick): a ticker thread would
//! wake up on the 2 cores the benchmark measures.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Cells of the bar.
const WIDTH: usize = 20;
/// Positions of the bar: `frac` is shown to 1/STEPS.
const STEPS: u64 = 10_000;
/// The shortest interval between two plain lines of the same test.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

pub struct Progress {
    kind: Kind,
}

enum Kind {
    /// The peer: its calls do nothing.
    Off,
    /// stderr is a terminal.
    Bar(ProgressBar),
    /// stderr is a log: the test and time of the last plain line.
    Plain(Option<(String, Instant)>),
}

/// `frac` as a share of the test's steps: clamped to 0..=1, 0 when not a number.
fn clamp(frac: f64) -> f64 {
    if frac.is_finite() {
        frac.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// Whether a plain line for `test` is due, after the last one (`last`) and at `now`.
fn plain_due(last: Option<&(String, Instant)>, test: &str, now: Instant) -> bool {
    match last {
        Some((t, at)) => t != test || now.duration_since(*at) >= PLAIN_EVERY,
        None => true,
    }
}

/// `[bw]    [#####...............]  25%  3/8 1 MiB x1000 rep 2/3`, drawn on `target`.
fn bar(target: ProgressDrawTarget) -> ProgressBar {
    let template = format!("{{prefix:<8}}[{{bar:{WIDTH}}}] {{percent:>3}}%  {{msg}}");
    let style = ProgressStyle::with_template(&template).expect("a valid template").progress_chars("#.");
    ProgressBar::with_draw_target(Some(STEPS), target).with_style(style)
}

impl Progress {
    /// The leader's display (`enabled`), or the peer's, which shows nothing.
    pub fn new(enabled: bool) -> Progress {
        let kind = match (enabled, std::io::stderr().is_terminal()) {
            (false, _) => Kind::Off,
            (true, true) => Kind::Bar(bar(ProgressDrawTarget::stderr())),
            (true, false) => Kind::Plain(None),
        };
        Progress { kind }
    }

    /// Shows that `test` is at `frac` (0..1, the share of its steps already done) and is now
    /// running `what` (e.g. `3/8 1 MiB x1000 rep 2/3`).
    pub fn update(&mut self, test: &str, frac: f64, what: &str) {
        let frac = clamp(frac);
        match &mut self.kind {
            Kind::Off => {}
            Kind::Bar(pb) => {
                // Every setter redraws (at most 20 times a second): only what changed.
                let tag = format!("[{test}]");
                if pb.prefix() != tag {
                    pb.set_prefix(tag);
                }
                pb.set_message(what.to_string());
                pb.set_position((frac * STEPS as f64).round() as u64);
            }
            Kind::Plain(last) => {
                let now = Instant::now();
                if plain_due(last.as_ref(), test, now) {
                    let pct = (frac * 100.0).floor();
                    let _ = writeln!(std::io::stderr().lock(), "[{test}] {pct:.0}% {what}");
                    *last = Some((test.to_string(), now));
                }
            }
        }
    }

    /// Prints `msg` on stdout on a line of its own (the bar, if any, is cleared and redrawn).
    pub fn println(&mut self, msg: &str) {
        match &self.kind {
            Kind::Bar(pb) => pb.suspend(|| println!("{msg}")),
            _ => println!("{msg}"),
        }
    }

    /// Removes the bar (terminal only), so that the next output starts on a clean line.
    pub fn finish(&mut self) {
        if let Kind::Bar(pb) = &self.kind {
            pb.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use indicatif::TermLike;

    use super::*;

    #[test]
    fn fractions_are_clamped() {
        assert_eq!(clamp(0.25), 0.25);
        assert_eq!(clamp(7.0), 1.0);
        assert_eq!(clamp(-1.0), 0.0);
        assert_eq!(clamp(f64::NAN), 0.0);
        assert_eq!(clamp(f64::INFINITY), 0.0);
    }

    #[test]
    fn plain_lines_when_a_test_starts_then_every_5_s() {
        let t0 = Instant::now();
        assert!(plain_due(None, "bw", t0));
        let last = ("bw".to_string(), t0);
        assert!(!plain_due(Some(&last), "bw", t0 + Duration::from_secs(1)));
        assert!(plain_due(Some(&last), "lat", t0 + Duration::from_secs(1)));
        assert!(plain_due(Some(&last), "bw", t0 + PLAIN_EVERY));
    }

    /// A terminal that keeps what was written to it.
    #[derive(Debug, Default, Clone)]
    struct Screen(Arc<Mutex<Vec<String>>>);

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> io::Result<()> {
            self.0.lock().unwrap().push(s.to_string());
            Ok(())
        }
        fn clear_line(&self) -> io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_bar_looks_as_before() {
        let screen = Screen::default();
        let mut p =
            Progress { kind: Kind::Bar(bar(ProgressDrawTarget::term_like(Box::new(screen.clone())))) };
        p.update("bw", 0.25, "3/8 1 MiB x1000 rep 2/3");
        let Kind::Bar(pb) = &p.kind else { unreachable!() };
        pb.tick();
        let drawn = screen.0.lock().unwrap().clone();
        let want = "[bw]    [#####...............]  25%  3/8 1 MiB x1000 rep 2/3";
        assert!(drawn.iter().any(|l| l == want), "{drawn:?}");
    }
}
