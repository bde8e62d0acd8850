//! The variables of NCCL between this process's GPUs, read once per process and validated.
//!
//! - `KVSTORE_NCCL_TIMEOUT_MS`: how long a collective may run before it is aborted ([`timeout`]).
//! - `KVSTORE_NCCL_MAX_COMMS`: how many device sets keep their communicators ([`max_sets`]).
//! - `KVSTORE_NCCL_FORCE=1`: NCCL even for keys whose values are all on the home GPU
//!   ([`force_single`]).
//!
//! A bad value of the first two fails every call that needs NCCL with [`Error::InvalidEnv`].

use std::env::VarError;
use std::sync::OnceLock;
use std::time::Duration;

use crate::{Error, Result};

/// Whether `KVSTORE_NCCL_FORCE=1`: NCCL even for values all on the home GPU (one-GPU tests).
pub fn force_single() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var("KVSTORE_NCCL_FORCE").as_deref() == Ok("1"))
}

/// `KVSTORE_NCCL_TIMEOUT_MS` when it is unset.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(60_000);

/// `KVSTORE_NCCL_MAX_COMMS` when it is unset.
const DEFAULT_MAX_SETS: usize = 8;

/// A bad value, kept so that every use reports the same [`Error::InvalidEnv`] (which is not
/// `Clone`).
#[derive(Clone, Debug)]
struct Invalid {
    var: &'static str,
    value: String,
    expected: &'static str,
}

impl Invalid {
    /// The crate's error for it.
    fn error(&self) -> Error {
        Error::InvalidEnv {
            var: self.var,
            value: self.value.clone(),
            expected: self.expected,
        }
    }
}

/// Parses `var`'s value as read by [`std::env::var`] with `parse` (given it trimmed): `default`
/// when it is unset, an [`Invalid`] naming the variable when it is not valid.
fn parse_var<T>(
    var: &'static str,
    value: std::result::Result<String, VarError>,
    expected: &'static str,
    default: T,
    parse: impl FnOnce(&str) -> Option<T>,
) -> std::result::Result<T, Invalid> {
    let invalid = |value: String| Invalid {
        var,
        value,
        expected,
    };
    match value {
        Err(VarError::NotPresent) => Ok(default),
        Err(VarError::NotUnicode(v)) => Err(invalid(v.to_string_lossy().into_owned())),
        Ok(v) => parse(v.trim()).ok_or_else(|| invalid(v)),
    }
}

/// `KVSTORE_NCCL_TIMEOUT_MS` from its value.
fn timeout_from(
    value: std::result::Result<String, VarError>,
) -> std::result::Result<Duration, Invalid> {
    parse_var(
        "KVSTORE_NCCL_TIMEOUT_MS",
        value,
        "a whole number of milliseconds (default 60000)",
        DEFAULT_TIMEOUT,
        |v| v.parse().ok().map(Duration::from_millis),
    )
}

/// `KVSTORE_NCCL_MAX_COMMS` from its value.
fn max_sets_from(
    value: std::result::Result<String, VarError>,
) -> std::result::Result<usize, Invalid> {
    parse_var(
        "KVSTORE_NCCL_MAX_COMMS",
        value,
        "a whole number of device sets, at least 1 (default 8)",
        DEFAULT_MAX_SETS,
        |v| v.parse().ok().filter(|&n| n > 0),
    )
}

/// How long a collective may run before it is aborted: `KVSTORE_NCCL_TIMEOUT_MS`, else 60 s.
pub(crate) fn timeout() -> Result<Duration> {
    static TIMEOUT: OnceLock<std::result::Result<Duration, Invalid>> = OnceLock::new();
    TIMEOUT
        .get_or_init(|| timeout_from(std::env::var("KVSTORE_NCCL_TIMEOUT_MS")))
        .clone()
        .map_err(|e| e.error())
}

/// How many device sets keep their communicators: `KVSTORE_NCCL_MAX_COMMS` (above 0), else 8.
pub(crate) fn max_sets() -> Result<usize> {
    static MAX: OnceLock<std::result::Result<usize, Invalid>> = OnceLock::new();
    MAX.get_or_init(|| max_sets_from(std::env::var("KVSTORE_NCCL_MAX_COMMS")))
        .clone()
        .map_err(|e| e.error())
}

/// Both settings above, so that a bad value fails a call before it starts anything.
pub(crate) fn check() -> Result<()> {
    timeout()?;
    max_sets()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;

    /// A variable set to `v`, as `std::env::var` reads it.
    fn set(v: &str) -> std::result::Result<String, VarError> {
        Ok(v.to_owned())
    }

    /// The variable, value and expectation of an error, through the crate's error and its text.
    fn named(e: Invalid) -> (&'static str, String, String) {
        let text = e.error().to_string();
        match e.error() {
            Error::InvalidEnv { var, value, .. } => (var, value, text),
            other => panic!("expected InvalidEnv, got {other:?}"),
        }
    }

    #[test]
    fn unset_variables_give_the_defaults() {
        assert_eq!(
            timeout_from(Err(VarError::NotPresent)).unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(max_sets_from(Err(VarError::NotPresent)).unwrap(), 8);
    }

    #[test]
    fn valid_values_are_read_trimmed() {
        assert_eq!(
            timeout_from(set(" 1500 ")).unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(timeout_from(set("0")).unwrap(), Duration::ZERO);
        assert_eq!(max_sets_from(set("1")).unwrap(), 1);
        assert_eq!(max_sets_from(set("32\n")).unwrap(), 32);
    }

    #[test]
    fn a_bad_timeout_is_an_error_that_names_the_variable() {
        for bad in ["soon", "", "-5", "1.5", "60s"] {
            let (var, value, text) = named(timeout_from(set(bad)).unwrap_err());
            assert_eq!(var, "KVSTORE_NCCL_TIMEOUT_MS");
            assert_eq!(value, bad);
            assert!(
                text.contains("KVSTORE_NCCL_TIMEOUT_MS") && text.contains("milliseconds"),
                "{text}"
            );
        }
        let not_unicode = OsString::from_vec(vec![b'1', 0xff]);
        let (var, _, _) = named(timeout_from(Err(VarError::NotUnicode(not_unicode))).unwrap_err());
        assert_eq!(var, "KVSTORE_NCCL_TIMEOUT_MS");
    }

    #[test]
    fn a_bad_communicator_bound_is_an_error_that_names_the_variable() {
        // 0 was silently taken as the default before; it is refused like any other bad value.
        for bad in ["0", "eight", "-1", "2.5", ""] {
            let (var, value, text) = named(max_sets_from(set(bad)).unwrap_err());
            assert_eq!(var, "KVSTORE_NCCL_MAX_COMMS");
            assert_eq!(value, bad);
            assert!(
                text.contains("KVSTORE_NCCL_MAX_COMMS") && text.contains("at least 1"),
                "{text}"
            );
        }
    }
}
