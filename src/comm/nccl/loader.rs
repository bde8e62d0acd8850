//! Finding and loading NCCL ourselves: cudarc opens NCCL only as `libnccl.so`, but the distros
//! and pip's `nvidia-nccl-cu12`/`-cu13` ship only `libnccl.so.2`, so a `nccl` store would
//! quietly fall back to peer copies. This module tries each of [`candidates`] until one loads,
//! and resolves the functions kvstore calls into a table ([`Nccl`]); cudarc's NCCL loader is
//! never used.
//!
//! The search, in order:
//! 1. `KVSTORE_NCCL_LIB`: a path to the library file.
//! 2. Every folder of `LD_LIBRARY_PATH`: `libnccl.so`, then `libnccl.so.2`.
//! 3. pip's `nvidia/nccl/lib/libnccl.so.2` under the site-packages of: the running Python
//!    (when this process is one), `VIRTUAL_ENV`, `CONDA_PREFIX`, the `python3` first on
//!    `PATH`, `~/.local`, and every `PYTHONPATH` entry.
//! 4. The usual system folders (`SYSTEM_DIRS`: `/usr/lib64`, `/usr/local/cuda/lib64`, ...).
//! 5. The dynamic loader's own search by name (`ld.so.cache`): `libnccl.so.2`, `libnccl.so`.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, OsString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// An NCCL communicator handle.
pub type Comm = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [c_char; 128]);

