//! The MXNet KVStore tutorial, line by line in Rust.
//!
//! Part 1 is seed 001 ("Distributed Key-Value Store", with four logical CPU devices); part 2 is
//! seed 003's notebook on a `device` store. Each Python line is in a comment above its twin.
//!
//! Run it with `cargo run --release --example quickstart`.

use kvstore::{cpu, Device, KvStore, NDArray, Updater};

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    seed_001()?;
    seed_003()?;
    Ok(())
}

fn seed_001() -> anyhow::Result<()> {
    println!("== seed 001: the KVStore tutorial on a 'local' store ==");
    // kv = mx.kv.create('local')
    let kv = KvStore::create("local")?;
    // shape = (2,3)
    let shape = [2, 3];
    // kv.init(3, mx.nd.ones(shape)*2)
    kv.init(3, &(NDArray::ones(shape) * 2.0))?;
    // a = mx.nd.zeros(shape)
    let a = NDArray::zeros(shape);
    // kv.pull(3, out = a)
    kv.pull(3, &a)?;
    // print(a.asnumpy())
    println!("{a}");

    // kv.push(3, mx.nd.ones(shape)*8)
    kv.push(3, &(NDArray::ones(shape) * 8.0))?;
    // kv.pull(3, out = a)
    kv.pull(3, &a)?;
    println!("{a}");

    // contexts = [mx.cpu(i) for i in range(4)]
    let contexts: Vec<Device> = (0..4).map(cpu).collect();
    // b = [mx.nd.ones(shape, ctx) for ctx in contexts]
    let b = ones_on(shape, &contexts, 1.0)?;
    // kv.push(3, b)
    kv.push(3, &b)?;
    // kv.pull(3, out = a)
    kv.pull(3, &a)?;
    println!("{a}");

    // def update(key, input, stored):
    //     print("update on key: %d" % key)
    //     stored += input * 2
    // kv._set_updater(update)
    kv.set_updater(Updater::custom(|key, input, stored| {
        println!("update on key: {key}");
        *stored += input * 2.0;
    }))?;
    // kv.pull(3, out=a)
    kv.pull(3, &a)?;
    println!("{a}");
    // kv.push(3, mx.nd.ones(shape))
    kv.push(3, &NDArray::ones(shape))?;
    // kv.pull(3, out=a)
    kv.pull(3, &a)?;
    println!("{a}");

    // b = [mx.nd.ones(shape, ctx) for ctx in contexts]
    let b = ones_on(shape, &contexts, 1.0)?;
    // kv.pull(3, out = b)
    kv.pull(3, &b)?;
    // print(b[1].asnumpy())
    println!("{}", b[1]);

    // keys = [5, 7, 9]
    let keys = [5, 7, 9];
    // kv.init(keys, [mx.nd.ones(shape)]*len(keys))
    kv.init_list(&keys, &vec![NDArray::ones(shape); keys.len()])?;
    // kv.push(keys, [mx.nd.ones(shape)]*len(keys))
    kv.push_list(&keys, &vec![NDArray::ones(shape); keys.len()])?;
    // b = [mx.nd.zeros(shape)]*len(keys)   -- one array, three times
    let b = vec![NDArray::zeros(shape); keys.len()];
    // kv.pull(keys, out = b)
    kv.pull_list(&keys, &b)?;
    // print(b[1].asnumpy())
    println!("{}", b[1]);

    // b = [[mx.nd.ones(shape, ctx) for ctx in contexts]] * len(keys)
    let b = vec![ones_on(shape, &contexts, 1.0)?; keys.len()];
    // kv.push(keys, b)
    kv.push_list(&keys, &b)?;
    // kv.pull(keys, out = b)
    kv.pull_list(&keys, &b)?;
    // print(b[1][1].asnumpy())
    println!("{}", b[1][1]);
    Ok(())
}

fn seed_003() -> anyhow::Result<()> {
    println!("== seed 003: the notebook on a 'device' store ==");
    // kv = kv.create('device')
    let kv = KvStore::create("device")?;
    // shape = (2, 3)
    let shape = [2, 3];
    // kv.init(3, np.ones(shape)* (-2))
    kv.init(3, &(NDArray::ones(shape) * -2.0))?;
    // A = np.zeros(shape)
    let a = NDArray::zeros(shape);
    // kv.pull(3, out = A)
    kv.pull(3, &a)?;
    println!("{a}");

    // kv.push(3, np.ones(shape)* (-7))
    kv.push(3, &(NDArray::ones(shape) * -7.0))?;
    // kv.pull(3, out = A)
    kv.pull(3, &a)?;
    println!("{a}");

    // contexts = [cpu(i) for i in range(3)]
    let contexts: Vec<Device> = (0..3).map(cpu).collect();
    // B = [np.ones(shape, ctx = ctx) for ctx in contexts]
    let b = ones_on(shape, &contexts, 1.0)?;
    // kv.push(3, B)
    kv.push(3, &b)?;
    // kv.pull(3, out = A)
    kv.pull(3, &a)?;
    println!("{a}");

    // keys = [7, 11, 13, 17]
    let keys = [7, 11, 13, 17];
    // values = [np.ones(shape) * (-3)] * len(keys)
    let values = vec![NDArray::ones(shape) * -3.0; keys.len()];
    // kv.init(keys, values)
    kv.init_list(&keys, &values)?;
    // C = [np.zeros(shape)] * len(keys)
    let c = vec![NDArray::zeros(shape); keys.len()];
    // kv.pull(keys, out = C)
    kv.pull_list(&keys, &c)?;
    // C[0]
    println!("{}", c[0]);

    // D = [[np.ones(shape, ctx = ctx) * (-0.1) for ctx in contexts]] * len(keys)
    let d = vec![ones_on(shape, &contexts, -0.1)?; keys.len()];
    // kv.push(keys, D)
    kv.push_list(&keys, &d)?;
    // kv.pull(keys, out = C)
    kv.pull_list(&keys, &c)?;
    println!("{}", c[0]);

    // def update(key, input, stored):
    //     print("update on key: %d" % key)
    //     stored += input * 0.01
    // kv._set_updater(update)
    kv.set_updater(Updater::custom(|key, input, stored| {
        println!("update on key: {key}");
        *stored += input * 0.01;
    }))?;
    // kv.pull(3, out = A)
    kv.pull(3, &a)?;
    println!("{a}");
    // kv.push(3, mx.nd.ones(shape) * 5)
    kv.push(3, &(NDArray::ones(shape) * 5.0))?;
    // kv.pull(3, out = A)
    kv.pull(3, &a)?;
    println!("{a}");
    Ok(())
}

/// `[mx.nd.ones(shape, ctx) * value for ctx in contexts]`
fn ones_on(shape: [usize; 2], contexts: &[Device], value: f64) -> kvstore::Result<Vec<NDArray>> {
    contexts
        .iter()
        .map(|&ctx| NDArray::full_on(shape, value, kvstore::DType::F32, ctx))
        .collect()
}
