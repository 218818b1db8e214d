//! Seeded attention's forward and backward at the benchmark's shapes (src/models/seeded.cpp):
//! DistilBERT-base QA, batch 8, seq 384, 12 heads of 64, dropout 0.1, in fp32 and bf16, and
//! MiniLM's short sentences (batch 32, seq 48, 12 heads of 32), each on both paths (the loop
//! over (batch, head) pairs and the batched products; the model takes the per-pair path at seq
//! 384 and the batched one at seq 48), and libtorch's fused scaled_dot_product_attention on the
//! same shapes without dropout (what a layer runs where dropout is 0) as a yardstick. Then a
//! decoder's causal attention at the Llama-125M bench row's shape (batch 1, seq 512, 12 heads
//! of 64, dropout 0 as Llama trains): the per-pair loop's causal tiles, the batched products
//! (the causal mask as a bias row per query), and libtorch's fused kernel with `is_causal`.
//!
//!   cargo bench --bench attention
//!   SPRTRAIN_BENCH_CASE=Llama SPRTRAIN_BENCH_PATH=pair cargo bench --bench attention    # one case, one path
//!   SPRTRAIN_BENCH_KIND=BFloat16 cargo bench --bench attention                           # one dtype
//!
//! Each pass takes q, k and v as the models do, (B, H, T, D) views of one (B, T, 3 H D)
//! projection, and merges the heads of its output back to (B, T, H D), so the layout copies a
//! kernel needs are timed with it.
//!
//! The products (two in forward; the recomputed scores and four more in backward) are what
//! must take the time: GFLOP/s counts only them, so against the machine's GEMM peak it says how
//! much the softmax, dropout and casts between them cost.

use std::time::Instant;

use serde::de::IntoDeserializer;
use serde::Deserialize;
use sprtrain::config::Fp32Gemm;
use sprtrain::models::layers::{key_mask, seeded_attention_with, seeded_causal_attention};
use tch::{Device, Kind, Tensor};

/// How a pass computes attention.
#[derive(Clone, Copy)]
enum Kernel {
    /// Seeded attention, batched when the scores have at most this many elements.
    Seeded(i64),
    /// libtorch's scaled_dot_product_attention, no dropout.
    Fused,
}

/// A shape to time: (B, H, T, D), decoder (causal, unpadded) or encoder (padded), and the
/// seeded kernel's dropout.
struct Case {
    name: &'static str,
    shape: [i64; 4],
    reps: usize,
    causal: bool,
    dropout: f64,
}

