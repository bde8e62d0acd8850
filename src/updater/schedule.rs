use std::f64::consts::PI;

use crate::{Error, Result};

/// A learning-rate schedule: a [`Decay`] after an optional [`Warmup`], as a function of the
/// update count (MXNet's `lr_scheduler`: `FactorScheduler`, `MultiFactorScheduler`,
/// `PolyScheduler`, `CosineScheduler`).
///
/// Set with [`crate::KvStore::set_lr_scheduler`]; its base learning rate is the updater's `lr`.
///
/// `num_update` is MXNet's: the running maximum of the keys' own push counts, so a loop that
/// pushes every key once per iteration sees 1, 2, 3, ... on its iterations.
///
/// With warm-up, for `num_update < warmup.steps`:
///
/// - linear: `lr = begin_lr + (base_lr - begin_lr) * num_update / warmup.steps`
/// - constant: `lr = begin_lr`
///
/// and from `warmup.steps` on, the decay below. Decays count `num_update` from 0, warm-up
/// included (MXNet's convention), except `Poly` and `Cosine`, which start at the end of warm-up.
///
/// The formulas are closed forms of MXNet's stateful classes: the rate depends on `num_update`
/// alone, not on which counts were asked for before.
///
/// ```
/// use kvstore::{LrScheduler, WarmupMode};
/// // 0.1, decayed by half every 10 updates, after 4 updates of linear warm-up from 0.
/// let s = LrScheduler::factor(10, 0.5).with_warmup(4, 0.0, WarmupMode::Linear);
/// assert_eq!(s.lr(0.1, 1), 0.025);
/// assert_eq!(s.lr(0.1, 10), 0.1);
/// assert_eq!(s.lr(0.1, 11), 0.05);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LrScheduler {
    /// The learning rate from the end of warm-up on.
    pub decay: Decay,
    /// The first updates' learning rate; `steps: 0` for none.
    pub warmup: Warmup,
}

/// How the learning rate ramps up over the first updates (MXNet's `warmup_*`); none by default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Warmup {
    /// Updates `0..steps` are warm-up; 0 means no warm-up.
    pub steps: u64,
    /// The learning rate at update 0; at most the base learning rate.
    pub begin_lr: f64,
    /// Linear ramp to the base learning rate, or constant `begin_lr`.
    pub mode: WarmupMode,
}

/// The shape of the warm-up (MXNet's `warmup_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WarmupMode {
    /// `begin_lr + (base_lr - begin_lr) * num_update / steps`.
    #[default]
    Linear,
    /// `begin_lr`.
    Constant,
}

/// The learning rate after warm-up, as a function of `num_update` and the base learning rate.
#[derive(Clone, Debug, PartialEq)]
pub enum Decay {
    /// The base learning rate.
    Constant,
    /// MXNet's `FactorScheduler`: `base_lr * factor^k`, `k = (num_update - 1) / step` (0 for
    /// `num_update = 0`), and once `k >= 1` never below `stop_factor_lr`.
    Factor {
        /// Updates between drops, at least 1.
        step: u64,
        /// The factor of each drop, in `[0, 1]`.
        factor: f64,
        /// The floor the drops stop at (MXNet's default is 1e-8).
        stop_factor_lr: f64,
    },
    /// MXNet's `MultiFactorScheduler`: `base_lr * factor^k`, `k` the `steps` below `num_update`.
    MultiFactor {
        /// Strictly increasing update counts, each at least 1.
        steps: Vec<u64>,
        /// The factor of each drop, in `[0, 1]`.
        factor: f64,
    },
    /// MXNet's `PolyScheduler`, with `w` the warm-up steps:
    /// `final_lr + (base_lr - final_lr) * (1 - (num_update - w) / (max_update - w))^pwr`,
    /// and `final_lr` past `max_update`.
    Poly {
        /// The update count the rate reaches `final_lr` at; more than the warm-up steps.
        max_update: u64,
        /// The power, at least 0 (MXNet's default is 2).
        pwr: f64,
        /// The last learning rate.
        final_lr: f64,
    },
    /// MXNet's `CosineScheduler`, with `w` the warm-up steps:
    /// `final_lr + (base_lr - final_lr) * (1 + cos(pi * (num_update - w) / (max_update - w))) / 2`,
    /// and `final_lr` past `max_update`.
    Cosine {
        /// The update count the rate reaches `final_lr` at; more than the warm-up steps.
        max_update: u64,
        /// The last learning rate.
        final_lr: f64,
    },
}

