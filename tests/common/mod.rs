//! Shared by the integration tests: where a test's store keeps its values, and where the test
//! puts the arrays it pushes and pulls, so that one test body runs on the CPU home and on GPU
//! homes.
//!
//! A test file writes its store tests as plain `fn name(home: Home)` and lists them in
//! [`on_every_home!`], which makes `cpu::name` (always run) and `gpu::name` (ignored: needs a
//! GPU; run with `--include-ignored` on a GPU machine).
#![allow(dead_code)]

#[cfg(feature = "mpi")]
pub(crate) mod mpi_job;
pub(crate) mod reference;

use kvstore::gpu_count;
use kvstore::{cpu, gpu, DType, Device, KvStore, NDArray, Shape};

/// Where a test's store keeps its values, and where the test's own arrays live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Home {
    /// A `local` store: values homed in host memory; the test's arrays on `cpu(0)`, `cpu(1)`, ...
    Cpu,
    /// A `device` store: every key homed on a GPU; the test's arrays on `gpu(i % gpu_count())`,
    /// so with one GPU all of a push's values share it (several values on one GPU), and with
    /// several they spread over all of them (an NCCL reduce).
    Gpu,
}

impl Home {
    /// The store kind whose keys live on this home: `local` or `device`.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Home::Cpu => "local",
            Home::Gpu => "device",
        }
    }

    /// Every store kind that keeps its keys on this home on this machine: without a GPU, the
    /// GPU kinds fall back to the CPU home and are listed with it.
    pub(crate) fn kinds(self) -> Vec<&'static str> {
        let gpu_kinds = ["device", "local_allreduce_device", "nccl"];
        match self {
            Home::Cpu if gpu_count() == 0 => {
                let mut all = vec!["local", "local_update_cpu", "local_allreduce_cpu"];
                all.extend(gpu_kinds);
                all
            }
            Home::Cpu => vec!["local", "local_update_cpu", "local_allreduce_cpu"],
            Home::Gpu => gpu_kinds.to_vec(),
        }
    }

    /// A fresh store of [`Home::kind`].
    pub(crate) fn store(self) -> KvStore {
        self.require();
        KvStore::create(self.kind()).unwrap()
    }

    /// A fresh store of `kind`, which must be one of [`Home::kinds`].
    pub(crate) fn store_of(self, kind: &str) -> KvStore {
        self.require();
        assert!(
            self.kinds().contains(&kind),
            "{kind} does not home its keys on {self:?}"
        );
        KvStore::create(kind).unwrap()
    }

    /// The device of the test's `i`-th array: `cpu(i)`, or `gpu(i % gpu_count())`.
    pub(crate) fn dev(self, i: usize) -> Device {
        match self {
            Home::Cpu => cpu(i),
            Home::Gpu => {
                self.require();
                gpu(i % gpu_count())
            }
        }
    }

    /// Where a store of this home puts a key when the caller does not say.
    pub(crate) fn is_home(self, device: Device) -> bool {
        match self {
            Home::Cpu => matches!(device, Device::Cpu(_)),
            Home::Gpu => matches!(device, Device::Gpu(_)),
        }
    }

    /// An f32 array of `shape` filled with `v` on the `i`-th device.
    pub(crate) fn full(self, shape: impl Into<Shape>, v: f64, i: usize) -> NDArray {
        self.full_typed(shape, v, DType::F32, i)
    }

    /// An array of `shape` and `dtype` filled with `v` on the `i`-th device.
    pub(crate) fn full_typed(
        self,
        shape: impl Into<Shape>,
        v: f64,
        dtype: DType,
        i: usize,
    ) -> NDArray {
        NDArray::full_on(shape, v, dtype, self.dev(i)).unwrap()
    }

    /// `a`, copied to the `i`-th device.
    pub(crate) fn put(self, a: &NDArray, i: usize) -> NDArray {
        a.to_device(self.dev(i)).unwrap()
    }

    /// A GPU home needs a GPU: fail loudly rather than pass without one.
    fn require(self) {
        if self == Home::Gpu {
            assert!(
                gpu_count() > 0,
                "this test needs a GPU and none was found (libcuda missing or no device)"
            );
        }
    }
}

