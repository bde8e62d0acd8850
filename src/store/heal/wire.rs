//! A piece of a key as words, as a heal sends it: its elements and its updater state.
//!
//! Words: a flag (1: with state), the step, the number of state buffers, then the value and
//! each state buffer, each as its dtype's number, its length and its little-endian bytes
//! padded to whole words. The receiver checks every length against what it expects, so a
//! piece cut short or of the wrong kind is an error, never a panic.

use crate::backend::HostState;
use crate::host::{from_le_bytes, to_le_bytes, HostData};
use crate::{DType, Error, Result};

/// Elements of a key, with their updater state where they have one.
pub(in crate::store) struct Piece {
    pub value: HostData,
    pub state: Option<HostState>,
}

impl Piece {
    /// Elements `range` of `value` and of each state buffer (all of one length).
    pub(super) fn cut(
        value: &HostData,
        state: Option<&HostState>,
        range: std::ops::Range<usize>,
    ) -> Piece {
        Piece {
            value: value.slice_of(range.clone()),
            state: state.map(|(step, bufs)| {
                (
                    *step,
                    bufs.iter().map(|b| b.slice_of(range.clone())).collect(),
                )
            }),
        }
    }

    /// Appends this piece's words to `out`.
    pub(in crate::store) fn encode(&self, out: &mut Vec<u64>) {
        let (flag, step, bufs) = match &self.state {
            Some((step, bufs)) => (1, *step, bufs.as_slice()),
            None => (0, 0, &[][..]),
        };
        out.extend([flag, step, bufs.len() as u64]);
        for data in std::iter::once(&self.value).chain(bufs) {
            let code = DType::ALL
                .iter()
                .position(|&d| d == data.dtype())
                .unwrap_or(0);
            out.extend([code as u64, data.len() as u64]);
            out.extend(to_le_bytes(data).chunks(8).map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(w)
            }));
        }
    }

    /// The piece at `words[*at..]`, of `len` elements of `dtype` (state buffers of `len`
    /// elements too); moves `at` past it.
    pub(in crate::store) fn decode(
        words: &[u64],
        at: &mut usize,
        dtype: DType,
        len: usize,
    ) -> Result<Piece> {
        let [flag, step, bufs] = take::<3>(words, at)?;
        if flag > 1 || bufs > 64 {
            return Err(cut_short());
        }
        let value = data(words, at, len)?;
        if value.dtype() != dtype {
            return Err(Error::internal("a piece of a key arrived in another dtype"));
        }
        let state = match flag {
            1 => Some((
                step,
                (0..bufs)
                    .map(|_| data(words, at, len))
                    .collect::<Result<_>>()?,
            )),
            _ => None,
        };
        Ok(Piece { value, state })
    }
}

/// The next `N` words.
fn take<const N: usize>(words: &[u64], at: &mut usize) -> Result<[u64; N]> {
    let got = words.get(*at..at.saturating_add(N)).ok_or_else(cut_short)?;
    *at += N;
    got.try_into().map_err(|_| cut_short())
}

/// The next buffer, of `len` elements.
fn data(words: &[u64], at: &mut usize, len: usize) -> Result<HostData> {
    let [code, n] = take::<2>(words, at)?;
    let dtype = *DType::ALL.get(code as usize).ok_or_else(cut_short)?;
    if n != len as u64 {
        return Err(Error::internal(
            "a piece of a key arrived of another length",
        ));
    }
    let bytes = len.checked_mul(dtype.size()).ok_or_else(cut_short)?;
    let body = words
        .get(*at..at.saturating_add(bytes.div_ceil(8)))
        .ok_or_else(cut_short)?;
    *at += body.len();
    let raw: Vec<u8> = body
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take(bytes)
        .collect();
    Ok(from_le_bytes(dtype, &raw))
}

fn cut_short() -> Error {
    Error::internal("a piece of a key arrived cut short")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_comes_back_as_it_went_and_a_cut_one_is_an_error() {
        let value = HostData::F16(
            (0..7)
                .map(|i| half::f16::from_f32(i as f32 - 2.5))
                .collect(),
        );
        let bufs = vec![
            HostData::F32(vec![1.5; 7]),
            HostData::F32((0..7).map(|i| i as f32).collect()),
        ];
        let whole = Piece {
            value: value.clone(),
            state: Some((9, bufs)),
        };
        let piece = Piece::cut(&whole.value, whole.state.as_ref(), 2..5);
        let bare = Piece {
            value: HostData::F64(vec![-1.0, 2.0]),
            state: None,
        };
        let mut words = Vec::new();
        piece.encode(&mut words);
        bare.encode(&mut words);
        let mut at = 0;
        let got = Piece::decode(&words, &mut at, DType::F16, 3).unwrap();
        assert_eq!(got.value, value.slice_of(2..5));
        let (step, bufs) = got.state.unwrap();
        assert_eq!((step, bufs[1].to_vec::<f32>()), (9, vec![2.0, 3.0, 4.0]));
        let got = Piece::decode(&words, &mut at, DType::F64, 2).unwrap();
        assert_eq!(
            (got.value.to_vec::<f64>(), got.state.is_none()),
            (vec![-1.0, 2.0], true)
        );
        assert_eq!(at, words.len());
        for cut in 0..words.len() {
            let mut at = 0;
            let first = Piece::decode(&words[..cut], &mut at, DType::F16, 3);
            let second = first.and_then(|_| Piece::decode(&words[..cut], &mut at, DType::F64, 2));
            assert!(second.is_err(), "cut at {cut}");
        }
        assert!(Piece::decode(&words, &mut 0, DType::F16, 4).is_err());
        assert!(Piece::decode(&words, &mut 0, DType::F32, 3).is_err());
    }
}
