//! [`Error`]: everything that can go wrong, as a typed enum.
//!
//! Every error leaves the store exactly as it was before the call.

use crate::{DType, Device, Key, KeyKind, Shape};

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error from the store or an array. Each message names what was involved and what to do.
/// Every error leaves the store as it was before the call, unless its variant says otherwise.
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

    /// An integer key that does not fit in an `i32`, as int keys are stored (MXNet's C `int`).
    #[error(
        "key {value} ({ty}) does not fit in an int key (i32, -2147483648..=2147483647): \
         renumber the keys into that range, or use string keys"
    )]
    KeyOutOfRange {
        /// The value, in decimal.
        value: String,
        /// Its Rust type: "u64", "usize", ...
        ty: &'static str,
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

    /// A checkpoint could not be written or read, or does not fit the store (`kind` says which).
    /// A failed `save` leaves any previous file at `path` as it was.
    #[error("checkpoint {}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint file.
        path: std::path::PathBuf,
        /// Which kind of failure it is.
        kind: crate::checkpoint_error::CheckpointErrorKind,
        /// What went wrong, and what to do.
        message: String,
        /// The error underneath: a [`std::io::Error`] or a [`safetensors::SafeTensorError`].
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },

    /// A user updater panicked. The key's value and state are unchanged.
    #[error("push: the updater panicked on key {key}: {message}; the stored value is unchanged")]
    UpdaterPanicked {
        /// The key.
        key: Key,
        /// The panic message.
        message: String,
    },

    /// A fallible custom updater ([`Updater::try_custom`](crate::Updater::try_custom)) failed.
    #[error("push: the updater failed on key {key}: {source}; the store is unchanged")]
    UpdaterFailed {
        /// The key.
        key: Key,
        /// The updater's error.
        #[source]
        source: BoxError,
    },

    /// The CUDA driver failed (but for [`Error::OutOfMemory`]), or a GPU did not finish in time.
    #[error("{op}{}: CUDA error: {message}", key.as_ref().map(|k| format!(" (key {k})")).unwrap_or_default())]
    Cuda {
        /// What was being done: "push", "pull", "to_device", "load kernels", ...
        op: &'static str,
        /// The key involved, when there is one.
        key: Option<Key>,
        /// The driver's message, or what happened in words.
        message: String,
        /// The driver's error, when a driver call failed (`source.0` is the `CUresult`).
        #[source]
        source: Option<cudarc::driver::DriverError>,
    },

    /// A GPU is older than a kernel needs (bfloat16 kernels: sm_80; PTX: the module's `.target`).
    #[error(
        "{op}{}: {what} needs a GPU of compute capability {}.{} (sm_{need}) or newer, but {device} \
         is {}.{} (sm_{have}): {fix}",
        key.as_ref().map(|k| format!(" (key {k})")).unwrap_or_default(),
        need / 10,
        need % 10,
        have / 10,
        have % 10
    )]
    GpuArch {
        /// What was being done: "load kernels", "load PTX updater".
        op: &'static str,
        /// The key involved, when there is one.
        key: Option<Key>,
        /// What needs the architecture: "the bfloat16 kernels (kernels/fused_bf16.ptx)", ...
        what: String,
        /// The GPU.
        device: Device,
        /// The GPU's compute capability, as major * 10 + minor (70 for 7.0).
        have: u32,
        /// The compute capability needed, likewise (80 for 8.0).
        need: u32,
        /// What to do instead.
        fix: &'static str,
    },

    /// A GPU ran out of memory.
    #[error(
        "{op}{}: out of memory on {}{}: free arrays on that device or home keys elsewhere",
        key.as_ref().map(|k| format!(" (key {k})")).unwrap_or_default(),
        device.map_or("a GPU".to_owned(), |d| d.to_string()),
        requested.map(|b| format!(" (asked for {b} bytes)")).unwrap_or_default()
    )]
    OutOfMemory {
        /// What was being done: "alloc", "copy to GPU", ...
        op: &'static str,
        /// The key involved, when there is one.
        key: Option<Key>,
        /// The device that ran out, when known.
        device: Option<Device>,
        /// The bytes asked for, when known.
        requested: Option<usize>,
        /// The driver's error (`CUDA_ERROR_OUT_OF_MEMORY`).
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// GPU memory lent by another library ([`crate::LentGpuArray`]) is not that GPU's device
    /// memory from first to last byte, or is misaligned for its element size.
    #[error("lend of GPU memory on {device}: {message}")]
    ForeignMemory {
        /// The GPU the memory was said to be on.
        device: Device,
        /// What does not hold, and what to do.
        message: String,
    },

    /// An internal invariant did not hold (a bug in kvstore, to report), instead of a panic.
    #[error("{op}: internal error: {message}; this is a bug in kvstore, please report it")]
    Internal {
        /// What was being done.
        op: &'static str,
        /// What did not hold.
        message: String,
    },

    /// NCCL failed, timed out or reported an asynchronous error; its communicator was aborted.
    #[error("{op}: NCCL error on keys [{}]: {message}", keys.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", "))]
    Nccl {
        /// What was being done: "push (reduce)", "pull (broadcast)", "create communicator", ...
        op: &'static str,
        /// The keys whose collectives were involved.
        keys: Vec<Key>,
        /// NCCL's own message (`ncclGetErrorString`, and `ncclGetLastError` when it has one).
        message: String,
    },

    /// The ranks disagree on a call: all fail it before any data moves; the world is unusable.
    #[error(
        "{op} (call #{seq}): the ranks disagree on this call: {detail}; every rank must make the \
         same kvstore calls, with the same keys, shapes and dtypes, in the same order"
    )]
    Desync {
        /// The operation on this rank.
        op: &'static str,
        /// This rank's call sequence number (1 for the first call).
        seq: u64,
        /// Which ranks differ from which, and the first differing key or call.
        detail: String,
    },

    /// Another rank rejected its input for this call (that rank gets its own error for it);
    /// nothing changed on any rank, and the store stays usable.
    #[error(
        "{op} (call #{seq}): {detail}; nothing changed on any rank. Fix the input on that rank: \
         every rank must make the same kvstore calls with valid input"
    )]
    RankRejected {
        /// The operation on this rank.
        op: &'static str,
        /// This rank's call sequence number.
        seq: u64,
        /// Which ranks rejected the call, and why.
        detail: String,
    },

    /// Another rank failed its part of this call; nothing changed, the store stays usable.
    #[error("{op} (call #{seq}): {detail}; nothing changed on any rank")]
    RankFailed {
        /// The operation on this rank.
        op: &'static str,
        /// This rank's call sequence number.
        seq: u64,
        /// Which ranks failed, and at what.
        detail: String,
    },

    /// A store kind of MXNet's this build lacks: `dist_async`, or `dist_*` without feature `mpi`.
    #[error("kind '{kind}' is not available: {reason}")]
    KindUnavailable {
        /// The kind asked for.
        kind: String,
        /// Why, and what to use instead.
        reason: String,
    },

    /// A collective did not complete within `KVSTORE_TIMEOUT`; the world is then unusable.
    #[error(
        "{op} (call #{seq}) of keys [{}] timed out{}: {detail}",
        keys.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", "),
        if missing.is_empty() { String::new() } else {
            format!(" waiting for ranks {missing:?}")
        }
    )]
    Timeout {
        /// The operation on this rank.
        op: &'static str,
        /// This rank's call sequence number.
        seq: u64,
        /// The keys of the call.
        keys: Vec<Key>,
        /// The ranks that are not in this call: not responding, or at another call.
        missing: Vec<usize>,
        /// Where every other rank is, and what to do.
        detail: String,
    },

    /// Another rank exited before this call, which can never complete; the world is unusable.
    #[error(
        "{op} (call #{seq}): rank {rank}{} {detail}, so this call can never complete. The \
         distributed world is unusable now: see rank {rank}'s own output for why it exited, fix \
         that, and restart the job",
        match host { Some(h) => format!(" (host {h})"), None => String::new() }
    )]
    RankExited {
        /// The operation on this rank.
        op: &'static str,
        /// This rank's call sequence number.
        seq: u64,
        /// The rank that exited.
        rank: usize,
        /// The host it ran on, where the transport knows it.
        host: Option<String>,
        /// How it exited ("exited with code 101 after its call #4 ..."), and what to do.
        detail: String,
    },

    /// Ranks were lost and the survivors went on without them (`mpirun --with-ft ulfm`): this
    /// call did not complete, and the store now runs on `world` ranks, this one being `rank`.
    /// Every survivor gets it, for the call in flight. [`KvStore::rank`] and
    /// [`KvStore::num_workers`] say the new numbers.
    ///
    /// The keys were reloaded from the store's last checkpoint (its last save or load), at the
    /// new world size, where `restored` names it; without one the store holds no key, and the
    /// program must init its keys again. Re-shard the data and carry on from the checkpoint's
    /// step.
    ///
    /// [`KvStore::rank`]: crate::KvStore::rank
    /// [`KvStore::num_workers`]: crate::KvStore::num_workers
    #[error(
        "{op}: the distributed world changed: {} lost ({detail}); this call did not complete, \
         and the store goes on with {world} ranks, this one now rank {rank}. {}",
        match lost.as_slice() {
            [one] => format!("rank {one} was"),
            more => format!("ranks {more:?} were"),
        },
        match (healed, restored) {
            (true, _) if *committed => "No key was lost: every key is as this call left it on \
                 every survivor (it took effect everywhere); re-shard the data and go on from the \
                 next step".to_owned(),
            (true, _) => "No key was lost: every key is as the last call that took effect left \
                 it (this one took effect nowhere); re-shard the data and redo this step"
                .to_owned(),
            (false, Some(path)) if *committed => format!(
                "This save took effect all the same (its checkpoint was committed before the \
                 loss): every key was reloaded from it, {path}, at the new world size; \
                 re-shard the data and go on from the step it saved"
            ),
            (false, Some(path)) => format!(
                "Every key was reloaded from the last checkpoint, {path}, at the new world size: \
                 re-shard the data and go on from that checkpoint's step"
            ),
            (false, None) => "The store saved no checkpoint and loaded none, so it holds no key \
                     now: init the keys again (or load a checkpoint), re-shard the data and go on"
                .to_owned(),
        }
    )]
    WorldChanged {
        /// The operation on this rank.
        op: &'static str,
        /// The ranks lost, as they were numbered before.
        lost: Vec<usize>,
        /// The number of ranks now.
        world: usize,
        /// This process's rank now.
        rank: usize,
        /// Whether every key was kept, rebuilt from the survivors' parts and the copies of the
        /// lost ranks' parts (`KVSTORE_REPLICAS=1`): nothing was lost.
        healed: bool,
        /// The checkpoint the keys were reloaded from, where they could not be kept.
        restored: Option<String>,
        /// Whether this call took effect on every survivor (else on none): a push the
        /// survivors had all agreed to commit before the loss was found, or a save whose
        /// checkpoint was committed on disk before it (then the one reloaded).
        committed: bool,
        /// How the loss was found, and how long the recovery took.
        detail: String,
    },

    /// An argument a language binding could not convert, so the store never saw the call.
    #[error("{op}: {message}")]
    Argument {
        /// The operation.
        op: &'static str,
        /// What was wrong, as the layer above said it.
        message: String,
    },

    /// A call queued on an [`AsyncKvStore`](crate::AsyncKvStore) failed: returned by the next
    /// wait on its keys or on those of a call skipped because of it, and by `wait_all`.
    #[error(
        "asynchronous call {call} failed: {source}{}",
        match skipped {
            0 => String::new(),
            n => format!("; {n} later call(s) were not run: wait_all() returns this error, then queue them again"),
        }
    )]
    Async {
        /// The call, with its number in issue order (`"#3 push [w1]"`).
        call: String,
        /// Later calls that were not run because of it.
        skipped: usize,
        /// The call's error.
        #[source]
        source: std::sync::Arc<Error>,
    },

    /// A distributed call after the world failed (a timeout, a desync, an exit, an MPI error).
    #[error(
        "{op}: the distributed world failed earlier and cannot be used any more (first failure: \
         {first}); fix that failure and restart the job"
    )]
    DistFailed {
        /// The operation refused.
        op: &'static str,
        /// The message of the first failure.
        first: String,
    },

    /// A launcher variable disagrees with MPI or does not parse, or MPI cannot be used.
    #[error("distributed setup: {var}: {message}")]
    DistEnv {
        /// The environment variable (`RANK`, `WORLD_SIZE`, `KVSTORE_TIMEOUT`, ...), or `MPI`.
        var: String,
        /// What is wrong, and what to do.
        message: String,
    },

    /// A row-sparse value that does not fit its key (a row id out of range, rows of the wrong
    /// shape or dtype), or a call that mixes row-sparse and dense.
    #[error("{op}: {message}")]
    RowSparse {
        /// The operation.
        op: &'static str,
        /// What is wrong, and what to do.
        message: String,
    },

    /// Gradient compression asked for what it cannot do (a threshold not above 0, a kind that
    /// does not compress, a call after `init`, a key not float32).
    #[error("{op}: gradient compression: {message}")]
    Compression {
        /// The operation.
        op: &'static str,
        /// What is wrong, and what to do.
        message: String,
    },

    /// An MPI call failed (the world is then unusable), or its buffers do not fit (nothing sent).
    #[error("{op}: MPI error: {message}")]
    Mpi {
        /// What was being done.
        op: &'static str,
        /// MPI's message (`MPI_Error_string`), or what does not fit.
        message: String,
    },
}

