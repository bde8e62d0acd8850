//! Reading PTX text: comments out, and every `.entry` with its parameter types.
//!
//! Shared by `build.rs` (through `#[path]`), which checks `kernels/**/*.ptx`, and by
//! [`PtxUpdater::new`](crate::PtxUpdater::new), which checks a user's module.

use std::collections::BTreeMap;

/// The parameter types of a user PTX updater's entry (`kvstore::PTX_UPDATER_PARAMS`).
pub(crate) const USER_UPDATER_PARAMS: [&str; 10] = [
    "u64", "u64", "u64", "u64", "u64", "u64", "f32", "f32", "f32", "f32",
];

/// `text` without its `//` and `/* */` comments (a block comment becomes a space).
pub(crate) fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
            out.push(' ');
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// Every `.visible .entry NAME(.param .TYPE name, ...)` of comment-free `text` and its types;
/// an error for an entry not `.visible`, an unreadable parameter list, or a name twice.
pub(crate) fn entries(text: &str) -> Result<BTreeMap<String, Vec<String>>, String> {
    let mut entries = BTreeMap::new();
    let mut rest = text;
    while let Some(i) = rest.find(".entry") {
        let decl = &rest[i + ".entry".len()..];
        let open = decl.find('(').ok_or("`.entry` without a parameter list")?;
        let close = decl.find(')').ok_or("`.entry` parameter list not closed")?;
        let name = decl[..open].trim().to_owned();
        if !rest[..i].trim_end().ends_with(".visible") {
            return Err(format!("entry {name} is not `.visible`"));
        }
        let mut types = Vec::new();
        for param in decl[open + 1..close].split(',').map(str::trim) {
            if param.is_empty() {
                continue;
            }
            // `.param .u64 table`: the second word is the type.
            let words: Vec<&str> = param.split_whitespace().collect();
            match words.as_slice() {
                [".param", ty, _name] if ty.starts_with('.') => types.push(ty[1..].to_owned()),
                _ => return Err(format!("entry {name}: cannot read parameter `{param}`")),
            }
        }
        if entries.insert(name.clone(), types).is_some() {
            return Err(format!("entry {name} is defined twice"));
        }
        rest = &decl[close..];
    }
    Ok(entries)
}

/// NN of the module's `.target sm_NN` (also `sm_90a`); `None` without a readable `.target`.
pub(crate) fn target(text: &str) -> Option<u32> {
    let text = strip_comments(text);
    let (_, rest) = text.split_once(".target")?;
    let word = rest.split_whitespace().next()?;
    let digits = word.strip_prefix("sm_")?.trim_end_matches([',', 'a', 'f']);
    digits.parse().ok()
}
