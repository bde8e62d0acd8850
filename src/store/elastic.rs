//! Going on after a lost rank: a `dist_*` store under `mpirun --with-ft ulfm` (Open MPI 5).
//!
//! A call that loses a rank fails on every survivor, which then, inside that call:
//! 1. rebuilds the link among the survivors ([`Dist::rejoin`](crate::comm::dist::Dist)): they
//!    agree on who is left, and go on only where they hold a strict majority of the ranks;
//! 2. places every key again for the new world size from the survivors' parts and the
//!    buddies' copies of the lost ranks' parts, moving only what the new world lacks
//!    ([`super::heal`]), where the store keeps copies and they are whole; else forgets every
//!    key and reloads the store's last checkpoint (its last save or load, or the save in
//!    flight where rank 0 committed it);
//! 3. returns [`Error::WorldChanged`], saying which, and whether the call committed, so the
//!    program re-shards its data and goes on.
//!
//! Every survivor gets the error for the same call: the calls' fault-tolerant agreements
//! ([`crate::comm::points`]) make a call in flight fail on every survivor or on none, and a
//! survivor that was not in a call gets it for its next one.

use std::path::Path;
use std::time::Instant;

use super::table::Table;
use super::{write, Active, KvStore};
use crate::config::ReplicaUpdate;
use crate::{Error, Result, Updater};

/// The most losses one call recovers from in a row (a rank lost while the others reload).
const MOST_LOSSES: usize = 8;

impl KvStore {
    /// `got`, unless it failed because a rank was lost and the survivors can go on without
    /// it: then they go on (see the [module documentation](self)) and this is
    /// [`Error::WorldChanged`].
    pub(super) fn survive<T>(&self, op: &'static str, got: Result<T>) -> Result<T> {
        let Err(mut err) = got else {
            return got;
        };
        // The ranks lost, numbered as before this call, and those left, by those numbers.
        let mut lost = Vec::new();
        let mut left: Vec<usize> = (0..self.num_workers()).collect();
        let start = Instant::now();
        // The world the table is laid out for (this rank, its size, its buddies): a heal that
        // another loss ends puts that table back, and the next heal starts from it again.
        let (base_rank, base_size, base_buddies) =
            (self.rank(), self.num_workers(), self.ranks.buddies());
        // Whether a heal of this recovery failed for another reason than a new loss.
        let mut heal_failed = false;
        // Whether the call that met the loss committed (the first rejoin says; later ones speak
        // of a heal of this recovery).
        let mut call_committed = None;
        // Whether a heal of this recovery failed (then an error with no new loss means the
        // heal itself failed, on every survivor alike: its ranks agree before they commit).
        let mut healing_failed = false;
        // Why the last heal failed, for the error's message.
        let mut heal_error: Option<String> = None;
        for _ in 0..MOST_LOSSES {
            let rejoined = match self.ranks.rejoin(&err) {
                Some(rejoined) => rejoined?,
                None if std::mem::take(&mut healing_failed) => crate::comm::link::Rejoined {
                    lost: Vec::new(),
                    took: std::time::Duration::ZERO,
                    committed: false,
                },
                None => return Err(err),
            };
            let call_committed = *call_committed.get_or_insert(rejoined.committed);
            if rejoined.lost.is_empty() && !lost.is_empty() {
                // A heal failed, and no rank more was lost: the copies cannot heal the store.
                heal_failed = true;
            }
            lost.extend(rejoined.lost.iter().filter_map(|&l| left.get(l).copied()));
            lost.sort_unstable();
            left.retain(|r| !lost.contains(r));
            let relinked = rejoined.took;
            // Copies heal the store where every lost rank's buddy survived: two losses that
            // take a rank and its buddy (at once, or the second during the heal) cannot, nor
            // can a copy that lags its part (the heal fails then, on every survivor).
            let healer = base_buddies
                .filter(|b| !heal_failed && lost.iter().all(|&l| !lost.contains(&b.buddy(l))));
            let buddies = base_buddies;
            let (done, how) = match healer {
                Some(buddies) => {
                    let began = Instant::now();
                    let healed = self.heal((base_rank, base_size), buddies, &lost);
                    healing_failed = healed.is_err();
                    if let Err(e) = &healed {
                        heal_error = Some(e.to_string());
                    }
                    let how = healed.as_ref().map_or(String::new(), |h| {
                        format!(
                            "; the keys were placed again from the survivors' parts and the \
                             copies of the lost ranks' parts in {:.2} s: {} of {} keys moved \
                             ({} bytes of values, and their state), the copies were made anew \
                             ({} bytes sent), and this rank received {} bytes",
                            began.elapsed().as_secs_f64(),
                            h.keys_moved,
                            h.keys,
                            h.part_bytes,
                            h.copy_bytes,
                            h.received
                        )
                    });
                    (healed.map(|_| (true, None)), how)
                }
                None => (
                    self.reload_last_checkpoint().map(|p| (false, p)),
                    String::new(),
                ),
            };
            // A save in flight that rank 0 committed on disk all the same took effect (and where
            // the store goes back to a checkpoint, its is the one reloaded).
            let committed = match &done {
                Ok((true, _)) if op == "save" => self.save_in_flight_committed(),
                Ok((true, _)) => call_committed,
                Ok((false, Some(path))) => self.saving_committed(path),
                _ => false,
            };
            match done {
                Ok((healed, restored)) => {
                    let heal_failure;
                    let why_not_copies = match (buddies, healer) {
                        (Some(_), None) if heal_failed => {
                            heal_failure = format!(
                                "; the heal from the copies failed ({}), so the store went back \
                                 to its last checkpoint",
                                heal_error.as_deref().unwrap_or("no reason given")
                            );
                            heal_failure.as_str()
                        }
                        (Some(_), None) => {
                            "; a lost rank's copy was lost too (two losses at once), so the \
                             copies could not heal it"
                        }
                        _ => "",
                    };
                    return Err(Error::WorldChanged {
                        op,
                        lost,
                        world: self.num_workers(),
                        rank: self.rank(),
                        healed,
                        restored: restored.map(|p| p.display().to_string()),
                        committed,
                        detail: format!(
                            "the survivors found who is left and rebuilt their link in {:.2} s; \
                             the recovery took {:.2} s in all{how}{why_not_copies}",
                            relinked.as_secs_f64(),
                            start.elapsed().as_secs_f64()
                        ),
                    });
                }
                // Another rank lost meanwhile: go round again.
                Err(e) => err = e,
            }
        }
        Err(err)
    }

