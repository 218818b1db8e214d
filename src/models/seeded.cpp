// Training-time dropout and attention whose backward passes regenerate the dropout mask from a
// seed instead of keeping it, and (attention) recompute the softmax probabilities instead of
// keeping them: the "selective activation recomputation" of Korthikanti et al. (2022), done on
// CPU. At DistilBERT-base's seq 384 x batch 8, libtorch's math attention path keeps three
// (B, H, T, T) fp32 tensors per layer (probabilities, dropout mask, dropped probabilities:
// 170 MB) and draws the mask with bernoulli_ (45 ms per layer); here a layer keeps q, k, v and
// the mask costs a hash per element. Recomputation adds one (T x T) product per layer.
//
// The mask is counter-based: element i of a tensor is kept when a hash of (seed, i) falls
// below (1 - p) * 2^32, so forward and backward (and any chunking) agree without storing it.
// Called from Rust through the C functions at the bottom (tensors are tch's at::Tensor*).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "ffi.h"
#include "gemm.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Two rounds of a 32-bit integer hash (Wellons' lowbias32) of the element's index, keyed by
// the seed: 32-bit multiplies, so the mask loop vectorises (AVX2: 8 elements per step). U is
// uint32_t or a GCC vector of them (the attention rows draw 16 at once).
template <typename U>
inline __attribute__((always_inline)) U lowbias32(U x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline uint32_t draw(uint32_t key0, uint32_t key1, uint32_t index) {
  return lowbias32(lowbias32(index ^ key0) + key1);
}

// bf16 (raw bits) to fp32, and fp32 to bf16 rounding to nearest-even as c10::BFloat16 does
// (NaN to 0x7FC0). Inline, so the loops that call them vectorise.
inline float bf16_bits_to_f32(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint16_t f32_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
  return value != value ? uint16_t{0x7FC0} : rounded;
}

// dst[j] = src[j] * mask(first + j) for j < n (dst may be src), fp32: the hot loop, compiled
// for AVX-512, AVX2 and baseline x86-64 and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void mask_f32(const float* src, float* dst, int64_t n, uint32_t first, uint32_t key0,
              uint32_t key1, uint32_t keep_below, float scale) {
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = draw(key0, key1, first + static_cast<uint32_t>(j)) < keep_below;
    dst[j] = keep ? src[j] * scale : 0.0f;
  }
}

// The same for bf16 (raw bits), rounding the product to nearest-even as c10::BFloat16 does
// (NaN to 0x7FC0), so it writes the bits the generic loop wrote; that loop converted one
// element at a time and weighed 6% of a bf16 MiniLM step.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void mask_bf16(const uint16_t* src, uint16_t* dst, int64_t n, uint32_t first, uint32_t key0,
               uint32_t key1, uint32_t keep_below, float scale) {
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = draw(key0, key1, first + static_cast<uint32_t>(j)) < keep_below;
    const uint16_t out = f32_to_bf16_bits(bf16_bits_to_f32(src[j]) * scale);
    dst[j] = keep ? out : uint16_t{0};
  }
}

struct Mask {
  uint32_t key0, key1;
  uint32_t keep_below;  // keep when the draw is below: (1 - p) * 2^32, saturated
  float scale;          // 1 / (1 - p)

  Mask(double p, int64_t seed)
      : key0(static_cast<uint32_t>(static_cast<uint64_t>(seed))),
        key1(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32)),
        keep_below(static_cast<uint32_t>(
            std::min(std::llround((1.0 - p) * 4294967296.0), 4294967295LL))),
        scale(static_cast<float>(1.0 / (1.0 - p))) {}

  // dst = src * the mask of elements first .. first + numel, both contiguous and of one dtype
  // (dst may be src). Element numbers are taken modulo 2^32.
  void apply(const at::Tensor& src, at::Tensor& dst, int64_t first) const {
    TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "dropout mask needs contiguous tensors");
    TORCH_CHECK(src.numel() == dst.numel() && src.scalar_type() == dst.scalar_type(),
                "dropout mask: source and destination differ");
    const int64_t n = src.numel();
    const Mask m = *this;
    if (src.scalar_type() == at::kFloat) {
      const float* in = src.data_ptr<float>();
      float* out = dst.data_ptr<float>();
      at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
        mask_f32(in + begin, out + begin, end - begin, static_cast<uint32_t>(first + begin), m.key0,
                 m.key1, m.keep_below, m.scale);
      });
      return;
    }
    if (src.scalar_type() == at::kBFloat16) {
      const auto* in = reinterpret_cast<const uint16_t*>(src.const_data_ptr<at::BFloat16>());
      auto* out = reinterpret_cast<uint16_t*>(dst.mutable_data_ptr<at::BFloat16>());
      at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
        mask_bf16(in + begin, out + begin, end - begin, static_cast<uint32_t>(first + begin), m.key0,
                  m.key1, m.keep_below, m.scale);
      });
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, src.scalar_type(), "seeded_mask", [&] {
      const scalar_t* in = src.data_ptr<scalar_t>();
      scalar_t* out = dst.data_ptr<scalar_t>();
      at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
          const bool keep = draw(m.key0, m.key1, static_cast<uint32_t>(first + j)) < m.keep_below;
          out[j] = keep ? static_cast<scalar_t>(static_cast<float>(in[j]) * m.scale) : scalar_t(0);
        }
      });
    });
  }

  void apply(at::Tensor& x, int64_t first) const { apply(x, x, first); }
};

// x times its dropout mask, in one pass into a new tensor.
at::Tensor masked_copy(const at::Tensor& x, double p, int64_t seed) {
  at::Tensor src = x.contiguous();
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Contiguous);
  Mask(p, seed).apply(src, out, 0);
  return out;
}

struct SeededDropout : public torch::autograd::Function<SeededDropout> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double p, int64_t seed) {
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    return masked_copy(x, p, seed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double p = ctx->saved_data["p"].toDouble();
    const int64_t seed = ctx->saved_data["seed"].toInt();
    return {masked_copy(grads[0], p, seed), at::Tensor(), at::Tensor()};
  }
};

// Row kernels of the per-pair attention, over one row of a (Tq, Tk) block in fp32, where ATen
// took a softmax, the mask and three dtype casts as separate passes (a sixth of a bf16
// DistilBERT step at seq 384): softmax with dropout, whose statistics (maximum, 1 / sum) let
// backward recompute a row in one pass, and the softmax gradient, which reads the dropped
// probabilities beside the undropped ones instead of drawing the mask a third time. Written on
// GCC's vectors of 16 floats (one AVX-512 register, two AVX2 ones), so they vectorise on every
// target without -ffast-math; a row's last n % 16 elements go through a padded chunk.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
#define SPRTRAIN_INLINE inline __attribute__((always_inline))

