//! [`Updater`]: how a key's stored value absorbs the sum of a push.
//!
//! Built-in updaters ([`Updater::Assign`], [`Updater::Axpby`], [`Sgd`], [`Adam`]) are fused with
//! the sum into one pass over memory, and each has a PTX twin for GPU homes. A
//! [`Updater::custom`] closure (the seeds' `_set_updater`) changes the stored [`NDArray`].
//!
//! Hyperparameters are `f64`, as in MXNet's Python. A step's scalars are computed in f64 and
//! rounded once to the key's accumulator type: f64 for f64 keys, else f32 (and on GPUs).

use std::any::{type_name, TypeId};
use std::fmt;
use std::sync::Arc;

use num_traits::Float;

mod ptx;
mod schedule;

use crate::dtype::Element;
use crate::{Error, Key, NDArray, Result};

pub(crate) use crate::error::BoxError;
pub use ptx::{PtxUpdater, PTX_UPDATER_BLOCK, PTX_UPDATER_MAX_BLOCKS, PTX_UPDATER_PARAMS};
pub use schedule::{Decay, LrScheduler, Warmup, WarmupMode};

/// A custom updater: `(key, merged input, stored value)`; an `Err` fails the push with
/// [`Error::UpdaterFailed`] and changes nothing.
pub type UpdateFn = dyn Fn(&Key, &NDArray, &mut NDArray) -> Result<(), BoxError> + Send + Sync;

/// How a push changes a key's stored value, given the sum of the values pushed to it.
#[derive(Clone, Default)]
pub enum Updater {
    /// `stored = input`. The default, as in MXNet.
    #[default]
    Assign,
    /// `stored = a * stored + b * input`.
    Axpby {
        /// Scale of the stored value.
        a: f64,
        /// Scale of the input.
        b: f64,
    },
    /// Stochastic gradient descent, MXNet's `sgd_update` / `sgd_mom_update`.
    Sgd(Sgd),
    /// Adam, MXNet's `adam_update` with bias correction.
    Adam(Adam),
    /// A user closure, called once per key and push with `(key, input, &mut stored)` on a copy
    /// that is stored only on `Ok` (an error or a panic changes nothing). It must not call its
    /// own store. GPU-homed keys go to the host and back: the slow path.
    Custom(CustomUpdater),
    /// A user's own PTX kernel for GPU-homed keys, with an optional CPU twin ([`PtxUpdater`]).
    Ptx(PtxUpdater),
}

/// A user closure as an updater ([`Updater::Custom`]), with the identity ranks compare.
#[derive(Clone)]
pub struct CustomUpdater {
    f: Arc<UpdateFn>,
    identity: Arc<str>,
    /// Whether the identity cannot tell which function this is (see `unnamed`).
    unnamed: bool,
}

impl CustomUpdater {
    /// `f`, known by its type and `label`.
    pub(crate) fn new<F>(f: F, label: Option<&str>) -> CustomUpdater
    where
        F: Fn(&Key, &NDArray, &mut NDArray) -> Result<(), BoxError> + Send + Sync + 'static,
    {
        CustomUpdater::known_as::<F>(Arc::new(f), label)
    }

    /// `f`, which cannot fail, known by its own type (not the wrapper's) and `label`.
    pub(crate) fn infallible<F>(f: F, label: Option<&str>) -> CustomUpdater
    where
        F: Fn(&Key, &NDArray, &mut NDArray) + Send + Sync + 'static,
    {
        let f = move |key: &Key, input: &NDArray, stored: &mut NDArray| {
            f(key, input, stored);
            Ok::<(), BoxError>(())
        };
        CustomUpdater::known_as::<F>(Arc::new(f), label)
    }

    /// `f` under the identity of type `F` and `label`.
    fn known_as<F: 'static>(f: Arc<UpdateFn>, label: Option<&str>) -> CustomUpdater {
        let (identity, unnamed) = (identity_of::<F>(label), unnamed::<F>(label));
        CustomUpdater {
            f,
            identity,
            unnamed,
        }
    }

    /// The closure's type name and id, then its label: what the ranks of a `dist_*` store compare.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The closure.
    pub fn function(&self) -> &Arc<UpdateFn> {
        &self.f
    }

    /// An error when the ranks of a `dist_*` store could not tell this updater from another.
    pub(crate) fn check_named(&self) -> Result<()> {
        if !self.unnamed {
            return Ok(());
        }
        Err(Error::InvalidUpdater(format!(
            "a dist store's ranks compare their updaters, but a function pointer or a boxed \
             closure ({}) has one type for every function, so they could not tell two apart: \
             name it with Updater::custom_labeled (or try_custom_labeled), or pass the closure \
             itself",
            self.identity
        )))
    }
}

