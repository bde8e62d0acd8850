//! Changing hyperparameters while training (the learning rate, all of an updater's
//! hyperparameters, a schedule, per-key multipliers), keeping every key's state and step.
//!
//! Each key counts its own updates (its step, Adam's `t`). A push call computes once
//! `num_update = max(num_update, max over its keys of step + 1)` (MXNet's) and
//! `lr = schedule(num_update)` (else the updater's `lr`), and gives each of its keys
//! `lr * lr_mult[key]` and `wd * wd_mult[key]`: one rate for all keys of a list push.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLockWriteGuard};

use super::groups::Group;
use super::{read, write, Active, KvStore};
use crate::updater::Hyper;
use crate::{Error, IntoKey, Key, LrScheduler, Result, Updater};

/// A key's multipliers of the learning rate and the weight decay (1 unless set).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Mult {
    lr: f64,
    wd: f64,
}

impl Default for Mult {
    fn default() -> Mult {
        Mult { lr: 1.0, wd: 1.0 }
    }
}

/// The store's hyperparameter settings beside the updater.
#[derive(Clone, Default)]
pub(super) struct Settings {
    scheduler: Option<LrScheduler>,
    /// Keys with a multiplier other than 1.
    mults: Arc<HashMap<Key, Mult>>,
    /// MXNet's `num_update`, shared by every `Active` of one updater generation.
    num_update: Arc<AtomicU64>,
}

impl Settings {
    /// The schedule and the per-key multipliers, in words every rank writes alike.
    pub(super) fn describe(&self) -> String {
        let mut mults: Vec<(&Key, &Mult)> = self.mults.iter().collect();
        mults.sort_by_key(|(k, _)| format!("{k:?}"));
        format!("schedule {:?}, multipliers {mults:?}", self.scheduler)
    }

    /// The settings for a new updater: the same schedule and multipliers, a count from 0.
    pub(super) fn restarted(&self) -> Settings {
        Settings {
            num_update: Arc::default(),
            ..self.clone()
        }
    }

    /// Checks that the schedule fits `updater`'s learning rate.
    pub(super) fn check_fits(&self, updater: &Updater) -> Result<()> {
        match &self.scheduler {
            Some(s) if updater.has_lr() => s.validate(updater.hyper().lr),
            _ => Ok(()),
        }
    }

    /// Sets `num_update` to `count`, lower or higher: after the store went back to a
    /// checkpoint, whose keys' update counts are lower than the count was.
    pub(super) fn reset_num_update(&self, count: u64) {
        self.num_update.store(count, Ordering::Relaxed);
    }

    fn lr_at(&self, updater: &Updater, num_update: u64) -> f64 {
        let base = updater.hyper().lr;
        self.scheduler
            .as_ref()
            .map_or(base, |s| s.lr(base, num_update))
    }
}

/// The learning rate and weight decay of each key of one push call, and the call's update count.
#[derive(Default)]
pub(super) struct PushHypers {
    per_key: Vec<Hyper>,
    num_update: u64,
}

impl PushHypers {
    /// The hyperparameters of group `i`.
    pub(super) fn of(&self, i: usize) -> Hyper {
        self.per_key.get(i).copied().unwrap_or_default()
    }

    /// Records the call's update count once its updates are issued.
    pub(super) fn commit(&self, active: &Active) {
        if self.num_update > 0 {
            active
                .hyper
                .num_update
                .fetch_max(self.num_update, Ordering::Relaxed);
        }
    }
}

