// AVX2 + FMA + F16C path, 8 lanes. Compiled for that target by attribute (no -march=native), and
// only called after the dispatcher has checked the CPU at run time.
// Standard headers come before the target pragma so their inline functions keep the default
// target (an inline function compiled for AVX2 here must never be the copy another TU links to).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "cpu_adam.h"

#pragma GCC target("avx2,fma,f16c")
// A target pragma re-initialises GCC's per-function optimisation options, -ffp-contract among them:
// without this the a*b+c lines of the vector body are fused into FMAs (seen: AdamW's p*decay fused
// with the update), which breaks [Note: bitwise-identical paths] and equality with torch.
#pragma GCC optimize("fp-contract=off")

namespace tiered {
namespace cpu_adam {
namespace {

struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, V x) {
    // Round to nearest even in integer arithmetic, as c10::BFloat16 (see scalar_ops.h).
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // packus works per 128-bit lane: [r0..3 r0..3 | r4..7 r4..7]; gather qwords 0 and 2.
    __m256i packed = _mm256_packus_epi32(r, r);
    packed = _mm256_permute4x64_epi64(packed, 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static bool all_zero(V acc) {
    return _mm256_movemask_ps(_mm256_cmp_ps(acc, _mm256_setzero_ps(), _CMP_NEQ_UQ)) == 0;
  }
};

}  // namespace
}  // namespace cpu_adam
}  // namespace tiered

#include "simd_kernel.h"

namespace tiered {
namespace cpu_adam {

void step_avx2(const Buffers& b, const Hyper& h, int64_t begin, int64_t end) {
  dispatch_all<SimdStep>(b, h, begin, end);
}

bool all_finite_avx2(const void* grad, DType t, float scale, int64_t begin, int64_t end) {
  return simd_all_finite_dispatch(grad, t, scale, begin, end);
}

}  // namespace cpu_adam
}  // namespace tiered
