//! kvstore's [`Error`] as Python exceptions.
//!
//! The classes live in `kvstore/_errors.py`: each derives from `kvstore.Error` and from the
//! built-in exception a Python user would catch (`KeyError` for an unknown key, `ValueError` for
//! a shape mismatch, ...). The message is the Rust one.

use kvstore::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// The name of the `kvstore._errors` class for an error.
fn class_name(e: &Error) -> &'static str {
    // A queued call's error is raised as that call's own would be, with the queue's message.
    match e.root() {
        Error::UnknownKey { .. } => "UnknownKeyError",
        Error::DuplicateInit { .. } => "DuplicateInitError",
        Error::ShapeMismatch { .. } => "ShapeMismatchError",
        Error::DTypeMismatch { .. } => "DTypeMismatchError",
        Error::MixedKeyTypes { .. } => "KeyTypeError",
        Error::KeyOutOfRange { .. } => "KeyOutOfRangeError",
        // A dist kind in the main wheel, which has no MPI link: the Python side then loads the
        // companion wheel's module, or says how to install it.
        Error::KindUnavailable { kind, .. }
            if kind.starts_with("dist") && !cfg!(feature = "mpi") =>
        {
            "_NoMpiLinkError"
        }
        Error::UnknownKind { .. } | Error::KindUnavailable { .. } => "UnknownKindError",
        Error::Desync { .. } => "DesyncError",
        Error::RankRejected { .. } => "RankRejectedError",
        Error::RankFailed { .. } => "RankFailedError",
        Error::RankExited { .. } => "RankExitedError",
        Error::WorldChanged { .. } => "WorldChangedError",
        Error::Timeout { .. } => "TimeoutError",
        Error::DistFailed { .. } => "DistFailedError",
        Error::Mpi { .. } => "MpiError",
        Error::DistEnv { .. } => "DistEnvError",
        Error::UpdaterPanicked { .. } | Error::UpdaterFailed { .. } => "UpdaterError",
        Error::Checkpoint { .. } => "CheckpointError",
        Error::RowSparse { .. } => "RowSparseError",
        Error::OutOfMemory { .. } => "DeviceOutOfMemoryError",
        Error::Cuda { .. }
        | Error::Nccl { .. }
        | Error::Internal { .. }
        | Error::GpuArch { .. } => "DeviceError",
        // LengthMismatch, Empty, DeviceNotFound, TooManyDims, DataLength, Operands,
        // InvalidUpdater, and variants added later.
        _ => "InvalidArgumentError",
    }
}

/// A Python exception for a kvstore error: the class from `kvstore._errors`, the Rust message.
/// A failing Python updater's own exception becomes the `__cause__`.
pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("kvstore._errors")
            .and_then(|m| m.getattr(class_name(&e)))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        let err = match class {
            Ok(class) => PyErr::from_type(class, e.to_string()),
            Err(_) => PyRuntimeError::new_err(e.to_string()),
        };
        if let Error::WorldChanged {
            lost,
            world,
            rank,
            healed,
            restored,
            committed,
            ..
        } = e.root()
        {
            let value = err.value(py);
            // Plain values: setting them cannot fail but on a broken interpreter.
            let _ = value.setattr("lost", lost.clone());
            let _ = value.setattr("world", *world);
            let _ = value.setattr("rank", *rank);
            let _ = value.setattr("healed", *healed);
            let _ = value.setattr("restored", restored.clone());
            let _ = value.setattr("committed", *committed);
        }
        if let Error::UpdaterFailed { source, .. } = e.root() {
            if let Some(cause) = source.downcast_ref::<PyErr>() {
                err.set_cause(py, Some(cause.clone_ref(py)));
            }
        }
        err
    })
}
