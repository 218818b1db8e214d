//! `runtime.fp32_gemm = "onednn"`: the linear layers' fp32 products through libtorch's oneDNN
//! matmul give libtorch's own `linear` (its BLAS) results, forward and backward, on the paths
//! the layers take (bias as the product's start, the input gradient, a weight gradient made
//! new on the first backward and added in place by the product on the second). One test in its
//! own process: the choice is process-wide.

use sprtrain::config::Fp32Gemm;
use sprtrain::models::layers;
use sprtrain::sysinfo::{self, CpuInfo};
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
fn linear_layers_through_onednn_match_libtorchs_blas() {
    if let Err(e) = sysinfo::select_fp32_gemm(Fp32Gemm::Onednn) {
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
    sysinfo::select_fp32_gemm(Fp32Gemm::Blas).unwrap();
    let blas = layers::linear(&x, &w, None);
    let d = max_diff(&without, &blas);
    assert!(
        d < 1e-4,
        "without a bias: oneDNN and the BLAS differ by {d:e}"
    );
}
