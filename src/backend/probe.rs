//! Finds the GPUs this process can use, once, without panicking: cudarc panics when libcuda
//! is missing, so the probe first asks whether the library loads at all.

use std::sync::OnceLock;

use crate::{Device, Error, Result};

/// The number of CUDA GPUs this process can use: 0 when libcuda is missing or has no device.
pub fn gpu_count() -> usize {
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

/// The GPUs this machine has, in words, for error messages.
pub fn describe_gpus() -> String {
    match gpu_count() {
        0 => "no GPU, only cpu(i) devices".to_owned(),
        1 => "1 GPU, gpu(0)".to_owned(),
        n => format!("{n} GPUs, gpu(0) to gpu({})", n - 1),
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
