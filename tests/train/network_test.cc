// The CPU backend: finite-difference gradient checks for every layer, model resolution errors,
// presets, state round trips and learning on a synthetic task.
#include <cmath>
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "tests/testing/test_util.h"
#include "tests/train/train_test_util.h"
#include "train/device_buckets.h"
#include "train/cpu_network.h"

namespace stoke::train {
namespace {

TEST(GradientCheck, ConvolutionWithBiasStrideAndPadding) {
  LayerSpec conv = Conv(4, 3, 2, 1);
  conv.bias = true;
  Fixture f = Build({conv, L(LayerType::kFlatten), Linear(3)}, 3, 7, 2);
  CheckGradients(f);
}

TEST(GradientCheck, BatchNormAndRelu) {
  Fixture f = Build({Conv(5, 3, 1, 1), L(LayerType::kBatchNorm), L(LayerType::kRelu),
                     L(LayerType::kGlobalAvgPool), Linear(4)},
                    4, 5, 3);
  CheckGradients(f);
}

TEST(GradientCheck, MaxPool) {
  Fixture f = Build({Conv(3, 3, 1, 1), Pool(LayerType::kMaxPool, 3, 2, 1), L(LayerType::kFlatten), Linear(3)}, 3, 6, 2);
  CheckGradients(f);
}

TEST(GradientCheck, AveragePoolCountsPadding) {
  Fixture f = Build({Conv(3, 1, 1, 0), Pool(LayerType::kAvgPool, 3, 2, 1), L(LayerType::kFlatten), Linear(3)}, 3, 6, 2);
  CheckGradients(f);
}

TEST(GradientCheck, ResidualAddWithTwoConsumers) {
  // "a" feeds both branches, so its gradient is the sum of two contributions.
  Fixture f = Build({Conv(4, 3, 1, 1, "a"), Conv(4, 3, 1, 1, "b", {"a"}), L(LayerType::kBatchNorm, "bn", {"b"}),
                     L(LayerType::kAdd, "sum", {"bn", "a"}), L(LayerType::kRelu), L(LayerType::kGlobalAvgPool),
                     Linear(3)},
                    3, 5, 2);
  CheckGradients(f);
}

TEST(GradientCheck, LinearDropoutAndVectorBatchNorm) {
  LayerSpec drop = L(LayerType::kDropout);
  drop.p = 0.3;
  Fixture f = Build({L(LayerType::kFlatten), Linear(8), L(LayerType::kBatchNorm), L(LayerType::kRelu), drop,
                     Linear(3)},
                    3, 3, 4);
  CheckGradients(f);
}

TEST(GradientCheck, LabelSmoothing) {
  Fixture f = Build({L(LayerType::kFlatten), Linear(5)}, 5, 3, 3, /*smoothing=*/0.2);
  CheckGradients(f);
}

TEST(GradientCheck, SmallResNetPreset) {
  // A full preset at a small size exercises projection shortcuts and blocked layouts together.
  // With thousands of ReLUs a step of 1e-3 crosses kinks (the difference quotient drifts from the
  // derivative as the step grows); 1e-4 is small enough and float32 still resolves it.
  ASSERT_OK_AND_ASSIGN(auto layers, ExpandPreset("resnet20", 4));
  Fixture f = Build(layers, 4, 8, 8);
  CheckGradients(f, 7, 3, 0.05, 1e-4f);
}

TEST(Dropout, SameStepSameMaskOtherStepOtherMask) {
  LayerSpec drop = L(LayerType::kDropout);
  drop.p = 0.5;
  Fixture f = Build({L(LayerType::kFlatten), Linear(16), drop, Linear(3)}, 3, 3, 4);
  ASSERT_OK_AND_ASSIGN(auto a, f.net->ForwardBackward(f.input, f.labels, 1));
  ASSERT_OK_AND_ASSIGN(auto b, f.net->ForwardBackward(f.input, f.labels, 1));
  ASSERT_OK_AND_ASSIGN(auto c, f.net->ForwardBackward(f.input, f.labels, 2));
  EXPECT_EQ(a.loss_sum, b.loss_sum);
  EXPECT_NE(a.loss_sum, c.loss_sum);
}

// The mask is drawn in logical (N, C, H, W) order whatever layout oneDNN keeps the activations in
// (channel-blocked after a convolution on most CPUs, padded to 8 or 16 channels by the vector
// width): dropout on a convolution's output drops the same units as dropout on its flattened copy,
// so masks agree across CPUs and with the CUDA backend.
TEST(Dropout, MaskFollowsTheLogicalOrderNotTheMemoryLayout) {
  LayerSpec drop = L(LayerType::kDropout, "d");
  drop.p = 0.5;
  LayerSpec nothing = L(LayerType::kDropout, "z");  // p 0: puts "d" at the same index in both models
  nothing.p = 0;
  // Both: conv "c" (16 channels), then "d" as the third layer, on the image or its flattened copy.
  Fixture image = Build({NoBias(Conv(16, 1, 1, 0, "c")), nothing, drop, L(LayerType::kFlatten, "f"), Linear(3, "fc")},
                        3, 6, 4);
  Fixture flat = Build({NoBias(Conv(16, 1, 1, 0, "c")), L(LayerType::kFlatten, "f"), drop, Linear(3, "fc")}, 3, 6, 4);
  ASSERT_TRUE(image.net && flat.net);
  ASSERT_OK_AND_ASSIGN(auto state, image.net->State());
  ASSERT_OK(flat.net->LoadState(state));
  for (const int64_t step : {1, 2, 7}) {
    ASSERT_OK_AND_ASSIGN(auto a, image.net->ForwardBackward(image.input, image.labels, step));
    ASSERT_OK_AND_ASSIGN(auto b, flat.net->ForwardBackward(flat.input, flat.labels, step));
    const std::vector<float> la = image.net->LastLogits(), lb = flat.net->LastLogits();
    ASSERT_EQ(la.size(), lb.size());
    for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], 1e-4f * (1 + std::abs(lb[i]))) << step << " " << i;
    EXPECT_NEAR(a.loss_sum, b.loss_sum, 1e-4 * b.loss_sum) << step;
  }
}

