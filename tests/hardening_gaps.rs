//! Gaps left by the hardening tests (issue 10): cases whose fix was in, but whose test would
//! also pass on the code before the fix.

use std::time::{Duration, Instant};

use kvstore::{Error, Key, KvStore, NDArray};

/// Fault 8: `init_list` checks duplicates in linear time. `tests/bad_input.rs` checks what the
/// check finds; this checks how long it takes. With the duplicate at the very end, the old
/// quadratic check compared every key with every earlier one: 4.5e10 string comparisons for
/// 300k keys, over a minute even optimized (100k keys took 10 s in a standalone replica of the
/// old loop on the loaded 2-core machine). The linear check takes well under a second; the
/// bound leaves room for a slow, loaded machine either way.
#[test]
fn init_list_duplicate_check_is_linear_time() {
    const N: usize = 300_000;
    const BOUND: Duration = Duration::from_secs(15);
    let mut keys: Vec<String> = (0..N).map(|i| format!("layer{i}/weight")).collect();
    keys[N - 1] = keys[N - 2].clone();
    let values = vec![NDArray::zeros([1]); N];
    let kv = KvStore::create("local").unwrap();

    let start = Instant::now();
    let result = kv.init_list(&keys, &values);
    let took = start.elapsed();
    match result {
        Err(Error::DuplicateInit { key }) => assert_eq!(key, Key::from(&keys[N - 2])),
        other => panic!("expected DuplicateInit, got {other:?}"),
    }
    assert!(kv.keys().is_empty(), "a failed init_list added keys");
    assert!(
        took < BOUND,
        "init_list of {N} keys took {took:?} to find a duplicate (bound {BOUND:?}): quadratic?"
    );
}
