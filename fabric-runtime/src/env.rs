//! The environment variables that change the engine's defaults, read one way.
//!
//! A switch (`FABRIC_DIRECT_POST`, `FABRIC_HUGE_PAGES`, `FABRIC_DELIVERY_COMPLETE`,
//! `FABRIC_SHM_LIVENESS`) is off with `0`, `off`, `false` or `no` and on with `1`, `on`, `true`
//! or `yes`, in any case, spaces around ignored. A duration (`FABRIC_AWAIT_SPIN_US`,
//! `FABRIC_AWAIT_LINGER_US`, `FABRIC_POLL_WINDOW_US`) is a whole number of microseconds, a
//! count (`FABRIC_MAX_COUNTERS`) a whole number.
//! Unset, the default holds; set to anything else, the default holds too and a `tracing`
//! warning names the variable and the value, so a typo is seen rather than silently ignored.
//! What is set in code (the builder's methods) wins over all of these. docs/operations.md,
//! "Environment variables", lists them.

use std::time::Duration;

/// `name` as a switch: `default` when unset or unreadable (warned).
pub(crate) fn switch(name: &str, default: bool) -> bool {
    match std::env::var(name) {
        Ok(v) => parse_switch(&v).unwrap_or_else(|| {
            tracing::warn!(
                variable = name,
                value = %v,
                default,
                "not a switch (0/off/false/no or 1/on/true/yes): the default holds"
            );
            default
        }),
        Err(_) => default,
    }
}

/// `name` as whole microseconds: `None` when unset or unreadable (warned).
pub(crate) fn micros(name: &str) -> Option<Duration> {
    let v = std::env::var(name).ok()?;
    let d = parse_micros(&v);
    if d.is_none() {
        tracing::warn!(variable = name, value = %v, "not a whole number of microseconds: the default holds");
    }
    d
}

/// `name` as a whole number: `None` when unset or unreadable (warned).
pub(crate) fn count(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    let n = parse_count(&v);
    if n.is_none() {
        tracing::warn!(variable = name, value = %v, "not a whole number: the default holds");
    }
    n
}

/// A whole number (`"65536"`, `" 0 "`); `None` for anything else.
pub(crate) fn parse_count(v: &str) -> Option<usize> {
    v.trim().parse::<usize>().ok()
}

/// A switch's value as a user would write it; `None` if it is neither on nor off.
pub(crate) fn parse_switch(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "0" | "off" | "false" | "no" => Some(false),
        "1" | "on" | "true" | "yes" => Some(true),
        _ => None,
    }
}

/// Whole microseconds (`"50"`, `" 200 "`); `None` for anything else.
pub(crate) fn parse_micros(v: &str) -> Option<Duration> {
    v.trim().parse::<u64>().ok().map(Duration::from_micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_reads_as_a_user_would_write_it() {
        for v in ["0", "off", "OFF", "false", "No", " 0 "] {
            assert_eq!(parse_switch(v), Some(false), "{v:?}");
        }
        for v in ["1", "on", "True", "yes", " YES\n"] {
            assert_eq!(parse_switch(v), Some(true), "{v:?}");
        }
        for v in ["", "2", "of", "disable", "-1"] {
            assert_eq!(parse_switch(v), None, "{v:?}");
        }
    }

    #[test]
    fn microseconds_are_whole_numbers() {
        assert_eq!(parse_micros("50"), Some(Duration::from_micros(50)));
        assert_eq!(parse_micros(" 200\n"), Some(Duration::from_micros(200)));
        assert_eq!(parse_micros("0"), Some(Duration::ZERO));
        for v in ["", "50us", "1.5", "-3", "off"] {
            assert_eq!(parse_micros(v), None, "{v:?}");
        }
    }

    #[test]
    fn counts_are_whole_numbers() {
        assert_eq!(parse_count("65536"), Some(65_536));
        assert_eq!(parse_count(" 0\n"), Some(0));
        for v in ["", "64k", "1e6", "-1", "1.5", "many"] {
            assert_eq!(parse_count(v), None, "{v:?}");
        }
    }

    #[test]
    fn an_unset_or_unreadable_variable_keeps_the_default() {
        // Names no other test sets (tests of one binary share the process environment).
        let (sw, us) = ("FABRIC_TEST_ENV_SWITCH_7F3A", "FABRIC_TEST_ENV_MICROS_7F3A");
        let n = "FABRIC_TEST_ENV_COUNT_7F3A";
        assert!(switch(sw, true));
        assert!(!switch(sw, false));
        assert_eq!(micros(us), None);
        assert_eq!(count(n), None);
        std::env::set_var(sw, "maybe");
        std::env::set_var(us, "fast");
        std::env::set_var(n, "lots");
        assert!(switch(sw, true), "an unreadable switch keeps the default");
        assert_eq!(micros(us), None);
        assert_eq!(count(n), None);
        std::env::set_var(sw, "off");
        std::env::set_var(us, "75");
        std::env::set_var(n, "1000");
        assert!(!switch(sw, true));
        assert_eq!(micros(us), Some(Duration::from_micros(75)));
        assert_eq!(count(n), Some(1000));
        std::env::remove_var(sw);
        std::env::remove_var(us);
        std::env::remove_var(n);
    }
}