SPRTRAIN_INLINE f32x16 splat(float x) { return f32x16{} + x; }

SPRTRAIN_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

SPRTRAIN_INLINE void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// e^x for x <= 0 to about 1 ulp: Cephes' expf (x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial in r, 2^n through the exponent bits), and 0 below -87.3 where e^x turns subnormal.
SPRTRAIN_INLINE f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lowest = splat(-87.3f);
  const f32x16 clamped = x < lowest ? lowest : x;
  const f32x16 t = clamped * 1.44269504088896341f + 0.5f;
  i32x16 n = __builtin_convertvector(t, i32x16);  // toward zero: floor(t) below
  f32x16 nf = __builtin_convertvector(n, f32x16);
  n += (nf > t);  // -1 where truncation rounded up
  nf = __builtin_convertvector(n, f32x16);
  f32x16 r = clamped - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  f32x16 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const i32x16 bits = (n + 127) << 23;
  f32x16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < lowest ? splat(0.0f) : y * two_n;
}

SPRTRAIN_INLINE float lane_max(f32x16 v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

SPRTRAIN_INLINE float lane_sum(f32x16 v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

typedef uint32_t u32x16 __attribute__((vector_size(64)));

// x times the dropout mask of elements first .. first + 15 (the draws of `draw`, 16 at once).
SPRTRAIN_INLINE f32x16 drop16(f32x16 x, const Mask& m, uint32_t first) {
  const u32x16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const u32x16 index = lanes + first;
  const u32x16 drawn = lowbias32(lowbias32(index ^ m.key0) + m.key1);
  return drawn < m.keep_below ? x * m.scale : splat(0.0f);
}

// A row's softmax: its maximum and the reciprocal of its sum of exponentials.
struct RowStats {
  float max, inv_sum;
};

// The probabilities of a row from its exponentials e (e^(x - max), sum known): p = e inv_sum
// into `probs` where not null, and into `out` p times the dropout mask of elements first ..
// first + 15 where `drop` is not null, else p. One chunk of 16.
SPRTRAIN_INLINE void finish16(f32x16 e, float inv_sum, float* probs, float* out,
                              const Mask* drop, uint32_t first) {
  const f32x16 p = e * inv_sum;
  if (probs != nullptr) store16(probs, p);
  store16(out, drop != nullptr ? drop16(p, *drop, first) : p);
}

// Forward of a row of n scores x: softmax(scale x + bias), then dropout with the mask of
// elements first .. first + n, written over x. Returns the row's statistics, from which
// backward recomputes it in one pass.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
RowStats softmax_dropout_row(float* x, const float* bias, float scale, int64_t n,
                             const Mask* drop, uint32_t first) {
  const int64_t full = n - n % kLanes;
  // The tail, padded with -inf: it adds nothing to the maximum or the sum.
  alignas(64) float tail[kLanes], tail_bias[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    tail[l] = full + l < n ? x[full + l] : -INFINITY;
    tail_bias[l] = full + l < n ? bias[full + l] : 0.0f;
  }
  f32x16 max = splat(-INFINITY);
  for (int64_t j = 0; j < full; j += kLanes) {
    const f32x16 y = load16(x + j) * scale + load16(bias + j);
    store16(x + j, y);
    max = y > max ? y : max;
  }
  const f32x16 y_tail = load16(tail) * scale + load16(tail_bias);
  if (full < n) max = y_tail > max ? y_tail : max;
  const float row_max = lane_max(max);
  f32x16 sum = splat(0.0f);
  for (int64_t j = 0; j < full; j += kLanes) {
    const f32x16 e = exp_nonpositive(load16(x + j) - row_max);
    store16(x + j, e);
    sum += e;
  }
  const f32x16 e_tail = exp_nonpositive(y_tail - row_max);
  if (full < n) sum += e_tail;
  const float inv_sum = 1.0f / lane_sum(sum);
  for (int64_t j = 0; j < full; j += kLanes) {
    finish16(load16(x + j), inv_sum, nullptr, x + j, drop, first + static_cast<uint32_t>(j));
  }
  if (full < n) {
    finish16(e_tail, inv_sum, nullptr, tail, drop, first + static_cast<uint32_t>(full));
    std::copy(tail, tail + (n - full), x + full);
  }
  return RowStats{row_max, inv_sum};
}

// The same row again in backward from its forward statistics, in one pass: the probabilities
// into `probs`, the dropped ones over x.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void softmax_dropout_row_again(float* x, const float* bias, float scale, int64_t n,
                               RowStats stats, float* probs, const Mask* drop, uint32_t first) {
  const int64_t full = n - n % kLanes;
  alignas(64) float tail[kLanes], tail_probs[kLanes];
  for (int64_t j = 0; j < n; j += kLanes) {
    f32x16 y;
    if (j < full) {
      y = load16(x + j) * scale + load16(bias + j);
    } else {
      for (int64_t l = 0; l < kLanes; ++l) {
        tail[l] = j + l < n ? x[j + l] * scale + bias[j + l] : -INFINITY;
      }
      y = load16(tail);
    }
    const f32x16 e = exp_nonpositive(y - stats.max);
    const uint32_t at = first + static_cast<uint32_t>(j);
    if (j < full) {
      finish16(e, stats.inv_sum, probs + j, x + j, drop, at);
    } else {
      finish16(e, stats.inv_sum, tail_probs, tail, drop, at);
      for (int64_t l = 0; j + l < n; ++l) {
        x[j + l] = tail[l];
        probs[j + l] = tail_probs[l];
      }
    }
  }
}

// grad = (dropped grad - probs <dropped, grad>) scale in place: the gradient of the scores from
// that of the dropped probabilities, times the score scale. With dropped = probs m / (1 - p)
// this is probs (grad m / (1 - p) - <probs, grad m / (1 - p)>), the softmax gradient of the
// masked gradient, without drawing the mask again.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void softmax_grad_row(const float* probs, const float* dropped, float* grad, float scale,
                      int64_t n) {
  const int64_t full = n - n % kLanes;
  alignas(64) float tail[kLanes], tail_probs[kLanes], tail_dropped[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    tail[l] = full + l < n ? grad[full + l] : 0.0f;
    tail_probs[l] = full + l < n ? probs[full + l] : 0.0f;
    tail_dropped[l] = full + l < n ? dropped[full + l] : 0.0f;
  }
  f32x16 dot = load16(tail) * load16(tail_dropped);
  for (int64_t j = 0; j < full; j += kLanes) dot += load16(grad + j) * load16(dropped + j);
  const float total = lane_sum(dot);
  for (int64_t j = 0; j < full; j += kLanes) {
    store16(grad + j,
            (load16(dropped + j) * load16(grad + j) - load16(probs + j) * total) * scale);
  }
  const f32x16 g_tail =
      (load16(tail_dropped) * load16(tail) - load16(tail_probs) * total) * scale;
  for (int64_t j = full; j < n; ++j) grad[j] = g_tail[j - full];
}

