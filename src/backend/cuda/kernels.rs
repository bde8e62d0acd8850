//! The GPU kernels: hand-written PTX for the fused multi-tensor push, and its ABI.
//!
//! One launch per (rule, dtype) updates a table of tensors. For tensor `t` and element `i`:
//!
//! ```text
//! g = inputs_t[0][i] + ... + inputs_t[k-1][i]                  (in f32, in this order)
//! stored_t[i], m_t[i], v_t[i] = RULE(g, stored_t[i], m_t[i], v_t[i])
//! ```
//!
//! with the rule's math in f32 as `backend::cpu` computes it (same operations and order,
//! round to nearest, no fused multiply-add, IEEE division and square root), so results equal
//! the CPU's bit for bit, f16 and bf16 too. Summing values on one GPU is `Assign` with `k` inputs.
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
//! The table holds `ntensors` 64-byte [`TensorRecord`]s, then `starts` ([`block_starts`]:
//! `ntensors + 1` u32, the prefix sum of each tensor's blocks), then the input-pointer arrays.
//! Launch with [`grid_dim`]`(starts[ntensors])` and `(BLOCK, 1, 1)`: one block per chunk of
//! real work (a `(max_n / chunk, ntensors)` grid launched 3 million blocks for BERT-large's
//! 82 thousand chunks). Block `b` binary-searches the `t` with `starts[t] <= b < starts[t + 1]`
//! ([`block_owner`] is the CPU twin) and updates chunk `c = b - starts[t]`, elements
//! `[c*chunk, min((c+1)*chunk, n))`, with a block-stride loop. Where every pointer of a tensor
//! is aligned at the chunk's start (16 bytes for f32 and the state, 8 for f16/bf16) the bulk
//! moves with 4-wide vector loads. Each element is read before the same thread writes it, so
//! `stored` may also be one of the inputs.
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

/// The most tensors one launch takes (a bound on the table's size; bigger tables are split).
pub const MAX_TENSORS_PER_LAUNCH: usize = 65535;

/// The most blocks one launch takes: `gridDim.x` is at most 2^31 - 1.
pub const MAX_BLOCKS_PER_LAUNCH: u64 = (1 << 31) - 1;

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
}

/// Whether `dtype` has kernels: f32, f16 and bf16 do, f64 does not.
pub fn has_kernels(dtype: DType) -> bool {
    dtype != DType::F64
}

/// The entry point for `rule` on `dtype`, e.g. `fused_sgd_bf16` (no module has f64's).
pub fn entry_name(rule: RuleKind, dtype: DType) -> &'static str {
    macro_rules! by_dtype {
        ($rule:literal) => {
            match dtype {
                DType::F32 => concat!("fused_", $rule, "_f32"),
                DType::F16 => concat!("fused_", $rule, "_f16"),
                DType::BF16 => concat!("fused_", $rule, "_bf16"),
                DType::F64 => concat!("fused_", $rule, "_f64"),
            }
        };
    }
    match rule {
        RuleKind::Assign => by_dtype!("assign"),
        RuleKind::Axpby => by_dtype!("axpby"),
        RuleKind::Sgd => by_dtype!("sgd"),
        RuleKind::SgdMom => by_dtype!("sgd_mom"),
        RuleKind::Adam => by_dtype!("adam"),
    }
}

/// The stem of the module of [`entry_name`]`(rule, dtype)`: one per dtype (f64's is absent).
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

/// The blocks a tensor needs: `ceil(n / CHUNK)`, 0 when `k == 0` (the kernels skip it).
pub fn blocks_for(n: u64, k: u32) -> u64 {
    if k == 0 {
        0
    } else {
        n.div_ceil(u64::from(CHUNK))
    }
}

/// `starts` of a launch over tensors of `(n, k)`: 0, then the running sum of [`blocks_for`];
/// `None` past [`MAX_BLOCKS_PER_LAUNCH`].
pub fn block_starts(tensors: impl IntoIterator<Item = (u64, u32)>) -> Option<Vec<u32>> {
    let mut starts = vec![0u32];
    let mut total = 0u64;
    for (n, k) in tensors {
        total += blocks_for(n, k);
        if total > MAX_BLOCKS_PER_LAUNCH {
            return None;
        }
        starts.push(total as u32);
    }
    Some(starts)
}

