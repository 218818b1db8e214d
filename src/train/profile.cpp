// libtorch's operator profiler (the one torch.profiler drives from Python), for
// `runtime.profile_steps` (src/train/profile.rs): it records every ATen operator and autograd node
// the profiled steps run, on every thread, with input shapes; stopping writes libtorch's
// Chrome trace and hands the events to Rust, which makes the table of self times.

#include <torch/csrc/autograd/profiler_kineto.h>

#include <sstream>
#include <string>

#include "../models/ffi.h"

namespace {

namespace impl = torch::profiler::impl;

impl::ProfilerConfig config() {
  return impl::ProfilerConfig(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
}

// One line an event: thread, start and end (ns), name, input shapes ("[8, 128];[]").
std::string events_tsv(const torch::autograd::profiler::ProfilerResult& result) {
  std::ostringstream out;
  for (const auto& e : result.events()) {
    if (e.isHiddenEvent() || e.deviceType() != c10::DeviceType::CPU) continue;
    out << e.startThreadId() << '\t' << e.startNs() << '\t' << e.endNs() << '\t' << e.name()
        << '\t';
    if (e.hasShapes()) {
      bool first = true;
      for (const auto& shape : e.shapes()) {
        out << (first ? "" : ";") << '[';
        for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
        out << ']';
        first = false;
      }
    }
    out << '\n';
  }
  return out.str();
}

}  // namespace

extern "C" {

// Starts recording. Null on success, else a message for sprtrain_free_error.
char* sprtrain_profiler_start() {
  try {
    torch::autograd::profiler::prepareProfiler(config(), {impl::ActivityType::CPU});
    torch::autograd::profiler::enableProfiler(config(), {impl::ActivityType::CPU});
    return nullptr;
  } catch (const std::exception& e) {
    return sprtrain_ffi::copy_message(e.what());
  }
}

// Stops recording, writes the Chrome trace to `trace_path` and returns the events as
// tab-separated lines (malloc'd, for sprtrain_free_error); *error is set instead on failure.
char* sprtrain_profiler_stop(const char* trace_path, char** error) {
  *error = nullptr;
  try {
    auto result = torch::autograd::profiler::disableProfiler();
    result->save(trace_path);
    return sprtrain_ffi::copy_message(events_tsv(*result).c_str());
  } catch (const std::exception& e) {
    *error = sprtrain_ffi::copy_message(e.what());
  }
  return nullptr;
}

}  // extern "C"
