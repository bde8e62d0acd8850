use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::ptx_text;
use crate::updater::{CustomUpdater, UpdateFn};
use crate::{DType, Error, Key, NDArray, Result};

/// The parameter types a user PTX updater's entry declares, in order (see [`PtxUpdater`]).
pub const PTX_UPDATER_PARAMS: [&str; 10] = ptx_text::USER_UPDATER_PARAMS;

/// Threads per block of a user updater launch.
pub const PTX_UPDATER_BLOCK: u32 = 256;
/// Most blocks of a user updater launch (its grid-stride loop covers the rest).
pub const PTX_UPDATER_MAX_BLOCKS: u32 = 4096;

/// [`PtxUpdater`]: a user's own update kernel, written in PTX, for keys homed on a GPU.
///
/// The entry must declare exactly this parameter list ([`PTX_UPDATER_PARAMS`]):
///
/// ```text
/// .visible .entry NAME(
///     .param .u64 stored,  // T*        the key's value, n elements, updated in place
///     .param .u64 merged,  // const T*  the sum of this push's values, n elements (read only)
///     .param .u64 m,       // float*    state 0: n floats, zero before the key's first push;
///                          //           0 (a null pointer) when the updater keeps no state
///     .param .u64 v,       // float*    state 1: likewise; 0 when it keeps fewer than 2
///     .param .u64 n,       // the element count
///     .param .u64 step,    // this key's push count under this updater: 1, 2, 3, ...
///     .param .f32 s0,      // the updater's four scalars (see PtxUpdater::with_scalars)
///     .param .f32 s1,
///     .param .f32 s2,
///     .param .f32 s3
/// )
/// ```
///
/// `T` is the updater's dtype (`f32`, `f16` or `bf16`). The kernel runs once per key and push
/// on the home GPU, after the sum, with 256 threads per block and at most 4096 blocks: it must
/// cover `n` with a grid-stride loop. Each GPU loads the module once, on first use.
///
/// Keys homed in host memory use the CPU twin given with [`PtxUpdater::with_cpu_twin`]; without
/// one, a push to such a key is an error and changes nothing.
///
/// ```
/// use kvstore::{DType, PtxUpdater, Updater};
/// # let ptx = kvstore::PtxUpdater::EXAMPLE_SGD_F32;
/// // `ptx` holds a module whose entry `sgd_f32` has the documented parameter list.
/// let sgd = PtxUpdater::new(ptx, "sgd_f32", DType::F32)?
///     .with_scalars([0.1, 0.0, 0.0, 0.0])
///     .with_cpu_twin(|_key, merged, stored| *stored += merged * -0.1);
/// let updater = Updater::Ptx(sgd);
/// # Ok::<(), kvstore::Error>(())
/// ```
#[derive(Clone)]
pub struct PtxUpdater {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    /// Shared by the copies `with_*` make, so a GPU's cache finds it by pointer.
    ptx: Arc<str>,
    /// The module's CRC-32, for [`Debug`](fmt::Debug): ranks of a `dist_*` store compare it.
    ptx_crc: u32,
    entry: String,
    dtype: DType,
    scalars: [f32; 4],
    state: usize,
    cpu_twin: Option<CustomUpdater>,
    /// How many GPUs have loaded the module (shared by the copies `with_*` make).
    loads: Arc<AtomicUsize>,
}

impl PtxUpdater {
    /// An example module: entry `sgd_f32`, `stored -= s0 * merged` over f32 values.
    pub const EXAMPLE_SGD_F32: &'static str = include_str!("../../kernels/user/sgd_f32.ptx");

