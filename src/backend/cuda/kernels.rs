//! The GPU kernels: hand-written PTX for the fused multi-tensor push, and its ABI.
//!
//! One launch per (rule, dtype) updates a table of tensors. For tensor `t` and element `i`:
//!
//! ```text
//! g = inputs_t[0][i] + ... + inputs_t[k-1][i]                  (in f32, in this order)
//! stored_t[i], m_t[i], v_t[i] = RULE(g, stored_t[i], m_t[i], v_t[i])
//! ```
//!
//! with the rule's math in f32 exactly as the CPU twin, `backend::cpu`, computes it: the same
//! operations in the same order, each rounded to nearest, no fused multiply-add, IEEE division
//! and square root. The results are meant to equal the CPU's bit for bit, for f16 and bf16 too
//! (both sides round the f32 result to nearest-even). Summing values on one GPU is the
//! `Assign` rule with `k` inputs.
//!
//! The entry `fused_<rule>_<dtype>` (see [`entry_name`]) is in the PTX module [`module_for`]
//! names, and takes, in this order:
//!
//! ```text
//! .param .u64 table      device pointer to `ntensors` TensorRecords
//! .param .u32 ntensors
//! .param .u32 chunk      elements per block (CHUNK)
//! then the f32 scalars `scalars()` returns for the rule:
//!   assign: -   axpby: a, b   sgd: lr, wd, rescale, clip   sgd_mom: lr, momentum, wd, rescale, clip
//!   adam: beta1, beta2, epsilon, wd, rescale, clip       (lr_t is per tensor, in the record)
//! clip = +inf means no clipping.
//! ```
//!
//! Launch with [`grid_dim`] and `(BLOCK, 1, 1)`: block `(x, y)` updates tensor `y`, elements
//! `[x*chunk, min((x+1)*chunk, n))`, with a block-stride loop. Where every pointer of a tensor is
//! aligned at the chunk's start (16 bytes for f32 and for the state, 8 for f16/bf16) the bulk
//! moves with 4-wide vector loads; the rest goes one element at a time. Each element is read
//! before it is written by the same thread, so `stored` may also be one of the inputs.
//!
//! `build.rs` checks every entry's parameter list against this ABI and assembles every file with
//! `ptxas` for sm_70 (files for sm_80 and up excepted), sm_80 and sm_90.

use crate::updater::Rule;
use crate::DType;

/// The PTX modules, as `(file stem, PTX text)`: load each once per GPU.
pub const PTX_SOURCES: &[(&str, &str)] = &[
    ("fused_f32", include_str!("../../../kernels/fused_f32.ptx")),
    ("fused_f16", include_str!("../../../kernels/fused_f16.ptx")),
    (
        "fused_bf16",
        include_str!("../../../kernels/fused_bf16.ptx"),
    ),
];

/// Elements each block handles (the `chunk` parameter).
pub const CHUNK: u32 = 4096;

/// Threads per block.
pub const BLOCK: u32 = 256;

/// The most tensors one launch can take: `gridDim.y` is at most 65535 on every GPU.
pub const MAX_TENSORS_PER_LAUNCH: usize = 65535;

/// The element rules that have kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleKind {
    /// `w = g`.
    Assign,
    /// `w = a*w + b*g`.
    Axpby,
    /// `w = (1 - lr*wd)*w - lr*clip(rescale*g)`.
    Sgd,
    /// `m = momentum*m - lr*wd*w - lr*clip(rescale*g); w += m`.
    SgdMom,
    /// Adam with a per-tensor bias-corrected step size `lr_t`.
    Adam,
}

impl RuleKind {
    /// Every rule, in declaration order.
    pub const ALL: [RuleKind; 5] = [
        RuleKind::Assign,
        RuleKind::Axpby,
        RuleKind::Sgd,
        RuleKind::SgdMom,
        RuleKind::Adam,
    ];

    /// The rule's part of the entry name: `assign`, `axpby`, `sgd`, `sgd_mom` or `adam`.
    pub fn name(self) -> &'static str {
        match self {
            RuleKind::Assign => "assign",
            RuleKind::Axpby => "axpby",
            RuleKind::Sgd => "sgd",
            RuleKind::SgdMom => "sgd_mom",
            RuleKind::Adam => "adam",
        }
    }

    /// Whether the rule keeps the `m` state buffer (f32, one per element).
    pub fn uses_m(self) -> bool {
        matches!(self, RuleKind::SgdMom | RuleKind::Adam)
    }

    /// Whether the rule keeps the `v` state buffer (f32, one per element).
    pub fn uses_v(self) -> bool {
        self == RuleKind::Adam
    }
}

/// Whether `dtype` has kernels: f32, f16 and bf16 do, f64 does not.
pub fn has_kernels(dtype: DType) -> bool {
    dtype != DType::F64
}