/// The tensor `t` and chunk `b - starts[t]` block `b` works on, by the kernels' binary
/// search; `None` for a block past the last one (the kernels exit).
pub fn block_owner(starts: &[u32], b: u32) -> Option<(usize, u32)> {
    let total = *starts.last()?;
    if b >= total {
        return None;
    }
    let (mut lo, mut hi) = (0usize, starts.len() - 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if starts[mid] <= b {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some((lo, b - starts[lo]))
}

/// The grid for `total` blocks ([`block_starts`]'s last entry); 0 is invalid: do not launch.
pub fn grid_dim(total: u32) -> (u32, u32, u32) {
    (total, 1, 1)
}

/// One tensor of a launch: `table` points to an array of these. Pointers are device addresses;
/// the bytes are in host order, which is the GPU's (CUDA hosts are little-endian).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
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

/// The kernel for one step of `rule`: its kind, its f32 scalars in ABI order, Adam's `lr_t`.
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
        assert_eq!(grid_dim(7), (7, 1, 1));
        let starts = block_starts([(1, 1), (4096, 2), (0, 1), (4097, 0), (4097, 3)]).unwrap();
        assert_eq!(starts, vec![0, 1, 2, 2, 2, 4]);
        assert_eq!(block_starts([]).unwrap(), vec![0]);
        assert!(block_starts([(u64::MAX / 2, 1)]).is_none());
    }

    /// Every block of a random table maps to exactly the chunks of work, in order, once each;
    /// against a brute-force walk over the tensors (an independent reference).
    #[test]
    fn blocks_map_to_every_chunk_once() {
        use rand::Rng;
        let mut rng = rand::thread_rng();
        for _ in 0..200 {
            let tensors: Vec<(u64, u32)> = (0..rng.gen_range(0..40))
                .map(|_| {
                    let n = match rng.gen_range(0..4) {
                        0 => 0,
                        1 => rng.gen_range(1..=4096),
                        _ => rng.gen_range(1..=40_000),
                    };
                    (
                        n,
                        if rng.gen_bool(0.1) {
                            0
                        } else {
                            rng.gen_range(1..4)
                        },
                    )
                })
                .collect();
            let mut want = Vec::new();
            for (t, &(n, k)) in tensors.iter().enumerate() {
                if k == 0 {
                    continue;
                }
                let mut c = 0u64;
                while c * u64::from(CHUNK) < n {
                    want.push((t, c as u32));
                    c += 1;
                }
            }
            let starts = block_starts(tensors.iter().copied()).unwrap();
            let total = *starts.last().unwrap();
            assert_eq!(total as usize, want.len());
            let got: Vec<(usize, u32)> = (0..total)
                .map(|b| block_owner(&starts, b).expect("a block inside the grid has work"))
                .collect();
            assert_eq!(got, want);
            assert_eq!(block_owner(&starts, total), None);
            assert_eq!(block_owner(&starts, u32::MAX), None);
        }
    }

    /// The shapes of BERT-large's 391 parameter tensors (vocabulary 30522, hidden 1024,
    /// 24 layers, intermediate 4096, 512 positions, 2 token types, pooler).
    fn bert_large() -> Vec<u64> {
        let (h, i) = (1024u64, 4096u64);
        let mut t = vec![30522 * h, 512 * h, 2 * h, h, h];
        for _ in 0..24 {
            t.extend([
                h * h,
                h,
                h * h,
                h,
                h * h,
                h,
                h * h,
                h,
                h,
                h,
                h * i,
                i,
                i * h,
                h,
                h,
                h,
            ]);
        }
        t.extend([h * h, h]);
        t
    }

    /// The numbers BENCHMARKS.md states: the old grid (largest tensor x tensors) and the new
    /// one (one block per chunk of work) for a BERT-large push.
    #[test]
    fn bert_large_grid() {
        let t = bert_large();
        assert_eq!(t.len(), 391);
        let max_n = *t.iter().max().unwrap();
        let old = max_n.div_ceil(u64::from(CHUNK)) * t.len() as u64;
        let starts = block_starts(t.iter().map(|&n| (n, 1))).unwrap();
        let new = u64::from(*starts.last().unwrap());
        assert_eq!((old, new), (2_983_721, 81_987));
    }
}