impl LrScheduler {
    /// A constant learning rate: useful with [`LrScheduler::with_warmup`] alone.
    pub fn constant() -> LrScheduler {
        LrScheduler::new(Decay::Constant)
    }

    /// [`Decay::Factor`] with MXNet's `stop_factor_lr` of 1e-8.
    pub fn factor(step: u64, factor: f64) -> LrScheduler {
        LrScheduler::new(Decay::Factor {
            step,
            factor,
            stop_factor_lr: 1e-8,
        })
    }

    /// [`Decay::MultiFactor`].
    pub fn multi_factor(steps: Vec<u64>, factor: f64) -> LrScheduler {
        LrScheduler::new(Decay::MultiFactor { steps, factor })
    }

    /// [`Decay::Poly`] down to 0.
    pub fn poly(max_update: u64, pwr: f64) -> LrScheduler {
        LrScheduler::new(Decay::Poly {
            max_update,
            pwr,
            final_lr: 0.0,
        })
    }

    /// [`Decay::Cosine`] down to `final_lr`.
    pub fn cosine(max_update: u64, final_lr: f64) -> LrScheduler {
        LrScheduler::new(Decay::Cosine {
            max_update,
            final_lr,
        })
    }

    /// A schedule of `decay` with no warm-up.
    pub fn new(decay: Decay) -> LrScheduler {
        LrScheduler {
            decay,
            warmup: Warmup::default(),
        }
    }

    /// This schedule, with a warm-up over the first `steps` updates from `begin_lr`.
    pub fn with_warmup(self, steps: u64, begin_lr: f64, mode: WarmupMode) -> LrScheduler {
        LrScheduler {
            warmup: Warmup {
                steps,
                begin_lr,
                mode,
            },
            ..self
        }
    }

    /// Checks the parameters for base learning rate `base_lr` ([`Error::InvalidUpdater`]).
    pub fn validate(&self, base_lr: f64) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidUpdater(what));
        let rate = |x: f64| x.is_finite() && x >= 0.0;
        let factor_ok = |f: f64| (0.0..=1.0).contains(&f);
        let w = self.warmup;
        if !rate(w.begin_lr) || (w.steps > 0 && w.begin_lr > base_lr) {
            return bad(format!(
                "the warm-up's begin_lr must be finite, non-negative and at most the base \
                 learning rate (the updater's lr, {base_lr}); got {}",
                w.begin_lr
            ));
        }
        match &self.decay {
            Decay::Constant => Ok(()),
            Decay::Factor { step, .. } if *step < 1 => {
                bad("a factor schedule's step must be at least 1 update".into())
            }
            Decay::Factor {
                factor,
                stop_factor_lr,
                ..
            } if !factor_ok(*factor) || !rate(*stop_factor_lr) => bad(format!(
                "a factor schedule's factor must be in [0, 1] (so the rate decreases) and \
                 stop_factor_lr finite and non-negative; got factor={factor}, \
                 stop_factor_lr={stop_factor_lr}"
            )),
            Decay::Factor { .. } => Ok(()),
            Decay::MultiFactor { steps, factor } => {
                let increasing = steps.windows(2).all(|p| p[0] < p[1]);
                if steps.is_empty() || steps[0] < 1 || !increasing {
                    return bad(format!(
                        "a multi-factor schedule's steps must be a non-empty, strictly \
                         increasing list of update counts from 1 up; got {steps:?}"
                    ));
                }
                if !factor_ok(*factor) {
                    return bad(format!(
                        "a multi-factor schedule's factor must be in [0, 1]; got {factor}"
                    ));
                }
                Ok(())
            }
            Decay::Poly {
                max_update,
                pwr,
                final_lr,
            } => {
                check_end("poly", *max_update, w.steps, *final_lr)?;
                if !(pwr.is_finite() && *pwr >= 0.0) {
                    return bad(format!(
                        "a poly schedule's pwr must be finite and non-negative; got {pwr}"
                    ));
                }
                Ok(())
            }
            Decay::Cosine {
                max_update,
                final_lr,
            } => check_end("cosine", *max_update, w.steps, *final_lr),
        }
    }

    /// The learning rate at `num_update` for `base_lr`, of a schedule that passed `validate`.
    pub fn lr(&self, base_lr: f64, num_update: u64) -> f64 {
        let w = self.warmup;
        if num_update < w.steps {
            return match w.mode {
                WarmupMode::Linear => {
                    w.begin_lr + (base_lr - w.begin_lr) * num_update as f64 / w.steps as f64
                }
                WarmupMode::Constant => w.begin_lr,
            };
        }
        let n = num_update;
        match &self.decay {
            Decay::Constant => base_lr,
            Decay::Factor {
                step,
                factor,
                stop_factor_lr,
            } => {
                let k = n.saturating_sub(1) / (*step).max(1);
                if k == 0 {
                    base_lr
                } else {
                    (base_lr * pow(*factor, k)).max(*stop_factor_lr)
                }
            }
            Decay::MultiFactor { steps, factor } => {
                let k = steps.iter().filter(|&&s| n > s).count() as u64;
                base_lr * pow(*factor, k)
            }
            Decay::Poly {
                max_update,
                final_lr,
                ..
            }
            | Decay::Cosine {
                max_update,
                final_lr,
            } => {
                if n > *max_update {
                    return *final_lr;
                }
                let done = (n - w.steps) as f64 / (max_update - w.steps) as f64;
                let left = match &self.decay {
                    Decay::Poly { pwr, .. } => (1.0 - done).powf(*pwr),
                    _ => (1.0 + (PI * done).cos()) / 2.0,
                };
                final_lr + (base_lr - final_lr) * left
            }
        }
    }
}

