//! Every `KVSTORE_*` variable a store reads, read here once at `create` and validated: a bad
//! value is an error that names the variable and what to set.
//!
//! | variable | what | default |
//! |---|---|---|
//! | `KVSTORE_PAR_MIN_BYTES` | bytes of traffic from which a call on host memory splits over threads (`0`: always) | 1048576 |
//! | `KVSTORE_BIGARRAY_BOUND` | keys of more elements are sliced over every rank of a dist store | 1000000 on one machine, 65536 across machines |
//! | `KVSTORE_DIST_POOL_BYTES` | host buffers a process's dist stores keep between calls (`0`: none); the MPI transport keeps up to a quarter of it (at least 64 MiB) per dtype in use | 1 GiB |
//! | `KVSTORE_DIST_CHECK` | the per-call fingerprint check of a dist store (`0`/`1`) | on |
//! | `KVSTORE_TIMEOUT` | seconds any wait of a dist store may last | 1800 |
//! | `KVSTORE_WAIT_LOG_SECS` | seconds between two "still waiting" logs of one wait | 60 |
//! | `KVSTORE_REPLICAS` | where a dist store goes on after a lost rank (`mpirun --with-ft ulfm`): `1` keeps a copy of every rank's part on a buddy rank, so a loss costs nothing; `0` keeps none, and a loss reloads the last checkpoint | 1 |
//! | `KVSTORE_REPLICA_UPDATE` | how a push keeps those copies current: `replay` forwards each part's summed push to the buddy, whose copy runs the same update; `send` sends each updated part, value and state, after the push commits (closure updaters, and PTX ones without a CPU twin, always send) | replay |
//!
//! [`nccl`] reads the `KVSTORE_NCCL_*` variables, once per process; the launcher's (`RANK`,
//! `WORLD_SIZE`, ...) are read by [`crate::comm::launch::LaunchEnv`].

pub(crate) mod nccl;

use std::time::Duration;

use crate::{Error, Result};

/// The default of `KVSTORE_PAR_MIN_BYTES`: below this many bytes of traffic (read + written)
/// waking the pool costs more than it saves (`cargo bench --bench threshold`).
pub const PAR_MIN_BYTES: usize = 1 << 20;

/// The default of `KVSTORE_BIGARRAY_BOUND` on one machine: keys of more elements are sliced
/// over every rank (MXNet's).
pub(crate) const DEFAULT_BIGARRAY_BOUND: usize = 1_000_000;

/// The default of `KVSTORE_BIGARRAY_BOUND` for ranks on more than one machine. A whole key
/// crosses each link one way (to its home, then back), a sliced key both ways at once (a
/// reduce-scatter, then an all-gather), so slicing halves a key's time on the wire where the
/// wire is the cost: from 256 KiB of float32, it saves more than the extra round trip costs
/// at up to 10 Gbit/s.
pub(crate) const ACROSS_HOSTS_BIGARRAY_BOUND: usize = 1 << 16;

/// The slicing bound for ranks on `hosts` machines: `set` (`KVSTORE_BIGARRAY_BOUND`) when set.
pub fn bigarray_bound(set: Option<usize>, hosts: usize) -> usize {
    set.unwrap_or(match hosts {
        0 | 1 => DEFAULT_BIGARRAY_BOUND,
        _ => ACROSS_HOSTS_BIGARRAY_BOUND,
    })
}

/// The default of `KVSTORE_DIST_POOL_BYTES`.
pub(crate) const DEFAULT_POOL_BYTES: usize = 1 << 30;

/// The default of `KVSTORE_TIMEOUT`: 30 minutes, as PyTorch's `init_process_group`. A slow
/// rank (a validation pass, a data load, a checkpoint write) is not a dead one, and a job must
/// survive it; a rank that dies is noticed sooner (`mpirun`, and its exit hook tells the others).
// `pub` for the MPI transport's test and bench support (`__internal::mpi`).
#[cfg_attr(not(feature = "mpi"), allow(unreachable_pub))]
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The default of `KVSTORE_WAIT_LOG_SECS`.
pub(crate) const DEFAULT_WAIT_LOG: Duration = Duration::from_secs(60);

