// Fused CPU Adam/AdamW over one flat partition: the interface shared by the ISA translation units,
// the dispatcher and the torch binding. Free of torch headers on purpose, so the kernels build and
// can be reasoned about on their own.
#pragma once

#include <cstdint>

#include "../common/adam_hyper.h"

namespace tiered {
namespace cpu_adam {

// Element type of a buffer. kNone marks an absent optional buffer (out_lowp).
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Scalars of one step: shared with the CUDA kernel.
using Hyper = ::tiered::AdamHyper;

struct Buffers {
  float* param;           // fp32 master weights, updated in place
  const void* grad;       // grad_t
  void* exp_avg;          // state_t
  void* exp_avg_sq;       // state_t
  void* out;              // out_t, or nullptr when out_t == kNone
  DType grad_t;
  DType state_t;
  DType out_t;
};

// Updates elements [begin, end) of the partition.
using StepFn = void (*)(const Buffers&, const Hyper&, int64_t begin, int64_t end);
// True iff every grad element in [begin, end), multiplied by grad_scale, is finite.
using FiniteFn = bool (*)(const void* grad, DType grad_t, float grad_scale, int64_t begin, int64_t end);

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

void step_scalar(const Buffers&, const Hyper&, int64_t, int64_t);
bool all_finite_scalar(const void*, DType, float, int64_t, int64_t);
void step_avx2(const Buffers&, const Hyper&, int64_t, int64_t);
bool all_finite_avx2(const void*, DType, float, int64_t, int64_t);
void step_avx512(const Buffers&, const Hyper&, int64_t, int64_t);
bool all_finite_avx512(const void*, DType, float, int64_t, int64_t);

// What this CPU (and OS) can run, best first.
bool cpu_supports(Isa isa);
Isa best_isa();
const char* isa_name(Isa isa);
StepFn step_fn(Isa isa);
FiniteFn finite_fn(Isa isa);

// Runs `isa` and the scalar path on the same deterministic inputs for every dtype combination and
// both modes; returns 0 when every output is bitwise equal, else the number of mismatching combos.
int self_test(Isa isa);

}  // namespace cpu_adam
}  // namespace tiered
