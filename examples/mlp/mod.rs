//! A small multi-layer perceptron with a hand-written forward and backward pass in `f32`, and a
//! seeded 3-class spiral data set. Shared by `examples/train_data_parallel.rs` and
//! `tests/training_equivalence.rs`.
//!
//! The network is `input -> 64 -> ReLU -> 64 -> ReLU -> classes`, trained with softmax
//! cross-entropy. [`Mlp::gradients`] returns gradients *summed* over the samples it is given, so
//! a store updater with `rescale_grad = 1 / global_batch` turns the sum over every device's
//! shard into the mean gradient of the global batch.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use kvstore::{AsyncKvStore, DType, Device, KvStore, NDArray, Shape, Updater};
use rayon::prelude::*;

/// Input features per sample (x, y of a point in the plane).
pub(crate) const INPUTS: usize = 2;
/// Units in each hidden layer.
pub(crate) const HIDDEN: usize = 64;
/// Number of classes (spiral arms).
pub(crate) const CLASSES: usize = 3;

/// A tiny deterministic generator (SplitMix64), so data and weights depend only on the seed.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// A classification data set: `x` is `len x INPUTS` row-major, `y` the class of each row.
pub(crate) struct Dataset {
    /// Features, row-major.
    pub x: Vec<f32>,
    /// Labels in `0..CLASSES`.
    pub y: Vec<usize>,
}

impl Dataset {
    /// `per_class` noisy points on each of `CLASSES` interleaved spiral arms, shuffled.
    pub(crate) fn spirals(per_class: usize, seed: u64) -> Dataset {
        let mut rng = Rng::new(seed);
        let mut rows: Vec<([f32; INPUTS], usize)> = Vec::with_capacity(per_class * CLASSES);
        for class in 0..CLASSES {
            for i in 0..per_class {
                let r = i as f64 / per_class as f64;
                let angle = class as f64 * 2.0 * std::f64::consts::PI / CLASSES as f64
                    + r * 4.0
                    + rng.normal() * 0.2;
                rows.push(([(r * angle.sin()) as f32, (r * angle.cos()) as f32], class));
            }
        }
        // Fisher-Yates, so every minibatch mixes the classes.
        for i in (1..rows.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            rows.swap(i, j);
        }
        Dataset {
            x: rows.iter().flat_map(|(p, _)| *p).collect(),
            y: rows.iter().map(|(_, c)| *c).collect(),
        }
    }

    /// The number of samples.
    pub(crate) fn len(&self) -> usize {
        self.y.len()
    }

    /// Rows `range` as a borrowed batch.
    pub(crate) fn batch(&self, range: std::ops::Range<usize>) -> Batch<'_> {
        Batch {
            x: &self.x[range.start * INPUTS..range.end * INPUTS],
            y: &self.y[range],
        }
    }
}

/// A borrowed slice of a data set.
#[derive(Clone, Copy)]
pub(crate) struct Batch<'a> {
    /// Features, row-major, `y.len() x INPUTS`.
    pub x: &'a [f32],
    /// Labels.
    pub y: &'a [usize],
}

/// The parameter tensors, in key order: `w1, b1, w2, b2, w3, b3`. Weights are `fan_in x fan_out`.
pub(crate) fn param_shapes() -> Vec<Vec<usize>> {
    vec![
        vec![INPUTS, HIDDEN],
        vec![HIDDEN],
        vec![HIDDEN, HIDDEN],
        vec![HIDDEN],
        vec![HIDDEN, CLASSES],
        vec![CLASSES],
    ]
}

/// He-initialized weights and small random biases, from `seed`.
pub(crate) fn init_params(seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed);
    param_shapes()
        .iter()
        .map(|shape| {
            let n: usize = shape.iter().product();
            let scale = match shape.as_slice() {
                [fan_in, _] => (2.0 / *fan_in as f64).sqrt(),
                _ => 0.01,
            };
            (0..n).map(|_| (rng.normal() * scale) as f32).collect()
        })
        .collect()
}

/// What one forward and backward pass over a batch gives.
pub(crate) struct Pass {
    /// Sum of the cross-entropy loss over the batch.
    pub loss_sum: f64,
    /// Number of samples classified correctly.
    pub correct: usize,
    /// Gradient of `loss_sum` for each parameter, in [`param_shapes`] order.
    pub grads: Vec<Vec<f32>>,
}

