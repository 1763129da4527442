// Property test of the model resolver and the CPU backend together: every random layer list is
// either refused with an error that names what is wrong, or trains (finite loss, parameters move
// where they have a gradient) and, for a fixed sample, has the gradients finite differences give.
#include <cmath>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "tests/testing/test_util.h"
#include "tests/train/train_test_util.h"
#include "train/cpu_network.h"

namespace stoke::train {
namespace {

constexpr uint64_t kFirstSeed = 1000;
constexpr int kModels = 400;
constexpr int kGradientCheckEvery = 12;  // of the accepted models

// Random uint8 images and labels for one batch of `r`'s input.
prefetch::Batch RandomBatch(const RandomModel& r, int batch, uint64_t seed, std::vector<uint8_t>& images,
                            std::vector<int32_t>& labels) {
  std::mt19937_64 rng(seed);
  images.resize(static_cast<size_t>(batch) * r.width * r.height * 3);
  for (auto& v : images) v = static_cast<uint8_t>(rng());
  labels.resize(static_cast<size_t>(batch));
  for (auto& y : labels) y = static_cast<int32_t>(rng() % static_cast<uint64_t>(r.model.classes));
  prefetch::Batch b;
  b.size = batch;
  b.width = r.width;
  b.height = r.height;
  b.images = images;
  b.labels = labels;
  return b;
}

TEST(RandomModels, EachTrainsOrIsRefusedWithANamedError) {
  std::map<LayerType, int> first_accepted, later_accepted;
  int accepted = 0, refused = 0, checked = 0, non_square = 0, one_by_one = 0, branches = 0;
  for (int i = 0; i < kModels; ++i) {
    const uint64_t seed = kFirstSeed + static_cast<uint64_t>(i);
    RandomModel r = MakeRandomModel(seed);
    SCOPED_TRACE(fmt::format("seed {}: {}", seed, r.Describe()));
    ModelSpec resolved = r.model;
    auto shapes = ResolveModel(resolved, {3, r.height, r.width});
    if (!shapes.ok()) {
      ++refused;
      EXPECT_EQ(shapes.status().code(), StatusCode::kInvalidArgument);
      // Every refusal says which layer (or that the model as a whole) is at fault.
      const std::string& m = shapes.status().message();
      EXPECT_TRUE(m.starts_with("layer ") || m.starts_with("the model") || m.starts_with("the last layer"))
          << shapes.status().ToString();
      continue;
    }
    ++accepted;
    non_square += r.width != r.height;
    one_by_one += r.width == 1 && r.height == 1;
    for (size_t k = 0; k < resolved.layers.size(); ++k) {
      (k == 0 ? first_accepted : later_accepted)[resolved.layers[k].type]++;
      branches += resolved.layers[k].type == LayerType::kAdd;
    }

    NetworkOptions o;
    o.model = r.model;
    o.image_size = r.width;
    o.image_height = r.height;
    o.batch = 1 + static_cast<int>(seed % 4);
    o.seed = seed;
    o.threads = 1;  // as in train_test_util.h's Build: two spin-waiting threads beside ctest -j2 are slow
    auto net = CpuNetwork::Create(o);
    ASSERT_TRUE(net.ok()) << "a model ResolveModel accepts must build: " << net.status().ToString();
    ASSERT_OK_AND_ASSIGN(const std::vector<NamedTensor> before, (*net)->State());
    SgdOptions sgd;
    sgd.momentum = 0.9;
    std::vector<uint8_t> images;
    std::vector<int32_t> labels;
    for (int step = 0; step < 2; ++step) {
      const prefetch::Batch b = RandomBatch(r, o.batch, seed * 31 + static_cast<uint64_t>(step), images, labels);
      ASSERT_OK_AND_ASSIGN(BatchStats stats, (*net)->TrainStep(b, 0.05f, sgd, step));
      EXPECT_TRUE(std::isfinite(stats.loss())) << "step " << step;
    }
    // Every tensor with a gradient moved, every gradient is finite, and something was learned.
    ASSERT_OK_AND_ASSIGN(const std::vector<NamedTensor> after, (*net)->State());
    ASSERT_OK_AND_ASSIGN(const std::vector<NamedTensor> grads, (*net)->Gradients());
    std::map<std::string, const NamedTensor*> old;
    for (const auto& t : before) old[t.name] = &t;
    int moved = 0;
    for (const NamedTensor& g : grads) {
      // A gradient of 1e-9 (a batch norm scale right before another batch norm) moves nothing in
      // float32; one of 1e-4 must.
      bool nonzero = false;
      for (float v : g.values) {
        ASSERT_TRUE(std::isfinite(v)) << g.name;
        nonzero = nonzero || std::abs(v) > 1e-4f;
      }
      const NamedTensor* now = nullptr;
      for (const auto& t : after) {
        if (t.name == g.name) now = &t;
      }
      ASSERT_NE(now, nullptr) << g.name;
      const bool changed = now->values != old.at(g.name)->values;
      moved += changed;
      if (nonzero) {
        EXPECT_TRUE(changed) << g.name << " has a gradient but did not change";
      }
    }
    EXPECT_GT(moved, 0) << "no parameter changed in two steps";

    if ((accepted - 1) % kGradientCheckEvery == 0) {
      ++checked;
      Fixture f = Build(r.model.layers, r.model.classes, r.width, 3, 0.1, seed, r.height);
      CheckGradients(f, 5, 6);
    }
  }
  std::printf("%d random models (seeds %llu..%llu): %d trained (%d non-square, %d on a 1x1 input, %d adds), "
              "%d refused, %d gradient-checked\n",
              kModels, static_cast<unsigned long long>(kFirstSeed),
              static_cast<unsigned long long>(kFirstSeed + kModels - 1), accepted, non_square, one_by_one, branches,
              refused, checked);
  // The generator must keep producing what this test is about: a good share of valid models, every
  // layer type first and later, refusals, odd inputs.
  EXPECT_GE(accepted, kModels / 4);
  EXPECT_GE(refused, kModels / 10);
  EXPECT_GT(non_square, 10);
  EXPECT_GT(one_by_one, 3);
  EXPECT_GT(branches, 10);
  for (int t = 0; t < 10; ++t) {
    const auto type = static_cast<LayerType>(t);
    EXPECT_GT(first_accepted[type], 0) << LayerTypeName(type) << " never came first in a valid model";
    EXPECT_GT(later_accepted[type], 0) << LayerTypeName(type) << " never came later in a valid model";
  }
}

// The first layers users reported as aborting the process: each trains now.
TEST(RandomModels, ParameterFreeFirstLayersTrain) {
  for (LayerType first : {LayerType::kRelu, LayerType::kMaxPool, LayerType::kAvgPool, LayerType::kBatchNorm,
                          LayerType::kDropout, LayerType::kGlobalAvgPool, LayerType::kFlatten}) {
    SCOPED_TRACE(std::string(LayerTypeName(first)));
    LayerSpec l = L(first);
    l.kernel = 2;
    std::vector<LayerSpec> layers = {l};
    if (first != LayerType::kFlatten && first != LayerType::kGlobalAvgPool) {
      layers.push_back(Conv(4, 3, 1, 1));
      layers.push_back(L(LayerType::kRelu));
    }
    layers.push_back(Linear(3));
    // A step of 1e-4: with 1e-3 some of the ReLU inputs after the convolution cross zero.
    Fixture f = Build(layers, 3, 8, 4);
    CheckGradients(f, 7, 12, 3e-2, 1e-4f);
  }
}

TEST(RandomModels, UnusedLayersAndModelsWithoutParametersAreRefused) {
  ModelSpec m;
  m.classes = 3;
  m.layers = {Conv(4, 3, 1, 1, "c1"), Conv(4, 3, 1, 1, "c2", {"input"}), L(LayerType::kFlatten), Linear(3)};
  auto r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer 0 ('c1', conv): its output is not an input of any later layer"),
            std::string::npos)
      << r.status().ToString();

  m.layers = {L(LayerType::kGlobalAvgPool), L(LayerType::kFlatten)};
  r = ResolveModel(m, {3, 8, 8});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no learnable parameters"), std::string::npos) << r.status().ToString();
}

TEST(RandomModels, ABatchTooLargeForMemoryIsRefusedNamingTheBatch) {
  NetworkOptions o;
  o.model.classes = 3;
  o.model.layers = {Conv(64, 3, 1, 1), L(LayerType::kGlobalAvgPool), Linear(3)};
  o.image_size = 1024;
  o.batch = 1 << 20;
  auto net = CpuNetwork::Create(o);
  ASSERT_FALSE(net.ok());
  EXPECT_EQ(net.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(net.status().message().find("batch 1048576"), std::string::npos) << net.status().ToString();
}

}  // namespace
}  // namespace stoke::train
