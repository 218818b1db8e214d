// Linear layers whose backward adds each weight's gradient straight into the weight's .grad
// (one GEMM with beta = 1) instead of returning it for autograd's AccumulateGrad to add: the
// "gradient accumulation fusion" of Megatron-LM, on CPU. sprtrain binds every parameter's
// .grad to a view of one flat buffer, so AccumulateGrad's `grad += new` is a pass over every
// weight's gradient each micro-step (a read of both and a write, plus a temporary the size of
// the weight): at Llama-125M's 512-row GEMMs that pass is a few percent of a step.
//
// Several layers of one input (query/key/value, gate/up) run as one product of their
// concatenated weights, and their weight gradient is one product too: into all the layers'
// .grads at once where those lie side by side in the flat buffer, else its rows added into
// each (one narrower product a layer was slower at 3072 rows). Where a weight has no usable
// .grad (not a leaf, no .grad yet, another dtype), its gradient goes back through autograd as
// usual. The one difference a caller can see: a backward asked for some inputs' gradients
// only (torch.autograd.grad) still adds these weights' gradients into their .grad; sprtrain
// only ever runs whole backwards.
//
// Under autocast (a lower compute dtype, bf16) the weights are cast once a call, several layers
// straight into one buffer, and the input too; the products run in that dtype and the weight
// gradient's product (rounded to it, as torch.autocast's) is added into the fp32 .grad in one
// mixed-dtype pass, where autograd's path cast it to a new fp32 tensor and then added that.
//
// Called from Rust through the C function at the bottom (tensors are tch's at::Tensor*).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "ffi.h"
#include "gemm.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether `param`'s .grad can take its gradient in place: a leaf's dense, contiguous .grad of
// its own dtype and shape (sprtrain's flat-buffer views).
bool grad_in_place(const at::Tensor& param) {
  // Not a leaf (GPT-2's transposed Conv1D weights): asking for its .grad would only warn.
  if (!param.is_leaf()) return false;
  const at::Tensor& grad = param.grad();
  return grad.defined() && grad.scalar_type() == param.scalar_type() &&
         grad.sizes() == param.sizes() && grad.is_contiguous() && !grad.is_sparse();
}

// A parameter's gradient: added into its .grad by `add_into` where that .grad can take it in
// place (sprtrain's flat-buffer views), returning undefined; else made by `make` and returned
// for autograd's AccumulateGrad.
template <typename Make, typename AddInto>
at::Tensor accumulate(const at::Tensor& param, Make make, AddInto add_into) {
  if (grad_in_place(param)) {
    at::Tensor target = param.mutable_grad();
    add_into(target);
    return at::Tensor();
  }
  return make();
}

// Where every weight's .grad can take its gradient in place (as `accumulate` requires) and
// the .grads are consecutive in memory in the order of `weights` (the flat buffer puts q/k/v
// or gate/up side by side where their names sort so), a (sum of out_i, in) view over all of
// them; else undefined.
at::Tensor adjacent_grads(const std::vector<at::Tensor>& weights, int64_t in) {
  if (weights.size() < 2) return at::Tensor();
  const at::Tensor& first = weights[0].grad();
  int64_t rows = 0;
  const float* next = nullptr;
  for (const at::Tensor& w : weights) {
    if (!w.requires_grad() || !grad_in_place(w) || w.scalar_type() != at::kFloat ||
        !w.grad().storage().is_alias_of(first.storage())) {
      return at::Tensor();
    }
    const at::Tensor& grad = w.grad();
    const float* start = grad.const_data_ptr<float>();
    if (next != nullptr && start != next) return at::Tensor();
    next = start + grad.numel();
    rows += w.size(0);
  }
  // A view of the same storage from the first .grad's offset (bounds-checked by libtorch).
  return first.as_strided({rows, in}, {in, 1});
}

// For each of `params` (autograd inputs `first_edge` on), the next rows of `all`, its
// gradient: added into its .grad where `accumulate` can, else appended to `result`.
void add_parts(AutogradContext* ctx, size_t first_edge, const std::vector<at::Tensor>& params,
               const at::Tensor& all, variable_list& result) {
  int64_t row = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor part = all.narrow(0, row, params[i].size(0));
    row += params[i].size(0);
    if (!ctx->needs_input_grad(first_edge + i)) {
      result.emplace_back();
      continue;
    }
    result.push_back(accumulate(
        params[i], [&] { return part.to(params[i].scalar_type()); },
        [&](at::Tensor& target) { target.add_(part); }));
  }
}

