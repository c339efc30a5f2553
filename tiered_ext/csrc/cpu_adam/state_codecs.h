// Native encode/decode of the compressed Adam moments: tiered/optim/state_codecs.py and
// tiered/optim/rounding_noise.py define every bit these kernels produce ([Note: counter-based
// rounding noise], [Note: codec speed]). Free of torch headers, as cpu_adam.h:
// state_codecs_binding.cpp checks the tensors, splits the work over threads and calls these per range.
#pragma once

#include <cstdint>

namespace tiered {
namespace state_codecs {

constexpr int kBlock = 256;          // elements per block of the 8-bit codes (BLOCK in Python)
constexpr float kBf16Safe = 3.38e38f;  // _BF16_SAFE in Python

// One int8 codec: its level table (code -> fraction of the block's maximum, code 0 = 0, as the
// Python codec's `grid`, passed in so both use the same floats) and shape.
struct LogCodec {
  const float* grid;  // levels + 1 entries
  int levels;
  int steps;
  bool is_signed;
  bool sqrt_domain;
};

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };  // as cpu_adam::Isa

// bf16: elements [begin, end) of x (global index of x[0]: index0) into dst; returns true when one
// of them is non-finite or above kBf16Safe (the caller rounds those to nearest, as Python does).
using Bf16EncodeFn = bool (*)(const float* x, uint16_t* dst, int64_t begin, int64_t end, uint64_t key,
                              int64_t index0);
// int8: the blocks [b0, b1) of an n-element tensor x into their scales and codes.
using LogEncodeFn = void (*)(const LogCodec& c, const float* x, float* scales, uint8_t* codes, int64_t n,
                             int64_t b0, int64_t b1, uint64_t key, int64_t index0);
// int8 decode of elements [begin, end) (begin a multiple of kBlock, or not: any range).
using LogDecodeFn = void (*)(const LogCodec& c, const float* table, const float* scales, const uint8_t* codes,
                             float* out, int64_t begin, int64_t end);

struct Kernels {
  Bf16EncodeFn bf16_encode;
  LogEncodeFn log_encode;
  LogDecodeFn log_decode;
};

Kernels kernels_scalar();
Kernels kernels_avx2();
Kernels kernels_avx512();

}  // namespace state_codecs
}  // namespace tiered
