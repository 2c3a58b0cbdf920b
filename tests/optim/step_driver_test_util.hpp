// What the step driver's tests share: the AdamW they check against (torch.optim.AdamW in double,
// with the hyper-parameters their configs give) and deterministic values.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace tier::step::test {

inline constexpr double kLr = 1e-2, kB1 = 0.9, kB2 = 0.999, kEps = 1e-8, kWd = 0.01;

// torch.optim.AdamW on one parameter, in double.
struct RefAdamW {
  std::vector<double> p, m, v;
  int t = 0;
  explicit RefAdamW(const std::vector<float>& init) : p(init.begin(), init.end()), m(init.size()), v(init.size()) {}
  void step(const std::vector<float>& g, double lr = kLr) {
    ++t;
    const double bc1 = 1 - std::pow(kB1, t), bc2 = 1 - std::pow(kB2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - lr * kWd;
      m[i] = kB1 * m[i] + (1 - kB1) * g[i];
      v[i] = kB2 * v[i] + (1 - kB2) * double(g[i]) * g[i];
      p[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + kEps);
    }
  }
};

inline std::vector<float> values(std::size_t n, float scale, float phase) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = scale * std::sin(0.37f * float(i) + phase);
  return out;
}

}  // namespace tier::step::test
