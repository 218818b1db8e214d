//! The seeded dropout and attention kernels (src/models/seeded.cpp): masks that depend only on
//! the seed, the dropout rate they promise, and attention values and gradients equal to
//! libtorch's own on the same mask.

mod common;

use common::max_abs_diff;
use rand::{Rng, SeedableRng};
use sprtrain::models::layers::{
    key_mask, seeded_attention_with, seeded_causal_attention, seeded_dropout,
};
use tch::{Kind, Tensor};

const CPU: tch::Device = tch::Device::Cpu;

/// Standard normal values from their own seeded stream (Box-Muller), so every run and every
/// test thread sees the same inputs whatever else draws from libtorch's global generator.
fn randn(shape: &[i64], seed: u64) -> Tensor {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product::<i64>() as usize;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect();
    Tensor::from_slice(&values).view(shape)
}

fn leaf(shape: &[i64], kind: Kind, seed: u64) -> Tensor {
    randn(shape, seed).to_kind(kind).set_requires_grad(true)
}

#[test]
fn dropout_mask_is_seeded_scaled_and_at_the_promised_rate() {
    let n = 1_000_000i64;
    let ones = Tensor::ones([n], (Kind::Float, CPU));
    let p = 0.1;
    let a = seeded_dropout(&ones, p, 7);
    let values: Vec<f32> = Vec::try_from(&a).unwrap();
    let scale = (1.0 / (1.0 - p)) as f32;
    assert!(values.iter().all(|&v| v == 0.0 || v == scale));
    // Kept fraction: binomial(1e6, 0.9) has sd 3e-4; 5 sd is 1.5e-3.
    let kept = values.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
    assert!((kept - 0.9).abs() < 1.5e-3, "kept {kept}");
    // The same seed gives the same mask; another seed an unrelated one (agreement of two
    // independent masks: 0.9^2 + 0.1^2 = 0.82).
    assert_eq!(max_abs_diff(&a, &seeded_dropout(&ones, p, 7)), 0.0);
    let b = seeded_dropout(&ones, p, 8);
    let agree = a
        .eq_tensor(&b)
        .to_kind(Kind::Float)
        .mean(Kind::Float)
        .double_value(&[]);
    assert!((agree - 0.82).abs() < 3e-3, "agreement {agree}");
}

#[test]
fn dropout_gradient_is_the_same_mask() {
    let x = leaf(&[64, 96], Kind::Float, 1);
    let w = randn(&[64, 96], 2);
    let y = seeded_dropout(&x, 0.25, 11);
    (&y * &w).sum(Kind::Float).backward();
    let mask = seeded_dropout(&Tensor::ones([64, 96], (Kind::Float, CPU)), 0.25, 11);
    // y = x * mask exactly (one multiply each), and dy/dx = mask.
    assert!(max_abs_diff(&y, &(&x * &mask)) < 1e-6);
    assert!(max_abs_diff(&x.grad(), &(&w * &mask)) < 1e-6);
}

/// bf16 dropout writes, bit for bit, the fp32 result on the same mask rounded to bf16 (both
/// round the one product x * scale to nearest-even), over values that exercise the rounding:
/// normal draws (sd 3), ties, infinities, NaN, the largest finite bf16, zeros and
/// subnormals; 100,003 elements so that the kernel's parallel chunks and vector tails are
/// crossed. The check is exact: no tolerance.
#[test]
fn bf16_dropout_is_the_fp32_result_rounded() {
    let n = 100_003i64;
    let mut values: Vec<f32> = Vec::try_from(&(randn(&[n], 5) * 3.0)).unwrap();
    let specials = [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        3.389_531_4e38, // the largest finite bf16: any scale above 1 overflows it to inf
        0.0,
        -0.0,
        1e-40,             // subnormal
        1.0 + 1.0 / 256.0, // halfway between two bf16 values (the input cast rounds it)
        65504.0,
    ];
    for (i, s) in specials.iter().enumerate() {
        values[i * 7] = *s;
    }
    let x = Tensor::from_slice(&values).to_kind(Kind::BFloat16);
    // p = 1/3 scales by 1.5: products of 8-bit mantissas that often fall halfway.
    for (p, seed) in [(0.1, 3), (1.0 / 3.0, 4), (0.5, 9)] {
        let ours = seeded_dropout(&x, p, seed);
        let expected = seeded_dropout(&x.to_kind(Kind::Float), p, seed).to_kind(Kind::BFloat16);
        assert_eq!(ours.kind(), Kind::BFloat16);
        // NaN stays NaN (libtorch's vectorised cast writes another NaN pattern than c10's
        // scalar one); every other element must match bit for bit.
        let nan = expected.isnan();
        assert!(ours.isnan().equal(&nan), "p {p}: NaN positions differ");
        let (a, b) = (
            ours.view_dtype(Kind::Int16),
            expected.view_dtype(Kind::Int16),
        );
        let differ = a
            .ne_tensor(&b)
            .logical_and(&nan.logical_not())
            .sum(Kind::Int64)
            .int64_value(&[]);
        assert_eq!(
            differ, 0,
            "p {p}: {differ} bf16 elements differ from the rounded fp32 result"
        );
    }
}