impl Error {
    /// An error for a broken invariant of the crate, rather than a panic.
    pub(crate) fn internal(what: &str) -> Error {
        Error::Mpi {
            op: "dist",
            message: format!("internal error: {what}; please report it"),
        }
    }

    /// [`Error::DistEnv`]: environment variable `var` is to fix, as `message` says.
    pub(crate) fn dist_env(var: &str, message: impl Into<String>) -> Error {
        Error::DistEnv {
            var: var.to_owned(),
            message: message.into(),
        }
    }

    /// Names `key` in a GPU error that has no key yet; other errors are returned as they are.
    pub(crate) fn with_key(mut self, key: &Key) -> Error {
        if let Error::Cuda { key: k @ None, .. }
        | Error::OutOfMemory { key: k @ None, .. }
        | Error::GpuArch { key: k @ None, .. } = &mut self
        {
            *k = Some(key.clone());
        }
        self
    }

    /// [`Error::ShapeMismatch`] or [`Error::DTypeMismatch`] unless argument `what` fits `key`.
    /// The check is inline and the error out of line: it runs for every array of every call
    /// (out of line, it cost a pull of 1000 keys 10% more instructions).
    #[inline]
    pub(crate) fn check_fit(
        op: &'static str,
        key: &Key,
        what: impl std::fmt::Display,
        shape: Shape,
        dtype: Option<DType>,
        got: &crate::NDArray,
    ) -> Result<()> {
        match got.shape() == shape && dtype.is_none_or(|d| d == got.dtype()) {
            true => Ok(()),
            false => Err(Error::misfit(op, key, &what, shape, dtype, got)),
        }
    }

