//! [`CheckpointErrorKind`]: what kind of failure an [`Error::Checkpoint`](crate::Error::Checkpoint)
//! is. A leaf: `error.rs` names it and the checkpoint code makes it, and it imports neither.

/// What kind of failure an [`Error::Checkpoint`](crate::Error::Checkpoint) is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CheckpointErrorKind {
    /// There is no file at the path (`load`), or the directory to save into does not exist
    /// (`save`). The source is the [`std::io::Error`].
    NotFound,
    /// Reading or writing failed for another reason: permissions, a full disk, a failing
    /// device. The source is the [`std::io::Error`].
    Io,
    /// The file is not a checkpoint this version can read: corrupt (a checksum that does not
    /// match), truncated, not a safetensors file, with missing or malformed metadata or
    /// tensors, or a shard of another save than the index names. The source is the
    /// safetensors error, when the file could not be parsed at all.
    Invalid,
    /// A valid checkpoint that does not fit the store: a key whose shape or dtype differs from
    /// the store's, or keys of the other kind (int or string) than the store holds.
    Mismatch,
}
