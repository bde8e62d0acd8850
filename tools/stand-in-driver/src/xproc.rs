//! NCCL across processes: the files through which the ranks of one clique, in separate processes
//! of one machine, find each other and move a collective's data.
//!
//! Every clique made by `ncclCommInitRank` has a folder named after its unique id (an FNV-1a
//! hash of the 128 bytes), under `KVSTORE_STANDIN_SHM_DIR`, else `/dev/shm`, else the temporary
//! folder. In it:
//!
//! - `rank-<r>`: written (atomically: a temporary file, then a rename) by the process of rank
//!   `r` when it joins: its pid, the start time of that pid (so a recycled pid is not taken for
//!   the rank), the number of ranks and the rank's device. A clique is complete when every rank
//!   is either in this process or has a file whose process is alive.
//! - `seen-<r>`: rank `r` saw every rank's file. Joining ends when every rank has said so
//!   (as NCCL's bootstrap is a collective: no rank's init returns before all have met).
//! - `c<seq>-from<r>-to<pid>`: rank `r`'s part of collective `seq` for the process `pid`: a
//!   header (kind, count, datatype, operation, root, length) and the bytes rank `r` sends
//!   (nothing for a broadcast's other ranks). For `ncclSend` / `ncclRecv` (kind 6,
//!   `SendRecv`) the header's count is the elements the rank sends in all, and the bytes after
//!   the header are a table of `2 * nranks` little-endian u64 (the elements it sends to each
//!   peer, in peer order, then the elements it receives from each peer), then its send blocks
//!   concatenated in peer order; the header's length covers both. The other kinds' files are
//!   unchanged. Written when every part of this process is at the front of its stream (the
//!   moment a GPU would start the kernel), read and deleted by `pid` when it runs the
//!   collective. A process reads every other rank's header, so a mismatch is seen by every
//!   rank, not only the ones that receive data.
//! - `left-<r>`: rank `r`'s communicator ended. The last process to leave (every rank left or
//!   its process is gone) removes the folder.
//!
//! Nothing here is a network layer: the ranks must share the folder, so one machine.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::state::{CollKind, Part};

/// The folder of the clique with unique id `id`.
pub fn dir_for(id: &[u8; 128]) -> PathBuf {
    let base = match std::env::var_os("KVSTORE_STANDIN_SHM_DIR") {
        Some(d) => PathBuf::from(d),
        None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => std::env::temp_dir(),
    };
    // FNV-1a, 64 bits: stable across processes and builds (std's hasher is not).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in id {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    base.join(format!("kvstore-standin-{h:016x}"))
}

/// The start time (clock ticks since boot, field 22 of `/proc/<pid>/stat`) of a live process;
/// `None` when there is no such process or it has exited (a zombie not yet reaped counts as
/// gone: it will never call again).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after the last.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | Some(&"x")) {
        return None;
    }
    // `fields[0]` is field 3 (the state), so field 22 is `fields[19]`.
    fields.get(19)?.parse().ok()
}

/// Whether process `pid`, started at `start`, is still running.
pub fn alive(pid: u32, start: u64) -> bool {
    start_time(pid) == Some(start)
}

/// This process's pid and start time.
pub fn me() -> (u32, u64) {
    let pid = std::process::id();
    (pid, start_time(pid).unwrap_or(0))
}

/// What a rank's `rank-<r>` file says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankFile {
    pub pid: u32,
    pub start: u64,
    pub nranks: usize,
    pub device: usize,
}

/// Writes `bytes` to `path` so that a reader sees all of it or nothing.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let (pid, _) = me();
    let tmp = path.with_extension(format!("tmp{pid}"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

fn rank_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}"))
}

/// Reads rank `rank`'s file, if it exists and parses.
pub fn read_rank(dir: &Path, rank: usize) -> Option<RankFile> {
    let text = std::fs::read_to_string(rank_path(dir, rank)).ok()?;
    let v: Vec<u64> = text
        .split_whitespace()
        .map(|w| w.parse().ok())
        .collect::<Option<_>>()?;
    match v[..] {
        [pid, start, nranks, device] => Some(RankFile {
            pid: u32::try_from(pid).ok()?,
            start,
            nranks: nranks as usize,
            device: device as usize,
        }),
        _ => None,
    }
}

