//! The text of a shard's `piece/<key>` and `residuals/<key>` entries: JSON objects, or in
//! earlier formats `name=value` fields, read into the same structs; the reader checks what
//! the fields say once, on the structs.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::layout::count_of;

/// How a shard spells its entries: by its format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Spelling {
    /// A JSON object (shards of format 3).
    Json,
    /// `name=value` fields separated by single spaces (shards of formats 1 and 2).
    Fields,
}

/// A `piece/<key>` entry: the element range `start..end` the shard holds, and the whole key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PieceSpec {
    /// The key's place in update order.
    pub order: usize,
    /// The first element of the range.
    pub start: usize,
    /// One past the last element of the range.
    pub end: usize,
    /// The whole key's dims (empty for a scalar).
    pub dims: Vec<usize>,
    /// The updater's step count, present exactly when the key has updater state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// Whether the key is row-sparse (left out for a dense key).
    #[serde(default, skip_serializing_if = "is_false")]
    pub sparse: bool,
}

/// A `residuals/<key>` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ResidualSpec {
    /// The number of `residual/<key>/<i>` tensors.
    pub count: u64,
    /// The elements of each: the whole key's.
    pub len: usize,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `spec` as this version writes it: a JSON object.
pub(super) fn to_json<T: Serialize>(spec: &T) -> Result<String, String> {
    serde_json::to_string(spec).map_err(|e| format!("cannot write the entry: {e}"))
}

impl PieceSpec {
    /// A `piece/` entry spelled `spelling`; the error says why it is not one.
    pub(super) fn parse(text: &str, spelling: Spelling) -> Result<PieceSpec, String> {
        match spelling {
            Spelling::Json => serde_json::from_str(text).map_err(|e| e.to_string()),
            Spelling::Fields => piece_of_fields(text),
        }
    }
}

impl ResidualSpec {
    /// A `residuals/` entry spelled `spelling`, if it is one.
    pub(super) fn parse(text: &str, spelling: Spelling) -> Option<ResidualSpec> {
        match spelling {
            Spelling::Json => serde_json::from_str(text).ok(),
            Spelling::Fields => residuals_of_fields(text),
        }
    }
}

/// A piece's `order=<o> start=<a> end=<b> dims=<d0>,<d1>,... step=<s> sparse=1` fields.
fn piece_of_fields(text: &str) -> Result<PieceSpec, String> {
    let mut fields: HashMap<&str, &str> = HashMap::new();
    for field in text.split(' ') {
        let (name, value) = field.split_once('=').ok_or("not name=value")?;
        if fields.insert(name, value).is_some() {
            return Err("a field is given twice".to_owned());
        }
    }
    if let Some(f) =
        (fields.keys()).find(|f| !["order", "start", "end", "dims", "step", "sparse"].contains(f))
    {
        return Err(format!("unknown field {f}"));
    }
    let count = |name: &str| -> Result<usize, String> {
        let text = fields.get(name).ok_or_else(|| format!("no {name}"))?;
        count_of(text).ok_or_else(|| format!("{name} is not a count"))
    };
    let dims = match *fields.get("dims").ok_or("no dims")? {
        "" => Vec::new(),
        text => (text.split(',').map(count_of))
            .collect::<Option<Vec<usize>>>()
            .ok_or("dims are not counts")?,
    };
    let step = fields
        .get("step")
        .map(|t| count_of(t).ok_or("step is not a count"));
    let sparse = match fields.get("sparse") {
        None => false,
        Some(&"1") => true,
        Some(_) => return Err("sparse is not 1".to_owned()),
    };
    Ok(PieceSpec {
        order: count("order")?,
        start: count("start")?,
        end: count("end")?,
        dims,
        step: step.transpose()?,
        sparse,
    })
}

/// Residuals' `count=<c> len=<n>` fields.
fn residuals_of_fields(text: &str) -> Option<ResidualSpec> {
    let (count, len) = text.split_once(' ')?;
    Some(ResidualSpec {
        count: count_of(count.strip_prefix("count=")?)?,
        len: count_of(len.strip_prefix("len=")?)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both spellings of one piece read as the same struct, and JSON writes back what it read.
    #[test]
    fn both_spellings_read_alike() {
        let want = PieceSpec {
            order: 3,
            start: 10,
            end: 250,
            dims: vec![20, 30],
            step: Some(7),
            sparse: true,
        };
        let fields = "order=3 start=10 end=250 dims=20,30 step=7 sparse=1";
        assert_eq!(PieceSpec::parse(fields, Spelling::Fields), Ok(want.clone()));
        let json = to_json(&want).unwrap();
        assert_eq!(PieceSpec::parse(&json, Spelling::Json), Ok(want));
        let dense = "{\"order\":0,\"start\":0,\"end\":0,\"dims\":[]}";
        let got = PieceSpec::parse(dense, Spelling::Json).unwrap();
        assert_eq!((got.step, got.sparse, got.dims.len()), (None, false, 0));
        assert_eq!(to_json(&got).unwrap(), dense);
        let r = ResidualSpec { count: 2, len: 9 };
        assert_eq!(
            ResidualSpec::parse("count=2 len=9", Spelling::Fields),
            Some(r.clone())
        );
        assert_eq!(
            ResidualSpec::parse(&to_json(&r).unwrap(), Spelling::Json),
            Some(r)
        );
    }

    /// What is not a spec in either spelling is an error, never a guess.
    #[test]
    fn malformed_specs_are_refused() {
        for text in [
            "order=1 start=0 end=1",
            "order=1 start=0 end=1 dims=1 order=1",
            "order=01 start=0 end=1 dims=1",
            "order=1 start=0 end=1 dims=1 sparse=2",
            "order=1 start=0 end=1 dims=1 colour=red",
            "order=1  start=0 end=1 dims=1",
        ] {
            assert!(PieceSpec::parse(text, Spelling::Fields).is_err(), "{text}");
        }
        for text in [
            "{\"order\":1,\"start\":0,\"end\":1}",
            "{\"order\":1,\"start\":0,\"end\":1,\"dims\":[1],\"colour\":1}",
            "{\"order\":1,\"order\":1,\"start\":0,\"end\":1,\"dims\":[1]}",
            "{\"order\":-1,\"start\":0,\"end\":1,\"dims\":[1]}",
            "{\"order\":1.5,\"start\":0,\"end\":1,\"dims\":[1]}",
            "order=1 start=0 end=1 dims=1",
        ] {
            assert!(PieceSpec::parse(text, Spelling::Json).is_err(), "{text}");
        }
        for text in [
            "count=1",
            "count=1 len=01",
            "len=1 count=1",
            "{\"count\":1}",
        ] {
            assert_eq!(ResidualSpec::parse(text, Spelling::Fields), None, "{text}");
            assert_eq!(ResidualSpec::parse(text, Spelling::Json), None, "{text}");
        }
    }
}