/// Whether `F` is one type for many functions (`fn`, `dyn Fn`) and no label says which.
fn unnamed<F: 'static>(label: Option<&str>) -> bool {
    let name = type_name::<F>();
    label.is_none()
        && (name.contains("dyn ")
            || ["fn(", "for<", "unsafe ", "extern "]
                .iter()
                .any(|p| name.starts_with(p)))
}

/// A closure's identity: its type's name and id (which tells apart closures alike by name, and
/// is the same in every process of one build), then `label`.
fn identity_of<F: 'static>(label: Option<&str>) -> Arc<str> {
    let label = label.map(|l| format!(", {l}")).unwrap_or_default();
    format!("{} {:?}{label}", type_name::<F>(), TypeId::of::<F>()).into()
}

impl Updater {
    /// Wraps a closure as an updater. The seeds' updater in one line:
    ///
    /// ```
    /// use kvstore::Updater;
    /// let u = Updater::custom(|key, input, stored| {
    ///     println!("update on key: {key}");
    ///     *stored += input * 2.0;
    /// });
    /// ```
    ///
    /// The ranks of a `dist_*` store compare its [`identity`](CustomUpdater::identity), the
    /// closure's type, not its captured values: name those with [`Updater::custom_labeled`]
    /// when they could differ between ranks.
    pub fn custom<F>(f: F) -> Updater
    where
        F: Fn(&Key, &NDArray, &mut NDArray) + Send + Sync + 'static,
    {
        Updater::Custom(CustomUpdater::infallible(f, None))
    }

    /// [`Updater::custom`] with a `label` (its captured values, in words) in its identity, so
    /// that ranks that captured different ones fail with [`Error::Desync`].
    ///
    /// ```
    /// use kvstore::Updater;
    /// let scale = 2.0;
    /// let u = Updater::custom_labeled(&format!("scale {scale}"), move |_key, input, stored| {
    ///     *stored += input * scale;
    /// });
    /// # let Updater::Custom(c) = u else { unreachable!() };
    /// assert!(c.identity().ends_with("scale 2"));
    /// ```
    pub fn custom_labeled<F>(label: &str, f: F) -> Updater
    where
        F: Fn(&Key, &NDArray, &mut NDArray) + Send + Sync + 'static,
    {
        Updater::Custom(CustomUpdater::infallible(f, Some(label)))
    }

    /// Wraps a fallible closure as an updater: an `Err` fails the push ([`Error::UpdaterFailed`]).
    ///
    /// ```
    /// use kvstore::{Error, KvStore, NDArray, Updater};
    /// let kv = KvStore::create("local")?;
    /// kv.init(0, &NDArray::zeros([2]))?;
    /// kv.set_updater(Updater::try_custom(|_key, input, stored| {
    ///     stored.add_scaled(input, 1.0)?; // arithmetic errors propagate with `?`
    ///     if input.to_vec::<f32>()?.iter().any(|x| !x.is_finite()) {
    ///         return Err("non-finite gradient".into());
    ///     }
    ///     Ok(())
    /// }))?;
    /// let err = kv.push(0, &NDArray::full([2], f64::NAN)).unwrap_err();
    /// assert!(matches!(err, Error::UpdaterFailed { .. }), "{err}");
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn try_custom<F>(f: F) -> Updater
    where
        F: Fn(&Key, &NDArray, &mut NDArray) -> Result<(), BoxError> + Send + Sync + 'static,
    {
        Updater::Custom(CustomUpdater::new(f, None))
    }

    /// [`Updater::try_custom`] with a `label`, as [`Updater::custom_labeled`] has it.
    pub fn try_custom_labeled<F>(label: &str, f: F) -> Updater
    where
        F: Fn(&Key, &NDArray, &mut NDArray) -> Result<(), BoxError> + Send + Sync + 'static,
    {
        Updater::Custom(CustomUpdater::new(f, Some(label)))
    }

    /// [`CustomUpdater::check_named`] of the closure or the PTX twin.
    pub(crate) fn check_named(&self) -> Result<()> {
        match self {
            Updater::Custom(c) => c.check_named(),
            Updater::Ptx(p) => p.twin().map_or(Ok(()), CustomUpdater::check_named),
            _ => Ok(()),
        }
    }

