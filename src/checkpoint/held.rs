//! A checkpoint file's header, checked, as the reader uses it: where each piece's and
//! residual's tensors are, with their checksums. [`Tensors`] is the one check of a tensor
//! against what its entry says.

use std::collections::HashSet;
use std::ops::Range;

use super::bounded;
use super::checksum::Sums;
use super::layout::{st_dtype, KeyMeta};
use super::Problem;
use crate::{DType, Key, KeyKind};

/// One tensor of a file: its bytes' absolute offsets `start..end`, and their checksums.
#[derive(Clone, Debug)]
pub(super) struct Span {
    /// The tensor's name, for errors.
    pub(super) name: String,
    pub(super) start: u64,
    pub(super) end: u64,
    /// The checksum of every chunk of its bytes; `None` in a file of format 1.
    pub(super) sums: Option<Vec<u32>>,
}

/// One key's compression residuals in a file: the key, its length, and one tensor per position.
pub(super) type Saved = (Key, usize, Vec<Span>);

/// One piece as a shard file holds it: where its value and state bytes are.
pub(super) struct Held {
    pub(super) meta: KeyMeta,
    pub(super) range: Range<usize>,
    /// The shard it is in (its rank).
    pub(super) file: usize,
    pub(super) value: Span,
    pub(super) state: Vec<Span>,
}

/// One shard's header, checked: what it holds and where.
pub(crate) struct ShardHeader {
    pub(super) rank: usize,
    /// The CRC-32 of the shard's header bytes (see [`bounded::Header::crc`]).
    pub(super) header_crc: u32,
    /// The token of the save that wrote it; `None` for a shard of format 1.
    pub(super) token: Option<u64>,
    /// The chunk size of its checksums; `None` for a shard of format 1.
    pub(super) chunk: Option<usize>,
    pub(super) kind: Option<KeyKind>,
    pub(super) updater: String,
    pub(super) state_names: Vec<String>,
    pub(super) pieces: Vec<Held>,
    /// The saving rank's compression residuals.
    pub(super) residuals: Vec<Saved>,
}

/// A file's tensors, with their checksums, and which have been claimed so far.
pub(super) struct Tensors<'a> {
    pub header: &'a bounded::Header,
    sums: Option<&'a Sums>,
    claimed: HashSet<String>,
}

impl<'a> Tensors<'a> {
    /// The tensors of `header`, none claimed yet.
    pub(super) fn new(header: &'a bounded::Header, sums: Option<&'a Sums>) -> Tensors<'a> {
        Tensors {
            header,
            sums,
            claimed: HashSet::new(),
        }
    }

    /// Claims tensor `name`, checked to have shape `dims` and `dtype` (any the store has when
    /// `None`): its dtype and span.
    pub(super) fn claim(
        &mut self,
        name: String,
        dtype: Option<DType>,
        dims: &[usize],
    ) -> std::result::Result<(DType, Span), Problem> {
        let info = (self.header.meta.info(&name))
            .ok_or_else(|| Problem::invalid(format!("tensor '{name}' is missing")))?;
        let got = DType::ALL.into_iter().find(|&t| st_dtype(t) == info.dtype);
        let got = got.ok_or_else(|| {
            Problem::invalid(format!(
                "tensor '{name}' has unsupported dtype {:?}",
                info.dtype
            ))
        })?;
        if let Some(want) = dtype.filter(|&d| d != got) {
            return Err(Problem::invalid(format!(
                "tensor '{name}' is {got}, expected {want}"
            )));
        }
        let (s, e) = info.data_offsets;
        // The elements of `dims`, counted against the tensor's bytes before any multiplication.
        let len = dims.iter().product::<usize>() as u64;
        let bytes = bounded::Cursor::new(e.saturating_sub(s) as u64);
        let fits = (bytes.count(len, got.size() as u64, "elements").ok())
            .is_some_and(|n| e.checked_sub(s) == Some(n * got.size()));
        if info.shape != dims || !fits {
            return Err(Problem::invalid(format!(
                "tensor '{name}' has shape {:?} and {} bytes, expected {dims:?} of {got}",
                info.shape,
                e.wrapping_sub(s)
            )));
        }
        let no_sums = || Problem::invalid(format!("tensor '{name}' has no checksums"));
        let sums = (self.sums)
            .map(|all| all.tensors.get(&name).cloned().ok_or_else(no_sums))
            .transpose()?;
        let Range { start, end } = self.header.span(info);
        self.claimed.insert(name.clone());
        let span = Span {
            name,
            start,
            end,
            sums,
        };
        Ok((got, span))
    }

    /// Claims the tensors `names`, each of `dtype` and shape `dims`.
    pub(super) fn claim_each(
        &mut self,
        names: impl IntoIterator<Item = String>,
        dtype: DType,
        dims: &[usize],
    ) -> std::result::Result<Vec<Span>, Problem> {
        (names.into_iter())
            .map(|name| Ok(self.claim(name, Some(dtype), dims)?.1))
            .collect()
    }

    /// Checks that every tensor was claimed: one that was not belongs to no `owner`.
    pub(super) fn all_claimed(&self, owner: &str) -> std::result::Result<(), Problem> {
        match (self.header.meta.tensors().keys()).find(|n| !self.claimed.contains(*n)) {
            Some(extra) => Err(Problem::invalid(format!(
                "tensor '{extra}' belongs to no {owner} in the metadata"
            ))),
            None => Ok(()),
        }
    }
}
