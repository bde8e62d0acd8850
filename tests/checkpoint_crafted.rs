//! Crafted checkpoint files that declare far more than they hold (issue 41, item 5): an index
//! naming 10^13 shards, a shard or single file declaring 10^13 residuals or keys with a valid
//! checksum, a header length of 2^64 - 1, state buffer names given twice. Before the bounds
//! every one of these aborted the process ("memory allocation of 1440000000000000 bytes
//! failed"); now each is an `Error::Checkpoint` whose message says what is wrong.
//!
//! Also the index's checksum: a corrupt index is `Invalid`, and an index of the previous
//! format (no checksum) still loads, with one warning in the log.

#[path = "common/checkpoint_format.rs"]
mod checkpoint_format;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use kvstore::{Adam, CheckpointErrorKind, Compression, Error, Key, KvStore, NDArray, Updater};
use safetensors::tensor::{Dtype, SafeTensors};

/// A fresh directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvstore-crafted-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// 10^13, the count of the crafted files.
const HUGE: &str = "10000000000000";

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.01,
        ..Adam::default()
    })
}

/// A small trained store: Adam state on two keys, and two compression residuals per key.
fn trained() -> KvStore {
    let kv = KvStore::create("device").unwrap();
    kv.set_gradient_compression(Compression::two_bit(0.5))
        .unwrap();
    kv.set_updater(adam()).unwrap();
    kv.init(0, &NDArray::ones([4])).unwrap();
    kv.init(1, &NDArray::full([2, 3], 2.0)).unwrap();
    let grads = [NDArray::full([4], 0.7), NDArray::full([4], -0.3)];
    kv.push(0, &grads[..]).unwrap();
    let grads = [NDArray::full([2, 3], 0.9), NDArray::full([2, 3], 0.2)];
    kv.push(1, &grads[..]).unwrap();
    kv
}

/// A store that a crafted file is loaded into.
fn target() -> KvStore {
    let kv = KvStore::create("device").unwrap();
    kv.set_updater(adam()).unwrap();
    kv
}