TEST(Model, ResolveErrorsNameTheLayer) {
  ModelSpec m;
  m.classes = 3;
  m.layers = {Conv(4, 3, 1, 1, "c1"), L(LayerType::kAdd, "sum", {"c1", "nope"})};
  auto r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer 1 ('sum', add): input 'nope'"), std::string::npos)
      << r.status().ToString();

  m.layers = {Conv(4, 3, 2, 1, "c1"), L(LayerType::kAdd, "sum", {"c1", "input"})};
  r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("differ in shape"), std::string::npos) << r.status().ToString();

  m.layers = {Conv(4, 3, 1, 1), L(LayerType::kGlobalAvgPool)};
  r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("vector of 3 logits"), std::string::npos) << r.status().ToString();

  m.layers = {L(LayerType::kFlatten), Conv(4, 3, 1, 1)};
  r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("needs a C x H x W input"), std::string::npos) << r.status().ToString();

  m.layers = {Conv(4, 9, 1, 0)};
  r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("does not fit"), std::string::npos) << r.status().ToString();

  EXPECT_FALSE(ExpandPreset("resnet101", 10).ok());
  EXPECT_NE(ExpandPreset("resnet101", 10).status().message().find("resnet50"), std::string::npos);
}

TEST(Model, PresetsHaveTheKnownParameterCounts) {
  // Counts of the reference architectures (ImageNet ones for 1000 classes at 224).
  const std::map<std::string, std::pair<int, int64_t>> expected = {
      {"resnet18", {224, 11689512}}, {"resnet34", {224, 21797672}}, {"resnet50", {224, 25557032}}};
  for (const auto& [name, want] : expected) {
    ModelSpec m;
    m.classes = 1000;
    ASSERT_OK_AND_ASSIGN(m.layers, ExpandPreset(name, 1000));
    const Shape input{3, want.first, want.first};
    ASSERT_OK_AND_ASSIGN(auto shapes, ResolveModel(m, input));
    EXPECT_EQ(CountParameters(m, shapes, input), want.second) << name;
  }
  ModelSpec r20;
  r20.classes = 10;
  ASSERT_OK_AND_ASSIGN(r20.layers, ExpandPreset("resnet20", 10));
  ASSERT_OK_AND_ASSIGN(auto shapes, ResolveModel(r20, {3, 32, 32}));
  // 0.27M with projection shortcuts on the two stage changes.
  EXPECT_NEAR(static_cast<double>(CountParameters(r20, shapes, {3, 32, 32})), 0.27e6, 0.01e6);
  ModelSpec lenet;
  lenet.classes = 10;
  ASSERT_OK_AND_ASSIGN(lenet.layers, ExpandPreset("lenet", 10));
  ASSERT_OK_AND_ASSIGN(shapes, ResolveModel(lenet, {3, 32, 32}));
  EXPECT_EQ(CountParameters(lenet, shapes, {3, 32, 32}), 62006);
}

