//! Sizes on the command lines of the benches and bench examples: `4096`, `64K`, `16M`, `1G`.

/// A size such as `4096`, `64K`, `16M` or `1G` (binary multiples, either case), in bytes; as a
/// clap value parser, or alone.
pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.as_bytes().last() {
        Some(b'K' | b'k') => (&t[..t.len() - 1], 1usize << 10),
        Some(b'M' | b'm') => (&t[..t.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!(
                "not a size: '{s}'; write bytes, or a number with K, M or G: 4096, 64K, 16M, 1G"
            )
        })
}
