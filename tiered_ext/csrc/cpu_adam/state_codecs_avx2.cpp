// The codec kernels compiled for AVX2 (8 lanes, gathers for the level look-ups); only called after
// the dispatcher has checked the CPU. Standard headers before the pragma: see cpu_adam_avx2.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#pragma GCC target("avx2,fma,f16c")
// no FMA contraction: the kernels' bits must be the scalar path's and torch's ([Note: bitwise-identical
// paths] in scalar_ops.h); the target pragma resets -ffp-contract
#pragma GCC optimize("fp-contract=off")

#include "state_codecs_kernel.h"

namespace tiered {
namespace state_codecs {

Kernels kernels_avx2() { return {&bf16_encode_impl, &log_encode_impl, &log_decode_impl}; }

}  // namespace state_codecs
}  // namespace tiered
