//! [`Error`]: everything that can go wrong, as a typed enum.
//!
//! Every error leaves the store exactly as it was before the call.

use crate::{DType, Device, Key, KeyKind, Shape};

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error from the store or an array. Each message names what was involved and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `KvStore::create` got a kind it does not know.
    #[error("unknown store kind '{kind}': use one of {}", valid.join(", "))]
    UnknownKind {
        /// The kind asked for.
        kind: String,
        /// The kinds this build accepts.
        valid: Vec<&'static str>,
    },

    /// An operation named a key that was never initialized.
    #[error("{op}: key {key} has not been initialized: call init({key}, value) first")]
    UnknownKey {
        /// The operation.
        op: &'static str,
        /// The key.
        key: Key,
    },

    /// `init` of a key that already has a value.
    #[error(
        "init: duplicate init of key {key}: each key is initialized once \
         (check for repeated init or broadcast calls, or a key listed twice); use push to change its value"
    )]
    DuplicateInit {
        /// The key.
        key: Key,
    },

    /// A value or out whose shape is not the key's.
    #[error(
        "{op}: shape mismatch for key {key}: the key holds {expected} but {what} is {got}; \
         pass arrays of the key's shape"
    )]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// The key.
        key: Key,
        /// Which argument: "value 2", "out 0", ...
        what: String,
        /// The key's shape.
        expected: Box<Shape>,
        /// The argument's shape.
        got: Box<Shape>,
    },

    /// A pushed value whose dtype is not the key's.
    #[error(
        "{op}: dtype mismatch for key {key}: the key holds {expected} but {what} is {got}; \
         convert it first with .astype(DType::{expected:?})"
    )]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// The key.
        key: Key,
        /// Which argument.
        what: String,
        /// The key's dtype.
        expected: DType,
        /// The argument's dtype.
        got: DType,
    },

    /// A list operation whose keys and values (or outs) differ in number.
    #[error("{op}: {keys} keys but {values} {what}: pass one entry per key")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// The number of keys.
        keys: usize,
        /// The number of values or outs.
        values: usize,
        /// "values" or "outs".
        what: &'static str,
    },

    /// A key of the other kind than the store holds.
    #[error(
        "{op}: key {key} is a {got} key, but this store holds {store} keys; \
         int and string keys cannot be mixed in one store"
    )]
    MixedKeyTypes {
        /// The operation.
        op: &'static str,
        /// The key.
        key: Key,
        /// The kind of `key`.
        got: KeyKind,
        /// The kind the store holds.
        store: KeyKind,
    },

    /// A push with no values, or a pull with no outs, for a key.
    #[error("{op}: no {what} given for key {key}: pass at least one array")]
    Empty {
        /// The operation.
        op: &'static str,
        /// The key.
        key: Key,
        /// "values" or "outs".
        what: &'static str,
    },

    /// A device that this machine does not have.
    #[error("device {device} does not exist: this machine has {available}; pick one of those")]
    DeviceNotFound {
        /// The device asked for.
        device: Device,
        /// What exists, in words ("no GPU", "2 GPUs: gpu(0)..gpu(1)").
        available: String,
    },

    /// An environment variable kvstore reads has a value it cannot use.
    #[error(
        "environment variable {var}={value:?} is not valid: expected {expected}; fix or unset it"
    )]
    InvalidEnv {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },

    /// A shape with more than 8 dimensions.
    #[error("a shape has {ndim} dimensions but at most 8 are supported; reshape it")]
    TooManyDims {
        /// The number of dimensions asked for.
        ndim: usize,
    },

    /// A shape whose element count, or byte size for a dtype, is over `isize::MAX`.
    #[error(
        "shape {dims:?}{} is too large: its {} would overflow (the limit is isize::MAX); use \
         smaller dimensions",
        dtype.map(|d| format!(" of {d}")).unwrap_or_default(),
        if dtype.is_some() { "size in bytes" } else { "element count" }
    )]
    ShapeTooLarge {
        /// The dimensions asked for.
        dims: Vec<usize>,
        /// The dtype, when the byte size is what overflows.
        dtype: Option<DType>,
    },

    /// Data whose length does not match the shape it was given.
    #[error("{len} elements cannot have shape {shape} ({} elements); fix the shape or the data", shape.size())]
    DataLength {
        /// The number of elements given.
        len: usize,
        /// The shape asked for.
        shape: Box<Shape>,
    },

    /// Two arrays in an arithmetic operation that do not match.
    #[error("{op}: operands do not match: {left} {left_dtype} vs {right} {right_dtype}")]
    Operands {
        /// The operation.
        op: &'static str,
        /// The left operand's shape.
        left: Box<Shape>,
        /// The left operand's dtype.
        left_dtype: DType,
        /// The right operand's shape.
        right: Box<Shape>,
        /// The right operand's dtype.
        right_dtype: DType,
    },

    /// An updater's parameters are out of range.
    #[error("invalid updater: {0}")]
    InvalidUpdater(String),

    /// A checkpoint could not be written or read, or does not fit the store: an I/O error, a
    /// corrupt or truncated file, missing or malformed metadata or tensors, or a key whose
    /// shape or dtype differs from the store's. A failed `load` changes nothing; a failed
    /// `save` leaves any previous file at `path` as it was.
    #[error("checkpoint {}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint file.
        path: std::path::PathBuf,
        /// What went wrong.
        message: String,
    },

    /// A user updater panicked. The key's value and state are unchanged.
    #[error("push: the updater panicked on key {key}: {message}; the stored value is unchanged")]
    UpdaterPanicked {
        /// The key.
        key: Key,
        /// The panic message.
        message: String,
    },

    /// The CUDA driver failed (allocation, copy, module load, launch, synchronize).
    #[error("{op}{}: CUDA error: {message}", key.as_ref().map(|k| format!(" (key {k})")).unwrap_or_default())]
    Cuda {
        /// What was being done: "push", "pull", "to_device", "load kernels", ...
        op: &'static str,
        /// The key involved, when there is one.
        key: Option<Key>,
        /// The driver's message.
        message: String,
    },

    /// NCCL failed, timed out or reported an asynchronous error. The communicator involved was
    /// aborted and dropped; keys on other GPU sets are unaffected.
    #[error("{op}: NCCL error on keys [{}]: {message}", keys.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", "))]
    Nccl {
        /// What was being done: "push (reduce)", "pull (broadcast)", "create communicator", ...
        op: &'static str,
        /// The keys whose collectives were involved.
        keys: Vec<Key>,
        /// NCCL's own message (`ncclGetErrorString`, and `ncclGetLastError` when it has one).
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_errors_name_the_op_keys_and_message() {
        let e = Error::Cuda {
            op: "push",
            key: Some(Key::Int(3)),
            message: "CUDA_ERROR_OUT_OF_MEMORY".to_owned(),
        };
        assert_eq!(
            e.to_string(),
            "push (key 3): CUDA error: CUDA_ERROR_OUT_OF_MEMORY"
        );
        let e = Error::Nccl {
            op: "push (reduce)",
            keys: vec![Key::Int(1), Key::Int(2)],
            message: "ncclUnhandledCudaError: unhandled cuda error".to_owned(),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("push (reduce): NCCL error on keys [1, 2]: "),
            "{text}"
        );
        assert!(text.ends_with("unhandled cuda error"), "{text}");
        assert!(
            std::mem::size_of::<Error>() <= 128,
            "clippy's large-error limit"
        );
    }
}
