//! The launcher of the MPI tests (`tests/dist_*.rs`, cargo feature `mpi`): each outer `#[test]`
//! runs `mpirun --oversubscribe -np N` on its own test binary, which re-enters through that
//! file's ignored test `inner` with `KVT_CASE` naming the case to run on every rank. Every rank
//! prints `KVT rank=R size=N OK <case> ...` (see [`ok_line`]) when its part passed; the outer
//! test checks those lines and the job's exit code. Each job has a hard bound: past it the job
//! is killed (and [`Job::killed`] says so). Jobs of one test binary run one at a time.
//!
//! Without `mpirun` on the PATH, [`launch`] prints `SKIPPED: mpirun not found` and returns
//! `None` (CI treats that line as a failure, since it installs Open MPI).
//!
//! On the simulated cluster (issue 37): with `KVT_CLUSTER` naming `scripts/cluster.sh` (and its
//! `KVC_*` settings in the environment), a job's ranks run on the cluster's hosts instead:
//! [`launch`] runs `cluster.sh mpirun` (mpirun in the first host, a hostfile, TCP between hosts)
//! and [`launch_without_mpi`] starts each rank with `cluster.sh exec HOST`, placed as
//! `cluster.sh place N` says, with `MASTER_ADDR` the first rank's host.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The environment variable that names the case `inner` runs.
pub(crate) const CASE_VAR: &str = "KVT_CASE";

/// Variables a job never inherits from the test's own environment (a launcher's, or kvstore's
/// settings): a job sees only what its `env` sets.
const CLEARED: [&str; 9] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "KVSTORE_TIMEOUT",
    "KVSTORE_WAIT_LOG_SECS",
    "KVSTORE_DIST_CHECK",
    "KVSTORE_BIGARRAY_BOUND",
    "KVSTORE_PAR_MIN_BYTES",
];

/// One job at a time: several oversubscribed jobs at once would only slow each other down.
static JOBS: Mutex<()> = Mutex::new(());

/// What a job did.
pub(crate) struct Job {
    /// The exit code; `None` if it was killed by a signal (or by the bound).
    pub code: Option<i32>,
    /// Whether the bound killed it.
    pub killed: bool,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

impl Job {
    /// The `KVT` lines of `rank`.
    pub(crate) fn lines(&self, rank: usize) -> Vec<&str> {
        let tag = format!("KVT rank={rank} ");
        // libtest may print "test inner ... " on the same line first.
        self.stdout
            .lines()
            .filter_map(|l| l.find(&tag).map(|i| &l[i..]))
            .collect()
    }

    /// The OK line of `rank` for `case`, if it printed one.
    pub(crate) fn ok_line(&self, rank: usize, size: usize, case: &str) -> Option<&str> {
        let want = format!("KVT rank={rank} size={size} OK {case} ");
        self.lines(rank).into_iter().find(|l| l.starts_with(&want))
    }

    /// Asserts that each of `ranks` printed an OK line for `case` containing every one of
    /// `needles`, and returns those lines.
    pub(crate) fn assert_ok(
        &self,
        ranks: &[usize],
        size: usize,
        case: &str,
        needles: &[&str],
    ) -> Vec<&str> {
        ranks
            .iter()
            .map(|&r| {
                let Some(line) = self.ok_line(r, size, case) else {
                    panic!("rank {r} did not report 'KVT rank={r} size={size} OK {case}'\n{self}");
                };
                for n in needles {
                    assert!(line.contains(n), "rank {r}: '{n}' not in: {line}\n{self}");
                }
                line
            })
            .collect()
    }

    /// Asserts that the job ended by itself with exit code 0 and that every one of its `np`
    /// ranks reported OK for `case`.
    pub(crate) fn assert_healthy(&self, np: usize, case: &str) -> Vec<&str> {
        assert!(!self.killed, "the job ran past its bound\n{self}");
        let ranks: Vec<usize> = (0..np).collect();
        let lines = self.assert_ok(&ranks, np, case, &[]);
        assert_eq!(self.code, Some(0), "a healthy run must exit 0\n{self}");
        lines
    }