/// What a store reads from the environment. See the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Config {
    /// `KVSTORE_PAR_MIN_BYTES`.
    pub par_min_bytes: usize,
    /// `KVSTORE_BIGARRAY_BOUND` (`None`: unset, chosen from the link by [`bigarray_bound`]).
    pub bigarray_bound: Option<usize>,
    /// `KVSTORE_DIST_POOL_BYTES`.
    pub pool_bytes: usize,
    /// `KVSTORE_DIST_CHECK`.
    pub dist_check: bool,
    /// `KVSTORE_TIMEOUT`.
    pub timeout: Duration,
    /// `KVSTORE_WAIT_LOG_SECS`.
    pub wait_log: Duration,
    /// `KVSTORE_REPLICAS` and `KVSTORE_REPLICA_UPDATE`: where a dist store that can go on
    /// after a lost rank keeps a copy of every rank's part on another rank, how a push keeps
    /// the copies current (`None`: no copies).
    pub replicas: Option<ReplicaUpdate>,
}

/// How a push keeps the buddies' copies current (`KVSTORE_REPLICA_UPDATE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplicaUpdate {
    /// Each rank forwards its part of the summed push to its buddy, before the push commits;
    /// the buddy's copy runs the same update on it (about one more slice on the wire per push).
    Replay,
    /// Each rank sends its updated part, value and updater state, to its buddy after the push
    /// commits (the part and its state on the wire per push).
    Send,
}

impl ReplicaUpdate {
    /// The name `KVSTORE_REPLICA_UPDATE` takes.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReplicaUpdate::Replay => "replay",
            ReplicaUpdate::Send => "send",
        }
    }
}

impl Config {
    /// The configuration of this process's environment now.
    pub(crate) fn from_env() -> Result<Config> {
        Config::from_vars(|k| std::env::var(k).ok())
    }

    /// The configuration `var` gives (`None`: unset); the error names the first bad variable.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let v = Vars(var);
        Ok(Config {
            par_min_bytes: v.count(
                "KVSTORE_PAR_MIN_BYTES",
                PAR_MIN_BYTES,
                "bytes (0 = always split over threads)",
            )?,
            bigarray_bound: v.optional_count(
                "KVSTORE_BIGARRAY_BOUND",
                "elements (keys with more are sliced over every rank)",
            )?,
            pool_bytes: v.count(
                "KVSTORE_DIST_POOL_BYTES",
                DEFAULT_POOL_BYTES,
                "bytes (0 keeps no buffers between calls)",
            )?,
            dist_check: v.switch("KVSTORE_DIST_CHECK", true)?,
            timeout: v.seconds("KVSTORE_TIMEOUT", DEFAULT_TIMEOUT, "1800")?,
            wait_log: v.seconds("KVSTORE_WAIT_LOG_SECS", DEFAULT_WAIT_LOG, "60")?,
            replicas: match v.replicas("KVSTORE_REPLICAS")? {
                true => Some(v.replica_update("KVSTORE_REPLICA_UPDATE")?),
                false => None,
            },
        })
    }
}