/// Plain attention through libtorch's autograd: softmax(q k^T / sqrt(d) + bias) * mask @ v.
fn reference_attention(q: &Tensor, k: &Tensor, v: &Tensor, keys: &Tensor, mask: &Tensor) -> Tensor {
    let d = q.size()[3] as f64;
    let scores = q.matmul(&k.transpose(-2, -1)) / d.sqrt();
    let scores = scores.masked_fill(&keys.logical_not(), f64::NEG_INFINITY);
    (scores.softmax(-1, Kind::Float) * mask).matmul(v)
}

/// The two ways seeded attention runs: batched products, and a loop over (batch, head) pairs.
const PATHS: [(&str, i64); 2] = [("batched", i64::MAX), ("per pair", 0)];

/// Values and gradients of the seeded attention, on each path, against the reference on the
/// same mask.
fn compare(p: f64, kind: Kind, tolerance: f64) {
    compare_queries(p, kind, tolerance, 37);
}

/// As `compare`, with `queries` queries (the first positions) against all 37 keys.
fn compare_queries(p: f64, kind: Kind, tolerance: f64, queries: i64) {
    for (path, batched_up_to) in PATHS {
        compare_on(
            p,
            kind,
            tolerance,
            batched_up_to,
            path,
            (queries, 37),
            Masking::Keys,
        );
    }
}

/// Which keys a query sees in `compare_on`.
#[derive(Clone, Copy, PartialEq)]
enum Masking {
    /// The unpadded keys.
    Keys,
    /// Also only those up to its own position, passed as a (B, 1, Tq, T) mask whose every row
    /// differs, as decoders with padding pass.
    CausalExplicit,
    /// The same, passed as the key mask and the causal flag (`seeded_causal_attention`).
    Causal,
}

/// (B, H, queries, D) q and (B, H, T, D) k, v (leaves), the key mask of lengths T, 20 and 5,
/// and an output gradient.
fn attention_inputs(kind: Kind, queries: i64) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    attention_inputs_of(kind, queries, 37)
}

fn attention_inputs_of(
    kind: Kind,
    queries: i64,
    t: i64,
) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let (b, h, d) = (3, 4, 16);
    let (q, k, v) = (
        leaf(&[b, h, queries, d], kind, 3),
        leaf(&[b, h, t, d], kind, 4),
        leaf(&[b, h, t, d], kind, 5),
    );
    // Padding: sequence lengths T, 20 and 5.
    let lengths = Tensor::from_slice(&[t, 20, 5]).view([b, 1]);
    let keys = key_mask(
        &Tensor::arange(t, (Kind::Int64, CPU))
            .view([1, t])
            .lt_tensor(&lengths),
    );
    let grad_out = randn(&[b, h, queries, d], 6);
    (q, k, v, keys, grad_out)
}