/// A forward pass and, when `backward`, the gradients of the summed loss.
pub(crate) fn pass(params: &[Vec<f32>], batch: Batch<'_>, backward: bool) -> Pass {
    let mut grads = vec![Vec::new(); if backward { 6 } else { 0 }];
    let (loss_sum, correct) = pass_each(params, batch, backward, |k, g| grads[k] = g);
    Pass {
        loss_sum,
        correct,
        grads,
    }
}

/// A forward pass and, when `backward`, the gradients of the summed loss, each given to
/// `on_grad(k, gradient of parameter k)` as soon as backward has it: the last layer's first
/// (keys 4, 5, then 2, 3, then 0, 1). Returns the summed loss and the number correct.
pub(crate) fn pass_each(
    params: &[Vec<f32>],
    batch: Batch<'_>,
    backward: bool,
    mut on_grad: impl FnMut(usize, Vec<f32>),
) -> (f64, usize) {
    let [w1, b1, w2, b2, w3, b3] = params else {
        panic!("an MLP has 6 parameter tensors, got {}", params.len());
    };
    let n = batch.y.len();
    let h1 = dense_relu(batch.x, w1, b1, n, INPUTS, HIDDEN);
    let h2 = dense_relu(&h1, w2, b2, n, HIDDEN, HIDDEN);
    let mut d3 = dense(&h2, w3, b3, n, HIDDEN, CLASSES);

    // Softmax cross-entropy; d3 becomes d(loss)/d(logits) = softmax - onehot.
    let mut loss_sum = 0.0f64;
    let mut correct = 0;
    for (row, &label) in d3.chunks_exact_mut(CLASSES).zip(batch.y) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let argmax = row.iter().position(|&v| v == max).unwrap_or(0);
        correct += usize::from(argmax == label);
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v /= sum;
        }
        loss_sum -= f64::from(row[label].max(f32::MIN_POSITIVE).ln());
        row[label] -= 1.0;
    }
    if !backward {
        return (loss_sum, correct);
    }

    on_grad(4, matmul_tn(&h2, &d3, n, HIDDEN, CLASSES));
    on_grad(5, column_sums(&d3, CLASSES));
    let mut d2 = matmul_nt(&d3, w3, n, CLASSES, HIDDEN);
    relu_mask(&mut d2, &h2);
    on_grad(2, matmul_tn(&h1, &d2, n, HIDDEN, HIDDEN));
    on_grad(3, column_sums(&d2, HIDDEN));
    let mut d1 = matmul_nt(&d2, w2, n, HIDDEN, HIDDEN);
    relu_mask(&mut d1, &h1);
    on_grad(0, matmul_tn(batch.x, &d1, n, INPUTS, HIDDEN));
    on_grad(1, column_sums(&d1, HIDDEN));
    (loss_sum, correct)
}

/// `x @ w + b` for `x: n x k`, `w: k x m`.
fn dense(x: &[f32], w: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * m);
    for _ in 0..n {
        out.extend_from_slice(b);
    }
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
        for (&xv, wr) in xr.iter().zip(w.chunks_exact(m)) {
            for (o, &wv) in or.iter_mut().zip(wr) {
                *o += xv * wv;
            }
        }
    }
    out
}

fn dense_relu(x: &[f32], w: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = dense(x, w, b, n, k, m);
    for v in &mut out {
        *v = v.max(0.0);
    }
    out
}

/// `a^T @ d` for `a: n x k`, `d: n x m`: a `k x m` weight gradient.
fn matmul_tn(a: &[f32], d: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; k * m];
    for (ar, dr) in a.chunks_exact(k).zip(d.chunks_exact(m)).take(n) {
        for (&av, or) in ar.iter().zip(out.chunks_exact_mut(m)) {
            if av != 0.0 {
                for (o, &dv) in or.iter_mut().zip(dr) {
                    *o += av * dv;
                }
            }
        }
    }
    out
}

/// `d @ w^T` for `d: n x m`, `w: k x m`: the gradient flowing back to a `n x k` input.
fn matmul_nt(d: &[f32], w: &[f32], n: usize, m: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n * k];
    for (dr, or) in d.chunks_exact(m).zip(out.chunks_exact_mut(k)).take(n) {
        for (o, wr) in or.iter_mut().zip(w.chunks_exact(m)) {
            *o = dr.iter().zip(wr).map(|(a, b)| a * b).sum();
        }
    }
    out
}

fn column_sums(d: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m];
    for row in d.chunks_exact(m) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
    out
}

/// Zeroes the gradient where the ReLU output was zero.
fn relu_mask(grad: &mut [f32], activation: &[f32]) {
    for (g, &a) in grad.iter_mut().zip(activation) {
        if a <= 0.0 {
            *g = 0.0;
        }
    }
}