/// Registers rank `rank` of this process in the clique's folder. A file of the same rank from a
/// process that is gone (an earlier job with the same id) is replaced; one from a live other
/// process is an error (the rank joined twice), as is a folder that cannot be written.
pub fn register(dir: &Path, rank: usize, nranks: usize, device: usize) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let (pid, start) = me();
    if let Some(old) = read_rank(dir, rank) {
        if old.pid != pid && alive(old.pid, old.start) {
            return Err(format!(
                "rank {rank} joined twice: process {} holds it already ({})",
                old.pid,
                dir.display()
            ));
        }
    }
    // Leftovers of an earlier job with this id that were meant for this rank or this pid.
    let _ = std::fs::remove_file(dir.join(format!("left-{rank}")));
    let _ = std::fs::remove_file(dir.join(format!("seen-{rank}")));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('c') && name.ends_with(&format!("-to{pid}")) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    write_atomic(
        &rank_path(dir, rank),
        format!("{pid} {start} {nranks} {device}\n").as_bytes(),
    )
    .map_err(|e| format!("cannot write in {}: {e}", dir.display()))
}

/// Says, for `ranks` of this process, that they saw every rank join (`seen-<r>`).
pub fn announce(dir: &Path, ranks: &[usize]) {
    for &r in ranks {
        let _ = write_atomic(&dir.join(format!("seen-{r}")), b"");
    }
}

/// Whether rank `rank` has said that it saw every rank join.
pub fn has_seen_all(dir: &Path, rank: usize) -> bool {
    dir.join(format!("seen-{rank}")).exists()
}

/// The header of a published part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: CollKind,
    pub count: usize,
    pub dtype: i32,
    pub op: i32,
    pub root: i32,
}

impl Header {
    /// The header of a part as issued.
    pub fn of(p: &Part) -> Header {
        Header {
            kind: p.kind,
            count: p.count,
            dtype: p.dtype,
            op: p.op,
            root: p.root,
        }
    }
}

/// How `p` differs from `p0` where all ranks must agree (the operation only for reductions,
/// the root only for rooted collectives), or `None`.
pub fn differ(p: &Header, p0: &Header) -> Option<String> {
    if p.kind != p0.kind {
        Some(format!("the kind ({:?} vs {:?})", p.kind, p0.kind))
    } else if p.count != p0.count && p.kind != CollKind::SendRecv {
        // Point-to-point ranks send different totals: their pairs are checked instead
        // (`state::p2p_mismatch`).
        Some(format!("the count ({} vs {})", p.count, p0.count))
    } else if p.dtype != p0.dtype {
        Some(format!("the datatype ({} vs {})", p.dtype, p0.dtype))
    } else if p.op != p0.op
        && matches!(
            p.kind,
            CollKind::Reduce | CollKind::AllReduce | CollKind::ReduceScatter
        )
    {
        Some(format!("the operation ({} vs {})", p.op, p0.op))
    } else if p.root != p0.root && matches!(p.kind, CollKind::Reduce | CollKind::Broadcast) {
        Some(format!("the root ({} vs {})", p.root, p0.root))
    } else {
        None
    }
}

const HEADER_BYTES: usize = 32;

fn kind_code(k: CollKind) -> u32 {
    match k {
        CollKind::Reduce => 1,
        CollKind::Broadcast => 2,
        CollKind::AllReduce => 3,
        CollKind::AllGather => 4,
        CollKind::ReduceScatter => 5,
        CollKind::SendRecv => 6,
    }
}

fn kind_of(code: u32) -> Option<CollKind> {
    Some(match code {
        1 => CollKind::Reduce,
        2 => CollKind::Broadcast,
        3 => CollKind::AllReduce,
        4 => CollKind::AllGather,
        5 => CollKind::ReduceScatter,
        6 => CollKind::SendRecv,
        _ => return None,
    })
}

fn part_path(dir: &Path, seq: u64, from: usize, to_pid: u32) -> PathBuf {
    dir.join(format!("c{seq}-from{from}-to{to_pid}"))
}

