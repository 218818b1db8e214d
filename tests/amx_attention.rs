//! The per-pair attention's bf16 products: on a CPU with AMX through oneDNN's brgemm
//! microkernel (no at::mm call; the scores reach the softmax in fp32, unrounded), elsewhere
//! through at::mm. Either way the output and gradients track fp32 attention of the same bf16
//! values. Its own process: it profiles on one thread.

mod common;

use common::{max_abs_diff, mm_calls, per_pair_attention};
use sprtrain::runtime::sysinfo::CpuInfo;
use tch::{Device, Kind, Tensor};

#[test]
fn bf16_per_pair_attention_runs_on_amx_and_tracks_fp32() {
    // - 37 positions: odd reduction lengths (the microkernel takes pairs of terms; the last
    //   one is added apart), (37, 16) x (16, 37) blocks narrower than one 64-column block;
    // - 5 queries of 37 keys: P^T dO with a (5, 37) P;
    // - 300 positions, causal: query tiles of 128, 128 and 44, key blocks of 64 and a part one.
    for (t, queries, causal) in [(37, 37, false), (37, 5, false), (300, 300, true)] {
        tch::manual_seed(t + queries);
        // bf16 values from the start, so both sides see the same inputs.
        let fused = Tensor::randn([3, t, 3 * 4 * 16], (Kind::Float, Device::Cpu))
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Float);
        let grad_out = Tensor::randn([3, 4, queries, 16], (Kind::Float, Device::Cpu));
        let (out, grad) = per_pair_attention(&fused, Kind::BFloat16, queries, causal, &grad_out);
        let (want, want_grad) = per_pair_attention(&fused, Kind::Float, queries, causal, &grad_out);
        // bf16 keeps 8 bits of mantissa: each rounding (the dropped probabilities, the output,
        // the scores' gradient) is off by up to 2^-9 relative, on outputs of magnitude ~1-3
        // and gradients up to ~15, summed over at most 300 terms of either sign: measured
        // 0.006-0.016 on outputs and 0.3% of the largest gradient, on AMX and off it.
        let what = format!("{queries} queries of {t} keys, causal {causal}");
        let d = max_abs_diff(&out, &want);
        assert!(d < 0.05, "{what}: bf16 outputs differ from fp32 by {d:e}");
        let d = max_abs_diff(&grad, &want_grad);
        let scale = f64::try_from(want_grad.abs().max()).unwrap();
        assert!(scale > 1.0, "{what}: trivial gradients");
        assert!(
            d < 0.01 * scale,
            "{what}: bf16 gradients differ from fp32 by {d:e} (largest {scale})"
        );
    }
    // Which products ran, as the profiler sees them (one thread, so that every pair runs on the
    // profiled one): none through at::mm on AMX; elsewhere at least 3 sequences x 4 heads x 3
    // causal tiles x 6 products.
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    tch::manual_seed(1);
    let fused = Tensor::randn([3, 300, 3 * 4 * 16], (Kind::Float, Device::Cpu));
    let grad_out = Tensor::randn([3, 4, 300, 16], (Kind::Float, Device::Cpu));
    let calls = mm_calls(tmp.path(), || {
        let _ = per_pair_attention(&fused, Kind::BFloat16, 300, true, &grad_out);
    });
    let cpu = CpuInfo::detect();
    if cpu.amx_bf16 && cpu.amx_tile {
        assert_eq!(calls, 0.0, "at::mm calls of bf16 attention on AMX");
    } else {
        eprintln!("no AMX here: bf16 attention's products through at::mm ({calls} calls)");
        assert!(
            calls >= 216.0,
            "at::mm calls of bf16 attention without AMX: {calls}"
        );
    }
}
