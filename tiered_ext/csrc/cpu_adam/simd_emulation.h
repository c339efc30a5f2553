// Test-only: the AVX-512 intrinsics of cpu_adam_avx512.cpp emulated in portable code with SIMDe
// (https://github.com/simd-everywhere/simde, header-only; pip package simde-py), so the AVX-512 Vec
// and the shared body simd_kernel.h run and are tested on CPUs without AVX-512. Included instead of
// <immintrin.h> when TIERED_SIMD_EMULATION is defined, which only tiered_ext/_avx512_emulated.py does
// (tests/test_kernel_avx512_emulated.py); the product build never defines it and never includes
// this file. SIMDe uses the baseline SSE2 of x86-64 where it can and plain C elsewhere, so nothing
// here can emit an instruction the CPU lacks (which is also why the target pragma is skipped).
//
// Three intrinsics are ours, not SIMDe's, below: the two SIMDe 0.8.2 does not implement, and one it
// implements with different rounding from the hardware instruction.
#pragma once

#ifndef TIERED_SIMD_EMULATION
#error "simd_emulation.h is for the emulated test build only (TIERED_SIMD_EMULATION)"
#endif

#include <cmath>
#include <cstdint>

// 512-bit vector types passed by value without AVX-512 enabled: GCC notes the ABI of such calls
// differs from an AVX-512 build's. Irrelevant here (every function is internal to this TU).
#pragma GCC diagnostic ignored "-Wpsabi"

#define SIMDE_ENABLE_NATIVE_ALIASES
#include "simde/x86/avx512.h"
#include "simde/x86/f16c.h"

namespace tiered {
namespace simd_emulation {
namespace {

// VFMADD..PS: a * b + c with ONE rounding. SIMDe 0.8.2's portable _mm512_fmadd_ps (and the
// _mm256/_mm_fmadd_ps it falls back to) compute (a * b) + c with two roundings unless the compiler
// targets FMA hardware (FP_FAST_FMAF), which would make the emulated AVX-512 path differ from the
// real one and from the scalar path's std::fma in the last bit. std::fma is correctly rounded.
inline simde__m512 mm512_fmadd_ps(simde__m512 a, simde__m512 b, simde__m512 c) {
  const simde__m512_private a_ = simde__m512_to_private(a);
  const simde__m512_private b_ = simde__m512_to_private(b);
  const simde__m512_private c_ = simde__m512_to_private(c);
  simde__m512_private r_;
  for (int i = 0; i < 16; ++i) r_.f32[i] = std::fma(a_.f32[i], b_.f32[i], c_.f32[i]);
  return simde__m512_from_private(r_);
}

// VPMOVDW (not in SIMDe 0.8.2): each 32-bit lane truncated to its low 16 bits (no saturation).
inline simde__m256i mm512_cvtepi32_epi16(simde__m512i a) {
  const simde__m512i_private a_ = simde__m512i_to_private(a);
  simde__m256i_private r_;
  for (int i = 0; i < 16; ++i) r_.u16[i] = static_cast<uint16_t>(a_.u32[i] & 0xFFFFu);
  return simde__m256i_from_private(r_);
}

// VCVTPS2PH zmm (not in SIMDe 0.8.2): SIMDe's _mm256_cvtps_ph on each 256-bit half. SIMDe ignores
// the rounding immediate and always rounds to nearest even (subnormals kept), so only that
// immediate is accepted here, at compile time.
template <int kImm>
inline simde__m256i mm512_cvtps_ph(simde__m512 a) {
  static_assert((kImm & ~SIMDE_MM_FROUND_NO_EXC) == SIMDE_MM_FROUND_TO_NEAREST_INT,
                "the emulated _mm512_cvtps_ph only rounds to nearest even");
  const simde__m512_private a_ = simde__m512_to_private(a);
  const simde__m128i lo = simde_mm256_cvtps_ph(a_.m256[0], kImm);
  const simde__m128i hi = simde_mm256_cvtps_ph(a_.m256[1], kImm);
  return simde_mm256_set_m128i(hi, lo);
}

}  // namespace
}  // namespace simd_emulation
}  // namespace tiered

#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps(a, b, c) ::tiered::simd_emulation::mm512_fmadd_ps((a), (b), (c))
#define _mm512_cvtepi32_epi16(a) ::tiered::simd_emulation::mm512_cvtepi32_epi16(a)
#define _mm512_cvtps_ph(a, imm) ::tiered::simd_emulation::mm512_cvtps_ph<(imm)>(a)