/// Each group's learning rate and weight decay in a push, given its update count (`steps`).
pub(super) fn for_push(active: &Active, groups: &[Group<'_>], steps: &[u64]) -> PushHypers {
    let updater = &active.updater;
    if !updater.has_lr() {
        return PushHypers::default();
    }
    let most = steps.iter().copied().max().unwrap_or(0) + 1;
    let num_update = most.max(active.hyper.num_update.load(Ordering::Relaxed));
    let lr = active.hyper.lr_at(updater, num_update);
    let wd = updater.hyper().wd;
    let mults = &active.hyper.mults;
    let per_key = groups
        .iter()
        .map(|g| {
            let m = mults.get(&g.slot.key).copied().unwrap_or_default();
            Hyper {
                lr: lr * m.lr,
                wd: wd * m.wd,
            }
        })
        .collect();
    PushHypers {
        per_key,
        num_update,
    }
}

/// Changing hyperparameters while keeping every key's updater state.
impl KvStore {
    /// Sets the learning rate of the [`Sgd`](crate::Sgd) or [`Adam`](crate::Adam) updater in
    /// force from the next push on, keeping every key's state and step count (MXNet's
    /// `Optimizer.set_learning_rate`).
    ///
    /// [`Error::InvalidUpdater`] for a negative or non-finite `lr`, an updater without a
    /// learning rate, or when a schedule is set (it decides the rate, as in MXNet).
    ///
    /// ```
    /// use kvstore::{KvStore, NDArray, Sgd, Updater};
    /// let kv = KvStore::create("local")?;
    /// kv.set_updater(Updater::Sgd(Sgd { lr: 0.1, momentum: 0.9, ..Sgd::default() }))?;
    /// kv.init(0, &NDArray::zeros([2]))?;
    /// kv.push(0, &NDArray::ones([2]))?; // m = -0.1, w = -0.1
    /// kv.set_learning_rate(0.01)?;
    /// kv.push(0, &NDArray::ones([2]))?; // m = 0.9 * -0.1 - 0.01 = -0.1, w = -0.2
    /// let w = NDArray::zeros([2]);
    /// kv.pull(0, &w)?;
    /// assert!((w.to_vec::<f32>()?[0] + 0.2).abs() < 1e-6);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_learning_rate(&self, lr: f64) -> Result<()> {
        let mut active = write(&self.active);
        if active.hyper.scheduler.is_some() {
            return Err(Error::InvalidUpdater(
                "a learning-rate schedule is set, and it decides the rate: change its base rate \
                 with update_hyperparameters, or clear it with set_lr_scheduler(None) first"
                    .into(),
            ));
        }
        let updater = match active.updater.clone() {
            Updater::Sgd(s) => Updater::Sgd(crate::Sgd { lr, ..s }),
            Updater::Adam(a) => Updater::Adam(crate::Adam { lr, ..a }),
            other => return Err(no_lr(&other)),
        };
        updater.validate()?;
        replace(&mut active, |u, _| *u = updater);
        Ok(())
    }

    /// Replaces the hyperparameters of the updater in force with those of `updater`, keeping
    /// every key's state and step count (Adam's bias correction goes on with the new betas).
    ///
    /// [`Error::InvalidUpdater`] for another rule, a closure or PTX updater (use
    /// [`KvStore::set_updater`]), other state buffers (SGD momentum from 0 to non-zero or back),
    /// parameters out of range, or a schedule whose warm-up starts above the new `lr`.
    ///
    /// ```
    /// use kvstore::{Adam, KvStore, Updater};
    /// let kv = KvStore::create("local")?;
    /// kv.set_updater(Updater::Adam(Adam { lr: 1e-3, ..Adam::default() }))?;
    /// kv.update_hyperparameters(Updater::Adam(Adam { lr: 1e-4, wd: 1e-2, ..Adam::default() }))?;
    /// assert!(kv.update_hyperparameters(Updater::Axpby { a: 1.0, b: 1.0 }).is_err());
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn update_hyperparameters(&self, updater: Updater) -> Result<()> {
        updater.validate()?;
        let mut active = write(&self.active);
        let (old, new) = (active.updater.name(), updater.name());
        if matches!(updater, Updater::Custom(_) | Updater::Ptx(_)) || old != new {
            return Err(Error::InvalidUpdater(format!(
                "update_hyperparameters keeps the state of the updater in force ('{old}'), so it \
                 takes a '{old}' updater with new parameters, not '{new}'; to change the rule, \
                 use set_updater, which starts every key's state afresh"
            )));
        }
        let (was, will) = (active.updater.state_names(), updater.state_names());
        if was != will {
            return Err(Error::InvalidUpdater(format!(
                "the new parameters change the state buffers from [{}] to [{}] (SGD momentum \
                 going from 0 to non-zero or back): use set_updater to start afresh, or keep \
                 the momentum non-zero",
                was.join(", "),
                will.join(", ")
            )));
        }
        active.hyper.check_fits(&updater)?;
        replace(&mut active, |u, _| *u = updater);
        Ok(())
    }

    /// Sets the learning-rate schedule ([`crate::LrScheduler`]; `None` clears it) from the next
    /// push on, keeping every key's state. It stays set across [`KvStore::set_updater`].
    ///
    /// [`Error::InvalidUpdater`] when the updater in force has no learning rate (set `Sgd` or
    /// `Adam` first) or the schedule's parameters are out of range.
    ///
    /// ```
    /// use kvstore::{KvStore, LrScheduler, Sgd, Updater, WarmupMode};
    /// let kv = KvStore::create("local")?;
    /// kv.set_updater(Updater::Sgd(Sgd { lr: 0.1, momentum: 0.9, ..Sgd::default() }))?;
    /// // 5 updates of linear warm-up from 0, then cosine decay to 0 at update 100.
    /// kv.set_lr_scheduler(Some(
    ///     LrScheduler::cosine(100, 0.0).with_warmup(5, 0.0, WarmupMode::Linear),
    /// ))?;
    /// assert_eq!(kv.learning_rate(), Some(0.0)); // at num_update 0
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_lr_scheduler(&self, scheduler: Option<LrScheduler>) -> Result<()> {
        let mut active = write(&self.active);
        if let Some(s) = &scheduler {
            if !active.updater.has_lr() {
                return Err(no_lr(&active.updater));
            }
            s.validate(active.updater.hyper().lr)?;
        }
        replace(&mut active, |_, hyper| hyper.scheduler = scheduler);
        Ok(())
    }

    /// The learning-rate schedule in force, if any.
    pub fn lr_scheduler(&self) -> Option<LrScheduler> {
        read(&self.active).hyper.scheduler.clone()
    }

    /// MXNet's `num_update`: the count the last `Sgd` or `Adam` push used (0 after `set_updater`).
    pub fn num_update(&self) -> u64 {
        read(&self.active).hyper.num_update.load(Ordering::Relaxed)
    }

    /// MXNet's `Optimizer.learning_rate` (no per-key multipliers); `None` for updaters without.
    pub fn learning_rate(&self) -> Option<f64> {
        let active = read(&self.active).clone();
        let n = active.hyper.num_update.load(Ordering::Relaxed);
        active
            .updater
            .has_lr()
            .then(|| active.hyper.lr_at(&active.updater, n))
    }

    /// Multiplies `key`'s learning rate by `mult` (MXNet's `lr_mult`) from its next push on, for
    /// `Sgd` and `Adam`. 1 unless set; it stays set across [`KvStore::set_updater`].
    ///
    /// [`Error::UnknownKey`], or [`Error::InvalidUpdater`] for a negative or non-finite `mult`.
    pub fn set_lr_mult(&self, key: impl IntoKey, mult: f64) -> Result<()> {
        self.set_mult("set_lr_mult", key.into_key()?, mult, |m| &mut m.lr)
    }

    /// [`KvStore::set_lr_mult`] for the weight decay (MXNet's `wd_mult`). MXNet gives 0 to every
    /// parameter whose name does not end in `_weight` or `_gamma`; here every key starts at 1.
    ///
    /// ```
    /// use kvstore::{KvStore, NDArray, Sgd, Updater};
    /// let kv = KvStore::create("local")?;
    /// kv.set_updater(Updater::Sgd(Sgd { lr: 0.1, wd: 1e-4, ..Sgd::default() }))?;
    /// kv.init_list(&["fc1_weight", "fc1_bias"], &[NDArray::ones([4, 4]), NDArray::ones([4])])?;
    /// kv.set_wd_mult("fc1_bias", 0.0)?;
    /// assert_eq!(kv.wd_mult("fc1_bias")?, 0.0);
    /// assert!(kv.set_wd_mult("fc2_bias", 0.0).is_err());
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_wd_mult(&self, key: impl IntoKey, mult: f64) -> Result<()> {
        self.set_mult("set_wd_mult", key.into_key()?, mult, |m| &mut m.wd)
    }

    /// `key`'s learning-rate multiplier; [`Error::UnknownKey`] for a key not initialized.
    pub fn lr_mult(&self, key: impl IntoKey) -> Result<f64> {
        Ok(self.mult("lr_mult", key.into_key()?)?.lr)
    }

    /// `key`'s weight-decay multiplier; [`Error::UnknownKey`] for a key not initialized.
    pub fn wd_mult(&self, key: impl IntoKey) -> Result<f64> {
        Ok(self.mult("wd_mult", key.into_key()?)?.wd)
    }

    fn mult(&self, op: &'static str, key: Key) -> Result<Mult> {
        read(&self.table).get(op, &key)?;
        let active = read(&self.active).clone();
        Ok(active.hyper.mults.get(&key).copied().unwrap_or_default())
    }

    fn set_mult(
        &self,
        op: &'static str,
        key: Key,
        mult: f64,
        field: fn(&mut Mult) -> &mut f64,
    ) -> Result<()> {
        if !(mult.is_finite() && mult >= 0.0) {
            return Err(Error::InvalidUpdater(format!(
                "{op}: key {key}'s multiplier must be finite and non-negative, got {mult}"
            )));
        }
        read(&self.table).get(op, &key)?;
        let mut active = write(&self.active);
        let mut mults = (*active.hyper.mults).clone();
        let m = mults.entry(key.clone()).or_default();
        *field(m) = mult;
        if *m == Mult::default() {
            mults.remove(&key);
        }
        replace(&mut active, |_, hyper| hyper.mults = Arc::new(mults));
        Ok(())
    }
}

/// Puts in force the updater and settings as `change` leaves them, keeping the generation.
fn replace(
    active: &mut RwLockWriteGuard<'_, Arc<Active>>,
    change: impl FnOnce(&mut Updater, &mut Settings),
) {
    let (mut updater, mut hyper) = (active.updater.clone(), active.hyper.clone());
    change(&mut updater, &mut hyper);
    **active = Arc::new(Active::new(updater, active.generation, hyper));
}

fn no_lr(updater: &Updater) -> Error {
    Error::InvalidUpdater(format!(
        "the updater in force, '{}', has no learning rate: set an Sgd or Adam updater first \
         with set_updater",
        updater.name()
    ))
}