TEST(Network, StateRoundTripAndShapeErrors) {
  Fixture f = Build({Conv(4, 3, 1, 1, "c"), L(LayerType::kBatchNorm, "bn"), L(LayerType::kGlobalAvgPool), Linear(3, "fc")},
                    3, 6, 2);
  ASSERT_OK_AND_ASSIGN(std::vector<NamedTensor> s, f.net->State());
  std::vector<std::string> names;
  for (const auto& t : s) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"c.weight", "c.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias",
                                              "bn.running_mean", "bn.running_var", "c.weight.momentum",
                                              "c.bias.momentum", "bn.weight.momentum", "bn.bias.momentum", "fc.weight.momentum",
                                              "fc.bias.momentum"}));
  for (auto& t : s) {
    for (size_t i = 0; i < t.values.size(); ++i) t.values[i] = 0.01f * static_cast<float>(i % 17);
  }
  ASSERT_OK(f.net->LoadState(s));
  ASSERT_OK_AND_ASSIGN(const auto back, f.net->State());
  for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(back[i].values, s[i].values) << s[i].name;

  s[0].dims = {4, 3, 3, 2};
  Status bad = f.net->LoadState(s);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("'c.weight' has shape [4, 3, 3, 2], the model needs [4, 3, 3, 3]"), std::string::npos)
      << bad.ToString();
  s[0].dims = {4, 3, 3, 3};
  s.erase(s.begin() + 4);  // fc.weight
  bad = f.net->LoadState(s);
  EXPECT_NE(bad.message().find("no tensor 'fc.weight'"), std::string::npos) << bad.ToString();
}

// Images whose class is the quadrant holding a bright square: learnable in a few dozen steps.
prefetch::Batch QuadrantBatch(int batch, int size, uint32_t seed, std::vector<uint8_t>& images,
                              std::vector<int32_t>& labels) {
  std::mt19937 rng(seed);
  images.assign(static_cast<size_t>(batch) * size * size * 3, 0);
  labels.resize(static_cast<size_t>(batch));
  for (int i = 0; i < batch; ++i) {
    const int q = static_cast<int>(rng() % 4);
    labels[static_cast<size_t>(i)] = q;
    const int half = size / 2;
    for (int y = 0; y < size; ++y) {
      for (int x = 0; x < size; ++x) {
        const bool lit = (y / half) * 2 + (x / half) == q;
        for (int c = 0; c < 3; ++c) {
          const int noise = static_cast<int>(rng() % 40);
          images[((static_cast<size_t>(i) * size + y) * size + x) * 3 + c] = static_cast<uint8_t>(lit ? 200 + noise / 3 : noise);
        }
      }
    }
  }
  prefetch::Batch b;
  b.size = batch;
  b.width = b.height = size;
  b.images = images;
  b.labels = labels;
  return b;
}

TEST(Network, LossDecreasesOnALearnableTask) {
  NetworkOptions o;
  o.model.classes = 4;
  o.model.layers = {Conv(8, 3, 1, 1), L(LayerType::kBatchNorm), L(LayerType::kRelu),
                    Pool(LayerType::kMaxPool, 2, 2, 0), L(LayerType::kFlatten), Linear(4)};
  o.image_size = 8;
  o.batch = 16;
  o.threads = 2;
  ASSERT_OK_AND_ASSIGN(auto net, CpuNetwork::Create(o));
  SgdOptions sgd{.momentum = 0.9, .nesterov = true, .weight_decay = 1e-4};
  std::vector<uint8_t> images;
  std::vector<int32_t> labels;
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    prefetch::Batch b = QuadrantBatch(16, 8, static_cast<uint32_t>(step), images, labels);
    ASSERT_OK_AND_ASSIGN(BatchStats s, net->TrainStep(b, 0.05f, sgd, step));
    if (step < 5) first += s.loss() / 5;
    if (step >= 55) last += s.loss() / 5;
  }
  EXPECT_LT(last, 0.3 * first) << "first " << first << " last " << last;
  prefetch::Batch b = QuadrantBatch(10, 8, 999, images, labels);  // a short evaluation batch
  ASSERT_OK_AND_ASSIGN(BatchStats eval, net->Evaluate(b));
  EXPECT_EQ(eval.count, 10);
  EXPECT_GE(eval.top1, 9);
  EXPECT_EQ(eval.top5, 10);

  // Training batches must be full; labels must fit the classes.
  EXPECT_FALSE(net->TrainStep(b, 0.05f, sgd, 60).ok());
  b = QuadrantBatch(16, 8, 5, images, labels);
  labels[3] = 4;
  auto r = net->TrainStep(b, 0.05f, sgd, 61);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("label 4, outside the model's 4 classes"), std::string::npos);
}

}  // namespace
}  // namespace stoke::train

