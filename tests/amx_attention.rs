//! The per-pair attention's bf16 products: on a CPU with AMX through oneDNN's brgemm
//! microkernel (no at::mm call; the scores reach the softmax in fp32, unrounded), elsewhere
//! through at::mm. Either way the output and gradients track fp32 attention of the same bf16
//! values. Its own process: it profiles on one thread.

use sprtrain::models::layers;
use sprtrain::sysinfo::CpuInfo;
use sprtrain::train::profile::StepProfiler;
use tch::{Device, Kind, Tensor};

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

/// Attention on the per-pair path, dropout 0.2, of q, k, v taken as (B, H, T, D) views of one
/// (B, T, 3 H D) projection in `kind` (3 sequences padded to lengths T, 20 and 5; 4 heads of
/// 16), the first `queries` positions asking: the output and the projection's gradient for
/// `grad_out`, both in fp32.
fn attention(
    fused: &Tensor,
    kind: Kind,
    queries: i64,
    causal: bool,
    grad_out: &Tensor,
) -> (Tensor, Tensor) {
    let fused = fused.to_kind(kind).detach().set_requires_grad(true);
    let (b, t, width) = fused.size3().unwrap();
    let (heads, d) = (4, width / 12);
    let part = |i: i64| {
        fused
            .narrow(2, i * heads * d, heads * d)
            .view([b, t, heads, d])
            .transpose(1, 2)
    };
    let lengths = Tensor::from_slice(&[t, 20, 5]).view([b, 1]);
    let positions = Tensor::arange(t, (Kind::Int64, Device::Cpu)).view([1, t]);
    let keys = layers::key_mask(&positions.lt_tensor(&lengths));
    let q = part(0).narrow(2, 0, queries);
    let out = if causal {
        layers::seeded_causal_attention(&q, &part(1), &part(2), &keys, 0.2, 11, 0)
    } else {
        layers::seeded_attention_with(&q, &part(1), &part(2), &keys, 0.2, 11, 0)
    };
    (out.to_kind(Kind::Float) * grad_out)
        .sum(Kind::Float)
        .backward();
    (
        out.detach().to_kind(Kind::Float),
        fused.grad().to_kind(Kind::Float),
    )
}

/// at::mm's calls while `f` runs, as libtorch's profiler records them on this thread.
fn mm_calls(dir: &std::path::Path, f: impl FnOnce()) -> f64 {
    let mut profiler = StepProfiler::new(1, 1, dir).unwrap();
    profiler.before_step(1).unwrap();
    f();
    let ops = std::fs::read_to_string(profiler.after_step(1, true).unwrap().unwrap()).unwrap();
    ops.lines()
        .find_map(|l| l.strip_prefix("| `aten::mm` | "))
        .and_then(|rest| rest.split(" |").next())
        .map_or(0.0, |calls| calls.parse().unwrap())
}

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
        let (out, grad) = attention(&fused, Kind::BFloat16, queries, causal, &grad_out);
        let (want, want_grad) = attention(&fused, Kind::Float, queries, causal, &grad_out);
        // bf16 keeps 8 bits of mantissa: each rounding (the dropped probabilities, the output,
        // the scores' gradient) is off by up to 2^-9 relative, on outputs of magnitude ~1-3
        // and gradients up to ~15, summed over at most 300 terms of either sign: measured
        // 0.006-0.016 on outputs and 0.3% of the largest gradient, on AMX and off it.
        let what = format!("{queries} queries of {t} keys, causal {causal}");
        let d = max_diff(&out, &want);
        assert!(d < 0.05, "{what}: bf16 outputs differ from fp32 by {d:e}");
        let d = max_diff(&grad, &want_grad);
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
        let _ = attention(&fused, Kind::BFloat16, 300, true, &grad_out);
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
