// Deterministic, platform-independent random numbers. std::shuffle and the std distributions are
// implementation-defined, so a dataset order or a sample's augmentation would change with the
// standard library; everything here is specified bit for bit.
#pragma once

#include <cstdint>
#include <span>
#include <utility>

namespace stoke {

__extension__ typedef unsigned __int128 Uint128;  // GCC/Clang extension, not ISO C++

// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit generator with good statistical quality and a
// trivially seedable state. Not cryptographic. Thread-compatible.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  // Moves past `draws` outputs at once: the next Next() is the one `draws` calls later.
  void Skip(uint64_t draws) { state_ += draws * 0x9E3779B97F4A7C15ull; }

  // Uniform integer in [0, bound), bound > 0, without modulo bias (Lemire's method).
  uint64_t Below(uint64_t bound) {
    Uint128 m = static_cast<Uint128>(Next()) * bound;
    auto low = static_cast<uint64_t>(m);
    if (low < bound) {
      uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<Uint128>(Next()) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

// Mixes several numbers into one seed, e.g. MixSeed(seed, epoch) or MixSeed(seed, epoch, index):
// nearby inputs give unrelated outputs.
inline uint64_t MixSeed(uint64_t a, uint64_t b, uint64_t c = 0) {
  SplitMix64 g(a);
  uint64_t x = g.Next() ^ b;
  SplitMix64 h(x);
  uint64_t y = h.Next() ^ c;
  return SplitMix64(y).Next();
}

// The generator for one sample: keyed by (seed, epoch, record index), so a sample's random choices
// are the same whichever thread makes them and in whatever order. Counter-based in effect: no
// state is shared between samples.
inline SplitMix64 SampleRng(uint64_t seed, int64_t epoch, int64_t index) {
  return SplitMix64(MixSeed(seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(index)));
}

// Uniform double in [0, 1) with 53 random bits.
inline double Uniform01(SplitMix64& rng) {
  return static_cast<double>(rng.Next() >> 11) * 0x1.0p-53;
}

// Uniform double in [lo, hi).
inline double Uniform(SplitMix64& rng, double lo, double hi) { return lo + (hi - lo) * Uniform01(rng); }

// Fisher-Yates shuffle of `items` driven by `rng`. Same seed, same order, everywhere.
template <typename T>
void Shuffle(std::span<T> items, SplitMix64& rng) {
  for (size_t i = items.size(); i > 1; --i) {
    size_t j = rng.Below(i);
    std::swap(items[i - 1], items[j]);
  }
}

}  // namespace stoke