namespace stoke::train {
namespace {

// A reference kernel is correct but tens of times slower (a global pooling gradient once took
// 40% of a step): every preset must get optimised kernels for all of its primitives.
TEST(Network, PresetsUseNoReferenceKernels) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "oneDNN's optimised kernels need AVX2 or better";
  for (const auto& [preset, size] : std::vector<std::pair<std::string, int>>{
           {"lenet", 32}, {"resnet20", 32}, {"resnet18", 64}, {"resnet50", 64}}) {
    NetworkOptions o;
    o.model.classes = 10;
    ASSERT_OK_AND_ASSIGN(o.model.layers, ExpandPreset(preset, 10));
    o.image_size = size;
    o.batch = 4;
    o.threads = 2;
    ASSERT_OK_AND_ASSIGN(auto net, CpuNetwork::Create(o));
    EXPECT_TRUE(net->ReferenceKernels().empty()) << preset << ": " << ::testing::PrintToString(net->ReferenceKernels());
  }
  // And the layer kinds presets do not use.
  NetworkOptions o;
  o.model.classes = 3;
  LayerSpec avg;
  avg.type = LayerType::kAvgPool;
  avg.kernel = 3;
  avg.stride = 2;
  avg.pad = 1;
  LayerSpec conv;
  conv.type = LayerType::kConv;
  conv.out = 16;
  conv.kernel = 3;
  conv.pad = 1;
  LayerSpec flat, drop, fc;
  flat.type = LayerType::kFlatten;
  drop.type = LayerType::kDropout;
  fc.type = LayerType::kLinear;
  fc.out = 3;
  o.model.layers = {conv, avg, flat, drop, fc};
  o.image_size = 16;
  o.batch = 4;
  ASSERT_OK_AND_ASSIGN(auto net, CpuNetwork::Create(o));
  EXPECT_TRUE(net->ReferenceKernels().empty()) << ::testing::PrintToString(net->ReferenceKernels());
}

}  // namespace
}  // namespace stoke::train