    /// Forgets every key and reloads the last checkpoint, if any (its path): the save in
    /// flight's, where rank 0 committed it on disk before the loss (so every survivor reloads
    /// the same one, whether its own save returned or not), else the last save's or load's.
    fn reload_last_checkpoint(&self) -> Result<Option<std::path::PathBuf>> {
        *write(&self.table) = Table::default();
        let saving = self
            .saving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let path = match saving {
            Some((dir, _)) if self.saving_committed(&dir) => Some(dir),
            _ => self.last_checkpoint(),
        };
        if let Some(p) = &path {
            self.load_here(p)?;
            self.remember_checkpoint(p);
        }
        // MXNet's num_update only grows: back at the checkpoint, it is the keys' count again,
        // so a schedule gives the redone pushes the rates they had.
        let active = super::read(&self.active).clone();
        let counts = (super::read(&self.table).slots.values())
            .map(|s| s.updates(active.generation))
            .max()
            .unwrap_or(0);
        active.hyper.reset_num_update(counts);
        Ok(path)
    }

    /// Whether the save in flight was committed on disk.
    fn save_in_flight_committed(&self) -> bool {
        let saving = self
            .saving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        saving.is_some_and(|(dir, _)| self.saving_committed(&dir))
    }

    /// Whether `dir` holds, committed, the generation the save in flight claimed.
    fn saving_committed(&self, dir: &std::path::Path) -> bool {
        let saving = self
            .saving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some((path, generation)) = saving else {
            return false;
        };
        let same = std::fs::canonicalize(dir).is_ok_and(|d| d == path);
        same && crate::checkpoint::read_index(&path).is_ok_and(|i| i.generation == generation)
    }

    /// Where the store keeps copies: how a push under `active` keeps them current. A closure
    /// updater's copies are always sent, never replayed (it may keep state of its own per
    /// key, which a second call would corrupt), and so are a PTX updater's without a CPU twin
    /// (copies live in host memory, GPU ranks' too).
    pub(super) fn copy_update(&self, active: &Active) -> Option<ReplicaUpdate> {
        self.ranks.buddies()?;
        let replayable = match &active.updater {
            Updater::Custom(_) => false,
            Updater::Ptx(p) => p.twin().is_some(),
            _ => true,
        };
        match replayable {
            true => Some(self.ranks.replica_update()),
            false => Some(ReplicaUpdate::Send),
        }
    }

    /// Remembers `path` as the checkpoint the survivors of a lost rank reload.
    pub(super) fn remember_checkpoint(&self, path: &Path) {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        *self
            .last_checkpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(path);
    }

    /// The checkpoint of this store's last save or load.
    fn last_checkpoint(&self) -> Option<std::path::PathBuf> {
        (self
            .last_checkpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner()))
        .clone()
    }
}
