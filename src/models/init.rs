//! Random initialisation of weights: normal draws, as transformers' `_init_weights` makes them,
//! fast enough that building a base-size model from its config is not a visible part of startup.
//!
//! libtorch's `normal_` draws on one thread from a Mersenne twister (0.3 s for DistilBERT's 66M
//! weights on these machines). Here each chunk of 64K elements has its own counter-based stream
//! (a keyed integer hash of the element's index, so any thread can draw any chunk) turned into
//! normals by the Box-Muller transform, written as plain arithmetic on blocks of eight pairs
//! that the compiler vectorises. The values depend on the key and the element's place only: not
//! on threads, nor on the instruction set (no fused multiply-adds are formed).

use rayon::prelude::*;
use tch::{Kind, Tensor};

/// Elements per independently keyed chunk: the unit of parallel work.
const CHUNK: usize = 1 << 16;
/// Outputs per block: eight Box-Muller pairs, cosines first, then sines.
const BLOCK: usize = 16;
const PAIRS: usize = BLOCK / 2;

/// Fills a contiguous fp32 CPU tensor with normal(0, `std`) draws from the stream `key`.
pub fn fill_normal(t: &Tensor, key: u64, std: f32) {
    assert!(t.kind() == Kind::Float && t.is_contiguous() && t.device() == tch::Device::Cpu);
    let n = t.numel();
    // SAFETY: `t` is a contiguous fp32 CPU tensor of n elements; the caller created it and
    // nothing else reads or writes it until this returns.
    let values = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) };
    fill_normal_slice(values, key, std);
}

/// [`fill_normal`] on a slice, in parallel over chunks.
pub fn fill_normal_slice(values: &mut [f32], key: u64, std: f32) {
    values
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| fill_chunk(chunk, chunk_key(key, i as u64), std));
}

/// Two 32-bit hash keys for chunk `index` of stream `key` (splitmix64's finaliser).
fn chunk_key(key: u64, index: u64) -> (u32, u32) {
    let mut z = key.wrapping_add((index + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z as u32, (z >> 32) as u32)
}

fn fill_chunk(chunk: &mut [f32], key: (u32, u32), std: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { fill_chunk_avx2(chunk, key, std) };
    }
    fill_chunk_portable(chunk, key, std)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_chunk_avx2(chunk: &mut [f32], key: (u32, u32), std: f32) {
    fill_chunk_portable(chunk, key, std)
}

#[inline(always)]
fn fill_chunk_portable(chunk: &mut [f32], key: (u32, u32), std: f32) {
    let mut blocks = chunk.chunks_exact_mut(BLOCK);
    let mut first_pair = 0u32;
    for out in &mut blocks {
        normal_block(
            out.try_into().unwrap_or_else(|_| unreachable!()),
            key,
            first_pair,
            std,
        );
        first_pair += PAIRS as u32;
    }
    let rest = blocks.into_remainder();
    if !rest.is_empty() {
        let mut last = [0f32; BLOCK];
        normal_block(&mut last, key, first_pair, std);
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// Wellons' lowbias32 integer hash.
#[inline(always)]
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// 24 random bits of draw `index` of the stream keyed by `key`.
#[inline(always)]
fn bits24(key: (u32, u32), index: u32) -> f32 {
    (lowbias32(lowbias32(index ^ key.0).wrapping_add(key.1)) >> 8) as f32
}

/// Natural logarithm of a positive normal f32: exponent and mantissa apart, the mantissa's
/// logarithm by the atanh series (|s| <= 0.172: relative error below 1e-7).
#[inline(always)]
fn ln(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut exponent = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000); // [1, 2)
    let high = m > std::f32::consts::SQRT_2;
    m = if high { m * 0.5 } else { m };
    exponent += high as i32;
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series = 1.0 + s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0))));
    exponent as f32 * std::f32::consts::LN_2 + 2.0 * s * series
}

/// cos and sin of x in [-pi, pi] by their Taylor series to degree 16 and 15 (error below 1e-6).
#[inline(always)]
fn cos_sin(x: f32) -> (f32, f32) {
    let x2 = x * x;
    // Term k over term k-1 is -x2 / ((2k-1) 2k) for cos and -x2 / (2k (2k+1)) for sin.
    let cos = nested_series(x2, &[2.0, 12.0, 30.0, 56.0, 90.0, 132.0, 182.0, 240.0]);
    let sin = x * nested_series(x2, &[6.0, 20.0, 42.0, 72.0, 110.0, 156.0, 210.0]);
    (cos, sin)
}

