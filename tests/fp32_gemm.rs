//! `runtime.fp32_gemm = "onednn"`: the linear layers' fp32 products through libtorch's oneDNN
//! matmul give libtorch's own `linear` (its BLAS) results, forward and backward, on the paths
//! the layers take (bias as the product's start, the input gradient, a weight gradient made
//! new on the first backward and added in place by the product on the second); the per-pair
//! attention's products through oneDNN's brgemm microkernel give the BLAS's, and the same bits
//! under "blas+brgemm", whose attention calls no at::mm (libtorch's profiler counts them). One
//! test in its own process: the choice is process-wide.

mod common;

use common::{mm_calls, per_pair_attention};
use sprtrain::config::Fp32Gemm;
use sprtrain::models::layers;
use sprtrain::runtime::sysinfo::CpuInfo;
use tch::{Device, Kind, Tensor};

fn leaf(dims: &[i64]) -> Tensor {
    Tensor::randn(dims, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

fn copy(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

#[test]
fn fp32_products_through_onednn_match_libtorchs_blas() {
    if let Err(e) = Fp32Gemm::Onednn.select() {
        // Only a CPU without what oneDNN's fp32 matmul needs may refuse it.
        assert!(
            !CpuInfo::detect().avx512_bw_vl_dq,
            "oneDNN refused a CPU with AVX-512 BW/VL/DQ: {e}"
        );
        assert!(e.to_string().contains("runtime.fp32_gemm"), "{e}");
        eprintln!("skipped: oneDNN's fp32 matmul does not run on this CPU ({e})");
        return;
    }
    tch::manual_seed(3);
    // Rows, inputs and outputs that are no multiple of a vector's width.
    let (x, w, b) = (leaf(&[3, 37, 70]), leaf(&[45, 70]), leaf(&[45]));
    let (xr, wr, br) = (copy(&x), copy(&w), copy(&b));
    let dy = Tensor::randn([3, 37, 45], (Kind::Float, Device::Cpu));
    let yr = xr.linear(&wr, Some(&br));
    (&yr * &dy).sum(Kind::Float).backward();
    // Twice: the first backward returns the weight gradient to autograd (no .grad yet), the
    // second adds it into that .grad with the product itself (beta = 1).
    for pass in 1..=2 {
        let y = layers::linear(&x, &w, Some(&b));
        // fp32 sums of 70 products of N(0, 1) values: rounding alone differs, at ~1e-6.
        let d = max_diff(&y, &yr);
        assert!(d < 1e-4, "pass {pass}: outputs differ by {d:e}");
        assert!(
            f64::try_from(y.abs().max()).unwrap() > 1.0,
            "trivial outputs"
        );
        (&y * &dy).sum(Kind::Float).backward();
    }
    for (name, ours, theirs) in [("x", &x, &xr), ("w", &w, &wr), ("b", &b, &br)] {
        let d = max_diff(&ours.grad(), &(theirs.grad() * 2.0));
        // Sums over 111 rows of values near 10: fp32 rounding is ~1e-5.
        assert!(d < 1e-4, "{name}: gradient differs by {d:e}");
    }
    // Without a bias, and back on the BLAS: the same products.
    let without = layers::linear(&x, &w, None);
    // The per-pair attention, each case through oneDNN then the BLAS: (B, T, 3 H D)
    // projections of 3 sequences, 4 heads of 16, padded to lengths (T, 20, 5).
    // - 37 positions: (37, 16) x (16, 37) products, no multiple of 8 (the transposes' blocks);
    // - 5 queries of 37 keys: P^T dO with a (5, 37) P, taken as it stands, not transposed;
    // - 300 positions, causal: query tiles of 128, 128 and 44 against growing key ranges.
    let cases = [(37, 37, false), (37, 5, false), (300, 300, true)];
    let mut onednn = Vec::new();
    for &(t, queries, causal) in &cases {
        tch::manual_seed(t + queries);
        let fused = leaf(&[3, t, 3 * 4 * 16]);
        let grad_out = Tensor::randn([3, 4, queries, 16], (Kind::Float, Device::Cpu));
        onednn.push((
            fused.shallow_clone(),
            grad_out.shallow_clone(),
            per_pair_attention(&fused, Kind::Float, queries, causal, &grad_out),
        ));
    }
    // "blas+brgemm" (the BLAS for the layers): attention through the same microkernel, so the
    // same bits.
    Fp32Gemm::BlasBrgemm.select().unwrap();
    for (&(t, queries, causal), (fused, grad_out, (out, grad))) in cases.iter().zip(&onednn) {
        let (again, again_grad) = per_pair_attention(fused, Kind::Float, queries, causal, grad_out);
        assert!(
            again.equal(out) && again_grad.equal(grad),
            "{queries} queries of {t} keys, causal {causal}: blas+brgemm's attention is not onednn's"
        );
    }
    Fp32Gemm::Blas.select().unwrap();
    let blas = layers::linear(&x, &w, None);
    let d = max_diff(&without, &blas);
    assert!(
        d < 1e-4,
        "without a bias: oneDNN and the BLAS differ by {d:e}"
    );
    for (&(t, queries, causal), (fused, grad_out, (out, grad))) in cases.iter().zip(&onednn) {
        let (want, want_grad) = per_pair_attention(fused, Kind::Float, queries, causal, grad_out);
        // Outputs near 1, gradients near 10: sums of at most 300 fp32 products in another
        // order differ by ~1e-6.
        let what = format!("{queries} queries of {t} keys, causal {causal}");
        let d = max_diff(out, &want);
        assert!(d < 1e-5, "{what}: attention outputs differ by {d:e}");
        let d = max_diff(grad, &want_grad);
        assert!(d < 1e-4, "{what}: attention gradients differ by {d:e}");
        assert!(
            f64::try_from(grad.abs().max()).unwrap() > 1.0,
            "trivial gradients"
        );
    }
    // Which library ran attention, as the profiler sees it (one thread, so that every pair runs
    // on the profiled one): at least 3 sequences x 4 heads x 3 causal tiles x 6 products
    // through at::mm on the BLAS; none under "blas+brgemm".
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let ((t, queries, causal), (fused, grad_out, _)) = (cases[2], &onednn[2]);
    let mut calls = Vec::new();
    for gemm in [Fp32Gemm::Blas, Fp32Gemm::BlasBrgemm] {
        gemm.select().unwrap();
        let dir = tmp.path().join(format!("{gemm:?}"));
        calls.push(mm_calls(&dir, || {
            let _ = per_pair_attention(fused, Kind::Float, queries, causal, grad_out);
        }));
    }
    assert!(
        calls[0] >= 216.0 && calls[1] == 0.0,
        "at::mm calls of {t} causal positions, BLAS and blas+brgemm: {calls:?}"
    );
}
