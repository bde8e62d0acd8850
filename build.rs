//! Checks the hand-written PTX in `kernels/` before anything can launch it.
//!
//! 1. Every entry `src/backend/cuda/kernels.rs` launches, `fused_<rule>_<dtype>`, must exist in
//!    `kernels/fused_<dtype>.ptx` with exactly the ABI's parameter list ([`RULE_PARAMS`]), and
//!    the ABI's 1-D grid: the fused kernels find their tensor from `%ctaid.x` and the block
//!    starts in the table, so no file may read `%ctaid.y` or `%nctaid` (the old 2-D grid).
//! 2. Every `kernels/*.ptx` is assembled with `ptxas` (env `PTXAS`, else `ptxas` on `PATH`) for
//!    each of sm_70, sm_80 and sm_90 that its `.target` allows; the cubins go to `OUT_DIR` and are
//!    only a check (the crate embeds the PTX text and the driver compiles it). A ptxas error fails
//!    the build; no ptxas at all is a warning.
//! 3. The example user updaters in `kernels/user/*.ptx` must declare the user-updater parameter
//!    list, and are assembled the same way.

use std::collections::BTreeMap;
use std::env;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "src/ptx_text.rs"]
mod ptx_text;

/// The kernel parameters every entry starts with: table, ntensors, chunk.
const COMMON_PARAMS: &[&str] = &["u64", "u32", "u32"];

/// The ABI, keyed by rule: the PTX types of the parameters of `fused_<rule>_<dtype>`.
const RULE_PARAMS: &[(&str, &[&str])] = &[
    ("assign", &["u64", "u32", "u32"]),
    ("axpby", &["u64", "u32", "u32", "f32", "f32"]),
    ("sgd", &["u64", "u32", "u32", "f32", "f32", "f32", "f32"]),
    (
        "sgd_mom",
        &["u64", "u32", "u32", "f32", "f32", "f32", "f32", "f32"],
    ),
    (
        "adam",
        &[
            "u64", "u32", "u32", "f32", "f32", "f32", "f32", "f32", "f32",
        ],
    ),
];

/// Element types with kernels; `fused_<rule>_<dtype>` lives in `kernels/fused_<dtype>.ptx`.
const DTYPES: &[&str] = &["f32", "f16", "bf16"];

/// The architectures each file is assembled for, where its `.target` allows.
const ARCHS: &[u32] = &[70, 80, 90];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/ptx_text.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=PTXAS");

    let dir = Path::new("kernels");
    let files = ptx_files(dir);
    let parsed: BTreeMap<String, Ptx> = files.iter().map(|p| read_ptx(p)).collect();

    check_abi(&parsed);

    // Example user updaters: every entry takes the user-updater parameter list.
    let user_files = ptx_files(&dir.join("user"));
    let user: BTreeMap<String, Ptx> = user_files.iter().map(|p| read_ptx(p)).collect();
    for (stem, ptx) in &user {
        for (name, types) in &ptx.entries {
            if *types != ptx_text::USER_UPDATER_PARAMS {
                fail(&format!(
                    "kernels/user/{stem}.ptx: {name} takes ({}), a user updater takes ({})",
                    types.join(", "),
                    ptx_text::USER_UPDATER_PARAMS.join(", ")
                ));
            }
        }
    }

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    if let Some(ptxas) = find_ptxas() {
        assemble_all(&ptxas, &files, &parsed, &out.join("kernels"));
        assemble_all(&ptxas, &user_files, &user, &out.join("user"));
    }
}

/// `kernels/<stem>.ptx` read and parsed, or the build fails.
fn read_ptx(path: &Path) -> (String, Ptx) {
    let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
    let text = fs::read_to_string(path)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
    let ptx = parse(&text).unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
    (stem, ptx)
}

/// What build.rs needs from one PTX file.
struct Ptx {
    /// The number in `.target sm_NN`.
    target: u32,
    /// Each `.entry` and the types of its parameters, in order.
    entries: BTreeMap<String, Vec<String>>,
    /// Special registers of a 2-D grid the code reads (`%ctaid.y`, `%nctaid.*`).
    grid_2d: Vec<&'static str>,
}

/// Stops the build with `msg` (cargo shows a failed build script's stderr).
fn fail(msg: &str) -> ! {
    eprintln!("\nkvstore build.rs: {msg}\n");
    std::process::exit(1);
}