    /// Checks that the parameters are in range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidUpdater(what));
        match self {
            Updater::Ptx(p) if p.state_buffers() > 2 => bad(format!(
                "a PTX updater keeps at most 2 state buffers (m and v), got {}",
                p.state_buffers()
            )),
            Updater::Axpby { a, b } if !(a.is_finite() && b.is_finite()) => {
                bad(format!("axpby needs finite a and b, got a={a}, b={b}"))
            }
            Updater::Sgd(s) => {
                check_common(s.lr, s.wd, s.rescale_grad, s.clip_gradient)?;
                let m = s.momentum;
                if !(0.0..1.0).contains(&m) {
                    return bad(format!("sgd momentum must be in [0, 1), got {m}"));
                }
                Ok(())
            }
            Updater::Adam(a) => {
                check_common(a.lr, a.wd, a.rescale_grad, a.clip_gradient)?;
                for (name, b) in [("beta1", a.beta1), ("beta2", a.beta2)] {
                    if !(0.0..1.0).contains(&b) {
                        return bad(format!("adam {name} must be in [0, 1), got {b}"));
                    }
                }
                if !(a.epsilon > 0.0 && a.epsilon.is_finite()) {
                    return bad(format!("adam epsilon must be positive, got {}", a.epsilon));
                }
                Ok(())
            }
            Updater::Assign | Updater::Axpby { .. } | Updater::Custom(_) | Updater::Ptx(_) => {
                Ok(())
            }
        }
    }

    /// The names of the per-key state buffers this updater keeps, each the size of the value.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Updater::Sgd(s) if s.momentum != 0.0 => &["momentum"],
            Updater::Adam(_) => &["mean", "var"],
            Updater::Ptx(p) => &["m", "v"][..p.state_buffers().min(2)],
            _ => &[],
        }
    }

    /// A short name: `assign`, `axpby`, `sgd`, `adam`, `custom` or `ptx`.
    pub fn name(&self) -> &'static str {
        match self {
            Updater::Assign => "assign",
            Updater::Axpby { .. } => "axpby",
            Updater::Sgd(_) => "sgd",
            Updater::Adam(_) => "adam",
            Updater::Custom(_) => "custom",
            Updater::Ptx(_) => "ptx",
        }
    }

    /// The updater's own learning rate and weight decay (zero for updaters without them).
    pub(crate) fn hyper(&self) -> Hyper {
        match self {
            Updater::Sgd(s) => Hyper { lr: s.lr, wd: s.wd },
            Updater::Adam(a) => Hyper { lr: a.lr, wd: a.wd },
            _ => Hyper::default(),
        }
    }

    /// Whether a schedule and per-key multipliers apply ([`Sgd`] and [`Adam`]).
    pub(crate) fn has_lr(&self) -> bool {
        matches!(self, Updater::Sgd(_) | Updater::Adam(_))
    }

    /// The fused element rule for step `step` (from 1); `None` for a closure or PTX updater.
    pub(crate) fn rule<A: Element + Float>(&self, step: u64) -> Option<Rule<A>> {
        self.rule_with(step, self.hyper())
    }

    /// [`Updater::rule`] with learning rate and weight decay `h` in place of the updater's own.
    pub(crate) fn rule_with<A: Element + Float>(&self, step: u64, h: Hyper) -> Option<Rule<A>> {
        let c = |x: f64| A::from_f64(x);
        let clip = |c: Option<f64>| A::from_f64(c.unwrap_or(f64::INFINITY));
        Some(match self {
            Updater::Assign => Rule::Assign,
            Updater::Axpby { a, b } => Rule::Axpby { a: c(*a), b: c(*b) },
            Updater::Sgd(s) if s.momentum == 0.0 => Rule::Sgd {
                lr: c(h.lr),
                wd: c(h.wd),
                rescale: c(s.rescale_grad),
                clip: clip(s.clip_gradient),
            },
            Updater::Sgd(s) => Rule::SgdMom {
                lr: c(h.lr),
                momentum: c(s.momentum),
                wd: c(h.wd),
                rescale: c(s.rescale_grad),
                clip: clip(s.clip_gradient),
            },
            Updater::Adam(a) => {
                let t = i32::try_from(step).unwrap_or(i32::MAX);
                let root2 = (1.0 - a.beta2.powi(t)).sqrt();
                let lr_t = h.lr * root2 / (1.0 - a.beta1.powi(t));
                // sqrt(v/(1-b2^t)) + eps, times sqrt(1-b2^t) as lr_t has it: sqrt(v) + eps_t.
                let epsilon = match a.epsilon_after_correction {
                    true => a.epsilon * root2,
                    false => a.epsilon,
                };
                Rule::Adam {
                    lr_t: c(lr_t),
                    beta1: c(a.beta1),
                    beta2: c(a.beta2),
                    epsilon: c(epsilon),
                    wd: c(h.wd),
                    rescale: c(a.rescale_grad),
                    clip: clip(a.clip_gradient),
                }
            }
            Updater::Custom(_) | Updater::Ptx(_) => return None,
        })
    }
}