/// 1 - x2/d0 (1 - x2/d1 (1 - ... (1 - x2/dn))), evaluated from the innermost bracket out (a
/// fixed order, so every build and both code paths give the same bits).
#[inline(always)]
fn nested_series(x2: f32, divisors: &[f32]) -> f32 {
    divisors
        .iter()
        .rev()
        .fold(1.0, |inner, &d| 1.0 - x2 / d * inner)
}

/// Eight Box-Muller pairs, pairs `first_pair ..` of the stream: radius from one uniform in
/// (0, 1), angle from another in [-pi, pi).
#[inline(always)]
fn normal_block(out: &mut [f32; BLOCK], key: (u32, u32), first_pair: u32, std: f32) {
    const TO_UNIT: f32 = 1.0 / (1u32 << 24) as f32;
    let mut radius = [0f32; PAIRS];
    let mut angle = [0f32; PAIRS];
    for j in 0..PAIRS {
        let pair = first_pair + j as u32;
        let u = (bits24(key, 2 * pair) + 0.5) * TO_UNIT;
        radius[j] = (-2.0 * ln(u)).sqrt() * std;
        angle[j] = (bits24(key, 2 * pair + 1) * TO_UNIT - 0.5) * std::f32::consts::TAU;
    }
    for j in 0..PAIRS {
        let (c, s) = cos_sin(angle[j]);
        out[j] = radius[j] * c;
        out[PAIRS + j] = radius[j] * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(n: usize, key: u64) -> Vec<f32> {
        let mut v = vec![0f32; n];
        fill_normal_slice(&mut v, key, 1.0);
        v
    }

    #[test]
    fn draws_are_standard_normal() {
        // 2M draws: the standard error of the mean is 0.0007, of the variance 0.001, of a
        // tail fraction at most 0.00035; the bounds are over 4 of them.
        let v = draws(2_000_003, 7);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        let kurtosis = v.iter().map(|&x| (x as f64 - mean).powi(4)).sum::<f64>() / n / var.powi(2);
        assert!(mean.abs() < 0.003, "mean {mean}");
        assert!((var - 1.0).abs() < 0.005, "variance {var}");
        assert!((kurtosis - 3.0).abs() < 0.03, "kurtosis {kurtosis}");
        for (k, inside) in [(1.0, 0.682_689), (2.0, 0.954_500), (3.0, 0.997_300)] {
            let frac = v.iter().filter(|x| x.abs() < k).count() as f64 / n;
            assert!((frac - inside).abs() < 0.0015, "within {k} sd: {frac}");
        }
        // Neighbours are independent: the lag-1 and lag-8 correlations are noise (sd 0.0007).
        for lag in [1, 8] {
            let c = v
                .windows(lag + 1)
                .map(|w| (w[0] * w[lag]) as f64)
                .sum::<f64>()
                / n;
            assert!(c.abs() < 0.003, "lag {lag}: {c}");
        }
        assert!(v.iter().all(|x| x.is_finite() && x.abs() < 6.0));
    }

    #[test]
    fn draws_depend_on_key_and_place_only() {
        let a = draws(200_000, 1);
        // The same on one thread as on many.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert_eq!(pool.install(|| draws(200_000, 1)), a);
        // A shorter buffer is a prefix (the tail of a partial block included).
        assert_eq!(draws(70_001, 1), a[..70_001]);
        assert_ne!(draws(1000, 2), a[..1000]);
        // Every code path the CPU takes gives the same values as the portable one.
        let mut portable = vec![0f32; 1000];
        fill_chunk_portable(&mut portable, chunk_key(1, 0), 1.0);
        assert_eq!(portable, a[..1000]);
    }

    #[test]
    fn ln_and_cos_sin_are_accurate() {
        for i in 1..=10_000 {
            let x = i as f32 / 10_000.0;
            assert!(
                (ln(x) - x.ln()).abs() <= 2e-7 * x.ln().abs().max(1.0),
                "ln {x}"
            );
            let a = (x - 0.5) * std::f32::consts::TAU;
            let (c, s) = cos_sin(a);
            assert!(
                (c - a.cos()).abs() < 2e-6 && (s - a.sin()).abs() < 2e-6,
                "{a}"
            );
        }
    }
}