    /// The mismatch [`Error::check_fit`] found: the shape's first, then the dtype's.
    #[cold]
    #[inline(never)]
    fn misfit(
        op: &'static str,
        key: &Key,
        what: &dyn std::fmt::Display,
        shape: Shape,
        dtype: Option<DType>,
        got: &crate::NDArray,
    ) -> Error {
        let (key, what) = (key.clone(), what.to_string());
        match dtype.filter(|_| got.shape() == shape) {
            Some(expected) => Error::DTypeMismatch {
                op,
                key,
                what,
                expected,
                got: got.dtype(),
            },
            None => Error::ShapeMismatch {
                op,
                key,
                what,
                expected: Box::new(shape),
                got: Box::new(got.shape()),
            },
        }
    }

    /// [`Error::OutOfMemory`] or [`Error::Cuda`] for a failed driver call during `op`.
    pub(crate) fn from_driver(
        op: &'static str,
        ordinal: Option<usize>,
        requested: Option<usize>,
        e: cudarc::driver::DriverError,
    ) -> Error {
        use cudarc::driver::sys::cudaError_enum;
        if e.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            return Error::OutOfMemory {
                op,
                key: None,
                device: ordinal.map(Device::Gpu),
                requested,
                source: e,
            };
        }
        let on = ordinal.map(|i| format!("gpu({i}): ")).unwrap_or_default();
        Error::Cuda {
            op,
            key: None,
            // The CUresult's name; the driver's own text is in `source` (formatting a
            // `DriverError` asks the driver, which needs libcuda loaded).
            message: match sticky_fault(e.0) {
                Some(what) => format!(
                    "{on}{:?}: {what}. CUDA makes this error sticky: this process's context on \
                     the GPU is unusable, and every later GPU call in it fails the same way. \
                     Restart the process; run it under compute-sanitizer to find the access",
                    e.0
                ),
                None => format!("{on}{:?}", e.0),
            },
            source: Some(e),
        }
    }

    /// The error itself, or for an [`Error::Async`] the queued call's own error: match on this
    /// to handle a queued call's failure as the same call's synchronous one.
    ///
    /// ```
    /// use kvstore::{AsyncKvStore, Error, KvStore, NDArray};
    /// let kv = AsyncKvStore::new(KvStore::create("local")?);
    /// kv.pull(3, &NDArray::zeros([2]), 0);
    /// let e = kv.wait_all().unwrap_err();
    /// assert!(matches!(e.root(), Error::UnknownKey { .. }));
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn root(&self) -> &Error {
        match self {
            Error::Async { source, .. } => source.root(),
            other => other,
        }
    }

    /// Whether CUDA makes this error sticky: every later GPU call in this process fails too.
    pub fn is_sticky_gpu_fault(&self) -> bool {
        matches!(self, Error::Cuda { source: Some(e), .. } if sticky_fault(e.0).is_some())
    }
}

