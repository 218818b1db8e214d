//! One optimizer step over DistilBERT-base's 66M parameters (the QA model, random init): the
//! flat fp32 buffer's gradient-norm clip and the fused AdamW update, as training runs them.
//!
//!   cargo bench --bench optimizer
//!
//! AdamW reads parameters, gradients and both moments and writes three of them back: 7 x 4
//! bytes a parameter, so the step is bound by memory bandwidth; GB/s says how close it gets.

use std::time::Instant;

use anyhow::Result;
use sprtrain::models::{self, Head};
use sprtrain::optim::{clip_coefficient, AdamW, AdamWConfig, FlatParams};
use tch::{Kind, Tensor};

fn main() -> Result<()> {
    let threads = std::env::var("SPRTRAIN_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    tch::set_num_threads(threads);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/models/distilbert-base-uncased");
    let model = models::from_config(&dir, Head::QuestionAnswering, |_| Ok(()), 42)?;
    let flat = FlatParams::new(&model.vs, |name| model.model.backward_stage(name));
    let n = flat.numel();
    // Gradients of a typical scale, written where backward would write them.
    let mut grads = flat.grads.shallow_clone();
    tch::no_grad(|| grads.copy_(&(Tensor::randn([n], (Kind::Float, tch::Device::Cpu)) * 1e-3)));
    let mut opt = AdamW::new(
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        &flat,
    );
    let reps = 20;
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 3 {
        let t = Instant::now();
        let scale = clip_coefficient(flat.grad_norm(), 1.0);
        opt.step(&flat, 5e-5, scale);
        if rep >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "optimizer step (clip + fused AdamW), {n} parameters, {threads} threads: median {:.1} ms, best {:.1} ms over {reps}; {:.1} GB/s of parameter state",
        median * 1e3,
        times[0] * 1e3,
        (n as f64 * 7.0 * 4.0) / median / 1e9
    );
    Ok(())
}