/// Data-parallel training of the MLP over several devices, with the optimizer in a [`KvStore`].
///
/// Each device holds its own copy of every parameter. A step splits the batch into one shard per
/// device, computes each shard's gradients in parallel (one rayon task per device), pushes every gradient of every
/// device in ONE `push_list` (key `i` = parameter `i`, one value per device), and pulls the
/// updated parameters back into every device's copy with ONE `pull_list`.
pub(crate) struct DataParallel {
    /// The store that sums the gradients and runs the optimizer.
    pub kv: Arc<KvStore>,
    /// One device per shard.
    pub devices: Vec<Device>,
    /// `params[k][d]`: parameter `k` on device `d`.
    pub params: Vec<Vec<NDArray>>,
    keys: Vec<i32>,
}

impl DataParallel {
    /// A `kind` store (e.g. `"device"`) with `updater`, holding the parameters from `seed`, and a
    /// copy of them on every device.
    pub(crate) fn new(
        kind: &str,
        devices: Vec<Device>,
        updater: Updater,
        seed: u64,
    ) -> kvstore::Result<DataParallel> {
        let kv = KvStore::create(kind)?;
        kv.set_updater(updater)?;
        let shapes = param_shapes();
        let keys: Vec<i32> = (0..shapes.len() as i32).collect();
        let init = init_params(seed)
            .into_iter()
            .zip(&shapes)
            .map(|(p, s)| NDArray::from_vec(p, shape(s)))
            .collect::<kvstore::Result<Vec<_>>>()?;
        kv.init_list(&keys, &init)?;
        let params = shapes
            .iter()
            .map(|s| {
                devices
                    .iter()
                    .map(|&d| NDArray::full_on(shape(s), 0.0, DType::F32, d))
                    .collect::<kvstore::Result<Vec<_>>>()
            })
            .collect::<kvstore::Result<Vec<_>>>()?;
        kv.pull_list(&keys, &params)?;
        Ok(DataParallel {
            kv: Arc::new(kv),
            devices,
            params,
            keys,
        })
    }

    /// One training step on `batch`; returns the summed loss and the number classified correctly
    /// (with the parameters from before the step).
    pub(crate) fn step(&self, batch: Batch<'_>) -> kvstore::Result<(f64, usize)> {
        self.step_with(batch, self.devices.len())
    }

    /// As [`DataParallel::step`], but only the first `pushed` devices' gradients are pushed.
    /// Tests use it to check that a dropped shard is caught.
    pub(crate) fn step_with(
        &self,
        batch: Batch<'_>,
        pushed: usize,
    ) -> kvstore::Result<(f64, usize)> {
        let n = self.devices.len();
        // One task per device on rayon's pool (threads are reused from step to step).
        let per_device: Vec<kvstore::Result<(f64, usize, Vec<NDArray>)>> = (0..n)
            .into_par_iter()
            .map(|d| self.device_pass(d, shard(batch, d, n)))
            .collect();
        let mut loss = 0.0;
        let mut correct = 0;
        // grads[k][d]: the gradient of parameter k from device d.
        let mut grads: Vec<Vec<NDArray>> = vec![Vec::with_capacity(n); self.keys.len()];
        for result in per_device.into_iter().take(pushed) {
            let (l, c, g) = result?;
            loss += l;
            correct += c;
            for (k, g) in g.into_iter().enumerate() {
                grads[k].push(g);
            }
        }
        self.kv.push_list(&self.keys, &grads)?;
        self.kv.pull_list(&self.keys, &self.params)?;
        Ok((loss, correct))
    }

