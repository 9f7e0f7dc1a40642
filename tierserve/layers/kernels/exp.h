// The exponential the kernels share, written so loops that call it stay vectorised.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tierserve_math {

// e^x for x <= 0 (an attention score minus its row's max; SiLU's -|x|), in arithmetic the
// compiler vectorises (libm's expf is a call per element, and it was most of a decode step):
// 2^n x a degree-6 polynomial of the remainder (Cephes' expf coefficients), within about an
// ulp; exactly 0 below -87, so a masked (-inf) score weighs nothing.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f);
  const float n = std::floor(t * 1.44269504088896341f + 0.5f);
  const float r = t - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

}  // namespace tierserve_math