/// What happened, for a result code that CUDA documents as leaving the context unusable.
fn sticky_fault(code: cudarc::driver::sys::cudaError_enum) -> Option<&'static str> {
    use cudarc::driver::sys::cudaError_enum as R;
    Some(match code {
        R::CUDA_ERROR_ILLEGAL_ADDRESS => {
            "a kernel accessed memory outside every allocation (an index out of bounds, or \
             freed memory; a PTX updater must stay within its n elements)"
        }
        R::CUDA_ERROR_MISALIGNED_ADDRESS => "a kernel accessed memory at a misaligned address",
        R::CUDA_ERROR_ILLEGAL_INSTRUCTION => "a kernel executed an illegal instruction",
        R::CUDA_ERROR_HARDWARE_STACK_ERROR => "a kernel overflowed its call stack",
        R::CUDA_ERROR_INVALID_ADDRESS_SPACE => {
            "a kernel accessed memory through the wrong address space"
        }
        R::CUDA_ERROR_INVALID_PC => "a kernel's program counter became invalid",
        R::CUDA_ERROR_ASSERT => "a kernel's assertion failed",
        R::CUDA_ERROR_LAUNCH_FAILED => "a kernel failed while running",
        _ => return None,
    })
}

/// The text of a caught panic's payload (`panic!` makes a `&str` or a `String`). Pass the
/// payload itself (`&*boxed`), not the box: a `&Box<dyn Any>` downcasts to neither.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a text message".to_owned())
}

