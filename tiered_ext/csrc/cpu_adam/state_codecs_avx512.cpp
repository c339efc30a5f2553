// The codec kernels compiled for AVX-512 (16 lanes); only called after the dispatcher has checked
// the CPU. In the test-only emulated build (TIERED_SIMD_EMULATION, see cpu_adam_avx512.cpp) no
// target pragma: that build must run on CPUs without AVX-512. Standard headers before the pragma.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifndef TIERED_SIMD_EMULATION
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")  // as state_codecs_avx2.cpp
#endif

#include "state_codecs_kernel.h"

namespace tiered {
namespace state_codecs {

Kernels kernels_avx512() { return {&bf16_encode_impl, &log_encode_impl, &log_decode_impl}; }

}  // namespace state_codecs
}  // namespace tiered