// Rows of n elements of bf16 (raw bits) to fp32 and back.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void bf16_to_f32(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = bf16_bits_to_f32(src[j]);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void f32_to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = f32_to_bf16_bits(src[j]);
}

// Rows of a (rows, stride) fp32 or bf16 block (the dtypes training runs in), worked on in fp32:
// an fp32 block's own rows, a bf16 block's converted into a buffer and back. Where a bf16
// block's values come from a product on AMX, `unrounded` holds them as the product left them
// in fp32 (row r at unrounded + (r - first_unrounded) * unrounded_ld), and rows are read
// from there instead: no rounding to bf16 and back between the product and the row kernels.
struct BlockRows {
  at::Tensor block;
  int64_t stride;
  float* unrounded = nullptr;
  int64_t unrounded_ld = 0, first_unrounded = 0;

  bool is_f32() const { return block.scalar_type() == at::kFloat; }

  // Row r's first n elements as fp32: the row itself in an fp32 block or in `unrounded`
  // (copied into buf where `into_buf`), else converted into buf.
  float* open(int64_t r, float* buf, int64_t n, bool into_buf = false) const {
    if (is_f32()) return block.data_ptr<float>() + r * stride;
    if (unrounded != nullptr) {
      float* row = unrounded + (r - first_unrounded) * unrounded_ld;
      if (!into_buf) return row;
      std::memcpy(buf, row, n * sizeof(float));
      return buf;
    }
    bf16_to_f32(
        reinterpret_cast<const uint16_t*>(block.const_data_ptr<at::BFloat16>()) + r * stride,
        buf, n);
    return buf;
  }

  // Writes back row r opened as `row` (n elements), and zeros from n to `width` (the keys a
  // causal row does not see, which the products over whole key tiles then read).
  void close(int64_t r, const float* row, int64_t n, int64_t width) const {
    if (is_f32()) {
      float* dst = block.data_ptr<float>() + r * stride;
      if (dst != row) std::memcpy(dst, row, n * sizeof(float));
      std::fill(dst + n, dst + width, 0.0f);
    } else {
      auto* dst =
          reinterpret_cast<uint16_t*>(block.mutable_data_ptr<at::BFloat16>()) + r * stride;
      f32_to_bf16(row, dst, n);
      std::fill(dst + n, dst + width, uint16_t{0});
    }
  }
};

// What every row of a per-pair attention call shares: the key bias in fp32, the shapes that
// place a row, the score scale and the dropout. Rows are numbered over the whole (B, H, Tq)
// call: row g is query g % Tq of pair g / Tq (batch g / (Tq H)), and its dropout mask starts at
// element g Tk of the (B, H, Tq, Tk) numbering, as on the batched path.
struct RowParams {
  const float* bias;  // (B, bias_rows, Tk) fp32
  int64_t bias_rows;  // 1, or Tq: one bias row per query
  int64_t heads, tq, tk;
  float scale;
  double p;
  Mask mask;
  bool causal;       // query r sees keys 0 ..= r (Tq = Tk)
  RowStats* stats;   // (B H Tq): forward writes each row's, backward reads them

  // The keys row r of a pair sees: the first r + 1 under the causal mask, else all.
  int64_t keys_seen(int64_t r) const { return causal ? r + 1 : tk; }

  const float* bias_of(int64_t g) const {
    const int64_t batch = g / (tq * heads);
    return bias + (batch * bias_rows + (bias_rows == 1 ? 0 : g % tq)) * tk;
  }

  const Mask* dropout() const { return p > 0.0 ? &mask : nullptr; }
};

// One thread's scratch on the per-pair path, reused over the pairs it takes: (Tq, Tk) blocks
// in the inputs' dtype for the scores and their gradient; in backward the fp32 probabilities
// and, for bf16 blocks, the fp32 dropped probabilities (an fp32 `scores` holds those itself);
// an fp32 row for conversions.
struct PairScratch {
  at::Tensor scores, grad_scores;
  std::vector<float> probs, dropped, row;

  PairScratch(const at::Tensor& like, int64_t tq, int64_t tk, bool backward)
      : scores(at::empty({tq, tk}, like.options())),
        grad_scores(backward ? at::empty({tq, tk}, like.options()) : at::Tensor()),
        probs(backward ? tq * tk : 0),
        dropped(backward && like.scalar_type() != at::kFloat ? tq * tk : 0),
        row(tk) {}

  // Row r of the dropped probabilities in fp32 (backward).
  float* dropped_row(int64_t r, int64_t tk) {
    return dropped.empty() ? scores.data_ptr<float>() + r * tk : dropped.data() + r * tk;
  }
};

// Rows [r0, r1) of a pair's `scores` (raw q k^T products over the first `width` keys; the
// pair's rows are numbered from first_row) turned in place into the dropped probabilities. In
// forward each row's softmax statistics go to rp.stats; in backward they come from there, and
// the fp32 probabilities go to s.probs (indexed as scores).
void softmax_dropout_rows(const BlockRows& scores, int64_t r0, int64_t r1, int64_t width,
                          int64_t first_row, const RowParams& rp, bool backward,
                          PairScratch& s) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t g = first_row + r, n = rp.keys_seen(r);
    const auto first = static_cast<uint32_t>(g * rp.tk);
    // Backward keeps a bf16 block's dropped probabilities in fp32 for the gradient.
    float* x = backward ? scores.open(r, s.dropped_row(r, rp.tk), n, true)
                        : scores.open(r, s.row.data(), n);
    if (backward) {
      softmax_dropout_row_again(x, rp.bias_of(g), rp.scale, n, rp.stats[g],
                                s.probs.data() + r * rp.tk, rp.dropout(), first);
    } else {
      rp.stats[g] = softmax_dropout_row(x, rp.bias_of(g), rp.scale, n, rp.dropout(), first);
    }
    scores.close(r, x, n, width);
  }
}

