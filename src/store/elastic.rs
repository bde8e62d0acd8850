//! Going on after a lost rank: a `dist_*` store under `mpirun --with-ft ulfm` (Open MPI 5).
//!
//! A call that loses a rank fails on every survivor, which then, inside that call:
//! 1. rebuilds the link among the survivors ([`Dist::rejoin`](crate::comm::dist::Dist)): they
//!    agree on who is left, and go on only where they hold a strict majority of the ranks;
//! 2. forgets every key, whose parts were placed for the old world size;
//! 3. reloads the store's last checkpoint (its last save or load), placed for the new size;
//! 4. returns [`Error::WorldChanged`], so the program re-shards its data and goes on from the
//!    checkpoint's step.
//!
//! Every survivor gets the error for its call in flight, and a survivor that was not in a call
//! gets it for its next one. Nothing of the failed call is kept on any rank: all go back to the
//! checkpoint.

use std::path::Path;
use std::time::Instant;

use super::table::Table;
use super::{write, KvStore};
use crate::{Error, Result};

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
        let mut lost = Vec::new();
        let start = Instant::now();
        for _ in 0..MOST_LOSSES {
            let Some(rejoined) = self.ranks.rejoin() else {
                return Err(err);
            };
            let rejoined = rejoined?;
            if lost.is_empty() {
                lost = rejoined.lost;
            }
            let relinked = rejoined.took;
            // Every key's parts were placed for the old world: forget them all.
            *write(&self.table) = Table::default();
            let path = self.last_checkpoint();
            let reloaded = match &path {
                Some(p) => self.load_here(p),
                None => Ok(()),
            };
            match reloaded {
                Ok(()) => {
                    return Err(Error::WorldChanged {
                        op,
                        lost,
                        world: self.num_workers(),
                        rank: self.rank(),
                        restored: path.map(|p| p.display().to_string()),
                        committed: false,
                        detail: format!(
                            "the survivors found who is left and rebuilt their link in {:.2} s; \
                             the recovery took {:.2} s in all",
                            relinked.as_secs_f64(),
                            start.elapsed().as_secs_f64()
                        ),
                    });
                }
                // Another rank lost while reloading: go round again.
                Err(e) => err = e,
            }
        }
        Err(err)
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
