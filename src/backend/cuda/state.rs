//! A GPU-homed key's value and updater state; the mirror of `cpu::state`.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::{cuda_err, gpu, GpuBuf};
use crate::host::HostData;
use crate::{Error, Key, Result};

/// A key's value and updater state on its home GPU.
#[derive(Debug)]
pub(crate) struct GpuCell {
    /// The stored value.
    pub buf: GpuBuf,
    pub(super) state: Option<GpuState>,
}

/// Updater state on the home GPU.
#[derive(Debug)]
pub(super) struct GpuState {
    pub generation: u64,
    pub step: u64,
    pub bufs: Vec<CudaSlice<f32>>,
}

impl GpuState {
    /// Counts a step; returns it and the addresses of the `m` and `v` buffers (0 for none).
    pub(super) fn advance(&mut self) -> (u64, u64, u64) {
        self.step += 1;
        let addr = |s: &CudaSlice<f32>| s.device_ptr(s.stream()).0;
        let (m, v) = (
            self.bufs.first().map_or(0, addr),
            self.bufs.get(1).map_or(0, addr),
        );
        (self.step, m, v)
    }
}

impl GpuCell {
    /// A cell holding `buf`, with no updater state yet.
    pub(crate) fn new(buf: GpuBuf) -> GpuCell {
        GpuCell { buf, state: None }
    }

    /// The step count of updater `generation`: `None` when the key has no state for it.
    pub(crate) fn step(&self, generation: u64) -> Option<u64> {
        self.state
            .as_ref()
            .filter(|s| s.generation == generation)
            .map(|s| s.step)
    }

    /// The step and state buffers of updater `generation` on the host; `None` without state.
    pub(crate) fn state_to_host(&self, generation: u64) -> Result<Option<(u64, Vec<HostData>)>> {
        let Some(state) = self.state.as_ref().filter(|s| s.generation == generation) else {
            return Ok(None);
        };
        let stream = self.buf.stream();
        super::host_wait(gpu(self.buf.ordinal())?)?;
        let bufs = state
            .bufs
            .iter()
            .map(|b| {
                let v =
                    super::clone_dtoh(stream, b).map_err(cuda_err("copy state to host", None))?;
                Ok(HostData::F32(v))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((state.step, bufs)))
    }

    /// Makes a checkpoint's state (`float32` buffers, one per state name; `None` clears it)
    /// ready to replace this cell's: it goes into the cell's buffers where they fit, else new
    /// ones are allocated here, so [`GpuCell::commit_state`] allocates nothing.
    pub(crate) fn stage_state(
        &self,
        generation: u64,
        state: Option<(u64, Vec<HostData>)>,
    ) -> Result<StagedState> {
        let Some((step, bufs)) = state else {
            return Ok(StagedState(Staged::Clear));
        };
        // The kernels index the state with the value's length: never hand them a shorter one.
        if let Some(b) = bufs.iter().find(|b| b.len() != self.buf.len()) {
            return Err(Error::Internal {
                op: "copy state to GPU",
                message: format!(
                    "a state buffer of {} elements for a value of {}",
                    b.len(),
                    self.buf.len()
                ),
            });
        }
        // Checked here, before any agreement, not by the copy after it.
        let room = |s: &GpuState| {
            s.bufs.len() == bufs.len() && s.bufs.iter().all(|b| b.len() == self.buf.len())
        };
        if self.state.as_ref().is_some_and(room) {
            return Ok(StagedState(Staged::InPlace {
                generation,
                step,
                bufs,
            }));
        }
        let stream = self.buf.stream();
        let bufs = bufs
            .iter()
            .map(|b| {
                let v: Vec<f32> = b.to_vec();
                super::clone_htod(stream, &v).map_err(cuda_err("copy state to GPU", None))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StagedState(Staged::New(GpuState {
            generation,
            step,
            bufs,
        })))
    }

    /// Puts in a state staged by [`GpuCell::stage_state`]; fails only where the GPU does.
    pub(crate) fn commit_state(&mut self, staged: StagedState) -> Result<()> {
        match staged.0 {
            Staged::Clear => self.state = None,
            Staged::New(state) => self.state = Some(state),
            Staged::InPlace {
                generation,
                step,
                bufs,
            } => {
                let stream = self.buf.stream().clone();
                let state = match self.state.as_mut() {
                    Some(s) if s.bufs.len() == bufs.len() => s,
                    _ => {
                        return Err(Error::Internal {
                            op: "copy state to GPU",
                            message: "the cell's state changed between staging and commit"
                                .to_owned(),
                        })
                    }
                };
                for (dst, src) in state.bufs.iter_mut().zip(&bufs) {
                    let v: Vec<f32> = src.to_vec();
                    if !v.is_empty() {
                        stream
                            .memcpy_htod(&v, dst)
                            .map_err(cuda_err("copy state to GPU", None))?;
                    }
                }
                state.generation = generation;
                state.step = step;
            }
        }
        Ok(())
    }
}

/// A checkpoint's updater state made ready for one cell ([`GpuCell::stage_state`]).
pub(crate) struct StagedState(Staged);

/// What a [`StagedState`] holds.
enum Staged {
    /// No state: the cell's is dropped.
    Clear,
    /// New buffers, holding the state.
    New(GpuState),
    /// The state, to copy into the cell's own buffers, which are as many.
    InPlace {
        generation: u64,
        step: u64,
        bufs: Vec<HostData>,
    },
}

/// Gives every cell a state for `generation` with `names` f32 buffers (zeros where it has
/// none or another updater's), before any step moves: a failed allocation changes no key.
pub(super) fn make_states<'c>(
    cells: impl Iterator<Item = (&'c Key, &'c mut GpuCell)>,
    generation: u64,
    names: usize,
) -> Result<()> {
    for (key, cell) in cells {
        let (home, n) = (cell.buf.ordinal(), cell.buf.len());
        // (A state with too few buffers would hand the kernel a null m or v.)
        let current = matches!(&cell.state,
            Some(s) if s.generation == generation && s.bufs.len() == names);
        if current {
            continue;
        }
        let st = gpu(home)?.stream();
        let bufs = (0..names)
            .map(|_| super::alloc_zeros::<f32>(st, n))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| {
                // The state's memory, on the key's home GPU.
                Error::from_driver("push (updater state)", Some(home), Some(n * 4), e).with_key(key)
            })?;
        cell.state = Some(GpuState {
            generation,
            step: 0,
            bufs,
        });
    }
    Ok(())
}