/// The learning rate and weight decay of one key in one push, schedule and multipliers applied.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Hyper {
    /// Learning rate.
    pub lr: f64,
    /// Weight decay.
    pub wd: f64,
}

fn check_common(lr: f64, wd: f64, rescale: f64, clip: Option<f64>) -> Result<()> {
    let ok = lr.is_finite() && lr >= 0.0 && wd.is_finite() && wd >= 0.0 && rescale.is_finite();
    let clip_ok = clip.is_none_or(|c| c >= 0.0 && !c.is_nan());
    if ok && clip_ok {
        return Ok(());
    }
    Err(Error::InvalidUpdater(format!(
        "lr and wd must be finite and non-negative, rescale_grad finite, clip_gradient \
         non-negative; got lr={lr}, wd={wd}, rescale_grad={rescale}, clip_gradient={clip:?}"
    )))
}

impl fmt::Debug for Updater {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Updater::Assign => f.write_str("Assign"),
            Updater::Axpby { a, b } => write!(f, "Axpby {{ a: {a}, b: {b} }}"),
            Updater::Sgd(s) => write!(f, "{s:?}"),
            Updater::Adam(a) => write!(f, "{a:?}"),
            Updater::Custom(c) => write!(f, "Custom({})", c.identity()),
            Updater::Ptx(p) => write!(f, "{p:?}"),
        }
    }
}

/// SGD, as MXNet's `sgd_update` and `sgd_mom_update` compute it. With `g = clip(rescale_grad * input)`:
///
/// - momentum 0: `w = (1 - lr*wd) * w - lr * g`
/// - otherwise: `m = momentum*m - lr*wd*w - lr*g; w += m`
///
/// ```
/// use kvstore::{Sgd, Updater};
/// let u = Updater::Sgd(Sgd { lr: 0.1, momentum: 0.9, ..Sgd::default() });
/// assert!(u.validate().is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum in [0, 1); 0 keeps no state.
    pub momentum: f64,
    /// Weight decay.
    pub wd: f64,
    /// Scale applied to the input first (e.g. 1 / batch size).
    pub rescale_grad: f64,
    /// Clip the rescaled input to [-c, c].
    pub clip_gradient: Option<f64>,
}

impl Default for Sgd {
    /// `lr` 0.01 and nothing else.
    fn default() -> Sgd {
        Sgd {
            lr: 0.01,
            momentum: 0.0,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: None,
        }
    }
}

/// Adam, as MXNet's `adam_update` computes it, with bias correction in the step size. With
/// `g = clip(rescale_grad * input + wd * w)` and `t` the key's step count (from 1):
///
/// `m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g²; w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps)`
///
/// With [`Adam::epsilon_after_correction`], `eps` is added to the bias-corrected root instead,
/// as `torch.optim.Adam` does: `w -= lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub epsilon: f64,
    /// Weight decay.
    pub wd: f64,
    /// Scale applied to the input first.
    pub rescale_grad: f64,
    /// Clip the gradient to [-c, c].
    pub clip_gradient: Option<f64>,
    /// Add `epsilon` to `sqrt(v/(1-b2^t))`, as PyTorch does, not to `sqrt(v)` (MXNet's, default).
    pub epsilon_after_correction: bool,
}

impl Default for Adam {
    /// MXNet's defaults: lr 0.001, betas 0.9 and 0.999, epsilon 1e-8.
    fn default() -> Adam {
        Adam {
            lr: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: None,
            epsilon_after_correction: false,
        }
    }
}

/// One step of a built-in updater, with its scalars in the accumulator type.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rule<A> {
    Assign,
    Axpby {
        a: A,
        b: A,
    },
    Sgd {
        lr: A,
        wd: A,
        rescale: A,
        clip: A,
    },
    SgdMom {
        lr: A,
        momentum: A,
        wd: A,
        rescale: A,
        clip: A,
    },
    Adam {
        lr_t: A,
        beta1: A,
        beta2: A,
        epsilon: A,
        wd: A,
        rescale: A,
        clip: A,
    },
}

/// Clamps `g` to `[-c, c]`, letting NaN through so a bad gradient is seen, not hidden.
#[inline(always)]
pub(crate) fn clip<A: Float>(g: A, c: A) -> A {
    if g > c {
        c
    } else if g < -c {
        -c
    } else {
        g
    }
}