// `params` (rows out_i each) in one (sum of out_i, ...) tensor of dtype `kind`: a cast (or, in
// their own dtype, a cat) written straight into one buffer.
at::Tensor concat_as(at::TensorList params, at::ScalarType kind) {
  if (params.size() == 1) return params[0].to(kind);
  if (params[0].scalar_type() == kind) return at::cat(params, 0);
  std::vector<int64_t> shape = params[0].sizes().vec();
  shape[0] = 0;
  for (const at::Tensor& t : params) shape[0] += t.size(0);
  at::Tensor out = at::empty(shape, params[0].options().dtype(kind));
  int64_t row = 0;
  for (const at::Tensor& t : params) {
    out.narrow(0, row, t.size(0)).copy_(t);
    row += t.size(0);
  }
  return out;
}

struct AccumulatingLinear : public torch::autograd::Function<AccumulatingLinear> {
  // x (..., in); weights (out_i, in); biases: none or one (out_i) per weight; the products run
  // in `kind` (the weights' dtype, or autocast's). Returns (..., sum of out_i) in `kind`.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList weights,
                            at::TensorList biases, at::ScalarType kind) {
    const at::Tensor w = concat_as(weights, kind);
    const at::Tensor xc = x.to(kind);
    std::optional<at::Tensor> b;
    if (!biases.empty()) b = concat_as(biases, kind);
    ctx->save_for_backward({xc, w});
    // The parameters themselves, to reach their .grad (saved variables of leaves unpack to the
    // leaves, but a list in saved_data says so without relying on it).
    ctx->saved_data["weights"] = weights.vec();
    ctx->saved_data["biases"] = biases.vec();
    return sprtrain_gemm::linear(xc, w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const std::vector<at::Tensor> weights = ctx->saved_data["weights"].toTensorVector();
    const std::vector<at::Tensor> biases = ctx->saved_data["biases"].toTensorVector();
    const int64_t in = w.size(1), out = w.size(0);
    const at::Tensor dy = grads[0].reshape({-1, out});  // (rows, sum of out_i)
    const at::Tensor x2 = x.reshape({-1, in});          // (rows, in)
    // grad += dY^T X: in the weights' own dtype with the product itself (beta = 1); in a lower
    // one (autocast) the product is made, then added into the fp32 .grad in one mixed-dtype
    // pass.
    const bool same_dtype = w.scalar_type() == weights[0].scalar_type();
    const auto add_product = [&](at::Tensor& target) {
      if (same_dtype) {
        sprtrain_gemm::product(target, dy.t(), x2, 1.0f);
      } else {
        target.add_(dy.t().mm(x2));
      }
    };

    variable_list result;
    // In the compute dtype; autograd casts it to x's own, as for any input.
    result.push_back(ctx->needs_input_grad(0) ? sprtrain_gemm::product(dy, w).view(x.sizes())
                                              : at::Tensor());
    const size_t n = weights.size();
    bool any_weight = false;  // LoRA's frozen base weights need none
    for (size_t i = 0; i < n; ++i) any_weight = any_weight || ctx->needs_input_grad(1 + i);
    at::Tensor region = any_weight ? adjacent_grads(weights, in) : at::Tensor();
    if (!any_weight || region.defined()) {
      // The layers' .grads lie one after another in the flat buffer, in the order of their
      // weights: one product into all of them.
      if (region.defined()) add_product(region);
      result.insert(result.end(), n, at::Tensor());
    } else if (n == 1) {
      result.push_back(accumulate(
          weights[0],
          [&] { return sprtrain_gemm::product(dy.t(), x2).to(weights[0].scalar_type()); },
          add_product));
    } else {
      // Apart in memory: one product for all (one narrower product a layer measured slower
      // at DistilBERT's 3072 rows), its rows added into each .grad.
      const at::Tensor all = sprtrain_gemm::product(dy.t(), x2);  // (sum of out_i, in)
      add_parts(ctx, 1, weights, all, result);
    }
    bool any_bias = false;
    for (size_t i = 0; i < biases.size(); ++i) {
      any_bias = any_bias || ctx->needs_input_grad(1 + n + i);
    }
    if (any_bias) {
      add_parts(ctx, 1 + n, biases, dy.sum(0), result);  // (sum of out_i)
    } else {
      result.insert(result.end(), biases.size(), at::Tensor());
    }
    result.emplace_back();  // kind
    return result;
  }
};

