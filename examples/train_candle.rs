//! A small candle MLP trained data-parallel over 4 simulated devices (CPU replicas), with the
//! store as the synchronisation layer: each step, every replica computes the gradients of its
//! shard of the batch, ALL parameter gradients of all replicas go to the store in ONE list
//! push, Adam runs in the store, and one list pull writes the new parameters into every
//! replica's own `Var`s. On the CPU no gradient or parameter is copied on the way (see the
//! `kvstore::candle` docs).
//!
//! ```text
//! cargo run --release --features candle --example train_candle
//! ```

use kvstore::candle::candle_core::{DType, Device, Result, Tensor, Var};
use kvstore::candle::CandleExt;
use kvstore::{Adam, KvStore, Updater};
use rand::Rng;

const WORKERS: usize = 4;
const INPUTS: usize = 8;
const HIDDEN: usize = 32;
const SAMPLES: usize = 1024;
const BATCH: usize = 128;
const STEPS: usize = 300;

/// A two-layer perceptron: `tanh(x w1 + b1) w2 + b2`.
struct Mlp {
    params: Vec<Var>,
}

impl Mlp {
    /// A replica whose parameters are copies of `values`.
    fn replica(values: &[Tensor]) -> Result<Mlp> {
        let params = values.iter().map(Var::from_tensor).collect::<Result<_>>()?;
        Ok(Mlp { params })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let p = &self.params;
        let h = x
            .matmul(p[0].as_tensor())?
            .broadcast_add(p[1].as_tensor())?
            .tanh()?;
        h.matmul(p[2].as_tensor())?.broadcast_add(p[3].as_tensor())
    }

    /// The mean squared error of a shard, and the gradient of every parameter.
    fn loss_and_grads(&self, x: &Tensor, y: &Tensor) -> Result<(f32, Vec<Tensor>)> {
        let loss = (self.forward(x)? - y)?.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        let g = self
            .params
            .iter()
            .map(|p| {
                grads
                    .get(p)
                    .cloned()
                    .expect("every parameter has a gradient")
            })
            .collect();
        Ok((loss.to_scalar()?, g))
    }
}

fn random(shape: &[usize], scale: f32, rng: &mut impl Rng) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut rng = rand::thread_rng();
    let cpu = Device::Cpu;

    // A regression task with a known answer: y = sin(x . a).
    let x = random(&[SAMPLES, INPUTS], 1.0, &mut rng)?;
    let a = random(&[INPUTS, 1], 1.0, &mut rng)?;
    let y = x.matmul(&a)?.sin()?;

    // One set of initial parameters, stored under keys 0..4 and copied into every replica.
    let init = vec![
        random(&[INPUTS, HIDDEN], (1.0 / INPUTS as f32).sqrt(), &mut rng)?,
        Tensor::zeros(HIDDEN, DType::F32, &cpu)?,
        random(&[HIDDEN, 1], (1.0 / HIDDEN as f32).sqrt(), &mut rng)?,
        Tensor::zeros(1, DType::F32, &cpu)?,
    ];
    let keys: Vec<i32> = (0..init.len() as i32).collect();
    let kv = KvStore::create("local")?;
    kv.init_list_candle(&keys, &init)?;
    // Each replica's loss is the mean over its shard: the mean over the batch is the sum of
    // the pushed gradients over WORKERS.
    kv.set_updater(Updater::Adam(Adam {
        lr: 0.01,
        rescale_grad: 1.0 / WORKERS as f64,
        ..Adam::default()
    }))?;
    let replicas = (0..WORKERS)
        .map(|_| Mlp::replica(&init))
        .collect::<Result<Vec<_>>>()?;
    // The pull outs: every replica's parameters, per key. Tensors are handles to the Vars'
    // storage, so a pull writes the replicas' parameters in place.
    let outs: Vec<Vec<Tensor>> = (0..keys.len())
        .map(|k| {
            replicas
                .iter()
                .map(|m| m.params[k].as_tensor().clone())
                .collect()
        })
        .collect();

    let shard = BATCH / WORKERS;
    for step in 0..STEPS {
        let start = (step * BATCH) % SAMPLES;
        let mut losses = 0.0;
        let mut per_key: Vec<Vec<Tensor>> = vec![Vec::with_capacity(WORKERS); keys.len()];
        for (r, m) in replicas.iter().enumerate() {
            let xs = x.narrow(0, start + r * shard, shard)?;
            let ys = y.narrow(0, start + r * shard, shard)?;
            let (loss, grads) = m.loss_and_grads(&xs, &ys)?;
            losses += loss;
            for (k, g) in grads.into_iter().enumerate() {
                per_key[k].push(g);
            }
        }
        kv.push_list_candle(&keys, &per_key)?;
        kv.pull_list_candle(&keys, &outs)?;
        if step % 30 == 0 || step == STEPS - 1 {
            println!("step {step:3}  loss {:.5}", losses / WORKERS as f32);
        }
    }
    Ok(())
}
