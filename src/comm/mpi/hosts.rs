//! Every rank's host name, gathered once at setup so that an error about a lost rank names its
//! machine ("rank 1 (host node7)"). A name from another process is never trusted: at most
//! [`HOST_BYTES`] bytes travel, and the receiver keeps only letters, digits, `.`, `-` and `_`
//! (anything else becomes `?`); an empty name reads as "unknown".

use std::os::raw::{c_char, c_int};

use mpi::ffi;

use super::raw;
use crate::Result;

/// The most bytes of a host name that travel (Linux's `HOST_NAME_MAX` is 64).
pub(super) const HOST_BYTES: usize = 64;

/// This machine's host name (`gethostname`), cut to [`HOST_BYTES`].
fn this_host() -> [u8; HOST_BYTES] {
    // Room for a name of HOST_BYTES (Linux's longest) and its 0: glibc refuses a buffer of
    // exactly HOST_BYTES for such a name (ENAMETOOLONG), which made it "unknown".
    let mut buf = [0u8; HOST_BYTES + 1];
    // SAFETY: `buf` is writable for `buf.len()` bytes, the length passed; gethostname writes at
    // most that many.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
    let mut out = [0u8; HOST_BYTES];
    if rc == 0 {
        out.copy_from_slice(&buf[..HOST_BYTES]);
    }
    out
}

/// A received name: up to the first 0, bytes outside `[A-Za-z0-9._-]` as `?`; or "unknown".
pub(super) fn clean(raw: &[u8]) -> String {
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    let name: String = raw[..end.min(HOST_BYTES)]
        .iter()
        .map(|&b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'-' | b'_' => b as char,
            _ => '?',
        })
        .collect();
    if name.is_empty() {
        "unknown".to_owned()
    } else {
        name
    }
}

/// Every rank's host name on `comm`, in rank order (blocking, inside the bounded setup).
pub(super) fn gather(comm: ffi::MPI_Comm, size: usize) -> Result<Vec<String>> {
    let mine = this_host();
    let mut all = vec![0u8; HOST_BYTES * size];
    let (n, dt) = (HOST_BYTES as c_int, raw::datatype::<u8>());
    let (sp, rp) = (raw::ptr(&mine), raw::ptr_mut(&mut all));
    // SAFETY: `mine` holds HOST_BYTES bytes and `all` HOST_BYTES per rank of `comm`, the
    // communicator's size; the call is blocking, so MPI is done with both when it returns.
    let rc = unsafe { ffi::MPI_Allgather(sp, n, dt, rp, n, dt, comm) };
    raw::check("initialise MPI (host names)", rc)?;
    Ok(all.chunks(HOST_BYTES).map(clean).collect())
}

/// "rank 1 (host node7)", or "ranks 1, 3 (hosts node7, node9)": ranks named with their hosts.
pub(super) fn ranks_on_hosts(ranks: &[usize], hosts: &[String]) -> String {
    let host = |r: usize| hosts.get(r).map_or("unknown", String::as_str).to_owned();
    let list = |f: &dyn Fn(usize) -> String| ranks.iter().map(|&r| f(r)).collect::<Vec<_>>();
    match ranks {
        [r] => format!("rank {r} (host {})", host(*r)),
        _ => format!(
            "ranks {} (hosts {})",
            list(&|r| r.to_string()).join(", "),
            list(&host).join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_received_name_is_cut_and_cleaned() {
        assert_eq!(clean(b"node-7.cluster_a\0junk"), "node-7.cluster_a");
        assert_eq!(clean(b"bad name\n\x1b[31m"), "bad?name???31m");
        assert_eq!(clean(b"\0"), "unknown");
        assert_eq!(clean(&[b'x'; 200]).len(), HOST_BYTES);
    }

    /// This machine's name as the kernel has it, even at Linux's longest, 64 bytes (run under
    /// `unshare --uts` with such a name to see it: it once read as "unknown").
    #[test]
    fn this_host_is_the_kernels_name() {
        let want = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        assert_eq!(clean(&this_host()), clean(want.trim().as_bytes()));
    }

    #[test]
    fn ranks_are_named_with_their_hosts() {
        let hosts = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        assert_eq!(ranks_on_hosts(&[1], &hosts), "rank 1 (host b)");
        assert_eq!(ranks_on_hosts(&[0, 2], &hosts), "ranks 0, 2 (hosts a, c)");
        assert_eq!(ranks_on_hosts(&[5], &hosts), "rank 5 (host unknown)");
    }
}