// Rows [r0, r1) of a pair's `grads`, the gradient of the dropped probabilities over the first
// `width` keys, turned in place into the gradient of the raw products (the score scale
// included), with the probabilities softmax_dropout_rows left in backward.
void softmax_grad_rows(const BlockRows& grads, int64_t r0, int64_t r1, int64_t width,
                       const RowParams& rp, PairScratch& s) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = rp.keys_seen(r);
    float* g = grads.open(r, s.row.data(), n);
    softmax_grad_row(s.probs.data() + r * rp.tk, s.dropped_row(r, rp.tk), g, rp.scale, n);
    grads.close(r, g, n, width);
  }
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// src (rows, cols; rows ld_src apart) of 32-bit elements (fp32, or pairs of bf16) transposed
// into dst (cols, rows; rows ld_dst apart): 8 x 8 blocks transposed in registers by three
// rounds of two-vector shuffles (round s swaps bit s of the row number with bit s of the column
// number), the edges element by element; bits are moved, never converted. The scalar loop over
// 16 x 16 blocks it replaced held 12% of an attention layer's perf samples.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void transpose32(const void* src_bytes, int64_t ld_src, void* dst_bytes, int64_t ld_dst,
                 int64_t rows, int64_t cols) {
  const auto* src = static_cast<const uint32_t*>(src_bytes);
  auto* dst = static_cast<uint32_t*>(dst_bytes);
  const int64_t full_rows = rows - rows % 8, full_cols = cols - cols % 8;
  for (int64_t i0 = 0; i0 < full_rows; i0 += 8) {
    for (int64_t j0 = 0; j0 < full_cols; j0 += 8) {
      f32x8 r[8], t[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&r[i], src + (i0 + i) * ld_src + j0, sizeof(f32x8));
      for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], i32x8{0, 8, 2, 10, 4, 12, 6, 14});
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], i32x8{1, 9, 3, 11, 5, 13, 7, 15});
      }
      for (int i : {0, 1, 4, 5}) {
        r[i] = __builtin_shuffle(t[i], t[i + 2], i32x8{0, 1, 8, 9, 4, 5, 12, 13});
        r[i + 2] = __builtin_shuffle(t[i], t[i + 2], i32x8{2, 3, 10, 11, 6, 7, 14, 15});
      }
      for (int i = 0; i < 4; ++i) {
        t[i] = __builtin_shuffle(r[i], r[i + 4], i32x8{0, 1, 2, 3, 8, 9, 10, 11});
        t[i + 4] = __builtin_shuffle(r[i], r[i + 4], i32x8{4, 5, 6, 7, 12, 13, 14, 15});
      }
      for (int j = 0; j < 8; ++j) std::memcpy(dst + (j0 + j) * ld_dst + i0, &t[j], sizeof(f32x8));
    }
  }
  // The last rows % 8 rows, and the last cols % 8 columns of the others.
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = i < full_rows ? full_cols : 0; j < cols; ++j) {
      std::memcpy(dst + j * ld_dst + i, src + i * ld_src + j, sizeof(uint32_t));
    }
  }
}

// A 2-D operand as the brgemm microkernel reads it, of elements T (float, or a bf16's raw
// bits): `data` holds a row-major matrix with rows `ld` apart, which is the operand itself, or
// its transpose when `transposed`.
template <typename T>
struct Plain {
  T* data;
  int64_t ld;
  bool transposed;
};
using PlainF32 = Plain<float>;
using PlainBf16 = Plain<const uint16_t>;

// x's layout (x of T's dtype, which the callers check), or none where x is neither row-major
// nor the transpose of a row-major matrix.
template <typename T>
std::optional<Plain<T>> plain_of(const at::Tensor& x) {
  T* data = static_cast<T*>(x.data_ptr());
  const int64_t rows = x.size(0), cols = x.size(1);
  if (x.stride(1) == 1 && x.stride(0) >= cols) return Plain<T>{data, x.stride(0), false};
  if (x.stride(0) == 1 && x.stride(1) >= rows) return Plain<T>{data, x.stride(1), true};
  return std::nullopt;
}

// Pairs of rows of a 16-bit (bf16) matrix src (rows, cols; rows ld_src apart) interleaved into
// 32-bit elements: dst[p][c] holds src[2p][c] in its low half and src[2p + 1][c] in its high
// half (zero past the last row), for p < (rows + 1) / 2 and c < cols (rows ld_dst apart). That
// is the VNNI layout AMX reads a product's second operand in, and, followed by a 32-bit
// transpose, a 16-bit transpose.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void interleave_rows16(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t cols,
                       uint32_t* dst, int64_t ld_dst) {
  for (int64_t p = 0; 2 * p < rows; ++p) {
    const uint16_t* even = src + 2 * p * ld_src;
    uint32_t* out = dst + p * ld_dst;
    if (2 * p + 1 < rows) {
      const uint16_t* odd = even + ld_src;
      for (int64_t c = 0; c < cols; ++c) out[c] = uint32_t{even[c]} | uint32_t{odd[c]} << 16;
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = even[c];
    }
  }
}

// A thread's 64-byte-aligned room for transposed or packed operands and results, by slot
// (grown, never shrunk): AMX's tile loads ran a third as fast from operands at 16-byte
// alignment (a (64 x 3072) x (3072 x 64) product: 1.46 against 0.43 TFLOP/s a thread).
void* aligned_room(int slot, int64_t bytes) {
  struct Room {
    void* data = nullptr;
    int64_t bytes = 0;
    ~Room() { std::free(data); }
  };
  thread_local Room rooms[5];
  Room& room = rooms[slot];
  if (room.bytes < bytes) {
    std::free(room.data);
    room.bytes = (bytes + 63) / 64 * 64;
    room.data = std::aligned_alloc(64, room.bytes);
    TORCH_CHECK(room.data != nullptr, "seeded attention: out of memory for ", bytes, " bytes");
  }
  return room.data;
}

// Whether this CPU runs oneDNN's bf16 brgemm microkernel on AMX (ATen packs bf16 operands for
// it only there).
bool amx_bf16() {
  static const bool available = at::native::cpublas::could_pack(at::kBFloat16);
  return available;
}