// The rows `rows` of the LM head's logits, (n, V) in fp32: the product in `kind` (rounded to it,
// as under autocast), then widened, as the loss reads logits.
at::Tensor logits_of(const at::Tensor& hidden, const at::Tensor& w, int64_t first, int64_t n,
                     at::ScalarType kind) {
  return sprtrain_gemm::linear(hidden.narrow(0, first, n).to(kind), w, std::nullopt)
      .to(at::kFloat);
}

// A causal LM's summed cross-entropy over its (N, V) logits without ever holding them: the
// head's product and the loss run `chunk` rows at a time, in forward and again in backward,
// where each chunk's gradient (softmax - one-hot) goes straight into the hidden state's and
// the head weight's gradients (Liger-Kernel's fused linear cross-entropy, on CPU). The
// logits, their log-probabilities and their gradient were three (N, V) fp32 tensors: 0.39 GB
// for Llama-125M at seq 1024, most of what activation checkpointing leaves.
struct ChunkedLmLoss : public torch::autograd::Function<ChunkedLmLoss> {
  // hidden (N, C); weight (V, C); targets (N) int64, -100 not counted. Returns the sum of the
  // counted rows' -log p(target), an fp32 scalar.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& targets,
                            at::ScalarType kind, int64_t chunk) {
    const at::Tensor w = weight.to(kind);
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    const int64_t rows = hidden.size(0);
    for (int64_t first = 0; first < rows; first += chunk) {
      const int64_t n = std::min(chunk, rows - first);
      const at::Tensor logits = logits_of(hidden, w, first, n, kind);  // (n, V)
      const at::Tensor y = targets.narrow(0, first, n);
      const at::Tensor picked = logits.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1);
      const at::Tensor nll = logits.logsumexp(1).sub_(picked);  // (n)
      total.add_(nll.masked_fill_(y.eq(-100), 0.0).sum());
    }
    ctx->save_for_backward({hidden, weight, targets});
    ctx->saved_data["kind"] = static_cast<int64_t>(kind);
    ctx->saved_data["chunk"] = chunk;
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &targets = saved[2];
    const auto kind = static_cast<at::ScalarType>(ctx->saved_data["kind"].toInt());
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const at::Tensor w = weight.to(kind);
    const at::Tensor scale = grads[0].to(at::kFloat);
    const bool need_hidden = ctx->needs_input_grad(0), need_weight = ctx->needs_input_grad(1);
    at::Tensor grad_hidden = need_hidden ? at::empty_like(hidden) : at::Tensor();
    // The head weight's gradient: straight into its .grad (the flat buffer's view) where it
    // can take it, else into a tensor returned for autograd to add.
    const bool in_place = need_weight && grad_in_place(weight);
    at::Tensor grad_weight;
    if (in_place) {
      grad_weight = weight.mutable_grad();
    } else if (need_weight) {
      grad_weight = at::zeros_like(weight);
    }
    const int64_t rows = hidden.size(0);
    for (int64_t first = 0; first < rows; first += chunk) {
      const int64_t n = std::min(chunk, rows - first);
      const at::Tensor y = targets.narrow(0, first, n);
      // d loss / d logits = (softmax - one-hot) x the incoming gradient, 0 on rows not counted.
      at::Tensor d = logits_of(hidden, w, first, n, kind).softmax(1);  // (n, V)
      d.scatter_add_(1, y.clamp_min(0).unsqueeze(1), at::full({n, 1}, -1.0, d.options()));
      d.mul_(y.ne(-100).unsqueeze(1).to(at::kFloat).mul_(scale));
      const at::Tensor dk = d.to(kind);
      if (need_hidden) {
        grad_hidden.narrow(0, first, n).copy_(sprtrain_gemm::product(dk, w));
      }
      if (need_weight) {
        const at::Tensor h = hidden.narrow(0, first, n).to(kind);
        if (grad_weight.scalar_type() == kind) {
          sprtrain_gemm::product(grad_weight, dk.t(), h, 1.0f);
        } else {
          grad_weight.add_(dk.t().mm(h));
        }
      }
    }
    return {grad_hidden, in_place ? at::Tensor() : grad_weight, at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

bool any_requires_grad(at::TensorList ts) {
  for (const at::Tensor& t : ts) {
    if (t.requires_grad()) return true;
  }
  return false;
}

}  // namespace

