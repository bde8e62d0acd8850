//! Store kinds and the names `KvStore::create` accepts.

use crate::{Error, Result};

/// The kinds of store, by where values live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Values live in host memory; values from several devices are summed on the CPU.
    Local,
    /// Values live on a home GPU, spread across GPUs by size (the CPU when there is none).
    Device,
    /// As `Device`, with NCCL moving data between GPUs (peer copies without libnccl).
    Nccl,
    /// One store across processes over MPI (`mpirun -np N`; cargo feature `mpi`): each key has
    /// a home rank where the updater and its state live; big keys are sliced over every rank.
    DistSync,
    /// As `DistSync`, for ranks that each drive a GPU. This build keeps values on the CPU, over
    /// MPI through host memory, and warns once that it does.
    DistDeviceSync,
}

/// The names `KvStore::create` accepts (MXNet's, lower case), and the kind each means.
const KIND_NAMES: [(&str, StoreKind); 10] = [
    ("local", StoreKind::Local),
    ("local_update_cpu", StoreKind::Local),
    ("local_allreduce_cpu", StoreKind::Local),
    ("device", StoreKind::Device),
    ("local_allreduce_device", StoreKind::Device),
    ("nccl", StoreKind::Nccl),
    ("dist_sync", StoreKind::DistSync),
    ("dist", StoreKind::DistSync),
    ("dist_device_sync", StoreKind::DistDeviceSync),
    ("dist_sync_device", StoreKind::DistDeviceSync),
];

/// Kinds MXNet has that this crate does not offer, with what to use instead.
const UNAVAILABLE: [(&str, &str); 2] = [
    (
        "dist_async",
        "asynchronous parameter-server updates are not supported yet; use 'dist_sync' (every \
         push is summed over all ranks before the update, as in MXNet's dist_sync)",
    ),
    (
        "dist_device_async",
        "asynchronous parameter-server updates are not supported yet; use 'dist_device_sync'",
    ),
];

impl StoreKind {
    /// The kind's canonical name: `local`, `device`, `nccl`, `dist_sync`, `dist_device_sync`.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Local => "local",
            StoreKind::Device => "device",
            StoreKind::Nccl => "nccl",
            StoreKind::DistSync => "dist_sync",
            StoreKind::DistDeviceSync => "dist_device_sync",
        }
    }

    /// Whether the kind spans processes (`dist_*`).
    pub fn is_dist(self) -> bool {
        matches!(self, StoreKind::DistSync | StoreKind::DistDeviceSync)
    }

    /// Parses a kind name, case-insensitively; an error lists the valid names. `dist_async` is
    /// an [`Error::KindUnavailable`] that says what to use instead.
    pub fn parse(name: &str) -> Result<StoreKind> {
        let lower = name.to_ascii_lowercase();
        if let Some((_, why)) = UNAVAILABLE.iter().find(|(n, _)| *n == lower) {
            return Err(Error::KindUnavailable {
                kind: name.to_owned(),
                reason: (*why).to_owned(),
            });
        }
        KIND_NAMES
            .iter()
            .find(|(n, _)| *n == lower)
            .map(|&(_, k)| k)
            .ok_or_else(|| Error::UnknownKind {
                kind: name.to_owned(),
                valid: KIND_NAMES.iter().map(|(n, _)| *n).collect(),
            })
    }
}

impl std::fmt::Display for StoreKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for StoreKind {
    type Err = Error;

    /// As [`StoreKind::parse`].
    fn from_str(name: &str) -> Result<StoreKind> {
        StoreKind::parse(name)
    }
}

/// What [`KvStore::create`](crate::KvStore::create) accepts: a kind name (`"local"`, an MXNet
/// alias, in any case) or a [`StoreKind`].
pub trait IntoStoreKind {
    /// The kind and the name [`crate::KvStore::type_name`] reports, or [`Error::UnknownKind`].
    fn into_store_kind(self) -> Result<(StoreKind, String)>;
}

impl IntoStoreKind for StoreKind {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        Ok((self, self.name().to_owned()))
    }
}

impl<S: AsRef<str>> IntoStoreKind for S {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        let name = self.as_ref();
        Ok((StoreKind::parse(name)?, name.to_ascii_lowercase()))
    }
}
