//! The independent f64 reference of the built-in updaters, shared by the tests that check the
//! store's numbers against it: MXNet's `sgd_update`, `sgd_mom_update` and `adam_update`, with
//! the weight rounded to the key's dtype after each step as the store keeps it.

use half::{bf16, f16};
use kvstore::{DType, Updater};

/// `x` rounded to `dtype`, as `NDArray::from_f64` rounds it.
pub(crate) fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(x as f32),
        DType::F64 => x,
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
    }
}

/// Every element of `v` rounded to `dtype`.
pub(crate) fn rounded(dtype: DType, v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| round_to(dtype, x)).collect()
}

/// `g` clipped to `[-c, c]` when a bound is given.
pub(crate) fn clip(g: f64, c: Option<f64>) -> f64 {
    match c {
        Some(c) => g.clamp(-c, c),
        None => g,
    }
}

/// A key in the reference: its weight (rounded to `dtype`), updater state in f64, and the
/// step count.
#[derive(Clone)]
pub(crate) struct RefKey {
    pub dtype: DType,
    pub w: Vec<f64>,
    pub m: Vec<f64>,
    pub v: Vec<f64>,
    pub t: i32,
}

impl RefKey {
    /// A key holding `w`, rounded to `dtype`, with no state yet.
    pub(crate) fn new(dtype: DType, w: Vec<f64>) -> RefKey {
        let n = w.len();
        RefKey {
            dtype,
            w: rounded(dtype, &w),
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        }
    }

    /// State and step count start afresh, as after `set_updater`.
    pub(crate) fn reset_state(&mut self) {
        self.m.iter_mut().for_each(|x| *x = 0.0);
        self.v.iter_mut().for_each(|x| *x = 0.0);
        self.t = 0;
    }

    /// One push whose values sum to `g`.
    ///
    /// The hyperparameters are f64; the store hands them to the math of f32, f16 and bf16 keys
    /// rounded to f32 (MXNet's kernels take float32 scalars), except Adam's step size, which it
    /// computes in f64 from the unrounded ones and rounds once.
    pub(crate) fn step(&mut self, u: &Updater, g: &[f64]) {
        self.t += 1;
        let dtype = self.dtype;
        let p = |x: f64| {
            if dtype == DType::F64 {
                x
            } else {
                f64::from(x as f32)
            }
        };
        for i in 0..self.w.len() {
            let (w, g) = (self.w[i], g[i]);
            let new = match u {
                Updater::Assign => g,
                Updater::Axpby { a, b } => p(*a) * w + p(*b) * g,
                Updater::Sgd(s) if s.momentum == 0.0 => {
                    let grad = clip(p(s.rescale_grad) * g, s.clip_gradient.map(p));
                    (1.0 - p(s.lr) * p(s.wd)) * w - p(s.lr) * grad
                }
                Updater::Sgd(s) => {
                    let (lr, wd) = (p(s.lr), p(s.wd));
                    let grad = clip(p(s.rescale_grad) * g, s.clip_gradient.map(p));
                    self.m[i] = p(s.momentum) * self.m[i] - lr * wd * w - lr * grad;
                    w + self.m[i]
                }
                Updater::Adam(a) => {
                    let (b1, b2) = (p(a.beta1), p(a.beta2));
                    let grad = clip(p(a.rescale_grad) * g + p(a.wd) * w, a.clip_gradient.map(p));
                    self.m[i] = b1 * self.m[i] + (1.0 - b1) * grad;
                    self.v[i] = b2 * self.v[i] + (1.0 - b2) * grad * grad;
                    let (c1, c2) = (1.0 - a.beta1.powi(self.t), 1.0 - a.beta2.powi(self.t));
                    if a.epsilon_after_correction {
                        // PyTorch's form: the bias-corrected moments, epsilon after the root.
                        let m_hat = self.m[i] / c1;
                        let v_hat = self.v[i] / c2;
                        w - a.lr * m_hat / (v_hat.sqrt() + a.epsilon)
                    } else {
                        let lr_t = a.lr * c2.sqrt() / c1;
                        w - p(lr_t) * self.m[i] / (self.v[i].sqrt() + p(a.epsilon))
                    }
                }
                other => panic!("no reference for {other:?}"),
            };
            self.w[i] = round_to(dtype, new);
        }
    }
}