/// `x^k` for a count `k`.
fn pow(x: f64, k: u64) -> f64 {
    x.powi(i32::try_from(k).unwrap_or(i32::MAX))
}

/// `max_update` must leave at least one update after the warm-up; `final_lr` must be a rate.
fn check_end(name: &str, max_update: u64, warmup: u64, final_lr: f64) -> Result<()> {
    if max_update <= warmup {
        return Err(Error::InvalidUpdater(format!(
            "a {name} schedule's max_update ({max_update}) must be more than its warm-up \
             steps ({warmup})"
        )));
    }
    if !(final_lr.is_finite() && final_lr >= 0.0) {
        return Err(Error::InvalidUpdater(format!(
            "a {name} schedule's final_lr must be finite and non-negative; got {final_lr}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-15 * b.abs().max(1e-300), "{a} != {b}");
    }

    #[test]
    fn warmup_is_linear_or_constant() {
        // steps 4 from 0.02 to base 0.1: +0.02 per update.
        let s = LrScheduler::constant().with_warmup(4, 0.02, WarmupMode::Linear);
        for (n, want) in [
            (0, 0.02),
            (1, 0.04),
            (2, 0.06),
            (3, 0.08),
            (4, 0.1),
            (9, 0.1),
        ] {
            close(s.lr(0.1, n), want);
        }
        let s = LrScheduler::constant().with_warmup(4, 0.02, WarmupMode::Constant);
        for (n, want) in [(0, 0.02), (3, 0.02), (4, 0.1)] {
            close(s.lr(0.1, n), want);
        }
    }

    #[test]
    fn factor_drops_after_each_step_and_stops_at_the_floor() {
        // step 3, factor 0.5, base 1: updates 0..=3 at 1, 4..=6 at 0.5, 7..=9 at 0.25, then
        // 0.125 < floor 0.2.
        let s = LrScheduler::new(Decay::Factor {
            step: 3,
            factor: 0.5,
            stop_factor_lr: 0.2,
        });
        let want = [
            1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.2, 0.2, 0.2, 0.2,
        ];
        for (n, w) in want.iter().enumerate() {
            close(s.lr(1.0, n as u64), *w);
        }
        // Warm-up does not shift the drops: warm-up 2 of 0 → 1, then 1 up to update 3.
        let s = LrScheduler::factor(3, 0.5).with_warmup(2, 0.0, WarmupMode::Linear);
        for (n, w) in [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.0), (4, 0.5)] {
            close(s.lr(1.0, n), w);
        }
    }

    #[test]
    fn multi_factor_drops_after_each_listed_update() {
        // Drops after 2 and 5, by 0.1: 1 for n ≤ 2, 0.1 for 3..=5, 0.01 from 6.
        let s = LrScheduler::multi_factor(vec![2, 5], 0.1);
        for (n, w) in [
            (0, 1.0),
            (2, 1.0),
            (3, 0.1),
            (5, 0.1),
            (6, 0.01),
            (100, 0.01),
        ] {
            close(s.lr(1.0, n), w);
        }
    }

    #[test]
    fn poly_decays_to_final_lr() {
        // max 10, pwr 2, base 1, final 0: (1 - n/10)^2 → 1, 0.81 (n=1), 0.25 (n=5), 0 (n=10).
        let s = LrScheduler::poly(10, 2.0);
        for (n, w) in [(0, 1.0), (1, 0.81), (5, 0.25), (10, 0.0), (11, 0.0)] {
            close(s.lr(1.0, n), w);
        }
        // Warm-up 2, max 6, final 0.2, pwr 1: at n = 2 + 4x it is 0.2 + 0.8 (1 - x):
        // n=2 → 1, n=4 → 0.6, n=6 → 0.2, then 0.2.
        let s = LrScheduler::new(Decay::Poly {
            max_update: 6,
            pwr: 1.0,
            final_lr: 0.2,
        })
        .with_warmup(2, 0.5, WarmupMode::Constant);
        for (n, w) in [(0, 0.5), (1, 0.5), (2, 1.0), (4, 0.6), (6, 0.2), (7, 0.2)] {
            close(s.lr(1.0, n), w);
        }
    }

    #[test]
    fn cosine_decays_to_final_lr() {
        // max 8, final 0, base 2: (1 + cos(pi n / 8)) → 2 at 0, 1 at 4 (cos = 0), 0 at 8,
        // 2 * (1 + cos(pi/4)) / 2 = 1 + sqrt(2)/2 at 2.
        let s = LrScheduler::cosine(8, 0.0);
        close(s.lr(2.0, 0), 2.0);
        close(s.lr(2.0, 2), 1.0 + 0.5f64.sqrt());
        assert!((s.lr(2.0, 4) - 1.0).abs() < 1e-15);
        assert!(s.lr(2.0, 8).abs() < 1e-15);
        close(s.lr(2.0, 9), 0.0);
        // Warm-up 4 from 0, then cosine over updates 4..=12 to 0.5: at 8, halfway, 1.25.
        let s = LrScheduler::cosine(12, 0.5).with_warmup(4, 0.0, WarmupMode::Linear);
        close(s.lr(2.0, 1), 0.5);
        close(s.lr(2.0, 4), 2.0);
        assert!((s.lr(2.0, 8) - 1.25).abs() < 1e-15);
        close(s.lr(2.0, 12), 0.5);
    }

    #[test]
    fn bad_schedules_are_errors() {
        let bad = [
            LrScheduler::factor(0, 0.5),
            LrScheduler::factor(3, 1.5),
            LrScheduler::factor(3, f64::NAN),
            LrScheduler::multi_factor(vec![], 0.5),
            LrScheduler::multi_factor(vec![3, 3], 0.5),
            LrScheduler::multi_factor(vec![0, 3], 0.5),
            LrScheduler::poly(0, 2.0),
            LrScheduler::poly(10, -1.0),
            LrScheduler::cosine(4, 0.0).with_warmup(4, 0.0, WarmupMode::Linear),
            LrScheduler::cosine(10, -0.1),
            LrScheduler::constant().with_warmup(3, 0.2, WarmupMode::Linear),
        ];
        for s in bad {
            let e = s.validate(0.1).unwrap_err();
            assert!(matches!(e, Error::InvalidUpdater(_)), "{s:?}: {e}");
        }
        assert!(LrScheduler::cosine(5, 0.0)
            .with_warmup(4, 0.1, WarmupMode::Linear)
            .validate(0.1)
            .is_ok());
    }
}