/// Median and best seconds of `reps` forward + backward passes, after 2 warm-up passes.
fn time_pass(case: &Case, kind: Kind, kernel: Kernel) -> (f64, f64) {
    let ([b, h, t, d], reps) = (case.shape, case.reps);
    tch::manual_seed(0);
    // q, k and v as the models pass them: (B, H, T, D) views of one (B, T, 3 H D) projection.
    let fused = Tensor::randn([b, t, 3 * h * d], (Kind::Float, Device::Cpu))
        .to_kind(kind)
        .set_requires_grad(true);
    let heads = |i: i64| {
        fused
            .narrow(2, i * h * d, h * d)
            .view([b, t, h, d])
            .transpose(1, 2)
    };
    // Padding as in a real batch: the last quarter of every other sequence (none for the
    // decoder, whose blocks are packed).
    let lengths = Tensor::from_slice(
        &(0..b)
            .map(|i| {
                if i % 2 == 0 || case.causal {
                    t
                } else {
                    t * 3 / 4
                }
            })
            .collect::<Vec<_>>(),
    )
    .view([b, 1]);
    let keys = key_mask(
        &Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .view([1, t])
            .lt_tensor(&lengths),
    );
    let grad_out = Tensor::randn([b, t, h * d], (kind, Device::Cpu));
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 2 {
        let start = Instant::now();
        let (p, seed) = (case.dropout, rep as i64);
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let out = match kernel {
            Kernel::Seeded(up_to) if case.causal => {
                seeded_causal_attention(&q, &k, &v, &keys, p, seed, up_to)
            }
            Kernel::Seeded(up_to) => seeded_attention_with(&q, &k, &v, &keys, p, seed, up_to),
            Kernel::Fused if case.causal => Tensor::scaled_dot_product_attention::<Tensor>(
                &q, &k, &v, None, 0.0, true, None, false,
            ),
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
        // (B, H, T, D) -> (B, T, H D), as the models merge the heads.
        let merged = out.transpose(1, 2).contiguous().view([b, t, h * d]);
        (&merged * &grad_out).sum(Kind::Float).backward();
        if rep >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
        let _ = fused.grad().zero_();
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
    // SPRTRAIN_BENCH_FP32_GEMM=blas|onednn|blas+brgemm: the library of the fp32 products, as
    // runtime.fp32_gemm (default: auto's choice for this CPU).
    let gemm = std::env::var("SPRTRAIN_BENCH_FP32_GEMM").map_or(Fp32Gemm::Auto, |name| {
        Fp32Gemm::deserialize(name.as_str().into_deserializer())
            .unwrap_or_else(|e: serde::de::value::Error| panic!("SPRTRAIN_BENCH_FP32_GEMM: {e}"))
    });
    let gemm = gemm.select().expect("runtime.fp32_gemm");
    println!("fp32 products: {gemm:?}");
    // SPRTRAIN_BENCH_CASE=<text>, SPRTRAIN_BENCH_PATH=<text>, SPRTRAIN_BENCH_KIND=<text>: only
    // the cases, paths and dtypes ("Float", "BFloat16") whose name contains it (to profile one).
    let only = std::env::var("SPRTRAIN_BENCH_CASE").unwrap_or_default();
    let only_path = std::env::var("SPRTRAIN_BENCH_PATH").unwrap_or_default();
    let only_kind = std::env::var("SPRTRAIN_BENCH_KIND").unwrap_or_default();
    let case = |name, shape, reps, causal, dropout| Case {
        name,
        shape,
        reps,
        causal,
        dropout,
    };
    for case in [
        case("DistilBERT QA, seq 384", [8, 12, 384, 64], 10, false, 0.1),
        case(
            "DistilBERT QA, length-grouped windows of 192",
            [8, 12, 192, 64],
            20,
            false,
            0.1,
        ),
        case("MiniLM sentences, seq 48", [32, 12, 48, 32], 50, false, 0.1),
        case(
            "Llama-125M causal LM, seq 512",
            [1, 12, 512, 64],
            20,
            true,
            0.0,
        ),
    ]
    .into_iter()
    .filter(|c| c.name.contains(&only))
    {
        for kind in [Kind::Float, Kind::BFloat16]
            .into_iter()
            .filter(|kind| format!("{kind:?}").contains(&only_kind))
        {
            for (path, kernel) in [
                ("per pair", Kernel::Seeded(0)),
                ("batched", Kernel::Seeded(i64::MAX)),
                ("libtorch fused", Kernel::Fused),
            ]
            .into_iter()
            .filter(|(path, _)| path.contains(&only_path))
            {
                let (median, best) = time_pass(&case, kind, kernel);
                let dropout = match kernel {
                    Kernel::Seeded(_) => case.dropout,
                    Kernel::Fused => 0.0,
                };
                let ([b, h, t, d], reps) = (case.shape, case.reps);
                // Seven (T x T x D) products a pass (the fused kernel's backward recomputes the
                // scores too), 2 flops per multiply-add; under the causal mask, the half of
                // them a kernel that skipped every masked product would do.
                let masked = if case.causal { 0.5 } else { 1.0 };
                let flops = masked * 7.0 * 2.0 * (b * h * t * t * d) as f64;
                println!(
                    "{}, {kind:?}, {path}, dropout {}, {threads} threads: forward + backward median {:.1} ms, best {:.1} ms over {reps}; products at {:.0} GFLOP/s",
                    case.name,
                    dropout,
                    median * 1e3,
                    best * 1e3,
                    flops / median / 1e9
                );
            }
        }
    }
}