/// `(queries, keys)`: the first `queries` positions against `keys` keys.
fn compare_on(
    p: f64,
    kind: Kind,
    tolerance: f64,
    batched_up_to: i64,
    path: &str,
    (queries, t): (i64, i64),
    masking: Masking,
) {
    let (q, k, v, key_padding, grad_out) = attention_inputs_of(kind, queries, t);
    let (b, h, tq, _) = q.size4().unwrap();
    let keys = if masking == Masking::Keys {
        key_padding.shallow_clone()
    } else {
        let positions = Tensor::arange(t, (Kind::Int64, CPU));
        let earlier = positions
            .view([1, t])
            .le_tensor(&positions.narrow(0, 0, tq).view([tq, 1]));
        key_padding.logical_and(&earlier.view([1, 1, tq, t]))
    };
    let seed = 1234;
    let out = if masking == Masking::Causal {
        seeded_causal_attention(&q, &k, &v, &key_padding, p, seed, batched_up_to)
    } else {
        seeded_attention_with(&q, &k, &v, &keys, p, seed, batched_up_to)
    };
    (&out.to_kind(Kind::Float) * &grad_out)
        .sum(Kind::Float)
        .backward();
    let got: Vec<Tensor> = [&q, &k, &v].iter().map(|x| x.grad().copy()).collect();

    let (q32, k32, v32) = (
        q.detach().to_kind(Kind::Float).set_requires_grad(true),
        k.detach().to_kind(Kind::Float).set_requires_grad(true),
        v.detach().to_kind(Kind::Float).set_requires_grad(true),
    );
    // Element i of the (B, H, Tq, T) probabilities meets element i of the dropout mask.
    let mask = if p > 0.0 {
        seeded_dropout(&Tensor::ones([b, h, tq, t], (Kind::Float, CPU)), p, seed)
    } else {
        Tensor::ones([b, h, tq, t], (Kind::Float, CPU))
    };
    let want = reference_attention(&q32, &k32, &v32, &keys, &mask);
    (&want * &grad_out).sum(Kind::Float).backward();
    assert!(
        max_abs_diff(&out, &want) < tolerance,
        "{path}: output differs by {}",
        max_abs_diff(&out, &want)
    );
    for (name, g, w) in [
        ("q", &got[0], &q32),
        ("k", &got[1], &k32),
        ("v", &got[2], &v32),
    ] {
        let diff = max_abs_diff(g, &w.grad());
        assert!(
            diff < tolerance,
            "{path}: gradient of {name} differs by {diff}"
        );
    }
}

#[test]
fn attention_without_dropout_equals_plain_attention() {
    // fp32, the same operations in another order: float rounding only.
    compare(0.0, Kind::Float, 1e-5);
}

#[test]
fn attention_with_dropout_equals_plain_attention_on_the_same_mask() {
    compare(0.1, Kind::Float, 1e-5);
    compare(0.5, Kind::Float, 1e-5);
}

/// The last layer under a first-token classification head asks one query of all the keys;
/// 5 queries check the key mask's broadcast over several.
#[test]
fn attention_of_fewer_queries_than_keys_equals_plain_attention() {
    for queries in [1, 5] {
        compare_queries(0.0, Kind::Float, 1e-5, queries);
        compare_queries(0.2, Kind::Float, 1e-5, queries);
    }
}

/// Per-query masks (causal, over padding): the bias row each query reads is its own.
#[test]
fn causal_attention_equals_plain_attention() {
    compare_fp32_on_both_paths(37, Masking::CausalExplicit);
}

/// `compare_on` in fp32 with and without dropout, on both paths, over T = `t` positions.
fn compare_fp32_on_both_paths(t: i64, masking: Masking) {
    for (path, batched_up_to) in PATHS {
        for p in [0.0, 0.2] {
            compare_on(p, Kind::Float, 1e-5, batched_up_to, path, (t, t), masking);
        }
    }
}

/// The causal flag: on the per-pair path, query tiles of 128 against the keys up to each
/// tile's end (300 positions: tiles of 128, 128 and 44, so the diagonal, off-diagonal and a
/// short last tile all occur); batched, an explicit mask built from it. Equal to plain
/// attention under the causal mask and the key padding, on the same dropout mask.
#[test]
fn causal_tiles_equal_plain_attention() {
    compare_fp32_on_both_paths(300, Masking::Causal);
    // bf16 (products and the block in bf16, softmax in fp32) against the fp32 reference.
    compare_on(
        0.1,
        Kind::BFloat16,
        0.1,
        0,
        "per pair, bf16",
        (300, 300),
        Masking::Causal,
    );
}