// The columns of the second operand that one microkernel call takes (AMX's tiles are 16 fp32
// wide; oneDNN's packed layouts take 16 to 64).
constexpr int64_t kAmxBlock = 64;

// An (m, n) fp32 result in rows `ld` apart.
struct F32Rows {
  float* data;
  int64_t ld;
};

// The (cols, rows) transpose of the row-major bf16 (rows, cols) matrix x (rows ld apart, rows
// even) into the thread's room 1: interleaved pairs of x's rows, transposed as 32-bit elements.
const uint16_t* transposed16(const uint16_t* x, int64_t ld, int64_t rows, int64_t cols) {
  auto* pairs = static_cast<uint32_t*>(aligned_room(0, rows / 2 * cols * 4));
  interleave_rows16(x, ld, rows, cols, pairs, cols);
  auto* out = static_cast<uint16_t*>(aligned_room(1, cols * rows * 2));
  transpose32(pairs, cols, out, rows / 2, rows / 2, cols);
  return out;
}

// The microkernel's part of amx_product: rows (m, k) row-major (ld_a apart, k even) times b
// (k, n) packed into VNNI blocks (the thread's room 2), into the thread's room 3 (rows ld_c
// apart).
F32Rows amx_blocks(const uint16_t* rows, int64_t ld_a, int64_t m, int64_t k, const PlainBf16& b,
                   int64_t n) {
  const int64_t blocks = (n + kAmxBlock - 1) / kAmxBlock, ld_c = blocks * kAmxBlock;
  auto* packed = static_cast<uint32_t*>(aligned_room(2, blocks * k / 2 * kAmxBlock * 4));
  auto* c = static_cast<float*>(aligned_room(3, m * ld_c * 4));
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t c0 = j * kAmxBlock, width = std::min(kAmxBlock, n - c0);
    uint32_t* block = packed + j * (k / 2) * kAmxBlock;  // (k / 2, 64)
    if (b.transposed) {
      // b = y^T for row-major y (n, k): rows c0 .. c0 + width of y as 32-bit pairs, transposed.
      transpose32(b.data + c0 * b.ld, b.ld / 2, block, kAmxBlock, width, k / 2);
    } else {
      interleave_rows16(b.data + c0, b.ld, k, width, block, kAmxBlock);
    }
    if (width < kAmxBlock) {
      for (int64_t p = 0; p < k / 2; ++p) {
        std::fill(block + p * kAmxBlock + width, block + (p + 1) * kAmxBlock, uint32_t{0});
      }
    }
    at::native::cpublas::brgemm(m, kAmxBlock, k, ld_a, kAmxBlock, ld_c, false,
                                reinterpret_cast<const at::BFloat16*>(rows),
                                reinterpret_cast<const at::BFloat16*>(block), c + c0, true);
  }
  return F32Rows{c, ld_c};
}

// a @ b for bf16 a (m, k) and b (k, n) on AMX, on the calling thread, in fp32 in the thread's
// scratch (valid until its next call): oneDNN's brgemm microkernel accumulates in fp32, as
// at::mm's oneDNN product does (rounded once, the two differ in summation order only). At
// (384, 64) x (64, 384) a call took 16 us against at::mm's 38 (which sets up a oneDNN
// primitive each call), at (64, 64) x (64, 64) 0.4 against 20. The microkernel reads its first
// operand row-major and its second in VNNI blocks of 64 columns, (k / 2, 64) pairs of rows
// interleaved: a row-major b is interleaved, a transposed one (b = y^T) is y's pairs of columns
// transposed as 32-bit elements, and a transposed a is transposed in two such passes. An odd
// k's last term is added in fp32. None where an operand is not bf16 or neither row-major nor
// transposed, or a transposed b's rows are an odd number of elements apart.
std::optional<F32Rows> amx_product(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16) return std::nullopt;
  const int64_t m = a.size(0), n = b.size(1), k = a.size(1) / 2 * 2;  // k even
  const std::optional<PlainBf16> pa = plain_of<const uint16_t>(a), pb = plain_of<const uint16_t>(b);
  if (!pa || !pb || (pb->transposed && pb->ld % 2 != 0)) return std::nullopt;
  if (m == 0 || n == 0 || k == 0) return std::nullopt;  // at::mm's own edge cases
  F32Rows c{nullptr, 0};
  if (pa->transposed && n * (k + m) < m * k) {
    // a = x^T for row-major x (k, m), and b narrow (P^T dO, dS^T Q: b is (T, 64)): out^T
    // (n, m) = b^T x, transposed back, moves (k + m) n elements where transposing a moves m k.
    const uint16_t* bt = pb->transposed ? pb->data : transposed16(pb->data, pb->ld, k, n);
    const F32Rows ct =
        amx_blocks(bt, pb->transposed ? pb->ld : k, n, k, PlainBf16{pa->data, pa->ld, false}, m);
    c = F32Rows{static_cast<float*>(aligned_room(4, m * n * 4)), n};
    transpose32(ct.data, ct.ld, c.data, c.ld, n, m);
  } else {
    // a itself, or a = x^T transposed into rows.
    const uint16_t* rows = pa->transposed ? transposed16(pa->data, pa->ld, k, m) : pa->data;
    c = amx_blocks(rows, pa->transposed ? k : pa->ld, m, k, *pb, n);
  }
  if (k < a.size(1)) {
    // The last of an odd number of terms: c += a[:, k] b[k, :].
    const auto element = [](const PlainBf16& x, int64_t i, int64_t j) {
      return bf16_bits_to_f32(x.transposed ? x.data[j * x.ld + i] : x.data[i * x.ld + j]);
    };
    for (int64_t i = 0; i < m; ++i) {
      const float a_ik = element(*pa, i, k);
      for (int64_t j = 0; j < n; ++j) c.data[i * c.ld + j] += a_ik * element(*pb, k, j);
    }
  }
  return c;
}

// out = a @ b through amx_product, rounded once into row-major bf16 out; false (nothing
// written) where out is not that or amx_product has none.
bool pair_product_amx(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  if (out.scalar_type() != at::kBFloat16) return false;
  const std::optional<PlainBf16> pc = plain_of<const uint16_t>(out);
  if (!pc || pc->transposed) return false;
  const std::optional<F32Rows> c = amx_product(a, b);
  if (!c) return false;
  auto* dst = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  const int64_t n = out.size(1);
  for (int64_t i = 0; i < out.size(0); ++i) f32_to_bf16(c->data + i * c->ld, dst + i * pc->ld, n);
  return true;
}

