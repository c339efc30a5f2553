// Multi-tensor fused Adam/AdamW on the GPU: the interface between the torch binding (binding.cpp)
// and the kernel (gpu_adam.cu). Free of torch headers, so nvcc alone compiles the kernel.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/adam_hyper.h"

namespace tiered {
namespace gpu_adam {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Scalars of one step: shared with the CPU kernel.
using Hyper = ::tiered::AdamHyper;

struct TensorDesc {
  float* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* out;  // nullptr when the group has no low-precision output
  int64_t n;
};

// One thread block per chunk of kChunk elements of one tensor.
struct ChunkDesc {
  int64_t tensor;
  int64_t start;
};

constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

// The chunk table of one launch: kChunk-element chunks of each tensor in turn (the binding's, and
// the host emulation's in gpu_adam.cu).
inline std::vector<ChunkDesc> plan_chunks(const TensorDesc* tensors, int64_t n_tensors) {
  std::vector<ChunkDesc> chunks;
  for (int64_t i = 0; i < n_tensors; ++i)
    for (int64_t s = 0; s < tensors[i].n; s += kChunk) chunks.push_back({i, s});
  return chunks;
}

// Launches one kernel for the whole group. `tensors` and `chunks` point to device memory; all
// tensors share grad_t / state_t / out_t. Returns 0 or a cudaError_t value.
int launch(const TensorDesc* tensors, const ChunkDesc* chunks, int64_t n_chunks, int grad_t, int state_t,
           int out_t, const Hyper& h, void* stream);

const char* error_string(int err);

}  // namespace gpu_adam
}  // namespace tiered