/// The error a fallible custom updater returns: any error type, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_errors_name_the_op_keys_and_message() {
        let e = Error::Cuda {
            op: "push",
            key: Some(Key::Int(3)),
            message: "CUDA_ERROR_LAUNCH_FAILED".to_owned(),
            source: None,
        };
        assert_eq!(
            e.to_string(),
            "push (key 3): CUDA error: CUDA_ERROR_LAUNCH_FAILED"
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

    #[test]
    fn driver_errors_keep_their_source_and_out_of_memory_is_its_own_variant() {
        use cudarc::driver::sys::cudaError_enum as R;
        use cudarc::driver::DriverError;
        use std::error::Error as _;

        let oom = Error::from_driver(
            "alloc",
            Some(1),
            Some(4096),
            DriverError(R::CUDA_ERROR_OUT_OF_MEMORY),
        );
        assert!(
            matches!(
                &oom,
                Error::OutOfMemory {
                    op: "alloc",
                    key: None,
                    device: Some(Device::Gpu(1)),
                    requested: Some(4096),
                    ..
                }
            ),
            "{oom}"
        );
        let src = oom.source().and_then(|s| s.downcast_ref::<DriverError>());
        assert!(src.is_some_and(|d| d.0 == R::CUDA_ERROR_OUT_OF_MEMORY));
        let oom = oom.with_key(&Key::Int(7));
        assert_eq!(
            oom.to_string(),
            "alloc (key 7): out of memory on gpu(1) (asked for 4096 bytes): \
             free arrays on that device or home keys elsewhere"
        );

        let other = Error::from_driver(
            "launch update kernel",
            None,
            None,
            DriverError(R::CUDA_ERROR_LAUNCH_FAILED),
        )
        .with_key(&Key::from("w"));
        assert!(
            matches!(&other, Error::Cuda { key: Some(Key::Str(k)), source: Some(d), .. }
                if k == "w" && d.0 == R::CUDA_ERROR_LAUNCH_FAILED),
            "{other}"
        );
        assert!(
            other
                .to_string()
                .starts_with("launch update kernel (key w): CUDA error: CUDA_ERROR_LAUNCH_FAILED"),
            "{other}"
        );
        // A kernel fault is sticky, and its message says so and what to do.
        let fault = Error::from_driver(
            "pull",
            Some(0),
            None,
            DriverError(R::CUDA_ERROR_ILLEGAL_ADDRESS),
        );
        let text = fault.to_string();
        assert!(fault.is_sticky_gpu_fault(), "{text}");
        assert!(
            text.starts_with("pull: CUDA error: gpu(0): CUDA_ERROR_ILLEGAL_ADDRESS: a kernel")
                && text.contains("sticky")
                && text.contains("Restart the process"),
            "{text}"
        );
        assert!(
            !Error::from_driver("pull", None, None, DriverError(R::CUDA_ERROR_INVALID_VALUE))
                .is_sticky_gpu_fault()
        );
        // A key already named is kept; other variants pass through.
        let named = Error::Cuda {
            op: "push",
            key: Some(Key::Int(1)),
            message: String::new(),
            source: None,
        };
        assert!(matches!(
            named.with_key(&Key::Int(2)),
            Error::Cuda {
                key: Some(Key::Int(1)),
                ..
            }
        ));
        let internal = Error::Internal {
            op: "copy to GPU",
            message: "3 elements into a buffer of 4".into(),
        };
        assert!(internal.to_string().contains("bug in kvstore"));
        assert!(matches!(
            internal.with_key(&Key::Int(2)),
            Error::Internal { .. }
        ));
    }
}
