//! Finds the GPUs this process can use, once, without panicking: cudarc panics when libcuda
//! is missing, so the probe first asks whether the library loads at all.
//!
//! **Test-only: [`GPU_MAP_VAR`] (`KVSTORE_TEST_GPU_MAP`).** A comma-separated list of CUDA
//! ordinals, one per device the store sees: `0,0` makes `gpu(0)` and `gpu(1)` two devices of
//! the store on the one physical GPU 0, each with its own stream. It exists so that the
//! multi-device paths of the `nccl` and `device` kinds (a communicator of several ranks, peer
//! copies, homes balanced over GPUs) can run on a one-GPU machine: NCCL >= 2.30 accepts two
//! ranks on one GPU with `NCCL_MULTI_RANK_GPU_ENABLE=1`. Timings taken under it are not
//! multi-GPU numbers. A bad value (not a list of ordinals below the machine's GPU count) fails
//! every use of a GPU with [`Error::InvalidEnv`].

use std::env::VarError;
use std::sync::OnceLock;

use crate::{Device, Error, Result};

/// The test-only variable that maps the store's GPUs onto physical ones (see the module docs).
pub const GPU_MAP_VAR: &str = "KVSTORE_TEST_GPU_MAP";

/// What [`GPU_MAP_VAR`] must hold.
const GPU_MAP_EXPECTED: &str = "a comma-separated list of CUDA ordinals below the machine's GPU \
                                count, one per device of the store, e.g. 0,0 (test-only)";

/// The number of physical CUDA GPUs: 0 when libcuda is missing or has no device.
fn physical_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to dlopen the driver library under its candidate
        // names and closes the handle again; it has no other effect.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    })
}

/// [`GPU_MAP_VAR`]'s value, read as [`std::env::var`] reads it, against `physical` GPUs: `None`
/// when unset, the ordinals when valid, and the offending value otherwise.
fn parse_gpu_map(
    value: std::result::Result<String, VarError>,
    physical: usize,
) -> std::result::Result<Option<Vec<usize>>, String> {
    let v = match value {
        Err(VarError::NotPresent) => return Ok(None),
        Err(VarError::NotUnicode(v)) => return Err(v.to_string_lossy().into_owned()),
        Ok(v) => v,
    };
    let ordinals: Option<Vec<usize>> = v
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&o| o < physical))
        .collect();
    match ordinals {
        Some(m) if !m.is_empty() => Ok(Some(m)),
        _ => Err(v),
    }
}

/// The store's GPUs as physical CUDA ordinals under [`GPU_MAP_VAR`] (`None`: unmapped), read
/// once; an [`Error::InvalidEnv`] naming the variable when its value is bad.
pub fn gpu_map() -> Result<Option<&'static [usize]>> {
    static MAP: OnceLock<std::result::Result<Option<Vec<usize>>, String>> = OnceLock::new();
    match MAP.get_or_init(|| parse_gpu_map(std::env::var(GPU_MAP_VAR), physical_count())) {
        Ok(m) => Ok(m.as_deref()),
        Err(value) => Err(Error::InvalidEnv {
            var: GPU_MAP_VAR,
            value: value.clone(),
            expected: GPU_MAP_EXPECTED,
        }),
    }
}

/// The physical CUDA ordinal of the store's `gpu(i)` (itself unless [`GPU_MAP_VAR`] maps it).
/// The caller has checked `i` against [`gpu_count`].
pub fn physical_ordinal(i: usize) -> Result<usize> {
    Ok(gpu_map()?.and_then(|m| m.get(i).copied()).unwrap_or(i))
}

/// The number of CUDA GPUs this process can use: 0 when libcuda is missing or has no device.
/// Under a valid [`GPU_MAP_VAR`], the number of devices it lists.
pub fn gpu_count() -> usize {
    match gpu_map() {
        Ok(Some(m)) => m.len(),
        _ => physical_count(),
    }
}

/// The GPUs this machine has, in words, for error messages.
pub fn describe_gpus() -> String {
    let gpus = match gpu_count() {
        0 => "no GPU, only cpu(i) devices".to_owned(),
        1 => "1 GPU, gpu(0)".to_owned(),
        n => format!("{n} GPUs, gpu(0) to gpu({})", n - 1),
    };
    match gpu_map() {
        Ok(Some(_)) => format!(
            "{gpus} ({GPU_MAP_VAR} maps them onto {} physical GPU(s))",
            physical_count()
        ),
        _ => gpus,
    }
}

/// Checks that `device` exists on this machine. Every `cpu(i)` does.
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu(_) => Ok(()),
        Device::Gpu(i) if i < gpu_count() => Ok(()),
        Device::Gpu(_) => Err(Error::DeviceNotFound {
            device,
            available: describe_gpus(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &str) -> std::result::Result<String, VarError> {
        Ok(v.to_owned())
    }

    #[test]
    fn an_unset_map_maps_nothing() {
        assert_eq!(parse_gpu_map(Err(VarError::NotPresent), 1), Ok(None));
    }

    #[test]
    fn a_map_may_repeat_a_gpu() {
        assert_eq!(parse_gpu_map(set("0,0"), 1), Ok(Some(vec![0, 0])));
        assert_eq!(parse_gpu_map(set(" 1, 0 ,1"), 2), Ok(Some(vec![1, 0, 1])));
        assert_eq!(parse_gpu_map(set("0"), 1), Ok(Some(vec![0])));
    }

    #[test]
    fn bad_maps_are_refused_with_their_value() {
        for (v, physical) in [
            ("", 1),
            ("0,", 1),
            ("0,,0", 1),
            ("a,0", 1),
            ("-1", 2),
            ("0,1", 1),
            ("0", 0),
            ("0;0", 1),
        ] {
            assert_eq!(parse_gpu_map(set(v), physical), Err(v.to_owned()), "{v:?}");
        }
        use std::os::unix::ffi::OsStringExt;
        let bad = std::ffi::OsString::from_vec(vec![b'0', 0xff]);
        assert!(parse_gpu_map(Err(VarError::NotUnicode(bad)), 1).is_err());
    }

    #[test]
    fn the_error_names_the_variable_and_what_it_expects() {
        let e = Error::InvalidEnv {
            var: GPU_MAP_VAR,
            value: "0,9".into(),
            expected: GPU_MAP_EXPECTED,
        };
        let text = e.to_string();
        assert!(
            text.contains("KVSTORE_TEST_GPU_MAP") && text.contains("0,9"),
            "{text}"
        );
        assert!(text.contains("test-only"), "{text}");
    }
}
