//! Seeded attention's forward and backward at the benchmark's shapes (src/models/seeded.cpp):
//! DistilBERT-base QA, batch 8, seq 384, 12 heads of 64, dropout 0.1, in fp32 and bf16, and
//! MiniLM's short sentences (batch 32, seq 48, 12 heads of 32), each on both paths (the loop
//! over (batch, head) pairs and the batched products; the model takes the per-pair path at seq
//! 384 and the batched one at seq 48), and libtorch's fused scaled_dot_product_attention on the
//! same shapes without dropout (what a layer runs where dropout is 0) as a yardstick.
//!
//!   cargo bench --bench attention
//!
//! The products (two in forward; the recomputed scores and four more in backward) are what
//! must take the time: GFLOP/s counts only them, so against the machine's GEMM peak it says how
//! much the softmax, dropout and casts between them cost.

use std::time::Instant;

use sprtrain::models::layers::{key_mask, seeded_attention_with};
use tch::{Device, Kind, Tensor};

/// How a pass computes attention.
#[derive(Clone, Copy)]
enum Kernel {
    /// Seeded attention, dropout 0.1, batched when the scores have at most this many elements.
    Seeded(i64),
    /// libtorch's scaled_dot_product_attention, no dropout.
    Fused,
}

/// Median and best seconds of `reps` forward + backward passes, after 2 warm-up passes.
fn time_pass(shape: [i64; 4], kind: Kind, kernel: Kernel, reps: usize) -> (f64, f64) {
    let [b, h, t, d] = shape;
    tch::manual_seed(0);
    let leaf = || {
        Tensor::randn([b, h, t, d], (Kind::Float, Device::Cpu))
            .to_kind(kind)
            .set_requires_grad(true)
    };
    let (q, k, v) = (leaf(), leaf(), leaf());
    // Padding as in a real batch: the last quarter of every other sequence.
    let lengths = Tensor::from_slice(
        &(0..b)
            .map(|i| if i % 2 == 0 { t } else { t * 3 / 4 })
            .collect::<Vec<_>>(),
    )
    .view([b, 1]);
    let keys = key_mask(
        &Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .view([1, t])
            .lt_tensor(&lengths),
    );
    let grad_out = Tensor::randn([b, h, t, d], (kind, Device::Cpu));
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 2 {
        let start = Instant::now();
        let out = match kernel {
            Kernel::Seeded(batched_up_to) => {
                seeded_attention_with(&q, &k, &v, &keys, 0.1, rep as i64, batched_up_to)
            }
            Kernel::Fused => Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                Some(&keys),
                0.0,
                false,
                None,
                false,
            ),
        };
        (&out * &grad_out).sum(Kind::Float).backward();
        if rep >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
        for x in [&q, &k, &v] {
            let _ = x.grad().zero_();
        }
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}

fn main() {
    let threads = std::env::var("SPRTRAIN_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    tch::set_num_threads(threads);
    for (name, shape, reps) in [
        ("DistilBERT QA, seq 384", [8, 12, 384, 64], 10),
        (
            "DistilBERT QA, length-grouped windows of 192",
            [8, 12, 192, 64],
            20,
        ),
        ("MiniLM sentences, seq 48", [32, 12, 48, 32], 50),
    ] {
        for kind in [Kind::Float, Kind::BFloat16] {
            for (path, kernel) in [
                ("per pair", Kernel::Seeded(0)),
                ("batched", Kernel::Seeded(i64::MAX)),
                ("libtorch fused, no dropout", Kernel::Fused),
            ] {
                let (median, best) = time_pass(shape, kind, kernel, reps);
                let [b, h, t, d] = shape;
                // Seven (T x T x D) products a pass (the fused kernel's backward recomputes the
                // scores too), 2 flops per multiply-add.
                let flops = 7.0 * 2.0 * (b * h * t * t * d) as f64;
                println!(
                    "{name}, {kind:?}, {path}, {threads} threads: forward + backward median {:.1} ms, best {:.1} ms over {reps}; products at {:.0} GFLOP/s",
                    median * 1e3,
                    best * 1e3,
                    flops / median / 1e9
                );
            }
        }
    }
}
