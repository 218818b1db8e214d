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
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ffi.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Two rounds of a 32-bit integer hash (Wellons' lowbias32) of the element's index, keyed by
// the seed: 32-bit multiplies, so the mask loop vectorises (AVX2: 8 elements per step).
inline uint32_t lowbias32(uint32_t x) {
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
    const uint32_t in_bits = static_cast<uint32_t>(src[j]) << 16;
    float value;
    std::memcpy(&value, &in_bits, sizeof value);
    value *= scale;
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
    const uint16_t out = value != value ? uint16_t{0x7FC0} : rounded;
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

// The (Tq, Tk) attention block of one (batch, head) pair: scores, softmax, dropout. Small
// enough to stay in cache; called inside a parallel loop over pairs, so the ATen ops it uses
// run single-threaded. `first` is the block's first element in the (B, H, Tq, Tk) mask
// numbering.
struct Block {
  at::Tensor probs;    // (Tq, Tk) fp32 softmax
  at::Tensor dropped;  // (Tq, Tk) probs with dropout applied and rescaled, in q's dtype
};

Block attention_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias,
                      double scale, double p, int64_t seed, int64_t first) {
  // (Tq, D) q, (Tk, D) k; (1, Tk) or (Tq, Tk) bias
  at::Tensor scores = at::addmm(bias, q, k.t(), 1.0, scale);
  at::Tensor probs = at::softmax(scores, -1, at::kFloat);
  at::Tensor dropped = probs;
  if (p > 0.0) {
    dropped = at::empty_like(probs);
    Mask(p, seed).apply(probs, dropped, first);
  }
  return {probs, dropped.to(q.scalar_type())};
}

// The whole (B H, Tq, Tk) attention at once: scores, softmax, dropout, as batched products.
// At short lengths the per-pair blocks are too small for their ATen calls to pay (B H of them
// a layer, each several dispatches) and batched products keep both threads busy; the (B H,
// Tq, Tk) tensors this keeps for the length of one layer's call are small there. Element i of
// the whole tensor is element i of the per-pair numbering (pair bh starts at bh Tq Tk), so
// both paths draw the same mask.
struct Batched {
  at::Tensor probs;    // (B H, Tq, Tk) fp32 softmax
  at::Tensor dropped;  // (B H, Tq, Tk) probs with dropout applied and rescaled, in q's dtype
};

// q3: (B H, Tq, D), k3: (B H, Tk, D); bias: (B, rows, Tk), rows 1 or Tq.
Batched attention_batched(const at::Tensor& q3, const at::Tensor& k3, const at::Tensor& bias,
                          int64_t h, double scale, double p, int64_t seed) {
  const int64_t b = bias.size(0), rows = bias.size(1), t = bias.size(2);
  at::Tensor bias3 = bias.unsqueeze(1).expand({b, h, rows, t}).reshape({b * h, rows, t});
  at::Tensor scores = at::baddbmm(bias3, q3, k3.transpose(1, 2), 1.0, scale);
  at::Tensor probs = at::softmax(scores, -1, at::kFloat);
  at::Tensor dropped = probs;
  if (p > 0.0) {
    dropped = at::empty_like(probs);
    Mask(p, seed).apply(probs, dropped, 0);
  }
  return {probs, dropped.to(q3.scalar_type())};
}

struct SeededAttention : public torch::autograd::Function<SeededAttention> {
  // q: (B, H, Tq, D), k, v: (B, H, Tk, D) (Tq = Tk but where a layer computes only the
  // positions its head reads); bias: (B, 1, Tk) or (B, Tq, Tk) additive (0 or a large
  // negative). `batched`: one set of batched products over all pairs instead of a loop.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& bias, double p,
                            int64_t seed, bool batched) {
    at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), tk = k.size(2), d = q.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    at::Tensor out;
    if (batched) {
      Batched all = attention_batched(q.view({b * h, tq, d}), k.view({b * h, tk, d}), bias, h,
                                      scale, p, seed);
      out = at::bmm(all.dropped, v.view({b * h, tk, d})).view({b, h, tq, d});
    } else {
      out = at::empty({b, h, tq, d}, q.options());
      at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh) {
          const int64_t i = bh / h, j = bh % h;
          Block blk =
              attention_block(q[i][j], k[i][j], bias[i], scale, p, seed, bh * tq * tk);
          at::Tensor out_ij = out[i][j];
          at::mm_out(out_ij, blk.dropped, v[i][j]);
        }
      });
    }
    ctx->save_for_backward({q, k, v, bias});
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["batched"] = batched;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &bias = saved[3];
    const double p = ctx->saved_data["p"].toDouble();
    const int64_t seed = ctx->saved_data["seed"].toInt();
    const bool batched = ctx->saved_data["batched"].toBool();
    at::Tensor grad_out = grads[0].contiguous();
    const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), tk = k.size(2), d = q.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    at::Tensor gq, gk, gv;
    if (batched) {
      at::Tensor q3 = q.view({b * h, tq, d}), k3 = k.view({b * h, tk, d});
      at::Tensor v3 = v.view({b * h, tk, d}), g = grad_out.view({b * h, tq, d});
      Batched all = attention_batched(q3, k3, bias, h, scale, p, seed);
      gv = at::bmm(all.dropped.transpose(1, 2), g).view({b, h, tk, d});
      at::Tensor g_probs = at::bmm(g, v3.transpose(1, 2)).to(at::kFloat).contiguous();
      if (p > 0.0) {
        Mask(p, seed).apply(g_probs, 0);
      }
      at::Tensor g_scores =
          at::_softmax_backward_data(g_probs, all.probs, -1, at::kFloat).to(q.scalar_type());
      gq = at::bmm(g_scores, k3).view({b, h, tq, d});
      gk = at::bmm(g_scores.transpose(1, 2), q3).view({b, h, tk, d});
    } else {
      gq = at::empty_like(q), gk = at::empty_like(k), gv = at::empty_like(v);
      at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh) {
          const int64_t i = bh / h, j = bh % h;
          const int64_t first = bh * tq * tk;
          at::Tensor q_ij = q[i][j], k_ij = k[i][j], g = grad_out[i][j];
          Block blk = attention_block(q_ij, k_ij, bias[i], scale, p, seed, first);
          at::Tensor gv_ij = gv[i][j], gq_ij = gq[i][j], gk_ij = gk[i][j];
          at::mm_out(gv_ij, blk.dropped.t(), g);  // (Tk, D)
          at::Tensor g_probs = at::mm(g, v[i][j].t()).to(at::kFloat);
          if (p > 0.0) {
            Mask(p, seed).apply(g_probs, first);
          }
          at::Tensor g_scores =
              at::_softmax_backward_data(g_probs, blk.probs, -1, at::kFloat).to(q.scalar_type());
          at::mm_out(gq_ij, g_scores, k_ij);
          at::mm_out(gk_ij, g_scores.t(), q_ij);
        }
      });
    }
    gq.mul_(scale);
    gk.mul_(scale);
    return {gq, gk, gv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// Dropout of x with probability p (0 <= p < 1), the mask drawn from `seed`.
at::Tensor* sprtrain_seeded_dropout(const at::Tensor* x, double p, int64_t seed, char** error) {
  return sprtrain_ffi::guarded(error, [&] { return SeededDropout::apply(*x, p, seed); });
}

// Scaled dot-product attention of (B, H, Tq, D) q and (B, H, Tk, D) k, v over the keys where
// key_mask (B, 1, 1, Tk), (B, Tk) or, per query, (B, 1, Tq, Tk), boolean, is true, with
// dropout p on the probabilities drawn from `seed`. Batched products when the (B, H, Tq, Tk)
// scores have at most `batched_up_to` elements, else a loop over (batch, head) pairs. Returns
// (B, H, Tq, D).
at::Tensor* sprtrain_seeded_attention(const at::Tensor* q, const at::Tensor* k,
                                      const at::Tensor* v, const at::Tensor* key_mask, double p,
                                      int64_t seed, int64_t batched_up_to, char** error) {
  return sprtrain_ffi::guarded(error, [&] {
    const int64_t b = key_mask->size(0), t = key_mask->size(-1);
    // One row of key bias for all queries, or one row per query (causal masks).
    const int64_t rows = key_mask->dim() == 4 ? key_mask->size(2) : 1;
    // A large finite negative rather than -inf: a row with no key left gets uniform weights,
    // not NaN (it is in range for bf16 too).
    at::Tensor bias = at::zeros({b, rows, t}, q->options().requires_grad(false));
    bias.masked_fill_(key_mask->logical_not().reshape({b, rows, t}), at::Scalar(-3.0e38));
    const int64_t scores = q->size(0) * q->size(1) * q->size(2) * k->size(2);
    return SeededAttention::apply(*q, *k, *v, bias, p, seed, scores <= batched_up_to);
  });
}

void sprtrain_free_error(char* error) { std::free(error); }
}
