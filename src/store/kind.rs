//! Store kinds and the names `KvStore::create` accepts.

use crate::{Error, Result};

/// The kinds of store, by where values live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Values live in host memory; values from several devices are summed on the CPU.
    Local,
    /// Values live on a home GPU, spread across GPUs by size (the CPU when there is none).
    Device,
    /// As `Device`, with NCCL moving data between GPUs (the CPU when there is none; peer
    /// copies, as `Device`, when libnccl cannot be loaded).
    Nccl,
}

/// The names `KvStore::create` accepts (MXNet's, lower case), and the kind each means.
const KIND_NAMES: [(&str, StoreKind); 6] = [
    ("local", StoreKind::Local),
    ("local_update_cpu", StoreKind::Local),
    ("local_allreduce_cpu", StoreKind::Local),
    ("device", StoreKind::Device),
    ("local_allreduce_device", StoreKind::Device),
    ("nccl", StoreKind::Nccl),
];

impl StoreKind {
    /// The kind's canonical name: `local`, `device` or `nccl`.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Local => "local",
            StoreKind::Device => "device",
            StoreKind::Nccl => "nccl",
        }
    }

    /// Parses a kind name, case-insensitively; an error lists the valid names.
    pub fn parse(name: &str) -> Result<StoreKind> {
        let lower = name.to_ascii_lowercase();
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

/// What [`KvStore::create`](crate::KvStore::create) accepts: a kind name (`"local"`, `"nccl"`, an MXNet alias, in any
/// case) or a [`StoreKind`].
pub trait IntoStoreKind {
    /// The kind, and the name the store reports as its [`KvStore::type_name`](crate::KvStore::type_name); an
    /// [`Error::UnknownKind`] for a name that is no kind.
    fn into_store_kind(self) -> Result<(StoreKind, String)>;
}

impl IntoStoreKind for StoreKind {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        Ok((self, self.name().to_owned()))
    }
}

impl IntoStoreKind for &str {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        Ok((StoreKind::parse(self)?, self.to_ascii_lowercase()))
    }
}

impl IntoStoreKind for String {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        self.as_str().into_store_kind()
    }
}

impl IntoStoreKind for &String {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        self.as_str().into_store_kind()
    }
}
