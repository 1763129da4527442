// Small statistics shared by the bench commands.
#pragma once

#include <algorithm>
#include <vector>

namespace stoke::bench {

// The median (the mean of the middle two for an even count); 0 for no values.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace stoke::bench