    /// An updater running `entry` of the PTX module `ptx` on keys of `dtype`.
    ///
    /// Fails for `f64` (GPU homes sum f64 values on the host), or when the module does not
    /// define `entry` with the documented parameters. The driver compiles the PTX when a GPU
    /// first uses it; a compile error fails that push. A trailing NUL (NVRTC's) is dropped, any
    /// other refused.
    pub fn new(ptx: impl Into<String>, entry: &str, dtype: DType) -> Result<PtxUpdater> {
        let ptx = ptx.into();
        let ptx = ptx.trim_end_matches('\0');
        if ptx.contains('\0') || entry.contains('\0') {
            return Err(Error::InvalidUpdater(
                "the PTX text or the entry name contains a NUL character".to_owned(),
            ));
        }
        if dtype == DType::F64 {
            return Err(Error::InvalidUpdater(
                "a PTX updater works on f32, f16 or bf16 keys, not f64".to_owned(),
            ));
        }
        check_entry(ptx, entry)?;
        Ok(PtxUpdater {
            inner: Arc::new(Inner {
                ptx_crc: crc32fast::hash(ptx.as_bytes()),
                ptx: ptx.into(),
                entry: entry.to_owned(),
                dtype,
                scalars: [0.0; 4],
                state: 0,
                cpu_twin: None,
                loads: Arc::default(),
            }),
        })
    }

    /// Sets the four scalars passed as `s0..s3` (all zero by default).
    pub fn with_scalars(self, scalars: [f32; 4]) -> PtxUpdater {
        self.rebuild(|i| i.scalars = scalars)
    }

    /// Keeps `buffers` (0, 1 or 2) float state buffers per key, passed as `m` and `v`.
    pub fn with_state(self, buffers: usize) -> PtxUpdater {
        self.rebuild(|i| i.state = buffers)
    }

    /// The closure that updates keys homed in host memory, as the kernel would, with
    /// [`Updater::custom`](crate::Updater::custom)'s signature.
    pub fn with_cpu_twin(
        self,
        f: impl Fn(&Key, &NDArray, &mut NDArray) + Send + Sync + 'static,
    ) -> PtxUpdater {
        self.rebuild(|i| i.cpu_twin = Some(CustomUpdater::infallible(f, None)))
    }

    /// [`PtxUpdater::with_cpu_twin`] with a `label`, as [`crate::Updater::custom_labeled`].
    pub fn with_cpu_twin_labeled(
        self,
        label: &str,
        f: impl Fn(&Key, &NDArray, &mut NDArray) + Send + Sync + 'static,
    ) -> PtxUpdater {
        self.rebuild(|i| i.cpu_twin = Some(CustomUpdater::infallible(f, Some(label))))
    }

    /// A copy with a change to its launch arguments or twin, sharing the loaded module.
    fn rebuild(self, change: impl FnOnce(&mut Inner)) -> PtxUpdater {
        let mut inner = Inner::clone(&self.inner);
        change(&mut inner);
        PtxUpdater {
            inner: Arc::new(inner),
        }
    }

    /// The entry name.
    pub fn entry(&self) -> &str {
        &self.inner.entry
    }

    /// The dtype of the keys it updates.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// The scalars `s0..s3`.
    pub fn scalars(&self) -> [f32; 4] {
        self.inner.scalars
    }

    /// The number of float state buffers per key.
    pub fn state_buffers(&self) -> usize {
        self.inner.state
    }

    /// The CPU twin, if one was given.
    pub fn cpu_twin(&self) -> Option<&Arc<UpdateFn>> {
        self.inner.cpu_twin.as_ref().map(CustomUpdater::function)
    }

    /// How many GPUs have loaded the module (once each, whatever the scalars, state or twin).
    pub fn modules_loaded(&self) -> usize {
        self.inner.loads.load(Ordering::Relaxed)
    }

    /// The CPU twin with its identity.
    pub(crate) fn twin(&self) -> Option<&CustomUpdater> {
        self.inner.cpu_twin.as_ref()
    }

    /// The PTX source.
    pub(crate) fn ptx(&self) -> &Arc<str> {
        &self.inner.ptx
    }

    /// Counts one more GPU that loaded the module.
    pub(crate) fn note_load(&self) {
        self.inner.loads.fetch_add(1, Ordering::Relaxed);
    }
}

impl fmt::Debug for PtxUpdater {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("PtxUpdater")
            .field("entry", &i.entry)
            .field("dtype", &i.dtype)
            .field("scalars", &i.scalars)
            .field("state", &i.state)
            // The module by its checksum: ranks with different PTX of one entry name differ.
            .field(
                "ptx",
                &format_args!("{} bytes, crc32 {:08x}", i.ptx.len(), i.ptx_crc),
            )
            .field(
                "cpu_twin",
                &i.cpu_twin.as_ref().map(CustomUpdater::identity),
            )
            .finish()
    }
}