/// The variables as a reader gives them: a value, or `None` when unset.
struct Vars<F>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    /// A whole number (`what` says of what) in `name`, or `default` when it is unset.
    fn count(&self, name: &'static str, default: usize, what: &'static str) -> Result<usize> {
        Ok(self.optional_count(name, what)?.unwrap_or(default))
    }

    /// A whole number (`what` says of what) in `name`, or `None` when it is unset.
    fn optional_count(&self, name: &'static str, what: &'static str) -> Result<Option<usize>> {
        let Some(v) = (self.0)(name) else {
            return Ok(None);
        };
        v.trim().parse().map(Some).map_err(|_| Error::InvalidEnv {
            var: name,
            value: v,
            expected: what,
        })
    }

    /// A switch (`0`, `false`, `off`, `no`; `1`, `true`, `on`, `yes`), or `default`.
    fn switch(&self, name: &'static str, default: bool) -> Result<bool> {
        let Some(v) = (self.0)(name) else {
            return Ok(default);
        };
        match v.trim().to_ascii_lowercase().as_str() {
            "0" | "false" | "off" | "no" => Ok(false),
            "1" | "true" | "on" | "yes" | "" => Ok(true),
            _ => Err(Error::dist_env(
                name,
                format!("'{v}' is not a switch: set it to 0 (off) or 1 (on)"),
            )),
        }
    }

    /// The number of copies of each part (`0` or `1`, default 1), as whether to keep one.
    fn replicas(&self, name: &'static str) -> Result<bool> {
        match self.optional_count(name, "copies of each rank's part: 0 or 1")? {
            None | Some(1) => Ok(true),
            Some(0) => Ok(false),
            Some(n) => Err(Error::InvalidEnv {
                var: name,
                value: n.to_string(),
                expected: "copies of each rank's part: 0 or 1 (more copies are not supported)",
            }),
        }
    }

    /// How a push keeps the copies current: `replay` (the default) or `send`.
    fn replica_update(&self, name: &'static str) -> Result<ReplicaUpdate> {
        let Some(v) = (self.0)(name) else {
            return Ok(ReplicaUpdate::Replay);
        };
        match v.trim().to_ascii_lowercase().as_str() {
            "replay" | "" => Ok(ReplicaUpdate::Replay),
            "send" => Ok(ReplicaUpdate::Send),
            _ => Err(Error::InvalidEnv {
                var: name,
                value: v,
                expected: "how a push keeps the copies current: replay (the buddy replays the \
                           update on the forwarded sum) or send (the updated part is sent)",
            }),
        }
    }

    /// A positive number of seconds (below 10⁹) in `name`, or `default` when it is unset.
    fn seconds(&self, name: &'static str, default: Duration, example: &str) -> Result<Duration> {
        let Some(v) = (self.0)(name) else {
            return Ok(default);
        };
        match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
            parsed => Err(Error::dist_env(
                name,
                format!(
                    "'{v}' {}: set it to e.g. {example}, or unset it for the default of {} s",
                    match parsed {
                        Ok(s) if s >= 1e9 => {
                            "is too long: the bound is below 10^9 seconds (31 years)"
                        }
                        Ok(_) => "is not a positive number of seconds",
                        Err(_) => "is not a number of seconds",
                    },
                    default.as_secs()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn unset_variables_give_the_defaults() {
        let c = Config::from_vars(env(&[])).unwrap();
        assert_eq!(c.par_min_bytes, PAR_MIN_BYTES);
        assert_eq!(c.bigarray_bound, None);
        assert_eq!(bigarray_bound(c.bigarray_bound, 1), 1_000_000);
        assert_eq!(bigarray_bound(c.bigarray_bound, 2), 65_536);
        assert_eq!(c.pool_bytes, DEFAULT_POOL_BYTES);
        assert!(c.dist_check);
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.wait_log, DEFAULT_WAIT_LOG);
        assert_eq!(c.replicas, Some(ReplicaUpdate::Replay));
    }

    #[test]
    fn set_variables_are_read() {
        let c = Config::from_vars(env(&[
            ("KVSTORE_PAR_MIN_BYTES", "0"),
            ("KVSTORE_BIGARRAY_BOUND", " 17 "),
            ("KVSTORE_DIST_POOL_BYTES", "4096"),
            ("KVSTORE_DIST_CHECK", "off"),
            ("KVSTORE_TIMEOUT", "2.5"),
            ("KVSTORE_WAIT_LOG_SECS", "7"),
            ("KVSTORE_REPLICA_UPDATE", " Send"),
        ]))
        .unwrap();
        assert_eq!(c.replicas, Some(ReplicaUpdate::Send));
        let off = [
            ("KVSTORE_REPLICAS", "0"),
            ("KVSTORE_REPLICA_UPDATE", "send"),
        ];
        assert_eq!(Config::from_vars(env(&off)).unwrap().replicas, None);
        assert_eq!(
            (
                c.par_min_bytes,
                c.bigarray_bound,
                c.pool_bytes,
                c.dist_check
            ),
            (0, Some(17), 4096, false)
        );
        // A bound that is set holds on one machine or many.
        assert_eq!(bigarray_bound(c.bigarray_bound, 1), 17);
        assert_eq!(bigarray_bound(c.bigarray_bound, 3), 17);
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.wait_log, Duration::from_secs(7));
    }

    #[test]
    fn a_bad_value_is_an_error_naming_its_variable() {
        for (name, bad) in [
            ("KVSTORE_PAR_MIN_BYTES", "1e6"),
            ("KVSTORE_BIGARRAY_BOUND", "-1"),
            ("KVSTORE_DIST_POOL_BYTES", "lots"),
            ("KVSTORE_DIST_CHECK", "maybe"),
            ("KVSTORE_TIMEOUT", "0"),
            ("KVSTORE_WAIT_LOG_SECS", "inf"),
            ("KVSTORE_REPLICAS", "2"),
            ("KVSTORE_REPLICAS", "one"),
            ("KVSTORE_REPLICA_UPDATE", "copy"),
        ] {
            let e = Config::from_vars(env(&[(name, bad)])).unwrap_err();
            assert!(e.to_string().contains(name), "{name}={bad}: {e}");
        }
    }

    #[test]
    fn a_timeout_too_long_says_so_not_that_it_is_not_positive() {
        let e = Config::from_vars(env(&[("KVSTORE_TIMEOUT", "1e9")])).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("too long"), "{text}");
        assert!(!text.contains("not a positive"), "{text}");
        let e = Config::from_vars(env(&[("KVSTORE_TIMEOUT", "-3")])).unwrap_err();
        assert!(e.to_string().contains("not a positive"), "{e}");
    }
}
