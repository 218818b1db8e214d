// What the flat optimizer buffers (src/optim.rs) need of libtorch that tch does not expose:
// zero-filled buffers whose pages the kernel zeroes on first touch, and pointing a parameter's
// `.grad` at a view of the flat gradient directly.
//
// A base-size model has three more buffers of its size (gradient, two Adam moments: 264 MB
// each for DistilBERT). `torch.zeros` writes every page before the first step; an anonymous
// mapping is zero already, and its pages are filled when the first step writes them, as
// torch.optim.AdamW creates its state lazily at the first step. Called from Rust through the C
// functions below (tensors are tch's at::Tensor*).

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <cstdint>

extern "C" {

// A contiguous fp32 CPU tensor of `numel` zeros backed by an anonymous mapping, unmapped when
// its storage is freed. Null when the mapping fails.
at::Tensor* sprtrain_lazy_zeros(int64_t numel) {
  const size_t bytes = static_cast<size_t>(numel > 0 ? numel : 1) * sizeof(float);
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) return nullptr;
  try {
    return new at::Tensor(at::from_blob(
        data, {numel}, [bytes](void* p) { munmap(p, bytes); },
        at::TensorOptions().dtype(at::kFloat).device(at::kCPU)));
  } catch (...) {
    munmap(data, bytes);
    return nullptr;
  }
}

// Makes `grad` the `.grad` of `var` (same shape and dtype; checked by the caller).
void sprtrain_set_grad(at::Tensor* var, const at::Tensor* grad) { var->mutable_grad() = *grad; }

}  // extern "C"
