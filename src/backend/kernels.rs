//! TEMPORARY STAND-IN (cuda branch): a minimal copy of the `kernels.rs` API from the ABI in
//! `/work/gpu-abi.md`, so the CUDA backend compiles before the `ptx` branch lands. The lead
//! replaces this file with the `ptx` helper's version at merge; `PTX_SOURCES` is empty here, so
//! a launch on a GPU reports a missing module instead of running.

use crate::updater::Rule;
use crate::DType;

/// The PTX files: (file stem, PTX text). Empty in this stand-in.
pub const PTX_SOURCES: &[(&str, &str)] = &[];

/// Elements per block-chunk of a fused launch.
pub const CHUNK: u32 = 4096;

/// Threads per block of a fused launch.
pub const BLOCK: u32 = 256;

/// The rule families the fused kernels implement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleKind {
    /// `stored = g`.
    Assign,
    /// `stored = a * stored + b * g`.
    Axpby,
    /// SGD without momentum.
    Sgd,
    /// SGD with momentum.
    SgdMom,
    /// Adam.
    Adam,
}

impl RuleKind {
    fn name(self) -> &'static str {
        match self {
            RuleKind::Assign => "assign",
            RuleKind::Axpby => "axpby",
            RuleKind::Sgd => "sgd",
            RuleKind::SgdMom => "sgd_mom",
            RuleKind::Adam => "adam",
        }
    }
}

/// The entry name of the fused kernel for `rule` and `dtype`, e.g. `fused_sgd_bf16`.
pub fn entry_name(rule: RuleKind, dtype: DType) -> &'static str {
    let d = match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
    };
    // 20 names at most; leaking them once each keeps the `&'static str` signature of the ABI.
    static NAMES: std::sync::OnceLock<std::sync::Mutex<Vec<&'static str>>> =
        std::sync::OnceLock::new();
    let name = format!("fused_{}_{d}", rule.name());
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.push(leaked);
    leaked
}

/// The PTX file (stem) that holds the entry for `rule` and `dtype`.
pub fn module_for(_rule: RuleKind, dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "fused_bf16",
        _ => "fused",
    }
}

/// The kernel family, its f32 scalars in ABI order, and Adam's per-tensor `lr_t`.
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