/// The entry point for `rule` on `dtype`, e.g. `fused_sgd_bf16`.
///
/// For f64, which has no kernels (see [`has_kernels`]), this is a `fused_<rule>_f64` that no
/// module defines, so loading it fails with the driver's "not found" error.
pub fn entry_name(rule: RuleKind, dtype: DType) -> &'static str {
    use DType::*;
    use RuleKind::*;
    match (rule, dtype) {
        (Assign, F32) => "fused_assign_f32",
        (Assign, F16) => "fused_assign_f16",
        (Assign, BF16) => "fused_assign_bf16",
        (Assign, F64) => "fused_assign_f64",
        (Axpby, F32) => "fused_axpby_f32",
        (Axpby, F16) => "fused_axpby_f16",
        (Axpby, BF16) => "fused_axpby_bf16",
        (Axpby, F64) => "fused_axpby_f64",
        (Sgd, F32) => "fused_sgd_f32",
        (Sgd, F16) => "fused_sgd_f16",
        (Sgd, BF16) => "fused_sgd_bf16",
        (Sgd, F64) => "fused_sgd_f64",
        (SgdMom, F32) => "fused_sgd_mom_f32",
        (SgdMom, F16) => "fused_sgd_mom_f16",
        (SgdMom, BF16) => "fused_sgd_mom_bf16",
        (SgdMom, F64) => "fused_sgd_mom_f64",
        (Adam, F32) => "fused_adam_f32",
        (Adam, F16) => "fused_adam_f16",
        (Adam, BF16) => "fused_adam_bf16",
        (Adam, F64) => "fused_adam_f64",
    }
}

/// The stem (in [`PTX_SOURCES`]) of the module that holds [`entry_name`]`(rule, dtype)`: one
/// module per dtype. For f64 it is `fused_f64`, which is not in [`PTX_SOURCES`].
pub fn module_for(_rule: RuleKind, dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "fused_f32",
        DType::F16 => "fused_f16",
        DType::BF16 => "fused_bf16",
        DType::F64 => "fused_f64",
    }
}

/// The PTX text of the module with this stem, if there is one.
pub fn ptx_source(stem: &str) -> Option<&'static str> {
    PTX_SOURCES
        .iter()
        .find(|(s, _)| *s == stem)
        .map(|(_, text)| *text)
}

/// The launch grid for a table of `ntensors` tensors whose largest has `max_n` elements, with
/// `chunk` = [`CHUNK`]: `(ceil(max_n / CHUNK), ntensors, 1)`. `ntensors` must be at most
/// [`MAX_TENSORS_PER_LAUNCH`]; split bigger tables over several launches.
pub fn grid_dim(max_n: usize, ntensors: usize) -> (u32, u32, u32) {
    let x = max_n.div_ceil(CHUNK as usize).max(1);
    (
        u32::try_from(x).unwrap_or(u32::MAX),
        u32::try_from(ntensors).unwrap_or(u32::MAX),
        1,
    )
}

/// One tensor of a launch: the `table` parameter points to an array of these in device memory.
/// All pointers are device addresses (`CUdeviceptr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TensorRecord {
    /// `n` elements of the dtype: read (except by `Assign`) and written.
    pub stored: u64,
    /// An array of `k` device pointers, each to `n` elements of the dtype, summed in order.
    pub inputs: u64,
    /// `n` f32 of state (momentum, or Adam's mean), or 0 if the rule keeps none.
    pub m: u64,
    /// `n` f32 of state (Adam's variance), or 0 if the rule keeps none.
    pub v: u64,
    /// The element count.
    pub n: u64,
    /// The number of inputs, at least 1 (a record with `k == 0` is skipped).
    pub k: u32,
    /// Adam's bias-corrected step size for this tensor; ignored by the other rules.
    pub lr_t: f32,
    /// Zero.
    pub _reserved: [u64; 2],
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<TensorRecord>() == 64);
    assert!(align_of::<TensorRecord>() == 8);
    assert!(offset_of!(TensorRecord, stored) == 0);
    assert!(offset_of!(TensorRecord, inputs) == 8);
    assert!(offset_of!(TensorRecord, m) == 16);
    assert!(offset_of!(TensorRecord, v) == 24);
    assert!(offset_of!(TensorRecord, n) == 32);
    assert!(offset_of!(TensorRecord, k) == 40);
    assert!(offset_of!(TensorRecord, lr_t) == 44);
    assert!(offset_of!(TensorRecord, _reserved) == 48);
};

// SAFETY: `TensorRecord` is `repr(C)` plain data (u64, u32, f32 fields, no padding, as the
// const asserts above check), so its bytes are exactly what the kernels read.
unsafe impl cudarc::driver::DeviceRepr for TensorRecord {}

// SAFETY: every field is an integer or a float, for which all-zero bytes are a valid value.
unsafe impl cudarc::driver::ValidAsZeroBits for TensorRecord {}