    /// Asserts that no rank reported OK for `case`.
    pub(crate) fn assert_no_ok(&self, case: &str) {
        let tag = format!(" OK {case} ");
        assert!(
            self.stdout.lines().all(|l| !l.contains(&tag)),
            "no rank may finish '{case}'\n{self}"
        );
    }
}

impl std::fmt::Display for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?} (killed by the bound: {}) after {:.1} s\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            self.killed,
            self.took.as_secs_f64(),
            self.stdout,
            self.stderr
        )
    }
}

/// What a rank prints when its part of `case` passed; `detail` is free text for the outer test.
pub(crate) fn ok_line(rank: usize, size: usize, case: &str, detail: &str) {
    use std::io::Write;
    // One write of the whole line: `println!` hands a long line over in pieces, and another
    // rank's output (they share mpirun's stdout) can land between them, so the outer test
    // once read "KVT ... OK skip " without its detail.
    let line = format!("KVT rank={rank} size={size} OK {case} {detail}\n");
    let mut out = std::io::stdout().lock();
    let _ = out.flush();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// The variable that names the simulated cluster's script (`scripts/cluster.sh`).
pub(crate) const CLUSTER_VAR: &str = "KVT_CLUSTER";

/// The simulated cluster's script, when the jobs run on it.
fn cluster() -> Option<PathBuf> {
    std::env::var_os(CLUSTER_VAR).map(PathBuf::from)
}

/// Where the cluster puts each of `n` ranks: (host, address, local rank, local world size).
fn cluster_places(cluster: &std::path::Path, n: usize) -> Vec<(String, String, String, String)> {
    let out = Command::new(cluster)
        .args(["place", &n.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .expect("run cluster.sh place");
    assert!(out.status.success(), "cluster.sh place {n} failed");
    let places: Vec<_> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(
                w.len(),
                5,
                "cluster.sh place: not 'RANK HOST ADDRESS LOCAL_RANK LOCAL_WORLD_SIZE': {l}"
            );
            (
                w[1].to_owned(),
                w[2].to_owned(),
                w[3].to_owned(),
                w[4].to_owned(),
            )
        })
        .collect();
    assert_eq!(places.len(), n, "cluster.sh place {n}: one line per rank");
    places
}

fn mpirun() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file())
}