// out = a @ b, one of a pair's products, on the thread that calls it. With attention's fp32
// products through oneDNN (runtime.fp32_gemm "onednn" or "blas+brgemm"), oneDNN's brgemm
// microkernel through ATen's cpublas (generated once per shape and thread): at
// (384, 64) x (64, 384) it ran 113-117 GFLOP/s a thread on a Zen 4 EPYC against MKL's 88-97,
// which also spends 5% of the attention zeroing each output before accumulating into it. The
// microkernel reads row-major operands only: a transposed b is copied transposed first, and for
// a transposed a the product is taken as out^T = b^T a^T where that copies fewer elements than
// a itself (P^T dO: two (T, 64) copies instead of a (T, T) one). bf16 products on AMX go
// through pair_product_amx; else (bf16 elsewhere, the BLAS chosen, other strides) at::mm_out.
void pair_product(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  const bool fp32 = out.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                    b.scalar_type() == at::kFloat;
  if (amx_bf16() && pair_product_amx(out, a, b)) return;
  const bool onednn = fp32 && sprtrain_gemm::attention_brgemm.load(std::memory_order_relaxed);
  const std::optional<PlainF32> pa = onednn ? plain_of<float>(a) : std::nullopt;
  const std::optional<PlainF32> pb = onednn ? plain_of<float>(b) : std::nullopt;
  const std::optional<PlainF32> pc = onednn ? plain_of<float>(out) : std::nullopt;
  if (!pa || !pb || !pc || pc->transposed) {
    at::mm_out(out, a, b);
    return;
  }
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  // The transpose of the (rows, cols) matrix src holds, as a (cols, rows) row-major matrix.
  const auto transposed_copy = [](int slot, const PlainF32& src, int64_t rows, int64_t cols) {
    auto* dst = static_cast<float*>(aligned_room(slot, rows * cols * sizeof(float)));
    transpose32(src.data, src.ld, dst, rows, rows, cols);
    return dst;
  };
  using at::native::cpublas::brgemm;
  const int64_t b_copy = pb->transposed ? 0 : k * n;
  if (pa->transposed && b_copy + m * n < m * k) {
    // out^T (n, m) = b^T (n, k) a^T (k, m), a^T being the row-major matrix a is a view of.
    const float* bt = pb->transposed ? pb->data : transposed_copy(0, *pb, k, n);
    auto* ct = static_cast<float*>(aligned_room(1, n * m * sizeof(float)));
    brgemm(n, m, k, pb->transposed ? pb->ld : k, pa->ld, m, false, bt, pa->data, ct);
    transpose32(ct, m, pc->data, pc->ld, n, m);
    return;
  }
  const float* a_rows = pa->transposed ? transposed_copy(2, *pa, k, m) : pa->data;
  const float* b_rows = pb->transposed ? transposed_copy(0, *pb, n, k) : pb->data;
  brgemm(m, n, k, pa->transposed ? k : pa->ld, pb->transposed ? n : pb->ld, pc->ld, false,
         a_rows, b_rows, pc->data);
}

// Runs body(pair, scratch) for every pair in [0, pairs) on ATen's threads, each thread taking
// the next pair as it finishes one, with scratch made once a thread by make_scratch(). A static
// split (half the pairs a thread) left a thread spinning at the end whenever the other's core
// ran slower, which on a shared VM is most calls.
template <typename MakeScratch, typename Body>
void for_each_pair(int64_t pairs, MakeScratch make_scratch, Body body) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Grad mode is per thread, and ATen's worker threads start with it on: the products'
    // out= forms refuse inputs that require grad there.
    at::NoGradGuard no_grad;
    auto scratch = make_scratch();
    for (int64_t pair = next.fetch_add(1); pair < pairs; pair = next.fetch_add(1)) {
      body(pair, scratch);
    }
    // Hands back the AMX tile state pair_product_amx's microkernel configured, if it did.
    if (amx_bf16()) at::native::cpublas::brgemm_release(true);
  });
}

// The rows of a pair a per-pair call takes at a time: all Tq, or under the causal mask tiles
// of kCausalTile queries, each against the keys up to its last query only, which skips the
// products and row passes over the masked upper triangle (at T = 512, 10 of 16 (128, 128)
// blocks are computed). At the Llama bench row's shape (batch 1, 512, 12 heads of 64, fp32)
// tiles of 128 took 14.6 ms forward + backward against 20.0 untiled; tiles of 64 and 32 were
// no faster (their smaller products' fixed costs; docs/benchmarks.md, round 9).
constexpr int64_t kCausalTile = 128;

struct Tile {
  int64_t r0, r1;  // queries [r0, r1)
  int64_t keys;    // keys [0, keys)
};

std::vector<Tile> pair_tiles(const RowParams& rp) {
  if (!rp.causal) return {Tile{0, rp.tq, rp.tk}};
  std::vector<Tile> tiles;
  for (int64_t r0 = 0; r0 < rp.tq; r0 += kCausalTile) {
    const int64_t r1 = std::min(rp.tq, r0 + kCausalTile);
    tiles.push_back(Tile{r0, r1, r1});
  }
  return tiles;
}

// Tile t's (r1 - r0, keys) block of `block`, a (Tq, Tk) scratch, as a strided view.
at::Tensor tile_of(const at::Tensor& block, const Tile& t) {
  return block.narrow(0, t.r0, t.r1 - t.r0).narrow(1, 0, t.keys);
}

// The product a @ b over tile t of `block` (a (Tq, Tk) scratch) for the row kernels: a bf16
// product on AMX left in fp32 where the microkernel put it (BlockRows' `unrounded`), else
// written into the tile by pair_product.
BlockRows product_rows(const at::Tensor& block, const Tile& t, const at::Tensor& a,
                       const at::Tensor& b) {
  const int64_t stride = block.size(1);
  if (block.scalar_type() == at::kBFloat16 && amx_bf16()) {
    if (const std::optional<F32Rows> c = amx_product(a, b)) {
      return BlockRows{block, stride, c->data, c->ld, t.r0};
    }
  }
  pair_product(tile_of(block, t), a, b);
  return BlockRows{block, stride};
}

// Tile t of pair bh: the dropped probabilities into its part of s.scores and, in backward, the
// fp32 probabilities into s.probs. q (Tq, D), k (Tk, D).
void attention_tile(const at::Tensor& q, const at::Tensor& k, int64_t bh, const Tile& t,
                    const RowParams& rp, bool backward, PairScratch& s) {
  const BlockRows scores =
      product_rows(s.scores, t, q.narrow(0, t.r0, t.r1 - t.r0), k.narrow(0, 0, t.keys).t());
  softmax_dropout_rows(scores, t.r0, t.r1, t.keys, bh * rp.tq, rp, backward, s);
}