/// Publishes rank `from`'s part of collective `seq` to process `to_pid`.
pub fn publish(
    dir: &Path,
    seq: u64,
    from: usize,
    to_pid: u32,
    h: &Header,
    data: &[u8],
) -> Result<(), String> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + data.len());
    bytes.extend_from_slice(&kind_code(h.kind).to_le_bytes());
    bytes.extend_from_slice(&(h.count as u64).to_le_bytes());
    bytes.extend_from_slice(&h.dtype.to_le_bytes());
    bytes.extend_from_slice(&h.op.to_le_bytes());
    bytes.extend_from_slice(&h.root.to_le_bytes());
    bytes.extend_from_slice(&(data.len() as u64).to_le_bytes());
    debug_assert_eq!(bytes.len(), HEADER_BYTES);
    bytes.extend_from_slice(data);
    write_atomic(&part_path(dir, seq, from, to_pid), &bytes)
        .map_err(|e| format!("cannot write in {}: {e}", dir.display()))
}

/// Whether rank `from`'s part of collective `seq` has arrived for this process.
pub fn arrived(dir: &Path, seq: u64, from: usize) -> bool {
    part_path(dir, seq, from, me().0).exists()
}

/// Reads (and deletes) rank `from`'s part of collective `seq` for this process.
pub fn take(dir: &Path, seq: u64, from: usize) -> Result<(Header, Vec<u8>), String> {
    let path = part_path(dir, seq, from, me().0);
    let bytes = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let _ = std::fs::remove_file(&path);
    let bad = || format!("{} is not a part the stand-in wrote", path.display());
    if bytes.len() < HEADER_BYTES {
        return Err(bad());
    }
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let h = Header {
        kind: kind_of(u32_at(0)).ok_or_else(bad)?,
        count: u64_at(4) as usize,
        dtype: u32_at(12) as i32,
        op: u32_at(16) as i32,
        root: u32_at(20) as i32,
    };
    let len = u64_at(24) as usize;
    if bytes.len() != HEADER_BYTES + len {
        return Err(bad());
    }
    Ok((h, bytes[HEADER_BYTES..].to_vec()))
}

/// The bytes of a point-to-point part after its header: `sends` (elements to each peer) and
/// `recvs` (elements from each peer) as `2 * nranks` little-endian u64, then `blocks`, the
/// blocks sent, concatenated in peer order.
pub fn p2p_payload(sends: &[usize], recvs: &[usize], blocks: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8 * (sends.len() + recvs.len()) + blocks.len());
    for &c in sends.iter().chain(recvs) {
        bytes.extend_from_slice(&(c as u64).to_le_bytes());
    }
    bytes.extend_from_slice(blocks);
    bytes
}

/// A point-to-point part read back: (elements sent to each peer, elements received from each
/// peer, the blocks sent, concatenated in peer order).
pub type P2pPart<'a> = (Vec<usize>, Vec<usize>, &'a [u8]);

/// Splits what [`p2p_payload`] wrote for a clique of `n` ranks into (elements sent to each
/// peer, elements received from each peer, the blocks sent), checking it against the header's
/// `count` (elements sent in all) and the element size `es`.
pub fn p2p_split(data: &[u8], n: usize, count: usize, es: usize) -> Result<P2pPart<'_>, String> {
    let table = 16 * n;
    if data.len() < table {
        return Err(format!(
            "its point-to-point part holds {} bytes, less than the table of counts of {n} ranks",
            data.len()
        ));
    }
    let counts: Vec<usize> = data[..table]
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .collect();
    let (sends, recvs) = counts.split_at(n);
    let total: usize = sends.iter().sum();
    let blocks = &data[table..];
    if total != count || blocks.len() != total * es {
        return Err(format!(
            "its point-to-point part says {count} elements sent, its table {total}, and it \
             holds {} bytes of blocks ({es} per element)",
            blocks.len()
        ));
    }
    Ok((sends.to_vec(), recvs.to_vec(), blocks))
}

/// Marks `ranks` as having left the clique; removes the folder when every rank left or its
/// process is gone.
pub fn leave(dir: &Path, ranks: &[usize], nranks: usize) {
    for &r in ranks {
        let _ = write_atomic(&dir.join(format!("left-{r}")), b"");
    }
    let all_gone = (0..nranks).all(|r| {
        dir.join(format!("left-{r}")).exists()
            || read_rank(dir, r).is_none_or(|f| !alive(f.pid, f.start))
    });
    if all_gone {
        let _ = std::fs::remove_dir_all(dir);
    }
}