fn ptx_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", dir.display())))
        .map(|e| e.expect("a readable directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .collect();
    files.sort();
    files
}

fn parse(text: &str) -> Result<Ptx, String> {
    let target = ptx_text::target(text).ok_or("no `.target sm_NN` line")?;
    let text = ptx_text::strip_comments(text);
    let entries = ptx_text::entries(&text)?;
    let grid_2d = ["%ctaid.y", "%ctaid.z", "%nctaid."]
        .into_iter()
        .filter(|r| text.contains(r))
        .collect();
    Ok(Ptx {
        target,
        entries,
        grid_2d,
    })
}

/// Every entry the Rust side launches exists with the ABI's parameter types.
fn check_abi(parsed: &BTreeMap<String, Ptx>) {
    let mut errors = Vec::new();
    for (rule, expected) in RULE_PARAMS {
        assert_eq!(&expected[..COMMON_PARAMS.len()], COMMON_PARAMS);
        for dtype in DTYPES {
            let name = format!("fused_{rule}_{dtype}");
            let file = format!("fused_{dtype}");
            let Some(ptx) = parsed.get(&file) else {
                errors.push(format!(
                    "kernels/{file}.ptx is missing (it must define {name})"
                ));
                continue;
            };
            if !ptx.grid_2d.is_empty() {
                errors.push(format!(
                    "kernels/{file}.ptx reads {}: the ABI's grid is 1-D (one block per chunk, \
                     found through the block starts in the table)",
                    ptx.grid_2d.join(", ")
                ));
            }
            match ptx.entries.get(&name) {
                None => errors.push(format!(
                    "kernels/{file}.ptx has no `.visible .entry {name}`"
                )),
                Some(got) if got != expected => errors.push(format!(
                    "kernels/{file}.ptx: {name} takes ({}), the ABI says ({})",
                    got.join(", "),
                    expected.join(", ")
                )),
                Some(_) => {}
            }
        }
    }
    if !errors.is_empty() {
        fail(&format!(
            "the PTX kernels do not match the ABI in build.rs:\n  {}",
            errors.join("\n  ")
        ));
    }
}

/// The ptxas to use: env `PTXAS`, else `ptxas` on `PATH`; `None` (with a warning) if neither runs.
fn find_ptxas() -> Option<PathBuf> {
    let (ptxas, from_env) = match env::var_os("PTXAS") {
        Some(p) if !p.is_empty() => (PathBuf::from(p), true),
        _ => (PathBuf::from("ptxas"), false),
    };
    match Command::new(&ptxas).arg("--version").output() {
        Ok(out) if out.status.success() => Some(ptxas),
        Ok(out) => fail(&format!(
            "`{} --version` failed: {}",
            ptxas.display(),
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) if e.kind() == ErrorKind::NotFound && !from_env => {
            println!(
                "cargo:warning=ptxas not found (set PTXAS or run scripts/install-ptxas.sh): \
                 the PTX kernels were checked against the ABI but not assembled"
            );
            None
        }
        Err(e) => fail(&format!("cannot run PTXAS={}: {e}", ptxas.display())),
    }
}

/// Assembles every file into `out` (one folder per source folder, so names cannot clash).
fn assemble_all(ptxas: &Path, files: &[PathBuf], parsed: &BTreeMap<String, Ptx>, out: &Path) {
    fs::create_dir_all(out)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", out.display())));
    for path in files {
        let stem = path.file_stem().unwrap().to_string_lossy();
        let ptx = &parsed[stem.as_ref()];
        for arch in ARCHS.iter().filter(|&&a| a >= ptx.target) {
            let cubin = out.join(format!("{stem}.sm_{arch}.cubin"));
            let result = Command::new(ptxas)
                .arg(format!("-arch=sm_{arch}"))
                .arg("-o")
                .arg(&cubin)
                .arg(path)
                .output()
                .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}", ptxas.display())));
            if !result.status.success() {
                fail(&format!(
                    "ptxas -arch=sm_{arch} {} failed:\n{}{}",
                    path.display(),
                    String::from_utf8_lossy(&result.stdout),
                    String::from_utf8_lossy(&result.stderr)
                ));
            }
        }
    }
}