namespace stoke::train {
namespace {

// LARS scales by trust * |w| / (|g| + wd |w| + eps); LARC clips that at the global rate; no
// adaptation, or a zero norm, leaves the gradient alone.
TEST(Scoring, TiesGoToTheLowerIndexAndANanIsAMiss) {
  const float nan = std::nanf("");
  // Every logit equal (a model with zeroed last layer): only class 0 is its arg-max.
  const std::vector<float> flat(10, 0.5f);
  EXPECT_EQ(LabelRank(flat, 0), 0);
  EXPECT_EQ(LabelRank(flat, 3), 3);
  EXPECT_EQ(LabelRank(flat, 9), 9);
  EXPECT_EQ(LabelRank(std::vector<float>{1, 3, 3, 2}, 2), 1);
  EXPECT_EQ(LabelRank(std::vector<float>{1, 3, 3, 2}, 1), 0);
  EXPECT_EQ(LabelRank(std::vector<float>{nan, 3, 0}, 1), 3);
  EXPECT_EQ(LabelRank(std::vector<float>{0, nan, 0}, 1), 3);

  // Three rows of 10 classes: a clear hit, a tie row whose label is class 7 (top-5 misses), a NaN row;
  // and a fourth row flagged as a stand-in, left out.
  std::vector<float> logits(40, 0.f);
  logits[2] = 5;  // row 0: label 2
  logits[25] = nan;  // row 2
  logits[30 + 1] = 9;  // row 3: a hit, but skipped
  const std::vector<int32_t> labels{2, 7, 0, 1};
  const std::vector<uint8_t> skip{0, 0, 0, 1};
  const BatchStats s = ScoreLogits(logits, 10, labels, 0.0, skip);
  EXPECT_EQ(s.count, 3);
  EXPECT_EQ(s.top1, 1);
  EXPECT_EQ(s.top5, 1);
  // Row 0: log(e^5 + 9) - 5; row 1: log(10); row 2: NaN.
  EXPECT_TRUE(std::isnan(s.loss_sum));
  const BatchStats two = ScoreLogits(std::span(logits).first(20), 10, std::span(labels).first(2), 0.0);
  EXPECT_NEAR(two.loss_sum, std::log(std::exp(5.0) + 9) - 5 + std::log(10.0), 1e-9);
  // Label smoothing s: loss = lse - (1 - s) z_y - (s / K) sum z.
  const BatchStats smooth = ScoreLogits(std::span(logits).first(10), 10, std::span(labels).first(1), 0.1);
  EXPECT_NEAR(smooth.loss_sum, std::log(std::exp(5.0) + 9) - 0.9 * 5 - 0.01 * 5, 1e-9);
}

TEST(LayerAdaptation, TrustRatioFollowsTheNorms) {
  SgdOptions sgd;
  EXPECT_EQ(TrustRatio(sgd, 2.0, 1.0, 0.0, 0.1f), 1.f);
  sgd.adaptation = LayerAdaptation::kLars;
  EXPECT_NEAR(TrustRatio(sgd, 2.0, 1.0, 0.0, 0.1f), 0.001 * 2.0 / 1.0, 1e-9);
  EXPECT_NEAR(TrustRatio(sgd, 2.0, 1.0, 0.5, 0.1f), 0.001 * 2.0 / 2.0, 1e-9);
  EXPECT_EQ(TrustRatio(sgd, 0.0, 1.0, 0.0, 0.1f), 1.f);
  EXPECT_EQ(TrustRatio(sgd, 2.0, 0.0, 0.0, 0.1f), 1.f);
  sgd.adaptation = LayerAdaptation::kLarc;  // trust 0.02: 0.02 * 2 / 1 = 0.04; / lr 0.1 = 0.4
  EXPECT_NEAR(TrustRatio(sgd, 2.0, 1.0, 0.0, 0.1f), 0.4, 1e-6);
  EXPECT_EQ(TrustRatio(sgd, 200.0, 1.0, 0.0, 0.1f), 1.f);  // clipped at the global rate
  sgd.clip = false;
  EXPECT_NEAR(TrustRatio(sgd, 200.0, 1.0, 0.0, 0.1f), 4.0, 1e-6);
  sgd.trust_coefficient = 0.5;
  EXPECT_NEAR(TrustRatio(sgd, 2.0, 1.0, 0.0, 0.1f), 1.0, 1e-6);
}

}  // namespace
namespace {

TEST(DeviceBuckets, CoverEveryParameterOnceInBackwardOrder) {
  // Two groups: 4-byte and 2-byte elements; layers 0..5; offsets padded to 64.
  std::vector<DeviceParam> params = {
      {.group = 0, .offset = 0, .count = 1000, .layer = 0},    {.group = 1, .offset = 0, .count = 10, .layer = 0},
      {.group = 0, .offset = 1024, .count = 300000, .layer = 2}, {.group = 1, .offset = 64, .count = 10, .layer = 3},
      {.group = 0, .offset = 301056, .count = 500, .layer = 4},  {.group = 1, .offset = 128, .count = 5000, .layer = 5},
  };
  const std::vector<int64_t> sizes = {301568, 5184};
  const auto buckets = PlanDeviceBuckets(params, sizes, {2, 4}, 400000, 2000);
  // Every element of both buffers in exactly one bucket.
  for (int g = 0; g < 2; ++g) {
    std::vector<int> covered(static_cast<size_t>(sizes[static_cast<size_t>(g)]), 0);
    for (const auto& b : buckets) {
      if (b.group != g) continue;
      for (int64_t i = b.begin; i < b.end; ++i) covered[static_cast<size_t>(i)]++;
    }
    for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "group " << g << " element " << i;
  }
  int params_in_buckets = 0;
  for (const auto& b : buckets) params_in_buckets += b.params;
  EXPECT_EQ(params_in_buckets, 6);
  // Launch order follows backward (last layer first); the first buckets are small.
  for (size_t i = 1; i < buckets.size(); ++i) {
    EXPECT_GE(buckets[i - 1].ready_after_layer, buckets[i].ready_after_layer) << i;
  }
  EXPECT_EQ(buckets.front().ready_after_layer, 5);
  EXPECT_LE((buckets.front().end - buckets.front().begin) * 4, 2000 + 5000 * 4);
  // Layer 4's small weight does not wait for layer 2's large one.
  EXPECT_TRUE(std::any_of(buckets.begin(), buckets.end(), [](const DeviceBucket& b) { return b.ready_after_layer == 4; }));
  // The big layer-2 weight closes its bucket: no bucket holds both it and layer 0's.
  for (const auto& b : buckets) {
    if (b.group == 0 && b.begin <= 1024 && b.end > 1024) {
      EXPECT_GT(b.begin, 0) << "layer 2 shares with layer 0";
    }
  }
}

}  // namespace
}  // namespace stoke::train