/// Models pass q, k and v as (B, H, T, D) views of one (B, T, 3 H D) projection, which the
/// per-pair path reads in place and answers in the (B, T, H, D) layout the caller transposes
/// back to. Values and gradients equal those of contiguous copies of the same inputs, on both
/// paths, with dropout, with and without the causal flag, in fp32 (the same products on other
/// strides: rounding only) and bf16.
#[test]
fn attention_of_strided_views_equals_contiguous_inputs() {
    let (b, t, h, d) = (3, 37, 4, 16);
    let (_, _, _, keys, grad_out) = attention_inputs(Kind::Float, t);
    let run = |kind: Kind, batched_up_to: i64, causal: bool, strided: bool| {
        let fused = leaf(&[b, t, 3 * h * d], kind, 21);
        let heads = |i: i64| {
            let part = fused
                .narrow(2, i * h * d, h * d)
                .view([b, t, h, d])
                .transpose(1, 2);
            if strided {
                part
            } else {
                part.contiguous()
            }
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let out = if causal {
            seeded_causal_attention(&q, &k, &v, &keys, 0.2, 5, batched_up_to)
        } else {
            seeded_attention_with(&q, &k, &v, &keys, 0.2, 5, batched_up_to)
        };
        // (B, H, T, D) -> (B, T, H D), as the models do.
        let merged = out.transpose(1, 2).contiguous().view([b, t, h * d]);
        (&merged.to_kind(Kind::Float) * &grad_out.transpose(1, 2).reshape([b, t, h * d]))
            .sum(Kind::Float)
            .backward();
        (out.to_kind(Kind::Float), fused.grad().to_kind(Kind::Float))
    };
    for (kind, tolerance) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1e-2)] {
        for (path, batched_up_to) in PATHS {
            for causal in [false, true] {
                let (out, grad) = run(kind, batched_up_to, causal, true);
                let (want, want_grad) = run(kind, batched_up_to, causal, false);
                let what = format!("{path}, {kind:?}, causal {causal}");
                let diff = max_abs_diff(&out, &want);
                assert!(diff <= tolerance, "{what}: output differs by {diff}");
                let diff = max_abs_diff(&grad, &want_grad);
                assert!(diff <= tolerance, "{what}: gradient differs by {diff}");
            }
        }
    }
}

#[test]
fn attention_in_bf16_stays_close_to_fp32() {
    // bf16 inputs and products (8 mantissa bits: relative 4e-3 per rounding) against the fp32
    // reference on the same bf16 values; softmax is fp32 in both.
    compare(0.1, Kind::BFloat16, 0.1);
}

/// Both paths drop the same elements: their outputs and gradients agree to fp32 rounding (a
/// mask that differed in one element of the 16,428 would move outputs by ~0.1).
#[test]
fn batched_and_per_pair_attention_agree() {
    let run = |batched_up_to: i64| {
        let (q, k, v, keys, grad_out) = attention_inputs(Kind::Float, 37);
        let out = seeded_attention_with(&q, &k, &v, &keys, 0.3, 99, batched_up_to);
        (&out * &grad_out).sum(Kind::Float).backward();
        (out.detach(), q.grad(), k.grad(), v.grad())
    };
    let (a, b) = (run(PATHS[0].1), run(PATHS[1].1));
    for (name, x, y) in [
        ("output", &a.0, &b.0),
        ("q", &a.1, &b.1),
        ("k", &a.2, &b.2),
        ("v", &a.3, &b.3),
    ] {
        let diff = max_abs_diff(x, y);
        assert!(diff < 1e-5, "{name} differs by {diff} between the paths");
    }
}

#[test]
fn the_model_dropout_stream_is_reproducible() {
    use sprtrain::models::layers::{dropout, seed_dropout};
    let x = Tensor::ones([1000], (Kind::Float, CPU));
    seed_dropout(5);
    let (a1, a2) = (dropout(&x, 0.1, true), dropout(&x, 0.1, true));
    seed_dropout(5);
    let (b1, b2) = (dropout(&x, 0.1, true), dropout(&x, 0.1, true));
    assert_eq!(max_abs_diff(&a1, &b1), 0.0);
    assert_eq!(max_abs_diff(&a2, &b2), 0.0);
    // Successive masks of one stream differ, and evaluation draws none.
    assert!(max_abs_diff(&a1, &a2) > 0.0);
    assert_eq!(max_abs_diff(&dropout(&x, 0.1, false), &x), 0.0);
}
