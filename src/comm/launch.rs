//! Who a rank is, as a launch without MPI (`torchrun --no-python`, srun wrappers) tells it in
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`: [`LaunchEnv`] reads
//! them, and says which one is missing or wrong. (How long a rank waits, `KVSTORE_TIMEOUT`
//! and `KVSTORE_WAIT_LOG_SECS`, is read by `crate::config`.)

use crate::{Error, Result};

/// A rank as a launcher without MPI describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaunchEnv {
    /// `RANK`: this process's rank, below `world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of ranks.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's rank on its machine; it picks the GPU.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: the number of ranks on this machine (`None`: unset).
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR`: the host of rank 0.
    pub master_addr: String,
    /// `MASTER_PORT`: the launcher's own port on rank 0's host.
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the launch from this process's environment.
    pub(crate) fn from_process() -> Result<LaunchEnv> {
        LaunchEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the launch through `var` (`None`: unset). An error names the first variable that
    /// is missing or wrong, and what to do.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let missing = |name: &str| {
            let how = "is not set: start every rank with `torchrun --no-python --nproc-per-node \
                       N prog` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and \
                       MASTER_PORT), set them yourself, or start the job with `mpirun -np N`";
            Error::dist_env(name, how.to_owned())
        };
        let number = |name: &str| -> Result<usize> {
            let v = var(name).ok_or_else(|| missing(name))?;
            (v.trim().parse::<usize>()).map_err(|_| {
                Error::dist_env(name, format!("'{v}' is not a non-negative whole number"))
            })
        };
        let world_size = number("WORLD_SIZE")?;
        if world_size == 0 {
            return Err(Error::dist_env(
                "WORLD_SIZE",
                "is 0: a job has at least one rank".to_owned(),
            ));
        }
        let rank = number("RANK")?;
        if rank >= world_size {
            let last = world_size - 1;
            return Err(Error::dist_env(
                "RANK",
                format!(
                    "is {rank}, but WORLD_SIZE is {world_size}: ranks run from 0 to {last}; the \
                     launcher's variables disagree"
                ),
            ));
        }
        let local_rank = number("LOCAL_RANK")?;
        if local_rank > rank {
            return Err(Error::dist_env(
                "LOCAL_RANK",
                format!(
                    "is {local_rank}, above RANK {rank}: a rank's local rank on its machine is \
                     at most its rank; the launcher's variables disagree"
                ),
            ));
        }
        let local_world_size = match var("LOCAL_WORLD_SIZE") {
            None => None,
            Some(_) => {
                let n = number("LOCAL_WORLD_SIZE")?;
                if n <= local_rank || n > world_size {
                    return Err(Error::dist_env(
                        "LOCAL_WORLD_SIZE",
                        format!(
                            "is {n}: it must be above LOCAL_RANK {local_rank} and at most \
                             WORLD_SIZE {world_size}; the launcher's variables disagree"
                        ),
                    ));
                }
                Some(n)
            }
        };
        let master_addr = var("MASTER_ADDR")
            .map(|a| a.trim().to_owned())
            .filter(|a| !a.is_empty())
            .ok_or_else(|| missing("MASTER_ADDR"))?;
        let port = number("MASTER_PORT")?;
        let master_port = (u16::try_from(port).ok())
            .filter(|&p| p > 0 && p < u16::MAX)
            .ok_or_else(|| {
                let why = "use a free TCP port from 1 to 65534 (kvstore's NCCL rendezvous \
                           listens on the port after it)";
                Error::dist_env("MASTER_PORT", format!("is {port}: {why}"))
            })?;
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }

    /// The number of machines the job runs on, as torchrun places ranks (`LOCAL_WORLD_SIZE` on
    /// each): 1 without `LOCAL_WORLD_SIZE`.
    pub(crate) fn hosts(&self) -> usize {
        self.local_world_size
            .map_or(1, |local| self.world_size.div_ceil(local))
    }

    /// Where rank 0 hands the NCCL id to the other ranks (`comm::nccl::rendezvous`): the port
    /// after `MASTER_PORT`, which the launcher keeps for itself.
    pub(crate) fn rendezvous_addr(&self) -> (&str, u16) {
        (&self.master_addr, self.master_port + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const GOOD: [(&str, &str); 5] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
    ];

    fn var_of(e: Error) -> String {
        match e {
            Error::DistEnv { var, .. } => var,
            other => panic!("expected DistEnv, got {other:?}"),
        }
    }

    #[test]
    fn a_torchrun_environment_is_read() {
        let l = LaunchEnv::from_vars(env(&GOOD)).unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank), (3, 4, 1));
        assert_eq!(l.rendezvous_addr(), ("10.0.0.7", 29501));
    }

    #[test]
    fn each_missing_variable_is_named() {
        for (skip, name) in GOOD.iter().map(|p| p.0).enumerate() {
            let pairs: Vec<_> = GOOD
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != skip)
                .map(|(_, p)| *p)
                .collect();
            let e = LaunchEnv::from_vars(env(&pairs)).unwrap_err();
            assert!(e.to_string().contains("is not set"), "{e}");
            assert_eq!(var_of(e), name);
        }
    }

    #[test]
    fn inconsistent_or_malformed_values_name_their_variable() {
        let cases: [(&str, &str, &str); 7] = [
            ("RANK", "4", "RANK"),
            ("RANK", "-1", "RANK"),
            ("WORLD_SIZE", "0", "WORLD_SIZE"),
            ("WORLD_SIZE", "four", "WORLD_SIZE"),
            ("LOCAL_RANK", "5", "LOCAL_RANK"),
            ("MASTER_PORT", "65535", "MASTER_PORT"),
            ("MASTER_ADDR", " ", "MASTER_ADDR"),
        ];
        for (var, value, named) in cases {
            let pairs: Vec<_> = GOOD
                .iter()
                .map(|&(k, v)| if k == var { (k, value) } else { (k, v) })
                .collect();
            let e = LaunchEnv::from_vars(env(&pairs)).unwrap_err();
            assert_eq!(var_of(e), named, "{var}={value}");
        }
    }

    #[test]
    fn machines_are_counted_from_local_world_size() {
        let with = |local: Option<&str>| {
            let mut pairs = GOOD.to_vec();
            pairs.extend(local.map(|l| ("LOCAL_WORLD_SIZE", l)));
            LaunchEnv::from_vars(env(&pairs))
        };
        // RANK 3 of 4, LOCAL_RANK 1.
        assert_eq!(with(None).unwrap().hosts(), 1);
        assert_eq!(with(Some("2")).unwrap().hosts(), 2);
        assert_eq!(with(Some("3")).unwrap().hosts(), 2);
        assert_eq!(with(Some("4")).unwrap().hosts(), 1);
        for bad in ["0", "1", "5", "two"] {
            let e = with(Some(bad)).unwrap_err();
            assert_eq!(var_of(e), "LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE={bad}");
        }
    }
}