    /// One training step as [`DataParallel::step`], with communication overlapping backward:
    /// each layer's gradients are pushed through `queue` (an [`AsyncKvStore`] over
    /// [`DataParallel::kv`]) as soon as every device has computed them, while backward goes on
    /// with the layers below; then every parameter is pulled, and the step waits for it all.
    /// The same sums as `step`'s one `push_list`, layer by layer, so the same parameters.
    pub(crate) fn step_overlapped(
        &self,
        queue: &AsyncKvStore,
        batch: Batch<'_>,
    ) -> kvstore::Result<(f64, usize)> {
        let n = self.devices.len();
        // grads[k][d]: device d's gradient of parameter k, until it is pushed. The device that
        // completes a layer pushes it, under the lock: each device gives its keys in one
        // order, so layers complete in that order on every rank, and the ranks' queued calls
        // match.
        let grads: Mutex<Vec<Vec<Option<NDArray>>>> =
            Mutex::new(vec![vec![None; n]; self.keys.len()]);
        let device = |d: usize| -> kvstore::Result<(f64, usize)> {
            let params = self.device_params(d)?;
            let mut failed = None;
            let on_grad = |k: usize, g: Vec<f32>| {
                let g = NDArray::from_vec(g, shape(&param_shapes()[k]))
                    .and_then(|g| g.to_device(self.devices[d]));
                let g = match g {
                    Ok(g) => g,
                    Err(e) => {
                        failed.get_or_insert(e);
                        return;
                    }
                };
                let mut grads = grads.lock().unwrap_or_else(|e| e.into_inner());
                grads[k][d] = Some(g);
                // A layer (its weight 2l and bias 2l + 1) goes out in one push once every
                // device has both.
                let layer = [k & !1, k | 1];
                if layer.iter().all(|&j| grads[j].iter().all(Option::is_some)) {
                    let values: Vec<Vec<NDArray>> = (layer.iter())
                        .map(|&j| grads[j].iter_mut().filter_map(Option::take).collect())
                        .collect();
                    let keys = [self.keys[layer[0]], self.keys[layer[1]]];
                    // MXNet's priority: the first layers, needed first, highest.
                    queue.push_list(&keys, &values, -(layer[0] as i32));
                }
            };
            let done = pass_each(&params, shard(batch, d, n), true, on_grad);
            failed.map_or(Ok(done), Err)
        };
        // Device 0 on this thread, the others on threads of their own.
        let results: Vec<kvstore::Result<(f64, usize)>> = std::thread::scope(|s| {
            let others: Vec<_> = (1..n).map(|d| s.spawn(move || device(d))).collect();
            let mut all = vec![device(0)];
            all.extend(others.into_iter().map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(kvstore::Error::Internal {
                        op: "step",
                        message: "a device's backward pass panicked".into(),
                    })
                })
            }));
            all
        });
        let (mut loss, mut correct) = (0.0, 0);
        let mut failed = None;
        for r in results {
            match r {
                Ok((l, c)) => {
                    loss += l;
                    correct += c;
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if let Some(e) = failed {
            // A key some device could not give is never pushed: on a dist store the other
            // ranks' push of it then fails. The pushes queued before it still run.
            let _ = queue.wait_all();
            return Err(e);
        }
        queue.pull_list(&self.keys, &self.params, 0);
        queue.wait_all()?;
        Ok((loss, correct))
    }

    /// Forward and backward on device `d`'s copy of the parameters; gradients land on `d`.
    fn device_pass(
        &self,
        d: usize,
        shard: Batch<'_>,
    ) -> kvstore::Result<(f64, usize, Vec<NDArray>)> {
        let params = self.device_params(d)?;
        let p = pass(&params, shard, true);
        let grads = p
            .grads
            .into_iter()
            .zip(param_shapes())
            .map(|(g, s)| NDArray::from_vec(g, shape(&s))?.to_device(self.devices[d]))
            .collect::<kvstore::Result<Vec<_>>>()?;
        Ok((p.loss_sum, p.correct, grads))
    }

    /// Device `d`'s copy of the parameters, on the host.
    pub(crate) fn device_params(&self, d: usize) -> kvstore::Result<Vec<Vec<f32>>> {
        self.params.iter().map(|p| p[d].to_vec::<f32>()).collect()
    }

    /// The parameters as the store holds them.
    pub(crate) fn stored_params(&self) -> kvstore::Result<Vec<Vec<f32>>> {
        param_shapes()
            .iter()
            .zip(&self.keys)
            .map(|(s, &k)| {
                let out = NDArray::zeros(shape(s));
                self.kv.pull(k, &out)?;
                out.to_vec::<f32>()
            })
            .collect()
    }

    /// Mean loss and accuracy of device 0's parameters on `data`, forward only.
    pub(crate) fn evaluate(&self, data: &Dataset) -> kvstore::Result<(f64, f64)> {
        let params = self.device_params(0)?;
        let p = pass(&params, data.batch(0..data.len()), false);
        let n = data.len() as f64;
        Ok((p.loss_sum / n, p.correct as f64 / n))
    }
}

/// Shard `d` of `n`: a contiguous run of rows, sizes differing by at most one.
pub(crate) fn shard(batch: Batch<'_>, d: usize, n: usize) -> Batch<'_> {
    let len = batch.y.len();
    let (start, end) = (len * d / n, len * (d + 1) / n);
    Batch {
        x: &batch.x[start * INPUTS..end * INPUTS],
        y: &batch.y[start..end],
    }
}

fn shape(dims: &[usize]) -> Shape {
    Shape::new(dims).expect("MLP parameters have at most 2 dimensions")
}