/// The kernel for one step of `rule`: its kind, its f32 scalar parameters in ABI order, and
/// Adam's per-tensor `lr_t` (for [`TensorRecord::lr_t`]).
pub(crate) fn scalars(rule: &Rule<f32>) -> (RuleKind, Vec<f32>, Option<f32>) {
    match *rule {
        Rule::Assign => (RuleKind::Assign, vec![], None),
        Rule::Axpby { a, b } => (RuleKind::Axpby, vec![a, b], None),
        Rule::Sgd {
            lr,
            wd,
            rescale,
            clip,
        } => (RuleKind::Sgd, vec![lr, wd, rescale, clip], None),
        Rule::SgdMom {
            lr,
            momentum,
            wd,
            rescale,
            clip,
        } => (
            RuleKind::SgdMom,
            vec![lr, momentum, wd, rescale, clip],
            None,
        ),
        Rule::Adam {
            lr_t,
            beta1,
            beta2,
            epsilon,
            wd,
            rescale,
            clip,
        } => (
            RuleKind::Adam,
            vec![beta1, beta2, epsilon, wd, rescale, clip],
            Some(lr_t),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Adam, Sgd, Updater};

    const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// The parameter types of `.visible .entry name(...)` in `text`.
    fn params(text: &str, name: &str) -> Vec<String> {
        let head = format!(".visible .entry {name}(");
        let start = text.find(&head).expect("entry present") + head.len();
        let end = start + text[start..].find(')').unwrap();
        text[start..end]
            .split(',')
            .map(|p| p.split_whitespace().nth(1).unwrap().to_owned())
            .collect()
    }

    #[test]
    fn every_entry_is_in_its_module() {
        for rule in RuleKind::ALL {
            for dtype in DTYPES {
                let name = entry_name(rule, dtype);
                let suffix = match dtype {
                    DType::F32 => "f32",
                    DType::F16 => "f16",
                    _ => "bf16",
                };
                assert_eq!(name, format!("fused_{}_{suffix}", rule.name()));
                let text = ptx_source(module_for(rule, dtype)).expect("module exists");
                assert!(text.contains(&format!(".visible .entry {name}(")), "{name}");
                // The entry is in this module only.
                for (stem, other) in PTX_SOURCES {
                    if *stem != module_for(rule, dtype) {
                        assert!(
                            !other.contains(&format!(".entry {name}(")),
                            "{name} in {stem}"
                        );
                    }
                }
            }
            assert!(!has_kernels(DType::F64));
            assert!(ptx_source(module_for(rule, DType::F64)).is_none());
        }
    }

    #[test]
    fn scalars_match_the_entry_parameters() {
        let sgd = Sgd {
            lr: 0.1,
            wd: 0.01,
            clip_gradient: Some(2.0),
            ..Sgd::default()
        };
        let updaters = [
            Updater::Assign,
            Updater::Axpby { a: 0.5, b: 2.0 },
            Updater::Sgd(sgd),
            Updater::Sgd(Sgd {
                momentum: 0.9,
                ..sgd
            }),
            Updater::Adam(Adam::default()),
        ];
        for (u, want) in updaters.iter().zip(RuleKind::ALL) {
            let rule = u.rule::<f32>(3).unwrap();
            let (kind, s, lr_t) = scalars(&rule);
            assert_eq!(kind, want);
            assert_eq!(lr_t.is_some(), kind == RuleKind::Adam);
            for dtype in DTYPES {
                let text = ptx_source(module_for(kind, dtype)).unwrap();
                let p = params(text, entry_name(kind, dtype));
                assert_eq!(&p[..3], [".u64", ".u32", ".u32"]);
                assert_eq!(p.len() - 3, s.len(), "{}", entry_name(kind, dtype));
                assert!(p[3..].iter().all(|t| t == ".f32"));
            }
        }
        // Concrete values, in ABI order.
        let (_, s, _) = scalars(&updaters[3].rule::<f32>(1).unwrap());
        assert_eq!(s, vec![0.1, 0.9, 0.01, 1.0, 2.0]);
        let (_, s, lr_t) = scalars(&updaters[4].rule::<f32>(1).unwrap());
        assert_eq!(s, vec![0.9, 0.999, 1e-8, 0.0, 1.0, f32::INFINITY]);
        let (lr, b1, b2) = (0.001f64, 0.9f64, 0.999f64);
        let want = (lr * (1.0 - b2).sqrt() / (1.0 - b1)) as f32;
        assert_eq!(lr_t, Some(want));
    }

    #[test]
    fn grid_covers_every_tensor() {
        assert_eq!(grid_dim(1, 1), (1, 1, 1));
        assert_eq!(grid_dim(4096, 3), (1, 3, 1));
        assert_eq!(grid_dim(4097, 50), (2, 50, 1));
        assert_eq!(grid_dim(0, 2), (1, 2, 1));
    }
}