extern "C" {

// The linear layers' fp32 products through oneDNN's matmul (`onednn`) or libtorch's BLAS, and
// the per-pair attention's through oneDNN's brgemm microkernel (`attention_brgemm`) or the BLAS,
// from now on, process-wide. Turning the matmul on first checks one product against at::mm's
// (its inputs made without touching libtorch's random generator, which seeds the model): false
// with *error set where oneDNN refuses this CPU or disagrees, the BLAS then in use for both.
// (The microkernel needs no check: ATen runs its own gemm where oneDNN's does not fit the CPU.)
bool sprtrain_set_fp32_gemm(bool onednn, bool attention_brgemm, char** error) {
  *error = nullptr;
  if (onednn) {
    try {
      const at::Tensor a = at::arange(96 * 40, at::kFloat).remainder(17.0).sub(8.0).view({96, 40});
      const at::Tensor b = at::arange(40 * 72, at::kFloat).remainder(13.0).sub(6.0).view({40, 72});
      at::Tensor out = at::empty({96, 72}, a.options());
      at::native::mkldnn_matmul(a, b, out, 0.0f, 1.0f);
      // Small integers: every partial sum is exact in fp32, so the two must agree exactly.
      TORCH_CHECK(out.equal(a.mm(b)), "oneDNN's fp32 product differs from at::mm's");
    } catch (const std::exception& e) {
      sprtrain_gemm::fp32_onednn.store(false);
      sprtrain_gemm::attention_brgemm.store(false);
      *error = sprtrain_ffi::copy_message(e.what());
      return false;
    }
  }
  sprtrain_gemm::fp32_onednn.store(onednn);
  sprtrain_gemm::attention_brgemm.store(attention_brgemm);
  return true;
}

// x @ cat(weights).T + cat(biases) for (..., in) x and `n_weights` (out_i, in) weights, with
// no biases or one (out_i) per weight; returns (..., sum of out_i). Under autograd, each
// weight's (and bias's) gradient is added into its .grad by the backward GEMM itself.
// `compute` is the dtype of the products (ATen's ScalarType code), or -1 for the weights'.
at::Tensor* sprtrain_accumulating_linear(const at::Tensor* x, const at::Tensor* const* weights,
                                         size_t n_weights, const at::Tensor* const* biases,
                                         size_t n_biases, int compute, char** error) {
  return sprtrain_ffi::guarded(error, [&] {
    TORCH_CHECK(n_weights > 0, "accumulating linear: no weights");
    TORCH_CHECK(n_biases == 0 || n_biases == n_weights,
                "accumulating linear: biases for some layers only");
    std::vector<at::Tensor> ws, bs;
    for (size_t i = 0; i < n_weights; ++i) ws.push_back(*weights[i]);
    for (size_t i = 0; i < n_biases; ++i) bs.push_back(*biases[i]);
    const at::ScalarType kind =
        compute < 0 ? ws[0].scalar_type() : static_cast<at::ScalarType>(compute);
    if (!at::GradMode::is_enabled() ||
        !(x->requires_grad() || any_requires_grad(ws) || any_requires_grad(bs))) {
      std::optional<at::Tensor> b;
      if (!bs.empty()) b = concat_as(bs, kind);
      return sprtrain_gemm::linear(x->to(kind), concat_as(ws, kind), b);
    }
    // As TensorLists, so that autograd counts every weight and bias as an input.
    return AccumulatingLinear::apply(*x, at::TensorList(ws), at::TensorList(bs), kind);
  });
}

// The summed cross-entropy of a causal LM's head `weight` (V, C) over `hidden` (N, C) against
// `targets` (N, int64; -100 not counted), the logits made `chunk` rows at a time and never
// whole; products in `compute` (ATen's ScalarType code, or -1 for the weight's dtype).
at::Tensor* sprtrain_chunked_lm_loss(const at::Tensor* hidden, const at::Tensor* weight,
                                     const at::Tensor* targets, int compute, int64_t chunk,
                                     char** error) {
  return sprtrain_ffi::guarded(error, [&] {
    TORCH_CHECK(hidden->dim() == 2 && weight->dim() == 2 && targets->dim() == 1,
                "chunked LM loss: hidden (N, C), weight (V, C) and targets (N) expected");
    TORCH_CHECK(chunk > 0, "chunked LM loss: chunk must be positive");
    const at::ScalarType kind =
        compute < 0 ? weight->scalar_type() : static_cast<at::ScalarType>(compute);
    return ChunkedLmLoss::apply(*hidden, *weight, *targets, kind, chunk);
  });
}
}

