// The vector body of the fused Adam step, written once over a vector-ops type `Vec` that the
// including translation unit defines (AVX2: 8 lanes, AVX-512: 16 lanes) inside tiered::cpu_adam's
// anonymous namespace, after its `#pragma GCC target`. Operation order: see [Note: bitwise-identical
// paths] in scalar_ops.h; the tail of each range runs step_element, which gives the same bits.
#pragma once

#include "scalar_ops.h"

namespace tiered {
namespace cpu_adam {
namespace {

template <class T> struct VIO;
template <> struct VIO<F32> {
  static typename Vec::V load(const float* p, int64_t i) { return Vec::load_f32(p + i); }
  static void store(float* p, int64_t i, typename Vec::V x) { Vec::store_f32(p + i, x); }
};
template <> struct VIO<BF16> {
  static typename Vec::V load(const uint16_t* p, int64_t i) { return Vec::load_bf16(p + i); }
  static void store(uint16_t* p, int64_t i, typename Vec::V x) { Vec::store_bf16(p + i, x); }
};
template <> struct VIO<F16> {
  static typename Vec::V load(const uint16_t* p, int64_t i) { return Vec::load_f16(p + i); }
  static void store(uint16_t* p, int64_t i, typename Vec::V x) { Vec::store_f16(p + i, x); }
};
template <> struct VIO<NoOut> {
  static void store(uint16_t*, int64_t, typename Vec::V) {}
};

template <class G, class S, class O, bool kAdamW>
struct SimdStep {
  using V = typename Vec::V;
  static void run(const Buffers& b, const Hyper& h, int64_t begin, int64_t end) {
    const auto* gp = static_cast<const typename G::storage*>(b.grad);
    auto* mp = static_cast<typename S::storage*>(b.exp_avg);
    auto* vp = static_cast<typename S::storage*>(b.exp_avg_sq);
    auto* op = static_cast<typename O::storage*>(b.out);
    float* pp = b.param;
    const V scale = Vec::set1(h.grad_scale);
    const V decay = Vec::set1(h.decay);
    const V l2 = Vec::set1(h.l2);
    const V omb1 = Vec::set1(h.one_minus_beta1);
    const V b2 = Vec::set1(h.beta2);
    const V omb2 = Vec::set1(h.one_minus_beta2);
    const V eps = Vec::set1(h.eps);
    const V nstep = Vec::set1(h.neg_step_size);
    const V bc2s = Vec::set1(h.bc2_sqrt);
    constexpr int64_t W = Vec::W;

    auto body = [&](int64_t i) __attribute__((always_inline)) {
      V g = Vec::mul(VIO<G>::load(gp, i), scale);
      V p = Vec::load_f32(pp + i);
      if (kAdamW) {
        p = Vec::mul(p, decay);
      } else {
        g = Vec::fmadd(l2, p, g);
      }
      V m = VIO<S>::load(mp, i);
      V v = VIO<S>::load(vp, i);
      m = Vec::fmadd(omb1, Vec::sub(g, m), m);
      v = Vec::fmadd(Vec::mul(omb2, g), g, Vec::mul(b2, v));
      const V d = Vec::add(Vec::div(Vec::sqrt(v), bc2s), eps);
      p = Vec::add(p, Vec::div(Vec::mul(nstep, m), d));
      Vec::store_f32(pp + i, p);
      VIO<S>::store(mp, i, m);
      VIO<S>::store(vp, i, v);
      VIO<O>::store(op, i, p);
    };

    int64_t i = begin;
    // Two independent vectors per iteration keep both sqrt/div pipes busy while loads stream in.
    for (; i + 2 * W <= end; i += 2 * W) {
      body(i);
      body(i + W);
    }
    for (; i + W <= end; i += W) body(i);
    for (; i < end; ++i) step_element<G, S, O, kAdamW>(b, h, i);
  }
};

template <class G>
inline bool simd_all_finite(const void* grad, float scale, int64_t begin, int64_t end) {
  using V = typename Vec::V;
  const auto* gp = static_cast<const typename G::storage*>(grad);
  const V s = Vec::set1(scale);
  V acc = Vec::set1(0.0f);
  constexpr int64_t W = Vec::W;
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    const V x = Vec::mul(VIO<G>::load(gp, i), s);
    acc = Vec::add(acc, Vec::sub(x, x));
  }
  return Vec::all_zero(acc) && all_finite_range<G>(grad, scale, i, end);
}

inline bool simd_all_finite_dispatch(const void* grad, DType t, float scale, int64_t begin, int64_t end) {
  switch (t) {
    case DType::kF32: return simd_all_finite<F32>(grad, scale, begin, end);
    case DType::kBF16: return simd_all_finite<BF16>(grad, scale, begin, end);
    default: return simd_all_finite<F16>(grad, scale, begin, end);
  }
}

}  // namespace
}  // namespace cpu_adam
}  // namespace tiered