/// Checks that `ptx` defines `.entry <entry>(...)` with [`PTX_UPDATER_PARAMS`].
fn check_entry(ptx: &str, entry: &str) -> Result<()> {
    let expected = PTX_UPDATER_PARAMS.join(", ");
    let bad = |what: String| {
        Err(Error::InvalidUpdater(format!(
            "{what}; a PTX updater's entry takes ({expected}): stored, merged, m, v, n, step, \
             s0..s3 (see kvstore::ptx_updater)"
        )))
    };
    match entry_params(ptx, entry) {
        Ok(None) => bad(format!("the PTX module defines no entry '{entry}'")),
        Ok(Some(p)) if p != PTX_UPDATER_PARAMS => {
            bad(format!("entry '{entry}' declares ({})", p.join(", ")))
        }
        Ok(Some(_)) => Ok(()),
        Err(e) => bad(format!("cannot read the PTX module's entries: {e}")),
    }
}

/// The parameter types of `.entry <entry>(...)` in `ptx`, if it defines one.
fn entry_params(ptx: &str, entry: &str) -> std::result::Result<Option<Vec<String>>, String> {
    let mut entries = ptx_text::entries(&ptx_text::strip_comments(ptx))?;
    Ok(entries.remove(entry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_module_has_the_documented_entry() {
        let params = entry_params(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32")
            .unwrap()
            .unwrap();
        assert_eq!(params, PTX_UPDATER_PARAMS);
        assert!(PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F32).is_ok());
    }

    #[test]
    fn wrong_entries_are_refused_with_the_expected_signature() {
        let ptx = ".visible .entry f(\n  .param .u64 a, // x\n  .param .f32 b\n)\n{ ret; }";
        assert_eq!(entry_params(ptx, "f").unwrap().unwrap(), vec!["u64", "f32"]);
        let err = PtxUpdater::new(ptx, "f", DType::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("declares (u64, f32)"), "{err}");
        assert!(
            err.contains("u64, u64, u64, u64, u64, u64, f32, f32, f32, f32"),
            "{err}"
        );
        let err = PtxUpdater::new(ptx, "g", DType::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no entry 'g'"), "{err}");
        // A longer name that starts with the asked one is not it.
        assert!(entry_params(".visible .entry fg(.param .u64 a)", "f")
            .unwrap()
            .is_none());
        // Entries that cannot be read are an error, not a miss.
        let err = PtxUpdater::new(".entry f(.param .u64 a)", "f", DType::F32).unwrap_err();
        assert!(err.to_string().contains("not `.visible`"), "{err}");
        let err = PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F64)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not f64"), "{err}");
    }

    #[test]
    fn a_signature_hidden_in_a_block_comment_does_not_count() {
        let good = PTX_UPDATER_PARAMS
            .iter()
            .enumerate()
            .map(|(i, t)| format!(".param .{t} p{i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let ptx =
            format!("/* .visible .entry f({good}) */\n.visible .entry f({good}, .param .u64 x)\n");
        let err = PtxUpdater::new(ptx, "f", DType::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("declares"), "{err}");
    }

    #[test]
    fn nul_characters_are_refused_but_a_trailing_one_is_dropped() {
        let ptx = format!("{}\0", PtxUpdater::EXAMPLE_SGD_F32);
        let p = PtxUpdater::new(ptx, "sgd_f32", DType::F32).unwrap();
        assert!(!p.ptx().contains('\0'));
        let ptx = PtxUpdater::EXAMPLE_SGD_F32.replacen("//", "\0//", 1);
        assert!(PtxUpdater::new(ptx, "sgd_f32", DType::F32).is_err());
        assert!(PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd\0f32", DType::F32).is_err());
    }

    #[test]
    fn changed_copies_share_the_module() {
        let a = PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F32).unwrap();
        let b = a.clone().with_scalars([1.0, 2.0, 3.0, 4.0]).with_state(1);
        assert_eq!(b.scalars(), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!((a.scalars(), a.state_buffers()), ([0.0; 4], 0));
        a.note_load();
        assert_eq!(b.modules_loaded(), 1, "the load count is shared");
    }
}