/// Whether this run is against the stand-in driver (`scripts/standin-gpu-tests.sh` sets
/// `KVSTORE_STANDIN=1`), whose PTX interpreter runs GPU threads one after another: the largest
/// shapes are scaled down there, unless `KVSTORE_STANDIN_FULL_SHAPES=1` asks for the full ones
/// (CI runs a few tests so, to see sizes past what the scaled shapes reach). A real GPU run
/// never sets it, and keeps the full shapes.
pub(crate) fn on_standin() -> bool {
    std::env::var_os("KVSTORE_STANDIN").is_some()
}

/// Whether the shapes are scaled down for the stand-in's interpreter (see [`on_standin`]).
pub(crate) fn standin_shapes() -> bool {
    on_standin() && std::env::var("KVSTORE_STANDIN_FULL_SHAPES").as_deref() != Ok("1")
}

impl Home {
    /// `full` elements, or `standin` on a GPU home run against the stand-in driver.
    pub(crate) fn scaled(self, full: usize, standin: usize) -> usize {
        if self == Home::Gpu && standin_shapes() {
            standin
        } else {
            full
        }
    }
}

/// Makes a `cpu` and a `gpu` test module, with one test per listed `fn name(home: Home)`.
///
/// The GPU tests are `#[ignore = "needs a GPU"]`. A function may return `()` or a `Result`.
#[macro_export]
macro_rules! on_every_home {
    ($($name:ident),+ $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() -> impl std::process::Termination {
                    super::$name($crate::common::Home::Cpu)
                }
            )+
        }
        mod gpu {
            $(
                #[test]
                #[ignore = "needs a GPU"]
                fn $name() -> impl std::process::Termination {
                    super::$name($crate::common::Home::Gpu)
                }
            )+
        }
    };
}

/// The name of the child-process marker: set to a test's name, it runs that test's body.
const CHILD: &str = "KVSTORE_TEST_CHILD";

/// Runs the test `name` in a child process of its own (this test binary, filtered to it, with
/// the ignored tests included, and `env` added to its environment) and checks that it passed,
/// within `limit`; returns false. In that child, returns true and the caller runs the body. For a test that makes a GPU fault:
/// CUDA's fault errors are sticky, so the process's context on that GPU is unusable
/// afterwards, and no other test may share the process; and for one that needs a setting the
/// stand-in driver reads once per process (`KVSTORE_STANDIN_MEM_GIB`).
pub(crate) fn in_own_process(name: &str, env: &[(&str, &str)], limit: std::time::Duration) -> bool {
    if std::env::var(CHILD).is_ok_and(|t| t == name) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary");
    // The child's output goes to a file, not a pipe: a full pipe would stall it.
    let log = std::env::temp_dir().join(format!("kvstore-{name}-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).expect("a log file for the child");
    let mut child = std::process::Command::new(exe)
        .args([name, "--exact", "--include-ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD, name)
        .envs(env.iter().copied())
        .stdout(file.try_clone().expect("the log file"))
        .stderr(file)
        .spawn()
        .expect("the test binary starts");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name} still ran after {limit:?} in its own process: it hangs");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    // The child's own lines, without its harness summary (which scripts would count as
    // passes or failures of their own).
    let shown: Vec<String> = text
        .lines()
        .filter(|l| !(l.starts_with("test result:") || l.starts_with("test ")))
        .map(|l| {
            // A SKIPPED line stays one of its own, so the run counts it.
            if l.starts_with("SKIPPED:") {
                l.to_owned()
            } else {
                format!("    [child] {l}")
            }
        })
        .collect();
    println!("{}", shown.join("\n"));
    assert!(
        status.success() && text.contains("1 passed"),
        "{name}, in a process of its own, did not pass ({status}); its output is above"
    );
    false
}