/// Runs `case` on `np` ranks under mpirun (or on one process without mpirun when `np` is
/// `None`), with `env` added, killing it after `bound`. Returns `None` when there is no mpirun.
pub(crate) fn launch(
    np: Option<usize>,
    case: &str,
    env: &[(&str, &str)],
    bound: Duration,
) -> Option<Job> {
    let mpirun = mpirun();
    let Some(mpirun) = mpirun else {
        eprintln!("SKIPPED: mpirun not found");
        return None;
    };
    let _one_at_a_time = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = match np {
        Some(n) => {
            let mut c = match cluster() {
                Some(cluster) => {
                    let mut c = Command::new(cluster);
                    c.arg("mpirun");
                    c
                }
                None => Command::new(mpirun),
            };
            c.args(["--oversubscribe", "-np", &n.to_string()]);
            for (k, _) in env {
                c.args(["-x", k]);
            }
            c.args(["-x", CASE_VAR]).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(INNER_ARGS)
        .env(CASE_VAR, case)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in CLEARED {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let job = supervise(vec![cmd], bound);
    summarize(&job, case, np.unwrap_or(1));
    Some(job)
}

/// Runs `case` on `n` processes started as a launcher without MPI starts them (torchrun, srun):
/// each with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` set, and `env` added; all of them are killed after `bound`. The job's exit code
/// is the first non-zero one among the processes (`None` if one was killed by a signal).
pub(crate) fn launch_without_mpi(
    n: usize,
    case: &str,
    env: &[(&str, &str)],
    bound: Duration,
) -> Job {
    let _one_at_a_time = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let exe = std::env::current_exe().expect("the test binary's path");
    // A port of this test process's own (NCCL's bootstrap listens on the one after it).
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    // One host, or the cluster's places: (host, address, local rank, local world size).
    let cluster = cluster();
    let places: Vec<(Option<String>, String, String, String)> = match &cluster {
        Some(c) => cluster_places(c, n)
            .into_iter()
            .map(|(h, a, l, lw)| (Some(h), a, l, lw))
            .collect(),
        None => (0..n)
            .map(|r| (None, "127.0.0.1".into(), r.to_string(), n.to_string()))
            .collect(),
    };
    let master = places[0].1.clone();
    let cmds = places
        .into_iter()
        .enumerate()
        .map(|(r, (host, _, local_rank, local_size))| {
            let mut cmd = match (&cluster, host) {
                (Some(c), Some(h)) => {
                    let mut cmd = Command::new(c);
                    cmd.args(["exec", &h]).arg(&exe);
                    cmd
                }
                _ => Command::new(&exe),
            };
            cmd.args(INNER_ARGS)
                .env(CASE_VAR, case)
                .env("MASTER_ADDR", &master)
                .env("MASTER_PORT", port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for v in CLEARED.iter().chain(MPI_LAUNCH) {
                cmd.env_remove(v);
            }
            cmd.env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", local_rank)
                .env("LOCAL_WORLD_SIZE", local_size);
            for (k, v) in env {
                cmd.env(k, v);
            }
            cmd
        })
        .collect();
    let job = supervise(cmds, bound);
    summarize(&job, case, n);
    job
}

/// What an MPI launcher sets, which a launch without MPI must not inherit.
const MPI_LAUNCH: &[&str] = &[
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCALNRANKS",
];

/// The arguments that make a test binary run only its `inner` test.
const INNER_ARGS: [&str; 5] = [
    "--ignored",
    "--exact",
    "inner",
    "--nocapture",
    "--test-threads=1",
];

/// Starts `cmds`, collects their output, and kills them all once `bound` has passed.
fn supervise(cmds: Vec<Command>, bound: Duration) -> Job {
    let start = Instant::now();
    let mut children = Vec::new();
    let mut readers = Vec::new();
    for mut cmd in cmds {
        let mut child = cmd.spawn().expect("spawn the job");
        let mut out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        readers.push((
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = out.read_to_string(&mut s);
                s
            }),
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                s
            }),
        ));
        children.push(child);
    }
    let mut killed = false;
    let mut statuses = vec![None; children.len()];
    while statuses.iter().any(Option::is_none) {
        for (child, status) in children.iter_mut().zip(&mut statuses) {
            if status.is_none() {
                *status = child.try_wait().expect("wait for the job");
            }
        }
        if start.elapsed() > bound && !killed {
            // SIGTERM first: mpirun forwards it to the ranks and cleans up after them.
            killed = true;
            for (child, status) in children.iter().zip(&statuses) {
                if status.is_none() {
                    // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
                    unsafe {
                        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
                    }
                }
            }
            let grace = Instant::now();
            while grace.elapsed() < Duration::from_secs(5) {
                let mut all = true;
                for (child, status) in children.iter_mut().zip(&mut statuses) {
                    if status.is_none() {
                        *status = child.try_wait().expect("wait");
                        all &= status.is_some();
                    }
                }
                if all {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            for child in &mut children {
                let _ = child.kill();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = start.elapsed();
    let codes: Vec<Option<i32>> = statuses.iter().map(|s| s.and_then(|s| s.code())).collect();
    let code = match codes.iter().find(|c| **c != Some(0)) {
        Some(c) => *c,
        None => Some(0),
    };
    let (mut stdout, mut stderr) = (String::new(), String::new());
    for (o, e) in readers {
        stdout.push_str(&o.join().unwrap_or_default());
        stderr.push_str(&e.join().unwrap_or_default());
    }
    Job {
        code,
        killed,
        stdout,
        stderr,
        took,
    }
}

/// A summary of a job, for `--nocapture` runs.
fn summarize(job: &Job, case: &str, ranks: usize) {
    println!(
        "{case} on {ranks} ranks: exit {:?} after {:.1} s",
        job.code,
        job.took.as_secs_f64()
    );
    for r in 0..ranks {
        for l in job.lines(r) {
            println!("  {l}");
        }
    }
}