// Forward of pair bh into out (Tq, D).
void pair_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t bh,
                  const RowParams& rp, at::Tensor out, PairScratch& s) {
  for (const Tile& t : pair_tiles(rp)) {
    attention_tile(q, k, bh, t, rp, false, s);
    at::Tensor out_rows = out.narrow(0, t.r0, t.r1 - t.r0);
    pair_product(out_rows, tile_of(s.scores, t), v.narrow(0, 0, t.keys));
  }
}

// Backward of pair bh: gq (Tq, D), gk, gv (Tk, D) from g (Tq, D). Each query tile leaves its
// dropped probabilities in s.scores and the gradient of its scores in s.grad_scores; then each
// key tile's gradients are one product over the queries that see it (rows from its first key
// on, under the causal mask), so nothing is accumulated across tiles.
void pair_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, int64_t bh, const RowParams& rp, at::Tensor gq,
                   at::Tensor gk, at::Tensor gv, PairScratch& s) {
  const std::vector<Tile> tiles = pair_tiles(rp);
  for (const Tile& t : tiles) {
    attention_tile(q, k, bh, t, rp, true, s);
    const int64_t rows = t.r1 - t.r0;
    const BlockRows grads =
        product_rows(s.grad_scores, t, g.narrow(0, t.r0, rows), v.narrow(0, 0, t.keys).t());
    softmax_grad_rows(grads, t.r0, t.r1, t.keys, rp, s);
    at::Tensor gq_rows = gq.narrow(0, t.r0, rows);
    pair_product(gq_rows, tile_of(s.grad_scores, t), k.narrow(0, 0, t.keys));
  }
  for (const Tile& t : tiles) {
    // Keys [k0, k0 + keys), seen by queries k0 .. Tq: under the causal mask the keys of tile t,
    // without it all keys (the one tile starts at 0).
    const int64_t k0 = t.r0, seen_by = rp.tq - k0, keys = rp.causal ? t.r1 - t.r0 : rp.tk;
    at::Tensor gv_rows = gv.narrow(0, k0, keys), gk_rows = gk.narrow(0, k0, keys);
    pair_product(gv_rows, s.scores.narrow(0, k0, seen_by).narrow(1, k0, keys).t(),
               g.narrow(0, k0, seen_by));
    pair_product(gk_rows, s.grad_scores.narrow(0, k0, seen_by).narrow(1, k0, keys).t(),
               q.narrow(0, k0, seen_by));
  }
}

// The whole (B H, Tq, Tk) attention at once as batched products, with ATen's softmax, the mask
// and the casts over whole tensors: at short lengths (sentences) its passes over many short
// rows beat the row kernels' per-row calls. Element i of the whole tensor is element i of the
// per-pair numbering, so both paths draw the same mask.
struct Batched {
  at::Tensor probs;    // (B H, Tq, Tk) fp32 softmax
  at::Tensor dropped;  // (B H, Tq, Tk) probs with dropout applied and rescaled, in q's dtype
};

// q3: (B H, Tq, D), k3: (B H, Tk, D); bias: (B, rows, Tk) fp32, rows 1 or Tq.
Batched attention_batched(const at::Tensor& q3, const at::Tensor& k3, const at::Tensor& bias,
                          int64_t h, double scale, double p, int64_t seed) {
  const int64_t b = bias.size(0), rows = bias.size(1), t = bias.size(2);
  at::Tensor bias3 =
      bias.to(q3.scalar_type()).unsqueeze(1).expand({b, h, rows, t}).reshape({b * h, rows, t});
  at::Tensor scores = at::baddbmm(bias3, q3, k3.transpose(1, 2), 1.0, scale);
  at::Tensor probs = at::softmax(scores, -1, at::kFloat);
  at::Tensor dropped = probs;
  if (p > 0.0) {
    dropped = at::empty_like(probs);
    Mask(p, seed).apply(probs, dropped, 0);
  }
  return {probs, dropped.to(q3.scalar_type())};
}

// x (B, H, T, D) with its D elements adjacent, as the per-pair products read them: x itself when
// they are (any other strides, e.g. a (B, T, H, D) tensor's transpose), else a contiguous copy.
at::Tensor unit_stride_rows(const at::Tensor& x) {
  return x.stride(3) == 1 ? x : x.contiguous();
}

// A new (B, H, T, D) tensor laid out as (B, T, H, D): the per-pair path writes its outputs and
// gradients there, so the caller's transpose back to (B, T, H D) is free.
at::Tensor heads_view(int64_t b, int64_t h, int64_t t, int64_t d, const at::TensorOptions& options) {
  return at::empty({b, t, h, d}, options).transpose(1, 2);
}

