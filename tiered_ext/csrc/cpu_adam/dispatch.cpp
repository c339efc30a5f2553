// Run-time ISA selection and the start-up self-test of the vector paths.
#include <cstring>
#include <vector>

#include "cpu_adam.h"
#include "scalar_ops.h"

namespace tiered {
namespace cpu_adam {

bool cpu_supports(Isa isa) {
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
#ifdef TIERED_SIMD_EMULATION
      return true;  // the test-only build: AVX-512 emulated in portable code (simd_emulation.h)
#else
      return cpu_supports(Isa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
  }
  return false;
}

Isa best_isa() {
  if (cpu_supports(Isa::kAvx512)) return Isa::kAvx512;
  if (cpu_supports(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

StepFn step_fn(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return &step_avx512;
    case Isa::kAvx2: return &step_avx2;
    default: return &step_scalar;
  }
}

FiniteFn finite_fn(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return &all_finite_avx512;
    case Isa::kAvx2: return &all_finite_avx2;
    default: return &all_finite_scalar;
  }
}

namespace {

// Deterministic pseudo-random floats in roughly [-2, 2], some tiny, some exactly zero.
struct Lcg {
  uint64_t s;
  float next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = static_cast<uint32_t>(s >> 33);
    float x = (static_cast<float>(r & 0xFFFFFF) / 8388608.0f) - 1.0f;
    if ((r >> 24) % 17 == 0) x *= 1e-6f;
    if ((r >> 24) % 31 == 0) x = 0.0f;
    return 2.0f * x;
  }
};

void fill(std::vector<uint8_t>& buf, DType t, int64_t n, Lcg& rng, bool positive) {
  const size_t es = t == DType::kF32 ? 4 : 2;
  buf.assign(static_cast<size_t>(n) * es, 0);
  for (int64_t i = 0; i < n; ++i) {
    float x = rng.next();
    if (positive) x = x * x;
    if (t == DType::kF32) std::memcpy(buf.data() + 4 * i, &x, 4);
    else {
      const uint16_t h = t == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
      std::memcpy(buf.data() + 2 * i, &h, 2);
    }
  }
}

}  // namespace

int self_test(Isa isa) {
  if (isa == Isa::kScalar || !cpu_supports(isa)) return 0;
  // 3 full 16-lane double iterations + a partial vector + a tail, at an odd offset (unaligned).
  const int64_t n = 16 * 2 * 3 + 16 + 5, off = 3;
  int bad = 0;
  const DType gts[] = {DType::kF32, DType::kBF16, DType::kF16};
  const DType sts[] = {DType::kF32, DType::kBF16};
  const DType ots[] = {DType::kNone, DType::kBF16, DType::kF16};
  for (DType gt : gts)
    for (DType st : sts)
      for (DType ot : ots)
        for (int mode = 0; mode < 2; ++mode) {
          Lcg rng{0x9E3779B97F4A7C15ull + static_cast<uint64_t>(gt) * 7 + static_cast<uint64_t>(st) * 3};
          std::vector<uint8_t> p, g, m, v;
          fill(p, DType::kF32, n, rng, false);
          fill(g, gt, n, rng, false);
          fill(m, st, n, rng, false);
          fill(v, st, n, rng, true);
          std::vector<uint8_t> p2 = p, m2 = m, v2 = v;
          std::vector<uint8_t> o(static_cast<size_t>(n) * 2, 0xAB), o2 = o;
          Hyper h{};
          h.grad_scale = 0.75f; h.beta1 = 0.9f; h.one_minus_beta1 = 0.1f; h.beta2 = 0.999f;
          h.one_minus_beta2 = 0.001f; h.eps = 1e-8f; h.neg_step_size = -0.0123f;
          h.bc2_sqrt = 0.31622777f; h.decay = 0.9999f; h.l2 = 0.01f; h.adamw = mode == 1;
          Buffers a{reinterpret_cast<float*>(p.data()), g.data(), m.data(), v.data(),
                    ot == DType::kNone ? nullptr : o.data(), gt, st, ot};
          Buffers b{reinterpret_cast<float*>(p2.data()), g.data(), m2.data(), v2.data(),
                    ot == DType::kNone ? nullptr : o2.data(), gt, st, ot};
          step_scalar(a, h, off, n);
          step_fn(isa)(b, h, off, n);
          if (p != p2 || m != m2 || v != v2 || o != o2) ++bad;
          const bool fa = all_finite_scalar(g.data(), gt, h.grad_scale, off, n);
          const bool fb = finite_fn(isa)(g.data(), gt, h.grad_scale, off, n);
          if (fa != fb || !fa) ++bad;
        }
  return bad;
}

}  // namespace cpu_adam
}  // namespace tiered
