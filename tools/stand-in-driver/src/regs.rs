//! Registers per thread, as ptxas allocates them, so a launch whose blocks need more registers
//! than a multiprocessor has fails with `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`, as on a GPU.
//!
//! A PTX module's `.reg` declarations are virtual registers that ptxas reuses, so only ptxas
//! can say how many hardware registers an entry takes. When a module is loaded, the driver's
//! JIT assembles it for the device; the stand-in does the same with the real `ptxas`
//! (`PTXAS`, else `ptxas` on `PATH`; `scripts/install-ptxas.sh` fetches one) for the device's
//! `sm_XX`, reads each entry's "Used N registers", and refuses the module if ptxas refuses it,
//! as the JIT would. Without a ptxas the check is skipped, once said on stderr.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use crate::state::report;

/// Registers one multiprocessor gives one block, on every architecture kvstore claims
/// (sm_70 to sm_90).
pub const REGISTERS_PER_BLOCK: u64 = 65536;

/// Registers are allocated to a warp in units of this many (sm_70 to sm_90).
const WARP_ALLOCATION_UNIT: u64 = 256;

/// Each entry's registers per thread, by name.
pub type Registers = Arc<HashMap<String, u32>>;

/// What ptxas said of one module: its entries' registers, or its refusal.
type Assembled = Result<Registers, String>;

/// The ptxas to run, if there is one.
fn ptxas() -> Option<&'static PathBuf> {
    static PTXAS: OnceLock<Option<PathBuf>> = OnceLock::new();
    PTXAS
        .get_or_init(|| {
            let path = match std::env::var_os("PTXAS") {
                Some(p) if !p.is_empty() => PathBuf::from(p),
                _ => PathBuf::from("ptxas"),
            };
            // NVIDIA's says "ptxas: NVIDIA (R) Ptx optimizing assembler": anything else (say
            // PTXAS=true, which skips build.rs's assembly) reports no registers.
            let runs = Command::new(&path)
                .arg("--version")
                .output()
                .is_ok_and(|o| {
                    o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ptxas")
                });
            if !runs {
                report(
                    "no ptxas (set PTXAS, or run scripts/install-ptxas.sh): registers per thread \
                     are not checked at launches",
                );
            }
            runs.then_some(path)
        })
        .as_ref()
}

/// Each entry's registers per thread when `ptx` is assembled for `sm_<sm>`; `Ok(None)` without
/// a ptxas; `Err` with ptxas's message when it refuses the module. Assembled once per text
/// and architecture in a process.
pub fn of_module(ptx: &str, sm: u32) -> Result<Option<Registers>, String> {
    let Some(ptxas) = ptxas() else {
        return Ok(None);
    };
    static SEEN: OnceLock<Mutex<HashMap<(String, u32), Assembled>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    let key = (ptx.to_owned(), sm);
    if let Some(done) = seen.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return done.clone().map(Some);
    }
    let done = assemble(ptxas, ptx, sm);
    seen.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, done.clone());
    done.map(Some)
}

fn assemble(ptxas: &PathBuf, ptx: &str, sm: u32) -> Assembled {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("kvstore-standin-{}-{n}.ptx", std::process::id()));
    std::fs::write(&file, ptx).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    let out = Command::new(ptxas)
        .arg(format!("-arch=sm_{sm}"))
        .arg("-v")
        .arg("-o")
        .arg("/dev/null")
        .arg(&file)
        .output();
    let _ = std::fs::remove_file(&file);
    let out = out.map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("ptxas -arch=sm_{sm} refuses it: {}", text.trim()));
    }
    Ok(Arc::new(parse(&text)))
}

/// Reads ptxas's `-v` report: "Compiling entry function 'NAME' for 'sm_90'" starts an entry,
/// and its "Used N registers" follows.
fn parse(text: &str) -> HashMap<String, u32> {
    let mut regs = HashMap::new();
    let mut entry: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            entry = rest.split('\'').next().map(str::to_owned);
        } else if let (Some(name), Some(rest)) = (&entry, line.split("Used ").nth(1)) {
            if let Some(n) = rest
                .split(" registers")
                .next()
                .and_then(|n| n.trim().parse::<u32>().ok())
            {
                regs.insert(name.clone(), n);
            }
        }
    }
    regs
}

/// The registers a block of `threads` threads takes, each thread using `per_thread`: whole
/// warps, each given a multiple of [`WARP_ALLOCATION_UNIT`].
pub fn per_block(per_thread: u32, threads: u64) -> u64 {
    let per_warp =
        (u64::from(per_thread) * 32).div_ceil(WARP_ALLOCATION_UNIT) * WARP_ALLOCATION_UNIT;
    threads.div_ceil(32) * per_warp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_registers_of_each_entry() {
        let text = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'copy' for 'sm_90'\n\
            ptxas info    : Function properties for copy\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 8 registers, used 0 barriers, 372 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'wide' for 'sm_90'\n\
            ptxas info    : Used 134 registers, 368 bytes cmem[0]\n";
        let regs = parse(text);
        assert_eq!(regs.get("copy"), Some(&8));
        assert_eq!(regs.get("wide"), Some(&134));
    }

    #[test]
    fn a_block_takes_whole_warps_of_whole_units() {
        // 8 registers: 256 per warp; 33 threads are two warps.
        assert_eq!(per_block(8, 33), 512);
        // 134 registers: 4288 per warp, rounded to 4352.
        assert_eq!(per_block(134, 256), 8 * 4352);
        assert!(per_block(134, 512) > REGISTERS_PER_BLOCK);
        assert!(per_block(64, 1024) <= REGISTERS_PER_BLOCK);
        assert!(per_block(65, 1024) > REGISTERS_PER_BLOCK);
    }
}
