// The fp32 matrix products of sprtrain's linear layers (src/models/linear_grad.cpp) and
// per-pair attention (seeded.cpp), and which library runs them: the BLAS libtorch's at::mm
// calls (MKL in PyPI's wheels), or oneDNN, which libtorch also carries (it runs libtorch's
// bf16 products): its matmul primitive for the layers, its brgemm microkernel for attention.
//
// Why a choice: on AMD CPUs MKL takes its generic ("def", AVX2) code path; oneDNN picks its
// kernels by instruction set alone and runs AVX-512 there. On a Zen 4 EPYC (2 threads), at the
// bench models' shapes, oneDNN's fp32 products measured 5-15% faster in every direction
// (forward, input gradient, accumulating weight gradient; docs/benchmarks.md, round 11). Both
// are fp32 throughout (oneDNN's default fpmath mode is strict): results differ in summation
// order only. The Rust side picks (`runtime.fp32_gemm`) once per process, before any product.
// The per-pair attention's (T x 64)-sized products (seeded.cpp) go through oneDNN's brgemm
// microkernel instead of its matmul primitive, whose per-call set-up and copies of strided
// operands ate the gain at those sizes. On an Intel Xeon with AMX (2 threads) MKL's own AVX-512
// kernels ran the layers faster than oneDNN's matmul (a DistilBERT step 2.55 s against 3.35),
// but the microkernel still ran attention faster than MKL (an attention layer 5-7% faster, about
// 1% of the step): there the layers keep the BLAS and attention takes the microkernel
// ("blas+brgemm").

#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <atomic>
#include <optional>
#include <vector>

namespace at::native {
// Declared by ATen/native/mkldnn/Matmul.h (TORCH_API; the wheel does not ship that header):
// result = beta * result + alpha * mat1 @ mat2 through oneDNN. It checks the CPU (AVX-512 BW,
// VL and DQ, or AVX-NE-CONVERT) and throws elsewhere.
void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result,
                   float beta, float alpha);
}  // namespace at::native

namespace sprtrain_gemm {

// Whether the linear layers' fp32 products go through oneDNN's matmul, and whether the per-pair
// attention's go through its brgemm microkernel (each set once by sprtrain_set_fp32_gemm).
inline std::atomic<bool> fp32_onednn{false};
inline std::atomic<bool> attention_brgemm{false};

// out = beta * out + a @ b for 2-D a (m, k), b (k, n) and out (m, n): every sprtrain product
// of fp32 operands in the chosen library, others (bf16) through ATen as before. beta 0 never
// reads out. Operands may be transposed views; oneDNN copies other strided ones first.
inline void product(at::Tensor out, const at::Tensor& a, const at::Tensor& b, float beta) {
  if (fp32_onednn.load(std::memory_order_relaxed) && out.scalar_type() == at::kFloat &&
      a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat) {
    // Not an ATen operator: named for libtorch's profiler (runtime.profile_steps), as at::mm is.
    RECORD_FUNCTION("sprtrain::onednn_mm", std::vector<c10::IValue>({a, b}));
    at::native::mkldnn_matmul(a, b, out, beta, 1.0f);
  } else if (beta == 0.0f) {
    at::mm_out(out, a, b);
  } else {
    out.addmm_(a, b, beta, 1.0);
  }
}

// a @ b as a new (m, n) tensor.
inline at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  product(out, a, b, 0.0f);
  return out;
}

// x @ w^T + bias for x (..., in), w (out, in), bias (out) or none: at::linear, with fp32
// products in the chosen library. Returns (..., out).
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  if (!(fp32_onednn.load(std::memory_order_relaxed) && x.scalar_type() == at::kFloat &&
        w.scalar_type() == at::kFloat)) {
    return at::linear(x, w, bias);
  }
  const int64_t in = w.size(1), out_features = w.size(0);
  const at::Tensor x2 = x.reshape({-1, in});  // (rows, in)
  at::Tensor y = at::empty({x2.size(0), out_features}, x2.options());
  // The bias as the product's starting value (beta = 1), as addmm does.
  if (bias.has_value()) y.copy_(bias->expand_as(y));
  product(y, x2, w.t(), bias.has_value() ? 1.0f : 0.0f);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape);
}

}  // namespace sprtrain_gemm
