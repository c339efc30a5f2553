// Scalar element update and exact dtype conversions. Included by every ISA translation unit, so
// everything here has internal linkage: each TU compiles its own copy under its own target flags
// (no ODR clash between an AVX2 and a generic copy of the same inline function).
//
// [Note: bitwise-identical paths]
// The vector bodies and this scalar code run the same operation sequence with explicit fused
// multiply-adds (std::fma / _mm*_fmadd_ps), IEEE sqrt and divide, and integer round-to-nearest-even
// conversions, and the build passes -ffp-contract=off so the compiler adds no fusions of its own.
// Hence an element gets the same bits whichever path (vector body, scalar tail, other ISA, other
// thread split) processes it: multithreaded == single-threaded bitwise, and the dispatcher's
// self-test can compare an ISA against the scalar path exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam.h"

namespace tiered {
namespace cpu_adam {
namespace {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, NaN -> canonical quiet NaN 0x7FC0, as c10::BFloat16's scalar conversion.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float, exact (RNE, subnormals kept): the branch-free algorithm of the FP16 library
// that c10::Half uses, so the scalar tail agrees bitwise with F16C/AVX-512 vcvtps2ph. One change
// from that library: a NaN keeps its top payload bits, quieted, as vcvtps2ph does (the library
// writes 0x7E00), so a NaN's half copy has the same bits in a tail as in the vector body.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized = bits_to_f32((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const uint32_t magic_mask = 126u << 23;
  const float denormalized = bits_to_f32((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t denorm_cutoff = 1u << 27;
  const uint32_t r = sign | (two_w < denorm_cutoff ? f32_to_bits(denormalized) : f32_to_bits(normalized));
  return bits_to_f32(r);
}

inline uint16_t f32_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  const uint32_t nan = 0x7E00u | ((w >> 13) & 0x03FFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

// Element-type tags: the kernels are templates over (grad, state, out) tags.
struct F32 {
  using storage = float;
  static float load(const storage* p, int64_t i) { return p[i]; }
  static void store(storage* p, int64_t i, float x) { p[i] = x; }
};
struct BF16 {
  using storage = uint16_t;
  static float load(const storage* p, int64_t i) { return bf16_to_f32(p[i]); }
  static void store(storage* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }
};
struct F16 {
  using storage = uint16_t;
  static float load(const storage* p, int64_t i) { return f16_to_f32(p[i]); }
  static void store(storage* p, int64_t i, float x) { p[i] = f32_to_f16(x); }
};
struct NoOut {
  using storage = uint16_t;
  static void store(storage*, int64_t, float) {}
};

// One element. The operation order is the one every vector body repeats (see the Note above):
//   g  = grad * scale            [+ l2 * p        (Adam, L2 mode)]
//   p  = p * decay                                (AdamW, decoupled)
//   m  = fma(1 - b1, g - m, m)                    (torch: exp_avg.lerp_(g, 1 - b1))
//   v  = fma((1 - b2) * g, g, b2 * v)             (torch: v.mul_(b2).addcmul_(g, g, 1 - b2))
//   d  = sqrt(v) / sqrt(bc2) + eps                (torch: (v.sqrt() / sqrt(bc2)).add_(eps))
//   p  = p + (-lr/bc1 * m) / d                    (torch: p.addcdiv_(m, d, -step_size))
// Each line rounds where torch's ATen kernels round (lerp_ and addcmul_ fuse, mul_/addcdiv_ do not), so
// every step but one rounds as torch.optim.AdamW / Adam do on CPU tensors. That includes dividing by
// sqrt(bc2) rather than multiplying by its reciprocal: the reciprocal saves a divide but differs in
// the last bit, which Adam amplifies for parameters whose gradient is ~0 (training through tiered
// is checked against plain PyTorch). The one difference left: our sqrt is IEEE (correctly rounded);
// torch 2.13's CPU sqrt is not (it differs from the correctly rounded result on ~20% of random
// inputs, measured), so an element can still differ from torch in the last bit.
template <class G, class S, class O, bool kAdamW>
inline void step_element(const Buffers& b, const Hyper& h, int64_t i) {
  float g = G::load(static_cast<const typename G::storage*>(b.grad), i) * h.grad_scale;
  float p = b.param[i];
  if (kAdamW) {
    p = p * h.decay;
  } else {
    g = std::fma(h.l2, p, g);
  }
  auto* mp = static_cast<typename S::storage*>(b.exp_avg);
  auto* vp = static_cast<typename S::storage*>(b.exp_avg_sq);
  float m = S::load(mp, i);
  float v = S::load(vp, i);
  m = std::fma(h.one_minus_beta1, g - m, m);
  v = std::fma(h.one_minus_beta2 * g, g, h.beta2 * v);
  const float d = std::sqrt(v) / h.bc2_sqrt + h.eps;
  p = p + (h.neg_step_size * m) / d;
  b.param[i] = p;
  S::store(mp, i, m);
  S::store(vp, i, v);
  O::store(static_cast<typename O::storage*>(b.out), i, p);
}

template <class G>
inline bool all_finite_range(const void* grad, float scale, int64_t begin, int64_t end) {
  // x - x is 0 for finite x and NaN for inf/NaN; the sum stays exactly 0 unless one was not finite.
  float acc = 0.0f;
  const auto* g = static_cast<const typename G::storage*>(grad);
  for (int64_t i = begin; i < end; ++i) {
    const float x = G::load(g, i) * scale;
    acc += x - x;
  }
  return acc == 0.0f;
}

inline bool all_finite_scalar_impl(const void* grad, DType t, float scale, int64_t begin, int64_t end) {
  switch (t) {
    case DType::kF32: return all_finite_range<F32>(grad, scale, begin, end);
    case DType::kBF16: return all_finite_range<BF16>(grad, scale, begin, end);
    default: return all_finite_range<F16>(grad, scale, begin, end);
  }
}

// Expands the runtime (grad, state, out, mode) quadruple into a template instantiation of KERNEL,
// a class template with a static run(const Buffers&, const Hyper&, int64_t, int64_t).
template <template <class, class, class, bool> class Kernel, class G, class S, class O>
inline void dispatch_mode(const Buffers& b, const Hyper& h, int64_t s, int64_t e) {
  if (h.adamw) Kernel<G, S, O, true>::run(b, h, s, e);
  else Kernel<G, S, O, false>::run(b, h, s, e);
}
template <template <class, class, class, bool> class Kernel, class G, class S>
inline void dispatch_out(const Buffers& b, const Hyper& h, int64_t s, int64_t e) {
  switch (b.out_t) {
    case DType::kBF16: dispatch_mode<Kernel, G, S, BF16>(b, h, s, e); break;
    case DType::kF16: dispatch_mode<Kernel, G, S, F16>(b, h, s, e); break;
    default: dispatch_mode<Kernel, G, S, NoOut>(b, h, s, e); break;
  }
}
template <template <class, class, class, bool> class Kernel, class G>
inline void dispatch_state(const Buffers& b, const Hyper& h, int64_t s, int64_t e) {
  if (b.state_t == DType::kBF16) dispatch_out<Kernel, G, BF16>(b, h, s, e);
  else dispatch_out<Kernel, G, F32>(b, h, s, e);
}
template <template <class, class, class, bool> class Kernel>
inline void dispatch_all(const Buffers& b, const Hyper& h, int64_t s, int64_t e) {
  switch (b.grad_t) {
    case DType::kBF16: dispatch_state<Kernel, BF16>(b, h, s, e); break;
    case DType::kF16: dispatch_state<Kernel, F16>(b, h, s, e); break;
    default: dispatch_state<Kernel, F32>(b, h, s, e); break;
  }
}

}  // namespace
}  // namespace cpu_adam
}  // namespace tiered
