//! Healing a store after a lost rank from what the survivors hold: their own parts, and the
//! copies of the lost ranks' parts that their buddies kept ([`super::copies`]).
//!
//! The survivors pass each other the old world's shards (each its own, and the shard of each
//! lost rank whose copy it keeps), in the checkpoint format, in memory; each writes them into a
//! private directory and loads that checkpoint at the new world size, as a load of a checkpoint
//! saved by another world size does. Every key is placed and cut again for the new size, with
//! its updater state and step; the update counts are the old table's. Every survivor receives
//! every shard (the whole store, once), whatever the new placement keeps of it.

use std::path::PathBuf;

use super::save_load::own_piece;
use super::{read, write, KvStore};
use crate::checkpoint::{self, KeyResiduals, SaveId};
use crate::comm::dist::Buddies;
use crate::comm::fingerprint::Fingerprint;
use crate::{Error, Result};

/// What healing did: the bytes of shards this rank received.
pub(super) struct Healed {
    pub(super) received: usize,
}

impl KvStore {
    /// Rebuilds every key at the new world size after the loss of `lost` (ranks of the old
    /// world, where this rank was `old.0` of `old.1`, with copies kept by `buddies`). Every
    /// survivor calls it; each lost rank's buddy must be a survivor.
    pub(super) fn heal(
        &self,
        (old_rank, old_size): (usize, usize),
        buddies: Buddies,
        lost: &[usize],
    ) -> Result<Healed> {
        let active = read(&self.active).clone();
        let slots = self.slots_in_order();
        let counts: Vec<(crate::Key, (u64, u64))> = (slots.iter())
            .map(|s| {
                (
                    s.key.clone(),
                    *s.updates.lock().unwrap_or_else(|p| p.into_inner()),
                )
            })
            .collect();
        let d = &self.ranks;
        let fp = Fingerprint::new("heal").note(format!(
            "{} keys of a world of {old_size}, lost {lost:?}",
            slots.len()
        ));
        let mut call = d.begin(fp)?;
        // One save's token for every shard, rank 0's.
        let token = call.broadcast_words(vec![getrandom::u64().unwrap_or(0x5eed)], 0)?[0];
        let save = SaveId {
            generation: 0,
            token,
        };
        // The old world's shards this rank holds: its own, and those of the lost ranks whose
        // copies it keeps.
        let mut mine: Vec<(usize, Vec<u8>)> = Vec::new();
        let keeps = lost
            .iter()
            .copied()
            .filter(|&l| buddies.buddy(l) == old_rank);
        for (rank, from_copy) in std::iter::once((old_rank, false)).chain(keeps.map(|l| (l, true)))
        {
            let mut pieces = Vec::new();
            for (order, slot) in slots.iter().enumerate() {
                if !slot.spread.holds(rank) {
                    continue;
                }
                let cell = read(&slot.cell);
                let piece = match from_copy {
                    false => own_piece(slot, &cell, order, rank, old_size, &active)?,
                    true => own_piece(slot, &read(&slot.copy), order, rank, old_size, &active)?,
                };
                pieces.push(piece);
            }
            // A lost rank's compression residuals are lost with it.
            let residuals: Vec<KeyResiduals> = match from_copy {
                true => Vec::new(),
                false => (slots.iter())
                    .filter_map(|s| {
                        let r = super::compress::lock(&s.residuals);
                        KeyResiduals::of(&s.key, s.shape.size(), &r)
                    })
                    .collect(),
            };
            let bytes = checkpoint::shard_bytes(
                save,
                rank,
                old_size,
                &active.updater,
                &pieces,
                &residuals,
            )?;
            mine.push((rank, bytes));
        }
        let shards = exchange(&mut *call, &mine)?;
        let received = shards.iter().map(|(_, b)| b.len()).sum();
        let dir = private_dir(d.rank());
        let reader = (|| {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).map_err(|e| {
                Error::internal(&format!("could not create {}: {e}", dir.display()))
            })?;
            for (rank, bytes) in &shards {
                checkpoint::put_shard(&dir, save, *rank, old_size, bytes)?;
            }
            checkpoint::commit(&dir, save, old_size)?;
            checkpoint::open(&dir)
        })();
        let reader = match reader {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        // Every key was placed for the old world: forget them all, then load them placed for
        // the new one. A heal that fails (another rank lost before its commit point, the last
        // of its collectives) puts the old table back, so that the survivors can heal again.
        let old = std::mem::take(&mut *write(&self.table));
        let (updater, generation) = (active.updater.clone(), active.generation);
        let loaded = self.load_from(&mut *call, &dir, &reader, &updater, generation);
        let _ = std::fs::remove_dir_all(&dir);
        if loaded.is_err() {
            *write(&self.table) = old;
        }
        loaded?;
        let table = read(&self.table);
        for (key, (gen, count)) in counts {
            if let Some(slot) = table.slots.get(&key) {
                slot.set_updates(gen, count);
            }
        }
        Ok(Healed { received })
    }
}

/// Every survivor's shards (rank in the old world, bytes), from each survivor's `mine`.
fn exchange(
    call: &mut dyn crate::comm::link::Round,
    mine: &[(usize, Vec<u8>)],
) -> Result<Vec<(usize, Vec<u8>)>> {
    // Words: the number of shards, then (rank, bytes) per shard, then their bytes, 8 to a word.
    let mut words = vec![mine.len() as u64];
    for (rank, bytes) in mine {
        words.extend([*rank as u64, bytes.len() as u64]);
    }
    for (_, bytes) in mine {
        words.extend(bytes.chunks(8).map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(w)
        }));
    }
    let lens = call.all_gather_words(&[words.len() as u64])?;
    let longest = lens.iter().copied().max().unwrap_or(0) as usize;
    words.resize(longest, 0);
    let all = call.all_gather_words(&words)?;
    let mut shards = Vec::new();
    for from in all.chunks(longest.max(1)) {
        let bad = || Error::internal("a survivor's shards arrived cut short");
        let n = *from.first().ok_or_else(bad)? as usize;
        let heads = from.get(1..1 + 2 * n).ok_or_else(bad)?;
        let mut at = 1 + 2 * n;
        for head in heads.chunks(2) {
            let (rank, len) = (head[0] as usize, head[1] as usize);
            let body = from.get(at..at + len.div_ceil(8)).ok_or_else(bad)?;
            let mut bytes: Vec<u8> = body.iter().flat_map(|w| w.to_le_bytes()).collect();
            bytes.truncate(len);
            shards.push((rank, bytes));
            at += len.div_ceil(8);
        }
    }
    shards.sort_by_key(|(rank, _)| *rank);
    Ok(shards)
}

/// A directory of this process's own for the healed checkpoint.
fn private_dir(rank: usize) -> PathBuf {
    std::env::temp_dir().join(format!(
        "kvstore-heal-{}-{rank}-{}",
        std::process::id(),
        getrandom::u64().unwrap_or(0)
    ))
}