/// `ncclConfig_t` as NCCL 2.14 (the first with it) laid it out; later versions only append
/// fields, and read `size` and `version` to know how much the caller has. Made only by
/// [`Config::new`].
#[repr(C)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    /// 0: calls return `ncclInProgress` instead of blocking.
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` (every field undefined or null: NCCL's defaults) with
    /// `blocking` set.
    pub fn new(blocking: bool) -> Config {
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 2 * 10000 + 14 * 100,
            blocking: c_int::from(blocking),
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
        }
    }
}

/// `ncclSuccess`.
pub const SUCCESS: c_int = 0;
/// `ncclInProgress`: a non-blocking call is still running.
pub const IN_PROGRESS: c_int = 7;

type R = c_int;
/// A device buffer a collective reads.
type Src = *const c_void;
/// A device buffer a collective writes.
type Dst = *mut c_void;
/// A `cudaStream_t`.
type Stream = *mut c_void;

/// The NCCL functions kvstore calls, resolved from one library (each field is the NCCL
/// function of its name: `group_start` is `ncclGroupStart`).
pub struct Nccl {
    /// The file that was loaded.
    pub path: PathBuf,
    /// The version code (e.g. 23007 for 2.30.7).
    pub version: i32,
    _lib: libloading::Library,
    pub(crate) get_error_string: unsafe extern "C" fn(R) -> *const c_char,
    /// Missing before 2.13.
    pub(crate) get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> R,
    /// Missing before 2.14.
    pub(crate) comm_init_rank_config:
        Option<unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> R>,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(Comm, *mut R) -> R,
    pub(crate) comm_abort: unsafe extern "C" fn(Comm) -> R,
    /// Missing before 2.14.
    pub(crate) comm_finalize: Option<unsafe extern "C" fn(Comm) -> R>,
    pub(crate) comm_destroy: unsafe extern "C" fn(Comm) -> R,
    pub(crate) group_start: unsafe extern "C" fn() -> R,
    pub(crate) group_end: unsafe extern "C" fn() -> R,
    /// (send, recv, count, datatype, op, root, comm, stream).
    pub(crate) reduce:
        unsafe extern "C" fn(Src, Dst, usize, c_int, c_int, c_int, Comm, Stream) -> R,
    /// (send, recv, count, datatype, root, comm, stream).
    pub(crate) broadcast: unsafe extern "C" fn(Src, Dst, usize, c_int, c_int, Comm, Stream) -> R,
    /// (send, recv, recvcount, datatype, op, comm, stream).
    pub(crate) reduce_scatter:
        unsafe extern "C" fn(Src, Dst, usize, c_int, c_int, Comm, Stream) -> R,
    /// (send, recv, sendcount, datatype, comm, stream).
    pub(crate) all_gather: unsafe extern "C" fn(Src, Dst, usize, c_int, Comm, Stream) -> R,
    /// (send, count, datatype, peer, comm, stream).
    pub(crate) send: unsafe extern "C" fn(Src, usize, c_int, c_int, Comm, Stream) -> R,
    /// (recv, count, datatype, peer, comm, stream).
    pub(crate) recv: unsafe extern "C" fn(Dst, usize, c_int, c_int, Comm, Stream) -> R,
}

// SAFETY: the table holds function pointers into a library that stays loaded for the process
// (`_lib` is never dropped: the table lives in a `static`); NCCL's functions may be called
// from any thread.
unsafe impl Send for Nccl {}
// SAFETY: as above; the table is never written after it is built.
unsafe impl Sync for Nccl {}

impl Nccl {
    /// Opens `path` and resolves the functions; an error names what is missing.
    fn open(path: &Path) -> Result<Nccl, String> {
        // SAFETY: loading NCCL runs its initializers, which have no preconditions.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        // `get!(name)?` for a function kvstore needs, `get!(name).ok()` for an optional one.
        macro_rules! get {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's function of this name, whose C signature is the
                // field's type (nccl.h).
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map(|s| *s)
                    .map_err(|e| format!("no {} in it ({e})", $name))
            };
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> R = get!("ncclGetVersion")?;
        let mut version = 0;
        // SAFETY: a valid out-pointer.
        let r = unsafe { get_version(&mut version) };
        if r != SUCCESS {
            return Err(format!("ncclGetVersion failed ({r})"));
        }
        Ok(Nccl {
            path: path.to_owned(),
            version,
            get_error_string: get!("ncclGetErrorString")?,
            get_last_error: get!("ncclGetLastError").ok(),
            get_unique_id: get!("ncclGetUniqueId")?,
            comm_init_rank_config: get!("ncclCommInitRankConfig").ok(),
            comm_get_async_error: get!("ncclCommGetAsyncError")?,
            comm_abort: get!("ncclCommAbort")?,
            comm_finalize: get!("ncclCommFinalize").ok(),
            comm_destroy: get!("ncclCommDestroy")?,
            group_start: get!("ncclGroupStart")?,
            group_end: get!("ncclGroupEnd")?,
            reduce: get!("ncclReduce")?,
            broadcast: get!("ncclBroadcast")?,
            reduce_scatter: get!("ncclReduceScatter")?,
            all_gather: get!("ncclAllGather")?,
            send: get!("ncclSend")?,
            recv: get!("ncclRecv")?,
            _lib: lib,
        })
    }

    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }
}

/// A version code as `major.minor.patch` (codes since 2.9 are `major*10000 + minor*100 + patch`).
pub fn version_string(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

/// The oldest NCCL kvstore uses: 2.14 brought non-blocking communicators.
pub const MIN_VERSION: i32 = 21400;

/// Why no usable NCCL was found: what was tried, for a message that says how to fix it.
#[derive(Debug, Clone)]
pub struct NotFound {
    /// Each candidate tried and why it did not do (an empty list: none exists).
    pub tried: Vec<(String, String)>,
}

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.tried.is_empty() {
            write!(
                f,
                "no libnccl.so or libnccl.so.2 was found (looked in KVSTORE_NCCL_LIB, \
                 LD_LIBRARY_PATH, pip's nvidia/nccl/lib under the Python site-packages, the \
                 system library folders and the loader's cache)"
            )?;
        } else {
            write!(f, "no usable NCCL: ")?;
            for (i, (what, why)) in self.tried.iter().enumerate() {
                write!(f, "{}{what}: {why}", if i > 0 { "; " } else { "" })?;
            }
        }
        write!(
            f,
            ". Install NCCL >= 2.14 (`pip install nvidia-nccl-cu12`, or the distro's libnccl2), \
             or set KVSTORE_NCCL_LIB=/path/to/libnccl.so.2"
        )
    }
}

/// The process's NCCL, found and loaded on first use (see the module docs).
pub fn library() -> Result<&'static Nccl, &'static NotFound> {
    static LIB: OnceLock<Result<Nccl, NotFound>> = OnceLock::new();
    LIB.get_or_init(|| load(&candidates(&SearchEnv::from_process())))
        .as_ref()
}

/// Tries each candidate in order; the first that loads, with NCCL >= [`MIN_VERSION`], wins.
fn load(candidates: &[Candidate]) -> Result<Nccl, NotFound> {
    let mut tried = Vec::new();
    for c in candidates {
        let (what, path) = match c {
            Candidate::Path(p) => (p.display().to_string(), p.clone()),
            Candidate::Name(n) => (format!("{n} (by the loader's search)"), PathBuf::from(n)),
        };
        match Nccl::open(&path) {
            Ok(lib) if lib.version >= MIN_VERSION => return Ok(lib),
            Ok(lib) => tried.push((
                what,
                format!(
                    "NCCL {} is older than 2.14 (non-blocking communicators)",
                    lib.version_string()
                ),
            )),
            // A name the loader does not find is not worth reporting.
            Err(_) if matches!(c, Candidate::Name(_)) => {}
            Err(e) => tried.push((what, e)),
        }
    }
    Err(NotFound { tried })
}

/// One place to try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Candidate {
    /// A file that exists.
    Path(PathBuf),
    /// A name for the dynamic loader's own search.
    Name(&'static str),
}

/// What the search reads from the process: environment variables, the running executable,
/// the home folder and the system folders (tests pass fake ones).
#[derive(Debug, Default, Clone)]
pub struct SearchEnv {
    /// Environment variables (only those the search reads matter).
    pub vars: HashMap<String, OsString>,
    /// The running executable (`/proc/self/exe`), to find the running Python's prefix.
    pub exe: Option<PathBuf>,
    /// System library folders, in order.
    pub system_dirs: Vec<PathBuf>,
}

/// The system folders searched, in order (step 4).
const SYSTEM_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
    "/usr/local/nccl/lib",
    "/opt/nccl/lib",
];

impl SearchEnv {
    /// This process's environment.
    pub fn from_process() -> SearchEnv {
        let keys = [
            "KVSTORE_NCCL_LIB",
            "LD_LIBRARY_PATH",
            "VIRTUAL_ENV",
            "CONDA_PREFIX",
            "PATH",
            "HOME",
            "PYTHONPATH",
        ];
        SearchEnv {
            vars: keys
                .iter()
                .filter_map(|k| std::env::var_os(k).map(|v| (k.to_string(), v)))
                .collect(),
            exe: std::fs::read_link("/proc/self/exe").ok(),
            system_dirs: SYSTEM_DIRS.iter().map(PathBuf::from).collect(),
        }
    }

    fn var(&self, k: &str) -> Option<&OsString> {
        self.vars.get(k).filter(|v| !v.is_empty())
    }

    fn paths(&self, k: &str) -> Vec<PathBuf> {
        self.var(k)
            .map(|v| {
                std::env::split_paths(v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The Python prefixes whose site-packages may hold pip's NCCL, in search order.
fn python_prefixes(env: &SearchEnv) -> Vec<PathBuf> {
    let mut out = Vec::new();
    // The running Python, when this process is one: <prefix>/bin/python3.x.
    if let Some(exe) = &env.exe {
        let is_python = exe
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("python"));
        if let (true, Some(prefix)) = (is_python, exe.parent().and_then(Path::parent)) {
            out.push(prefix.to_owned());
        }
    }
    for k in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = env.var(k) {
            out.push(PathBuf::from(v));
        }
    }
    // The first python3 on PATH: <prefix>/bin/python3.
    if let Some(prefix) = env
        .paths("PATH")
        .into_iter()
        .find(|d| d.join("python3").is_file())
        .and_then(|d| d.parent().map(Path::to_owned))
    {
        out.push(prefix);
    }
    if let Some(home) = env.var("HOME") {
        out.push(Path::new(home).join(".local"));
    }
    out
}

/// The site-packages folders under a Python prefix: `lib/python3*/{site,dist}-packages`,
/// `local/lib/python3*/dist-packages`, and Debian's `lib/python3/dist-packages`.
fn site_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in [prefix.join("lib"), prefix.join("local/lib")] {
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            out.push(py.join("site-packages"));
            out.push(py.join("dist-packages"));
        }
    }
    out
}

/// Every place to try, in the order of the module docs; paths only where a file exists.
pub fn candidates(env: &SearchEnv) -> Vec<Candidate> {
    let mut paths: Vec<PathBuf> = Vec::new();
    if let Some(p) = env.var("KVSTORE_NCCL_LIB") {
        // Kept even when missing, so the error names it.
        paths.push(PathBuf::from(p));
    }
    let mut files = Vec::new();
    for d in env.paths("LD_LIBRARY_PATH") {
        files.push(d.join("libnccl.so"));
        files.push(d.join("libnccl.so.2"));
    }
    let mut sites: Vec<PathBuf> = python_prefixes(env)
        .iter()
        .flat_map(|p| site_dirs(p))
        .collect();
    sites.extend(env.paths("PYTHONPATH"));
    for s in sites {
        files.push(s.join("nvidia/nccl/lib/libnccl.so.2"));
    }
    for d in &env.system_dirs {
        files.push(d.join("libnccl.so.2"));
        files.push(d.join("libnccl.so"));
    }
    paths.extend(files.into_iter().filter(|f| f.is_file()));
    let mut seen = std::collections::HashSet::new();
    paths.retain(|p| seen.insert(p.clone()));
    let mut out: Vec<Candidate> = paths.into_iter().map(Candidate::Path).collect();
    out.push(Candidate::Name("libnccl.so.2"));
    out.push(Candidate::Name("libnccl.so"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the system temp dir, removed on drop.
    struct Tmp(PathBuf);
    impl Tmp {
        fn new() -> Tmp {
            let p = std::env::temp_dir().join(format!(
                "kvstore-nccl-search-{}-{}",
                std::process::id(),
                rand::random::<u64>()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Tmp(p)
        }
        fn file(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"not really a library").unwrap();
            p
        }
    }
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn env(t: &Tmp, vars: &[(&str, String)]) -> SearchEnv {
        SearchEnv {
            vars: vars
                .iter()
                .map(|(k, v)| (k.to_string(), OsString::from(v)))
                .collect(),
            exe: None,
            system_dirs: vec![t.0.join("sys/lib64"), t.0.join("sys/lib")],
        }
    }

    fn paths(c: &[Candidate]) -> Vec<PathBuf> {
        c.iter()
            .filter_map(|c| match c {
                Candidate::Path(p) => Some(p.clone()),
                Candidate::Name(_) => None,
            })
            .collect()
    }

    #[test]
    fn nothing_there_leaves_only_the_loader_names() {
        let t = Tmp::new();
        let c = candidates(&env(&t, &[]));
        assert_eq!(
            c,
            vec![
                Candidate::Name("libnccl.so.2"),
                Candidate::Name("libnccl.so")
            ]
        );
    }

    #[test]
    fn pip_nccl_in_a_virtualenv_is_found() {
        let t = Tmp::new();
        let lib = t.file("venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        // A different Python's site-packages without NCCL is passed over.
        t.file("venv/lib/python3.10/site-packages/other/x.py");
        let c = candidates(&env(
            &t,
            &[("VIRTUAL_ENV", t.0.join("venv").display().to_string())],
        ));
        assert_eq!(paths(&c), vec![lib]);
    }

    #[test]
    fn the_running_python_and_the_one_on_path_are_searched() {
        let t = Tmp::new();
        let running = t.file("py/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        t.file("py/bin/python3.12");
        let on_path = t.file("usr/local/lib/python3.9/dist-packages/nvidia/nccl/lib/libnccl.so.2");
        t.file("usr/bin/python3");
        let mut e = env(
            &t,
            &[(
                "PATH",
                format!("/nonexistent:{}", t.0.join("usr/bin").display()),
            )],
        );
        e.exe = Some(t.0.join("py/bin/python3.12"));
        assert_eq!(paths(&candidates(&e)), vec![running, on_path]);
    }

    #[test]
    fn order_is_env_then_ld_library_path_then_pip_then_system() {
        let t = Tmp::new();
        let sys = t.file("sys/lib/libnccl.so.2");
        let sys64 = t.file("sys/lib64/libnccl.so");
        let pip = t.file("home/.local/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let ld2 = t.file("ld/libnccl.so.2");
        let ld = t.file("ld/libnccl.so");
        let pp = t.file("pp/nvidia/nccl/lib/libnccl.so.2");
        let explicit = t.0.join("missing/libnccl.so.2");
        let e = env(
            &t,
            &[
                ("KVSTORE_NCCL_LIB", explicit.display().to_string()),
                ("LD_LIBRARY_PATH", format!("{}:", t.0.join("ld").display())),
                ("HOME", t.0.join("home").display().to_string()),
                ("PYTHONPATH", t.0.join("pp").display().to_string()),
            ],
        );
        let c = candidates(&e);
        assert_eq!(paths(&c), vec![explicit, ld, ld2, pip, pp, sys64, sys]);
        assert_eq!(c.last(), Some(&Candidate::Name("libnccl.so")));
    }

    /// A file that is not a library is reported with the loader's reason, and the message
    /// says how to fix it.
    #[test]
    fn a_broken_candidate_is_reported() {
        let t = Tmp::new();
        let bad = t.file("ld/libnccl.so.2");
        let e = env(
            &t,
            &[("LD_LIBRARY_PATH", t.0.join("ld").display().to_string())],
        );
        let c: Vec<Candidate> = candidates(&e)
            .into_iter()
            .filter(|c| matches!(c, Candidate::Path(_)))
            .collect();
        let err = load(&c).err().expect("not a library");
        assert_eq!(err.tried.len(), 1);
        assert_eq!(err.tried[0].0, bad.display().to_string());
        let msg = err.to_string();
        assert!(
            msg.contains("KVSTORE_NCCL_LIB") && msg.contains("pip install"),
            "{msg}"
        );
        assert!(NotFound { tried: vec![] }
            .to_string()
            .contains("no libnccl.so"));
    }

    /// With `KVSTORE_NCCL_LIB` naming a real NCCL (pip's `libnccl.so.2` loads without a GPU),
    /// it is the one loaded, and its functions resolve.
    #[test]
    fn an_explicit_library_is_loaded() {
        let Some(want) = std::env::var_os("KVSTORE_NCCL_LIB") else {
            println!("SKIPPED: an_explicit_library_is_loaded: KVSTORE_NCCL_LIB is not set");
            return;
        };
        let lib = library().expect("KVSTORE_NCCL_LIB names a usable NCCL");
        assert_eq!(lib.path, PathBuf::from(want));
        assert!(lib.version >= MIN_VERSION, "{}", lib.version_string());
        assert!(lib.comm_init_rank_config.is_some() && lib.comm_finalize.is_some());
        println!(
            "loaded NCCL {} from {}",
            lib.version_string(),
            lib.path.display()
        );
    }

    #[test]
    fn version_codes_read_as_versions() {
        assert_eq!(version_string(23007), "2.30.7");
        assert_eq!(version_string(21403), "2.14.3");
    }
}