struct SeededAttention : public torch::autograd::Function<SeededAttention> {
  // q: (B, H, Tq, D), k, v: (B, H, Tk, D) (Tq = Tk but where a layer computes only the
  // positions its head reads); bias: (B, 1, Tk) or (B, Tq, Tk) fp32 additive (0 or a large
  // negative). `batched`: one set of batched products over all pairs, at short lengths where
  // per-pair calls cost more than their arithmetic, instead of a loop over pairs that keeps
  // each block in cache.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& bias, double p,
                            int64_t seed, bool batched, bool causal) {
    // The per-pair products read each pair's (T, D) rows where they lie, e.g. strided views of
    // a (B, T, H, D) projection, instead of copying q, k and v into (B, H, T, D) first.
    at::Tensor q = batched ? q_in.contiguous() : unit_stride_rows(q_in);
    at::Tensor k = batched ? k_in.contiguous() : unit_stride_rows(k_in);
    at::Tensor v = batched ? v_in.contiguous() : unit_stride_rows(v_in);
    const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), tk = k.size(2), d = q.size(3);
    TORCH_CHECK(!(causal && batched), "seeded attention: the causal mask is per-pair only");
    TORCH_CHECK(!causal || tq == tk, "seeded attention: the causal mask needs Tq = Tk");
    // Each row's softmax statistics, for backward's one-pass recomputation (per-pair path).
    at::Tensor stats = at::empty({batched ? 0 : b * h * tq, 2}, q.options().dtype(at::kFloat));
    const RowParams rp = row_params(bias, stats, h, tq, tk, d, p, seed, causal);
    at::Tensor out;
    if (batched) {
      Batched all = attention_batched(q.view({b * h, tq, d}), k.view({b * h, tk, d}), bias, h,
                                      rp.scale, p, seed);
      out = at::bmm(all.dropped, v.view({b * h, tk, d})).view({b, h, tq, d});
    } else {
      TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                  "seeded attention's per-pair path takes fp32 or bf16, not ", q.scalar_type());
      out = heads_view(b, h, tq, d, q.options());
      for_each_pair(
          b * h, [&] { return PairScratch(q, tq, tk, false); },
          [&](int64_t bh, PairScratch& s) {
            const int64_t i = bh / h, j = bh % h;
            pair_forward(q[i][j], k[i][j], v[i][j], bh, rp, out[i][j], s);
          });
    }
    ctx->save_for_backward({q, k, v, bias, stats});
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["batched"] = batched;
    ctx->saved_data["causal"] = causal;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &bias = saved[3];
    const at::Tensor& stats = saved[4];
    const double p = ctx->saved_data["p"].toDouble();
    const int64_t seed = ctx->saved_data["seed"].toInt();
    const bool batched = ctx->saved_data["batched"].toBool();
    const bool causal = ctx->saved_data["causal"].toBool();
    at::Tensor grad_out = batched ? grads[0].contiguous() : unit_stride_rows(grads[0]);
    const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), tk = k.size(2), d = q.size(3);
    const RowParams rp = row_params(bias, stats, h, tq, tk, d, p, seed, causal);
    at::Tensor gq, gk, gv;
    if (batched) {
      at::Tensor q3 = q.view({b * h, tq, d}), k3 = k.view({b * h, tk, d});
      at::Tensor v3 = v.view({b * h, tk, d}), g = grad_out.view({b * h, tq, d});
      Batched all = attention_batched(q3, k3, bias, h, rp.scale, p, seed);
      gv = at::bmm(all.dropped.transpose(1, 2), g).view({b, h, tk, d});
      at::Tensor g_probs = at::bmm(g, v3.transpose(1, 2)).to(at::kFloat).contiguous();
      if (p > 0.0) {
        Mask(p, seed).apply(g_probs, 0);
      }
      at::Tensor g_scores =
          at::_softmax_backward_data(g_probs, all.probs, -1, at::kFloat).to(q.scalar_type());
      gq = at::bmm(g_scores, k3).view({b, h, tq, d}).mul_(rp.scale);
      gk = at::bmm(g_scores.transpose(1, 2), q3).view({b, h, tk, d}).mul_(rp.scale);
    } else {
      gq = heads_view(b, h, tq, d, q.options());
      gk = heads_view(b, h, tk, d, k.options());
      gv = heads_view(b, h, tk, d, v.options());
      for_each_pair(
          b * h, [&] { return PairScratch(q, tq, tk, true); },
          [&](int64_t bh, PairScratch& s) {
            const int64_t i = bh / h, j = bh % h;
            pair_backward(q[i][j], k[i][j], v[i][j], grad_out[i][j], bh, rp, gq[i][j], gk[i][j],
                          gv[i][j], s);
          });
    }
    return {gq, gk, gv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  // `bias` (contiguous fp32) and `stats` ((B H Tq, 2) fp32, or empty on the batched path) must
  // outlive the returned parameters.
  static RowParams row_params(const at::Tensor& bias, const at::Tensor& stats, int64_t h,
                              int64_t tq, int64_t tk, int64_t d, double p, int64_t seed,
                              bool causal) {
    static_assert(sizeof(RowStats) == 2 * sizeof(float), "RowStats is a (max, 1 / sum) pair");
    return RowParams{bias.const_data_ptr<float>(),
                     bias.size(1),
                     h,
                     tq,
                     tk,
                     static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))),
                     p,
                     Mask(p, seed),
                     causal,
                     reinterpret_cast<RowStats*>(stats.data_ptr<float>())};
  }
};

}  // namespace

extern "C" {

// Dropout of x with probability p (0 <= p < 1), the mask drawn from `seed`.
at::Tensor* sprtrain_seeded_dropout(const at::Tensor* x, double p, int64_t seed, char** error) {
  return sprtrain_ffi::guarded(error, [&] { return SeededDropout::apply(*x, p, seed); });
}

// Scaled dot-product attention of (B, H, Tq, D) q and (B, H, Tk, D) k, v over the keys where
// key_mask (B, 1, 1, Tk), (B, Tk) or, per query, (B, 1, Tq, Tk), boolean, is true, and with
// `causal` where also key <= query (Tq = Tk, key_mask not per query), with dropout p on the
// probabilities drawn from `seed`. Batched products when the (B, H, Tq, Tk) scores have at most
// `batched_up_to` elements, else a loop over (batch, head) pairs. Returns (B, H, Tq, D).
at::Tensor* sprtrain_seeded_attention(const at::Tensor* q, const at::Tensor* k,
                                      const at::Tensor* v, const at::Tensor* key_mask, double p,
                                      int64_t seed, int64_t batched_up_to, bool causal,
                                      char** error) {
  return sprtrain_ffi::guarded(error, [&] {
    const int64_t b = key_mask->size(0), t = key_mask->size(-1);
    const int64_t scores = q->size(0) * q->size(1) * q->size(2) * k->size(2);
    const bool batched = scores <= batched_up_to;
    at::Tensor allowed = key_mask->reshape({b, 1, -1, t});
    TORCH_CHECK(!causal || allowed.size(2) == 1,
                "seeded attention: a causal call takes a key mask, not one per query");
    if (causal && batched) {
      // The batched products take the causal mask as a bias row per query.
      allowed = allowed.logical_and(at::ones({t, t}, key_mask->options().dtype(at::kBool)).tril());
    }
    // One row of key bias for all queries, or one row per query.
    const int64_t rows = allowed.size(2);
    // A large finite negative rather than -inf: a row with no key left gets uniform weights,
    // not NaN (it is in range for bf16 too).
    at::Tensor bias = at::zeros({b, rows, t}, q->options().dtype(at::kFloat).requires_grad(false));
    bias.masked_fill_(allowed.logical_not().reshape({b, rows, t}), at::Scalar(-3.0e38));
    return SeededAttention::apply(*q, *k, *v, bias, p, seed, batched, causal && !batched);
  });
}

void sprtrain_free_error(char* error) { std::free(error); }
}