/// The kind and message of a checkpoint error; panics on anything else.
fn checkpoint_error(result: kvstore::Result<()>) -> (CheckpointErrorKind, String) {
    match result {
        Err(e @ Error::Checkpoint { kind, .. }) => (kind, e.to_string()),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

/// Asserts that `result` is a checkpoint error of `kind` whose message has `needle`.
fn assert_error(result: kvstore::Result<()>, kind: CheckpointErrorKind, needle: &str) {
    let (got, message) = checkpoint_error(result);
    assert_eq!(got, kind, "{message}");
    assert!(message.contains(needle), "'{message}' lacks '{needle}'");
}

/// The index text of format 3: the lines, and the CRC-32 of them.
fn index_3(lines: &str) -> String {
    format!("{lines}crc32 {:08x}\n", crc32fast::hash(lines.as_bytes()))
}

/// The tensors (name, dtype, shape, data) and metadata of a safetensors file.
type Parts = (
    Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    HashMap<String, String>,
);

fn parts(bytes: &[u8]) -> Parts {
    let file = SafeTensors::deserialize(bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    (tensors, meta)
}

/// The file of `tensors` and `meta`, with every checksum made right for them.
fn sealed(
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    meta: HashMap<String, String>,
) -> Vec<u8> {
    let views: Vec<checkpoint_format::Tensor> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    checkpoint_format::sealed(&views, meta)
}

/// Rewrites the file at `path` with `alter` applied to its metadata, every checksum made right.
fn rewrite(path: &Path, alter: impl FnOnce(&mut HashMap<String, String>)) {
    let (tensors, mut meta) = parts(&fs::read(path).unwrap());
    alter(&mut meta);
    fs::write(path, sealed(&tensors, meta)).unwrap();
}

#[test]
fn an_index_naming_ten_trillion_shards_is_an_error() {
    let dir = temp_dir("world");
    let token = "0123456789abcdef";
    // The index alone: no generation folder at all. Format 1 (70 bytes, as in the issue), 2
    // and 3 (with a valid checksum).
    let indexes = [
        format!("kvstore-checkpoint-index/1\ngeneration 1844674407\nworld {HUGE}\n"),
        format!("kvstore-checkpoint-index/2\ngeneration 0\nworld {HUGE}\ntoken {token}\n"),
        index_3(&format!(
            "kvstore-checkpoint-index/3\ngeneration 0\nworld {HUGE}\ntoken {token}\n"
        )),
        index_3(&format!(
            "kvstore-checkpoint-index/3\ngeneration 0\nworld {}\ntoken {token}\n",
            u64::MAX
        )),
    ];
    assert_eq!(indexes[0].len(), 70);
    for index in &indexes {
        fs::write(dir.join("index"), index).unwrap();
        let kv = target();
        assert_error(kv.load(&dir), CheckpointErrorKind::NotFound, "shards");
        assert!(kv.keys().is_empty());
    }
    // A real checkpoint whose index names 10^13 shards, checksum and all (its shards are named
    // for a world of 2, so none of the 10^13 is there).
    let real = dir.join("real");
    trained().save_sharded(&real, 2).unwrap();
    let text = fs::read_to_string(real.join("index")).unwrap();
    let lines: String = text.lines().take(4).map(|l| format!("{l}\n")).collect();
    let crafted = index_3(&lines.replace("world 2", &format!("world {HUGE}")));
    fs::write(real.join("index"), crafted).unwrap();
    let (kind, message) = checkpoint_error(target().load(&real));
    assert_eq!(kind, CheckpointErrorKind::NotFound, "{message}");
    assert!(
        message.contains(&format!("the index names {HUGE} shards")) && message.contains("0 of"),
        "{message}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_shard_declaring_ten_trillion_residuals_is_an_error() {
    let dir = temp_dir("residuals");
    trained().save_sharded(&dir, 2).unwrap();
    target().load(&dir).unwrap();
    let gen = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap();
    let shard = gen.join("shard-0-of-2.safetensors");
    let good = fs::read(&shard).unwrap();
    // Shards of this version spell the entry as JSON.
    for spec in [
        format!("{{\"count\":{HUGE},\"len\":4}}"),
        format!("{{\"count\":{},\"len\":4}}", u64::MAX),
        format!("{{\"count\":1,\"len\":{HUGE}}}"),
        format!("{{\"count\":{HUGE},\"len\":{HUGE}}}"),
    ] {
        fs::write(&shard, &good).unwrap();
        rewrite(&shard, |m| {
            m.insert("residuals/0".into(), spec.clone());
        });
        let kv = target();
        assert_error(kv.load(&dir), CheckpointErrorKind::Invalid, "residual");
        assert!(kv.keys().is_empty(), "{spec}");
    }
    // The message says what is wrong and what to do.
    fs::write(&shard, &good).unwrap();
    rewrite(&shard, |m| {
        m.insert(
            "residuals/0".into(),
            format!("{{\"count\":{HUGE},\"len\":4}}"),
        );
    });
    let (_, message) = checkpoint_error(target().load(&dir));
    assert!(
        message.contains(&format!("declares {HUGE} residual tensors")) && message.contains("save"),
        "{message}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_single_file_declaring_ten_trillion_keys_or_residuals_is_an_error() {
    let dir = temp_dir("single");
    let path = dir.join("ckpt.safetensors");
    trained().save_single_file(&path).unwrap();
    let good = fs::read(&path).unwrap();
    for entry in ["keys", "residuals/0", "residuals/1"] {
        for value in [
            HUGE.to_owned(),
            u64::MAX.to_string(),
            "18446744073709551616".into(),
        ] {
            fs::write(&path, &good).unwrap();
            rewrite(&path, |m| {
                m.insert(entry.into(), value.clone());
            });
            let kv = target();
            assert_error(kv.load(&path), CheckpointErrorKind::Invalid, entry);
            assert!(kv.keys().is_empty());
        }
    }
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_step_count_leaves_room_for_more_pushes() {
    // A step count sizes nothing, but every push adds one to it: 2^64 - 1 would overflow on
    // the first push after the load, so it is refused; 10^13 loads, and pushes on.
    let dir = temp_dir("step");
    let path = dir.join("ckpt.safetensors");
    trained().save_single_file(&path).unwrap();
    let good = fs::read(&path).unwrap();
    for value in [u64::MAX.to_string(), (1u64 << 63).to_string()] {
        fs::write(&path, &good).unwrap();
        rewrite(&path, |m| {
            m.insert("step/0".into(), value.clone());
        });
        assert_error(target().load(&path), CheckpointErrorKind::Invalid, "step/0");
    }
    fs::write(&path, &good).unwrap();
    rewrite(&path, |m| {
        m.insert("step/0".into(), i64::MAX.to_string());
    });
    let kv = target();
    kv.load(&path).unwrap();
    kv.push(0, &NDArray::full([4], 0.5)).unwrap();
    // The same in a shard's piece.
    let sharded = dir.join("sharded");
    trained().save_sharded(&sharded, 1).unwrap();
    let shard = fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap()
        .join("shard-0-of-1.safetensors");
    rewrite(&shard, |m| {
        let spec = m.get("piece/0").unwrap().clone();
        let mut spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
        spec["step"] = u64::MAX.into();
        m.insert("piece/0".into(), spec.to_string());
    });
    assert_error(
        target().load(&sharded),
        CheckpointErrorKind::Invalid,
        "step",
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_header_length_beyond_the_file_is_an_error() {
    let dir = temp_dir("length");
    let path = dir.join("ckpt.safetensors");
    trained().save_single_file(&path).unwrap();
    let good = fs::read(&path).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap());
    for len in [
        u64::MAX,
        10_000_000_000_000,
        99_999_999,
        n + 1,
        good.len() as u64,
    ] {
        let mut bad = good.clone();
        bad[..8].copy_from_slice(&len.to_le_bytes());
        fs::write(&path, &bad).unwrap();
        assert_error(target().load(&path), CheckpointErrorKind::Invalid, "header");
    }
    // The same in a shard.
    let sharded = dir.join("sharded");
    trained().save_sharded(&sharded, 1).unwrap();
    let shard = fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap()
        .join("shard-0-of-1.safetensors");
    let mut bad = fs::read(&shard).unwrap();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    fs::write(&shard, &bad).unwrap();
    assert_error(
        target().load(&sharded),
        CheckpointErrorKind::Invalid,
        "header",
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn state_names_given_twice_are_an_error() {
    // Each name given twice would read its tensors twice over: a header of a million repeated
    // names would make the load allocate a million times the file's state.
    let dir = temp_dir("names");
    let path = dir.join("ckpt.safetensors");
    trained().save_single_file(&path).unwrap();
    rewrite(&path, |m| {
        m.insert("state_names".into(), "mean,var,mean".into());
    });
    assert_error(target().load(&path), CheckpointErrorKind::Invalid, "twice");
    let sharded = dir.join("sharded");
    trained().save_sharded(&sharded, 1).unwrap();
    let shard = fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap()
        .join("shard-0-of-1.safetensors");
    rewrite(&shard, |m| {
        m.insert("state_names".into(), "mean,var,var".into());
    });
    assert_error(
        target().load(&sharded),
        CheckpointErrorKind::Invalid,
        "twice",
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// The warnings logged on each thread, for the tests of the index's warning.
struct Capture(Mutex<Vec<(std::thread::ThreadId, String)>>);

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let line = (std::thread::current().id(), record.args().to_string());
            self.0.lock().unwrap().push(line);
        }
    }

    fn flush(&self) {}
}

/// The warnings logged on this thread so far.
fn warnings() -> Vec<String> {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    let capture = CAPTURE.get_or_init(|| {
        let capture: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(capture).unwrap();
        log::set_max_level(log::LevelFilter::Warn);
        capture
    });
    let me = std::thread::current().id();
    let lines = capture.0.lock().unwrap();
    lines
        .iter()
        .filter(|(id, _)| *id == me)
        .map(|(_, l)| l.clone())
        .collect()
}

/// Every key's value in `kv`, by key.
fn values(kv: &KvStore) -> Vec<(Key, Vec<f32>)> {
    kv.keys()
        .into_iter()
        .map(|k| {
            let (shape, _, _) = kv.meta(k.clone()).unwrap();
            let out = NDArray::zeros(shape);
            kv.pull(k.clone(), &out).unwrap();
            (k, out.to_vec::<f32>().unwrap())
        })
        .collect()
}

#[test]
fn an_index_without_a_checksum_loads_with_one_warning() {
    let dir = temp_dir("old-index");
    let kv = trained();
    kv.save_sharded(&dir, 2).unwrap();
    let text = fs::read_to_string(dir.join("index")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{text}");
    assert_eq!(lines[0], "kvstore-checkpoint-index/3");
    assert!(lines[4].starts_with("crc32 "), "{text}");
    assert_eq!(text, index_3(&text[..text.find("crc32").unwrap()]));

    // This version's index loads with no warning.
    let before = warnings().len();
    let loaded = target();
    loaded.load(&dir).unwrap();
    assert_eq!(values(&loaded), values(&kv));
    assert_eq!(warnings().len(), before, "{:?}", warnings());

    // The previous format: the first four lines, no checksum.
    let old = format!(
        "kvstore-checkpoint-index/2\n{}\n{}\n{}\n",
        lines[1], lines[2], lines[3]
    );
    fs::write(dir.join("index"), &old).unwrap();
    let loaded = target();
    loaded.load(&dir).unwrap();
    assert_eq!(values(&loaded), values(&kv));
    let new: Vec<String> = warnings().split_off(before);
    assert_eq!(new.len(), 1, "{new:?}");
    assert!(
        new[0].contains("index") && new[0].contains("no checksum"),
        "{new:?}"
    );

    // A corrupt index of this version: a flipped digit, a lost checksum line, an index of the
    // previous format with a checksum line.
    let body: String = lines[..4].iter().map(|l| format!("{l}\n")).collect();
    let flipped = index_3(&body).replace("generation 0", "generation 1");
    let wrong_sum = body.clone() + "crc32 00000000\n";
    let no_sum = body.clone();
    let old_with_sum = index_3(&old);
    for (text, needle) in [
        (flipped, "checksum of the index"),
        (wrong_sum, "checksum of the index"),
        (no_sum, "index is corrupt"),
        (old_with_sum, "index is corrupt"),
    ] {
        fs::write(dir.join("index"), &text).unwrap();
        let kv = target();
        assert_error(kv.load(&dir), CheckpointErrorKind::Invalid, needle);
        assert!(kv.keys().is_empty());
    }
    fs::remove_dir_all(&dir).unwrap();
}
