//! Crash-safe file replacement: write a temporary file, flush it, rename it over the target,
//! flush the directory.

use std::cell::Cell;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    /// Test hook: fail the next checkpoint writes of this thread after this many bytes.
    static FAIL_AFTER: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Makes every checkpoint save on the calling thread fail with an I/O error after writing
/// `bytes` bytes of the temporary file (`None` turns this off). For tests of interrupted saves.
#[cfg(feature = "test-util")]
pub fn fail_writes_after(bytes: Option<u64>) {
    FAIL_AFTER.with(|f| f.set(bytes));
}

/// Writes `bytes` to a temporary file next to `path`, flushes it, renames it over `path` and
/// flushes the directory. The temporary file is removed on error.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file_name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = write_file(&tmp, bytes).and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(&dir)
}

fn write_file(tmp: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = OpenOptions::new().write(true).create_new(true).open(tmp)?;
    let limit = FAIL_AFTER.with(Cell::get);
    for (i, chunk) in bytes.chunks(1 << 16).enumerate() {
        let offset = (i << 16) as u64;
        if let Some(limit) = limit.filter(|&l| offset + chunk.len() as u64 > l) {
            file.write_all(&chunk[..(limit - offset.min(limit)) as usize])?;
            return Err(io::Error::other("injected write failure (test hook)"));
        }
        file.write_all(chunk)?;
    }
    file.sync_all()
}

#[cfg(unix)]
pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
pub(super) fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}
