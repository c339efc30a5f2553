// AVX-512 (F/BW/VL) path, 16 lanes, bf16 conversions in integer arithmetic (round to nearest even,
// exactly as c10::BFloat16; vcvtneps2bf16 would flush subnormals). Compiled for that target by
// pragma (no -march=native) and only called after the dispatcher has checked the CPU at run time.
// Standard headers come before the pragma: see cpu_adam_avx2.cpp.
//
// TIERED_SIMD_EMULATION (the test-only build of tiered_ext/_avx512_emulated.py, never the product build):
// the same code over SIMDe's portable emulation of these intrinsics (simd_emulation.h), so this
// path runs and is tested on CPUs without AVX-512. No target pragma then: with it GCC could emit
// real AVX-512 instructions for the inlined portable code.
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef TIERED_SIMD_EMULATION
#include "simd_emulation.h"
#else
#include <immintrin.h>
#endif

#include "cpu_adam.h"

#ifndef TIERED_SIMD_EMULATION
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
// A target pragma re-initialises GCC's per-function optimisation options, -ffp-contract among them:
// without this the a*b+c lines of the vector body are fused into FMAs (seen: AdamW's p*decay fused
// with the update), which breaks [Note: bitwise-identical paths] and equality with torch.
#pragma GCC optimize("fp-contract=off")

namespace tiered {
namespace cpu_adam {
namespace {

struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static bool all_zero(V acc) {
    return _mm512_cmp_ps_mask(acc, _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0;
  }
};

}  // namespace
}  // namespace cpu_adam
}  // namespace tiered

#include "simd_kernel.h"

namespace tiered {
namespace cpu_adam {

void step_avx512(const Buffers& b, const Hyper& h, int64_t begin, int64_t end) {
  dispatch_all<SimdStep>(b, h, begin, end);
}

bool all_finite_avx512(const void* grad, DType t, float scale, int64_t begin, int64_t end) {
  return simd_all_finite_dispatch(grad, t, scale, begin, end);
}

}  // namespace cpu_adam
}  // namespace tiered
