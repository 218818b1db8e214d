// What the C entry points of sprtrain's C++ units share: a C++ exception becomes an error
// message for Rust instead of unwinding through the FFI boundary.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace sprtrain_ffi {

// A malloc'd copy of `what`, freed by sprtrain_free_error.
inline char* copy_message(const char* what) {
  const size_t n = std::strlen(what) + 1;
  char* s = static_cast<char*>(std::malloc(n));
  if (s != nullptr) std::memcpy(s, what, n);
  return s;
}

// f()'s tensor as a new at::Tensor* for Rust to own, or null with *error set.
template <typename F>
at::Tensor* guarded(char** error, F f) {
  *error = nullptr;
  try {
    return new at::Tensor(f());
  } catch (const std::exception& e) {
    *error = copy_message(e.what());
  } catch (...) {
    *error = copy_message("unknown C++ exception");
  }
  return nullptr;
}

}  // namespace sprtrain_ffi
