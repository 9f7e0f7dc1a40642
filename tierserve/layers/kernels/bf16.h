// bf16 <-> float32 on the bits, shared by the kernels. A bf16 value is the top half of a
// float32's bits: widening is a shift, and narrowing rounds to nearest even as torch's
// conversion does (a NaN stays a quiet NaN). Written on the bits so the loops that call them
// stay vectorised; c10::BFloat16's own conversions are a call per element.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tierserve_bf16 {

inline float wide(float x) { return x; }
inline float wide(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T narrow(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7fc0u : rounded),
                         c10::BFloat16::from_bits());
  }
}

}  // namespace tierserve_bf16
