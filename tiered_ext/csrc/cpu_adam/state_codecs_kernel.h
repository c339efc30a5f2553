// The codec kernels' bodies, included once by each ISA translation unit (state_codecs_{scalar,avx2,
// avx512}.cpp) after its target pragma, so the compiler vectorises the same plain loops for each.
// Every value is a correctly rounded IEEE operation (mul, sub, div, sqrt, compare) or integer
// arithmetic, so all paths give the same bits; the one approximate step (log2_estimate) only picks
// where the exact search for the lower code starts ([Note: counter-based rounding noise] in
// tiered/optim/rounding_noise.py defines the code by that search).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "state_codecs.h"

namespace tiered {
namespace state_codecs {
namespace {

// ---- the rounding noise: one 32-bit word per element, a hash of (key, global element index) ----
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The 32-bit key of the indices whose high half is `hi` (the same for 2^32 elements in a row).
inline uint32_t segment_key(uint64_t key, uint64_t hi) { return static_cast<uint32_t>(splitmix64(key + hi)); }

// lowbias32 (C. Wellons' 32-bit integer hash): the word of the element whose low index half is
// `lo`, under its segment's key.
inline uint32_t noise_word(uint32_t lo, uint32_t k) {
  uint32_t x = lo ^ k;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// log2 of a positive normal float to ~1e-5: exponent plus log2 of the mantissa in [1, 2) from
// atanh's series (t = (f - 1) / (f + 1) <= 1/3). A subnormal gets a wrong estimate, which the
// exact search corrects (slowly): the estimate decides nothing.
inline float log2_estimate(float m) {
  const uint32_t b = bits_of(m);
  const float e = static_cast<float>(static_cast<int32_t>(b >> 23) - 127);
  const float f = float_of((b & 0x7FFFFFu) | 0x3F800000u);
  const float t = (f - 1.0f) / (f + 1.0f);
  const float t2 = t * t;
  const float s = t * (1.0f + t2 * (1.0f / 3.0f + t2 * (1.0f / 5.0f + t2 * (1.0f / 7.0f))));
  return e + 2.8853900817779268f * s;  // 2 / ln 2
}

// Calls fn(first, last, k) over the parts of elements [begin, end) (global index index0 + i) whose
// indices share their high 32 bits, k that part's segment key.
template <typename Fn>
inline void for_segments(int64_t begin, int64_t end, uint64_t key, int64_t index0, Fn&& fn) {
  while (begin < end) {
    const uint64_t g = static_cast<uint64_t>(index0 + begin);
    const uint64_t room = (uint64_t{1} << 32) - (g & 0xFFFFFFFFu);
    const int64_t last = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(end - begin), room)) + begin;
    fn(begin, last, segment_key(key, g >> 32));
    begin = last;
  }
}

bool bf16_encode_impl(const float* x, uint16_t* dst, int64_t begin, int64_t end, uint64_t key, int64_t index0) {
  bool odd = false;
  for_segments(begin, end, key, index0, [&](int64_t a, int64_t b, uint32_t k) {
    const uint32_t lo0 = static_cast<uint32_t>(index0 + a);
    const uint32_t* __restrict xb = reinterpret_cast<const uint32_t*>(x) + a;
    uint16_t* __restrict d = dst + a;
    const int64_t len = b - a;
    uint32_t big = 0;  // the largest |x| pattern: above kBf16Safe's (or NaN's) means round to nearest
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t noise = noise_word(lo0 + static_cast<uint32_t>(i), k) >> 16;
      d[i] = static_cast<uint16_t>((xb[i] + noise) >> 16);
      const uint32_t m = xb[i] & 0x7FFFFFFFu;
      big = m > big ? m : big;
    }
    odd |= big > bits_of(kBf16Safe);
  });
  return odd;
}

// The lower code of magnitude m > 0 in a block whose levels are lv[0..levels] (lv[levels + 1] =
// +inf): the largest c with lv[c] <= m, searched from the estimate c0 (the slow path: the vector
// loop corrects the estimate by one step, which is all it ever needs but for subnormal blocks).
inline int lower_code(const float* lv, int levels, float m, int c0) {
  int c = c0 < 0 ? 0 : (c0 > levels ? levels : c0);
  while (c > 0 && lv[c] > m) --c;
  while (c < levels && lv[c + 1] <= m) ++c;
  return c;
}

// The code of magnitude m whose lower code is c (levels lo, hi): c, plus one with the probability
// (m - lo) / (hi - lo) decided by the noise word, 0 for m = 0; plus 128 for a negative signed value.
// In a finite block m, lo, hi and u are >= 0 and not NaN (up may be, where width is 0, and is not
// used there), so each float comparison is the same comparison of the bit patterns: integer
// compares vectorise here, float ones do not (GCC keeps them as branches under -ftrapping-math).
inline int32_t round_code(float m, int32_t c, float lo, float hi, uint32_t word, uint32_t ybits, bool is_signed) {
  const float width = hi - lo;
  const float up = (m - lo) / width;  // where width > 0; else not used
  const float u = static_cast<float>(static_cast<int32_t>(word >> 8)) * 5.9604644775390625e-8f;  // 2^-24
  const int32_t round_up = static_cast<int32_t>(bits_of(u) < bits_of(up)) & static_cast<int32_t>(bits_of(hi) > bits_of(lo));
  const int32_t code = (c + round_up) * static_cast<int32_t>(bits_of(m) != 0);
  const int32_t negative = static_cast<int32_t>(is_signed) & static_cast<int32_t>(ybits > 0x80000000u);  // y < 0
  return code + 128 * negative;
}

void log_encode_impl(const LogCodec& cd, const float* x, float* scales, uint8_t* codes, int64_t n, int64_t b0,
                     int64_t b1, uint64_t key, int64_t index0) {
  const int levels = cd.levels;
  const float steps = static_cast<float>(cd.steps);
  const float flevels = static_cast<float>(levels);
  alignas(64) float y[kBlock], mag[kBlock], lv[kBlock + 2], lo[kBlock], hi[kBlock];
  alignas(64) int32_t code[kBlock];
  alignas(64) uint32_t word[kBlock];
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t a = blk * kBlock;
    const int len = static_cast<int>(std::min<int64_t>(kBlock, n - a));
    const float* __restrict xa = x + a;
    uint8_t* __restrict ca = codes + a;
    // |y| is non-negative: its bit pattern orders as the value, and NaN's lies above inf's, so the
    // block's maximum is an integer max (vectorised, where a float max must keep NaN's order)
    uint32_t topb = 0;
    for (int i = 0; i < len; ++i) {
      const float xi = xa[i];
      const float yi = cd.sqrt_domain ? std::sqrt(xi < 0.0f ? 0.0f : xi) : xi;  // NaN stays NaN
      y[i] = yi;
      mag[i] = std::fabs(yi);
      const uint32_t mb = bits_of(yi) & 0x7FFFFFFFu;
      topb = mb > topb ? mb : topb;
    }
    if (topb >= 0x7F800000u) {  // inf or NaN: decodes as NaN throughout; only a signed code's sign
      scales[blk] = std::numeric_limits<float>::quiet_NaN();
      for (int i = 0; i < len; ++i) ca[i] = (cd.is_signed && y[i] < 0.0f) ? 128 : 0;
      continue;
    }
    const float top = float_of(topb);
    scales[blk] = top;
    for (int c = 0; c <= levels; ++c) lv[c] = cd.grid[c] * top;
    lv[levels + 1] = std::numeric_limits<float>::infinity();
    const float ltop = top > 0.0f ? log2_estimate(top) : 0.0f;
    for_segments(a, a + len, key, index0, [&](int64_t s, int64_t e, uint32_t k) {
      const uint32_t lo0 = static_cast<uint32_t>(index0 + s);
      uint32_t* __restrict w = word + (s - a);
      for (int64_t i = 0; i < e - s; ++i) w[i] = noise_word(lo0 + static_cast<uint32_t>(i), k);
    });
    // the estimate, vectorised; then, per element, one step of the exact search each way and the
    // rounding (scalar: the level look-ups; gathers are far slower on CPUs with the GDS
    // mitigation). lv[levels + 1] = inf makes the top code's width inf, so it never rounds up, as
    // the Python codec's zero width does not.
    for (int i = 0; i < len; ++i) {
      const float p = (log2_estimate(mag[i]) - ltop) * steps + flevels;
      code[i] = p > 0.0f ? static_cast<int32_t>(p < flevels ? p : flevels) : 0;
    }
    for (int i = 0; i < len; ++i) {
      // two independent loads; the estimate is nearly always right, so the branches predict
      const float m = mag[i];
      const int32_t c = code[i];
      float a = lv[c], b = lv[c + 1];
      if (a > m && c > 0) {
        code[i] = c - 1;
        b = a;
        a = lv[c - 1];
      } else if (b <= m && c < levels) {
        code[i] = c + 1;
        a = b;
        b = lv[c + 2];
      }
      lo[i] = a;
      hi[i] = b;
    }
    uint32_t bad = 0;
    const bool sgn = cd.is_signed;
    for (int i = 0; i < len; ++i) {
      const float m = mag[i];
      const uint32_t mb = bits_of(m);  // comparisons of non-negative floats by pattern (round_code)
      bad += static_cast<uint32_t>(mb != 0) & (static_cast<uint32_t>(bits_of(lo[i]) > mb) | static_cast<uint32_t>(bits_of(hi[i]) <= mb));
      code[i] = round_code(m, code[i], lo[i], hi[i], word[i], bits_of(y[i]), sgn);
    }
    if (bad) {  // an estimate off by more than one (subnormal values): the search to the end
      for (int i = 0; i < len; ++i) {
        const int32_t c = mag[i] > 0.0f ? lower_code(lv, levels, mag[i], 0) : 0;
        code[i] = round_code(mag[i], c, lv[c], lv[c + 1], word[i], bits_of(y[i]), sgn);
      }
    }
    for (int i = 0; i < len; ++i) ca[i] = static_cast<uint8_t>(code[i]);
  }
}

void log_decode_impl(const LogCodec& cd, const float* table, const float* scales, const uint8_t* codes, float* out,
                     int64_t begin, int64_t end) {
  const float* __restrict t = table;
  for (int64_t a = begin; a < end;) {
    const int64_t blk = a / kBlock;
    const int64_t e = std::min(end, (blk + 1) * kBlock);
    const float s = scales[blk];
    const uint8_t* __restrict c = codes + a;
    float* __restrict o = out + a;
    const int64_t len = e - a;
    if (s != s) {  // NaN scale: NaN x level keeps the NaN's sign, the Python codec then negates
      for (int64_t i = 0; i < len; ++i) {
        float r = t[c[i]] * s;
        if (cd.is_signed && c[i] >= 128) r = -r;
        o[i] = cd.sqrt_domain ? r * r : r;
      }
    } else if (cd.sqrt_domain) {
      for (int64_t i = 0; i < len; ++i) {
        const float r = t[static_cast<int32_t>(c[i])] * s;
        o[i] = r * r;
      }
    } else {
      for (int64_t i = 0; i < len; ++i) o[i] = t[static_cast<int32_t>(c[i])] * s;
    }
    a = e;
  }
}

}  // namespace
}  // namespace state_codecs
}  // namespace tiered
