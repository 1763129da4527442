// The CUDA backend against the CPU backend: every layer's forward and backward on random inputs
// (float32, bfloat16 and float16, each with its tolerance), a few hundred training steps of a small
// model ending at close losses, state round trips, float16 loss scaling and training from the
// prefetch ring's device buffers. Every test skips, saying why, where no GPU is usable, except the
// cuDNN graph checks, which cuDNN makes on the host.
#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <random>
#include <set>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "dataset/dataset.h"
#include "tests/testing/test_util.h"
#include "tests/train/train_test_util.h"
#include "train/config.h"
#include "train/cpu_network.h"
#include "train/cuda/cudnn_graph.h"
#include "train/cuda/kernels.h"
#include "train/cuda/layer_graphs.h"
#include "train/cuda_network.h"
#include "train/data_parallel.h"
#include "train/trainer.h"

namespace stoke::train {

void PrintTo(Precision p, std::ostream* os) { *os << PrecisionName(p); }

namespace {

#define SKIP_WITHOUT_GPU()                                                   \
  do {                                                                       \
    Status gpu = CudaAvailable();                                            \
    if (!gpu.ok()) GTEST_SKIP() << gpu.message();       \
  } while (0)

// One small model per layer type under test (each also runs the linear and loss steps).
struct Case {
  std::string name;
  std::vector<LayerSpec> layers;
};
std::vector<Case> Cases() {
  LayerSpec drop = L(LayerType::kDropout);
  drop.p = 0.3;
  LayerSpec bn0 = L(LayerType::kBatchNorm);
  return {
      {"conv_bias_stride_pad_global_pool",
       {Conv(8, 3, 2, 1), L(LayerType::kGlobalAvgPool), Linear(5)}},
      {"conv_batchnorm_relu_maxpool_flatten",
       {NoBias(Conv(16, 3, 1, 1)), L(LayerType::kBatchNorm), L(LayerType::kRelu), Pool(LayerType::kMaxPool, 3, 2, 1),
        L(LayerType::kFlatten), Linear(5)}},
      {"avgpool_padding_then_linear_on_an_image",
       {NoBias(Conv(8, 1, 1, 0)), Pool(LayerType::kAvgPool, 3, 2, 1), Linear(5)}},
      {"residual_add_with_a_shared_input",
       {NoBias(Conv(8, 3, 1, 1, "stem")), L(LayerType::kRelu, "r"), NoBias(Conv(8, 3, 1, 1, "a", {"r"})),
        L(LayerType::kBatchNorm, "abn", {"a"}), L(LayerType::kAdd, "sum", {"abn", "r"}), L(LayerType::kRelu),
        L(LayerType::kGlobalAvgPool), Linear(5)}},
      // Both inputs of the add are its alone: their gradient buffers are the add's own (nothing
      // copied); "r" feeds two convolutions, whose input gradients are summed.
      {"residual_add_of_two_branches",
       {NoBias(Conv(8, 3, 1, 1, "stem")), L(LayerType::kRelu, "r"), NoBias(Conv(8, 3, 1, 1, "a", {"r"})),
        L(LayerType::kBatchNorm, "abn", {"a"}), NoBias(Conv(8, 1, 1, 0, "b", {"r"})), L(LayerType::kAdd, "sum", {"abn", "b"}),
        L(LayerType::kRelu), L(LayerType::kGlobalAvgPool), Linear(5)}},
      {"vectors_linear_batchnorm_dropout",
       {L(LayerType::kFlatten), Linear(32), bn0, L(LayerType::kRelu), drop, Linear(5)}},
  };
}

struct Tolerance {
  double loss, logits, grads;  // relative
};
Tolerance For(Precision p) {
  switch (p) {
    case Precision::kFloat32:
      return {1e-4, 1e-3, 2e-3};
    case Precision::kBFloat16:
      return {3e-2, 5e-2, 8e-2};
    case Precision::kFloat16:
      return {5e-3, 1e-2, 2e-2};
  }
  return {};
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * static_cast<double>(got[i] - want[i]);
    norm += want[i] * static_cast<double>(want[i]);
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-12);
}

// A plain NCHW input of `batch` normal images (3 x size x size) and labels i % 5.
struct RandomBatch {
  std::vector<float> input;
  std::vector<int32_t> labels;
  RandomBatch(int batch, int size, uint32_t seed)
      : input(static_cast<size_t>(batch) * 3 * size * size), labels(static_cast<size_t>(batch)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (auto& v : input) v = normal(rng);
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>(i % 5);
  }
};

NetworkOptions Options(std::vector<LayerSpec> layers, Precision p, int batch = 8, int size = 16) {
  NetworkOptions o;
  o.model.layers = std::move(layers);
  o.model.classes = 5;
  o.image_size = size;
  o.batch = batch;
  o.label_smoothing = 0.1;
  o.seed = 11;
  o.threads = 2;
  o.precision = p;
  return o;
}

class CudaParity : public ::testing::TestWithParam<Precision> {};

// One forward and backward of `c` on both backends from the same parameters: the loss, the logits
// and every parameter gradient within `precision`'s tolerance. With `fuse`, batch norm + ReLU pairs
// run as stoke's fused kernels; returns how many did.
int CompareWithTheCpu(const Case& c, Precision precision, bool fuse) {
  const Tolerance tol = For(precision);
  int fused = -1;
  SCOPED_TRACE(c.name);
  NetworkOptions cpu_opt = Options(c.layers, Precision::kFloat32);
  NetworkOptions gpu_opt = Options(c.layers, precision);
  gpu_opt.fuse_bn_relu = fuse;
  [&] {
    ASSERT_OK_AND_ASSIGN(auto cpu, CpuNetwork::Create(cpu_opt));
    ASSERT_OK_AND_ASSIGN(auto gpu, CudaNetwork::Create(gpu_opt));
    fused = gpu->FusedBatchNormRelu();
    for (const auto& f : gpu->FallbackKernels()) std::printf("[%s] own kernel: %s\n", c.name.c_str(), f.c_str());
    for (const auto& f : gpu->NondeterministicSteps()) {
      std::printf("[%s] non-deterministic engine: %s\n", c.name.c_str(), f.c_str());
    }
    for (const auto& f : gpu->RoundedFloat32Steps()) {
      std::printf("[%s] float32 engine rounding to TF32: %s\n", c.name.c_str(), f.c_str());
    }

    // The same seed gives the same starting parameters on both backends.
    ASSERT_OK_AND_ASSIGN(const auto cpu_state, cpu->State());
    ASSERT_OK_AND_ASSIGN(const auto gpu_state, gpu->State());
    ASSERT_EQ(cpu_state.size(), gpu_state.size());
    for (size_t i = 0; i < cpu_state.size(); ++i) {
      EXPECT_EQ(cpu_state[i].name, gpu_state[i].name);
      EXPECT_EQ(cpu_state[i].values, gpu_state[i].values) << cpu_state[i].name;
    }

    const RandomBatch in(8, 16, 7);
    ASSERT_OK_AND_ASSIGN(BatchStats want, cpu->ForwardBackward(in.input, in.labels, 3));
    ASSERT_OK_AND_ASSIGN(BatchStats got, gpu->ForwardBackward(in.input, in.labels, 3));
    EXPECT_NEAR(got.loss(), want.loss(), tol.loss * std::max(1.0, want.loss()));
    EXPECT_LE(RelativeError(gpu->LastLogits(), cpu->LastLogits()), tol.logits);
    ASSERT_OK_AND_ASSIGN(const auto cpu_grads, cpu->Gradients());
    ASSERT_OK_AND_ASSIGN(const auto gpu_grads, gpu->Gradients());
    ASSERT_EQ(cpu_grads.size(), gpu_grads.size());
    for (size_t i = 0; i < cpu_grads.size(); ++i) {
      ASSERT_EQ(cpu_grads[i].name, gpu_grads[i].name);
      const double err = RelativeError(gpu_grads[i].values, cpu_grads[i].values);
      EXPECT_LE(err, tol.grads) << cpu_grads[i].name;
      std::printf("[%s %s%s] %-14s gradient relative error %.2e\n", c.name.c_str(),
                  std::string(PrecisionName(precision)).c_str(), fuse ? " fused" : "", cpu_grads[i].name.c_str(), err);
    }
    // Batch norm's running statistics after that training pass: the same update on both backends
    // (momentum, and the unbiased batch variance), which evaluation then relies on.
    ASSERT_OK_AND_ASSIGN(const auto cpu_after, cpu->State());
    ASSERT_OK_AND_ASSIGN(const auto gpu_after, gpu->State());
    ASSERT_EQ(cpu_after.size(), gpu_after.size());
    for (size_t i = 0; i < cpu_after.size(); ++i) {
      const std::string& name = cpu_after[i].name;
      if (!name.ends_with(".running_mean") && !name.ends_with(".running_var")) continue;
      EXPECT_NE(cpu_after[i].values, cpu_state[i].values) << name << ": the training pass did not move it";
      const double err = RelativeError(gpu_after[i].values, cpu_after[i].values);
      EXPECT_LE(err, tol.grads) << name;
      std::printf("[%s %s%s] %-14s relative error %.2e\n", c.name.c_str(), std::string(PrecisionName(precision)).c_str(),
                  fuse ? " fused" : "", name.c_str(), err);
    }
  }();
  return fused;
}

TEST_P(CudaParity, EveryLayerForwardAndBackwardMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) EXPECT_EQ(CompareWithTheCpu(c, GetParam(), false), 0);
}

// The same with batch norm + ReLU fused where a batch norm's only consumer is a ReLU (an image
// model and a vector one have such a pair).
TEST_P(CudaParity, FusedBatchNormReluMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  int fused = 0;
  for (const Case& c : Cases()) fused += CompareWithTheCpu(c, GetParam(), true);
  EXPECT_EQ(fused, 2);
}

// Host batches of a learnable task: the class is the brightest of 4 colour patterns.
struct Task {
  std::vector<std::vector<uint8_t>> images;
  std::vector<std::vector<int32_t>> labels;
  prefetch::Batch Get(size_t i, int batch, int size) const {
    prefetch::Batch b;
    b.size = batch;
    b.width = b.height = size;
    b.images = images[i % images.size()];
    b.labels = labels[i % labels.size()];
    return b;
  }
};
Task MakeTask(int batches, int batch, int size) {
  Task t;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> noise(0, 60);
  for (int b = 0; b < batches; ++b) {
    std::vector<uint8_t> img(static_cast<size_t>(batch) * size * size * 3);
    std::vector<int32_t> lab(static_cast<size_t>(batch));
    for (int s = 0; s < batch; ++s) {
      const int y = static_cast<int>(rng() % 4);
      lab[static_cast<size_t>(s)] = y;
      for (int p = 0; p < size * size; ++p) {
        const int row = p / size, col = p % size;
        const bool on = (y == 0 && row < size / 2) || (y == 1 && row >= size / 2) || (y == 2 && col < size / 2) ||
                        (y == 3 && col >= size / 2);
        for (int c = 0; c < 3; ++c) {
          img[(static_cast<size_t>(s) * size * size + p) * 3 + c] = static_cast<uint8_t>((on ? 180 : 40) + noise(rng));
        }
      }
    }
    t.images.push_back(std::move(img));
    t.labels.push_back(std::move(lab));
  }
  return t;
}

TEST_P(CudaParity, ThreeHundredTrainingStepsEndAtCloseLosses) {
  SKIP_WITHOUT_GPU();
  const Precision precision = GetParam();
  const std::vector<LayerSpec> layers = Cases()[1].layers;
  const int batch = 16, size = 16, steps = 300;
  const Task task = MakeTask(12, batch, size);
  NetworkOptions co = Options(layers, Precision::kFloat32, batch, size);
  co.model.classes = 5;
  ASSERT_OK_AND_ASSIGN(auto cpu, CpuNetwork::Create(co));
  ASSERT_OK_AND_ASSIGN(auto gpu, CudaNetwork::Create(Options(layers, precision, batch, size)));
  // The same on the GPU with batch norm + ReLU fused.
  NetworkOptions fo = Options(layers, precision, batch, size);
  fo.fuse_bn_relu = true;
  ASSERT_OK_AND_ASSIGN(auto fused, CudaNetwork::Create(fo));
  ASSERT_EQ(fused->FusedBatchNormRelu(), 1);
  SgdOptions sgd;
  sgd.momentum = 0.9;
  sgd.weight_decay = 5e-4;
  double cpu_first = 0, cpu_last = 0, gpu_last = 0, fused_last = 0;
  for (int s = 0; s < steps; ++s) {
    const prefetch::Batch b = task.Get(static_cast<size_t>(s), batch, size);
    ASSERT_OK_AND_ASSIGN(BatchStats cs, cpu->TrainStep(b, 0.05f, sgd, s));
    ASSERT_OK_AND_ASSIGN(BatchStats gs, gpu->TrainStep(b, 0.05f, sgd, s));
    ASSERT_OK_AND_ASSIGN(BatchStats fs, fused->TrainStep(b, 0.05f, sgd, s));
    if (s < 20) cpu_first += cs.loss() / 20;
    if (s >= steps - 20) {
      cpu_last += cs.loss() / 20;
      gpu_last += gs.loss() / 20;
      fused_last += fs.loss() / 20;
    }
  }
  // Evaluation (running statistics; the fused inference kernel): the fused network given the
  // unfused one's state must evaluate a batch as the unfused one does.
  const prefetch::Batch b = task.Get(0, batch, size);
  ASSERT_OK_AND_ASSIGN(const auto state, gpu->State());
  ASSERT_OK(fused->LoadState(state));
  ASSERT_OK_AND_ASSIGN(BatchStats ge, gpu->Evaluate(b));
  ASSERT_OK_AND_ASSIGN(BatchStats fe, fused->Evaluate(b));
  std::printf("[%s] mean loss of the last 20 of %d steps: CPU %.4f, GPU %.4f, GPU fused %.4f (CPU first 20: %.4f); "
              "evaluation loss from one state: GPU %.5f, GPU fused %.5f\n",
              std::string(PrecisionName(precision)).c_str(), steps, cpu_last, gpu_last, fused_last, cpu_first,
              ge.loss(), fe.loss());
  EXPECT_LT(cpu_last, 0.5 * cpu_first);
  const double allowed = precision == Precision::kFloat32 ? 0.02 : 0.06;
  EXPECT_NEAR(gpu_last, cpu_last, allowed + 0.1 * cpu_last);
  EXPECT_NEAR(fused_last, cpu_last, allowed + 0.1 * cpu_last);
  EXPECT_NEAR(fe.loss(), ge.loss(), For(precision).loss * std::max(1.0, ge.loss()));
  EXPECT_EQ(fe.top1, ge.top1);
}

// LARS and LARC on the device (per-tensor norms in a fixed order, the ratio scaling the gradient
// with its weight decay before momentum) against the CPU backend's: ten float32 steps of a model
// with convolution, batch norm (not adapted) and linear weights end at the same parameters, and
// differ from plain SGD's. The linear weight (32 x 16 x 16 x 5 = 40,960 values) spans three of the
// device's 16,384-value chunks, so a tensor's norm is summed over several.
TEST(CudaLayerAdaptation, LarsAndLarcMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<LayerSpec> layers = {NoBias(Conv(32, 3, 1, 1)), L(LayerType::kBatchNorm), L(LayerType::kRelu),
                                         L(LayerType::kFlatten), Linear(5)};
  const int batch = 16, size = 16, steps = 10;
  const Task task = MakeTask(12, batch, size);
  auto train = [&](auto net, const SgdOptions& sgd, float lr) -> std::vector<NamedTensor> {
    for (int s = 0; s < steps; ++s) {
      auto st = net->TrainStep(task.Get(static_cast<size_t>(s), batch, size), lr, sgd, s);
      EXPECT_TRUE(st.ok()) << st.status().ToString();
    }
    auto state = net->State();
    EXPECT_TRUE(state.ok());
    return state.ok() ? *state : std::vector<NamedTensor>{};
  };
  SgdOptions plain;
  plain.momentum = 0.9;
  plain.weight_decay = 5e-4;
  ASSERT_OK_AND_ASSIGN(auto sgd_net, CudaNetwork::Create(Options(layers, Precision::kFloat32, batch, size)));
  const auto sgd_state = train(std::move(sgd_net), plain, 0.5f);
  for (LayerAdaptation a : {LayerAdaptation::kLars, LayerAdaptation::kLarc}) {
    SCOPED_TRACE(std::string(LayerAdaptationName(a)));
    SgdOptions sgd = plain;
    sgd.adaptation = a;
    sgd.nesterov = a == LayerAdaptation::kLarc;
    ASSERT_OK_AND_ASSIGN(auto cpu, CpuNetwork::Create(Options(layers, Precision::kFloat32, batch, size)));
    ASSERT_OK_AND_ASSIGN(auto gpu, CudaNetwork::Create(Options(layers, Precision::kFloat32, batch, size)));
    const auto want = train(std::move(cpu), sgd, 0.5f);
    const auto got = train(std::move(gpu), sgd, 0.5f);
    ASSERT_EQ(want.size(), got.size());
    double moved = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(want[i].name, got[i].name);
      EXPECT_LE(RelativeError(got[i].values, want[i].values), 2e-3) << want[i].name;
      if (want[i].name.ends_with("weight")) moved = std::max(moved, RelativeError(got[i].values, sgd_state[i].values));
    }
    EXPECT_GT(moved, 1e-2) << "the adaptation changed nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaParity,
                         ::testing::Values(Precision::kFloat32, Precision::kBFloat16, Precision::kFloat16),
                         [](const auto& info) { return std::string(PrecisionName(info.param)); });

// The CPU property test's random models (train/random_models_test.cc) on the GPU: every model the
// resolver accepts builds on both backends and gives the same loss, logits and gradients in float32.
TEST(CudaRandomModels, MatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const Tolerance tol = For(Precision::kFloat32);
  int compared = 0;
  for (uint64_t seed = 1000; seed < 1400; ++seed) {
    RandomModel r = MakeRandomModel(seed);
    ModelSpec resolved = r.model;
    if (!ResolveModel(resolved, {3, r.height, r.width}).ok()) continue;
    SCOPED_TRACE(fmt::format("seed {}: {}", seed, r.Describe()));
    NetworkOptions o;
    o.model = r.model;
    o.image_size = r.width;
    o.image_height = r.height;
    o.batch = 3;
    o.seed = seed;
    o.threads = 2;
    ASSERT_OK_AND_ASSIGN(auto cpu, CpuNetwork::Create(o));
    ASSERT_OK_AND_ASSIGN(auto gpu, CudaNetwork::Create(o));
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal;
    std::vector<float> input(static_cast<size_t>(o.batch) * 3 * r.width * r.height);
    for (auto& v : input) v = normal(rng);
    std::vector<int32_t> labels(static_cast<size_t>(o.batch));
    for (auto& y : labels) y = static_cast<int32_t>(rng() % static_cast<uint32_t>(r.model.classes));
    ASSERT_OK_AND_ASSIGN(BatchStats want, cpu->ForwardBackward(input, labels, 1));
    ASSERT_OK_AND_ASSIGN(BatchStats got, gpu->ForwardBackward(input, labels, 1));
    EXPECT_NEAR(got.loss(), want.loss(), tol.loss * std::max(1.0, want.loss()));
    EXPECT_LE(RelativeError(gpu->LastLogits(), cpu->LastLogits()), tol.logits);
    ASSERT_OK_AND_ASSIGN(const auto cpu_grads, cpu->Gradients());
    ASSERT_OK_AND_ASSIGN(const auto gpu_grads, gpu->Gradients());
    ASSERT_EQ(cpu_grads.size(), gpu_grads.size());
    for (size_t i = 0; i < cpu_grads.size(); ++i) {
      EXPECT_LE(RelativeError(gpu_grads[i].values, cpu_grads[i].values), tol.grads) << cpu_grads[i].name;
    }
    ++compared;
  }
  std::printf("%d random models compared\n", compared);
  EXPECT_GT(compared, 100);
}

TEST(CudaNetwork, StateRoundTripsAndBadStateIsRefused) {
  SKIP_WITHOUT_GPU();
  ASSERT_OK_AND_ASSIGN(auto gpu, CudaNetwork::Create(Options(Cases()[3].layers, Precision::kBFloat16)));
  ASSERT_OK_AND_ASSIGN(auto state, gpu->State());
  for (auto& t : state) {
    for (auto& v : t.values) v += 0.25f;
  }
  ASSERT_OK(gpu->LoadState(state));
  ASSERT_OK_AND_ASSIGN(const auto back, gpu->State());
  for (size_t i = 0; i < state.size(); ++i) EXPECT_EQ(back[i].values, state[i].values) << state[i].name;
  state[0].dims.push_back(1);
  Status bad = gpu->LoadState(state);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find(state[0].name), std::string::npos) << bad.ToString();
}

// Autotuning times each convolution's candidate engines and keeps the fastest: whatever it picks
// computes what heuristics' first choice computes, and a second network of the same shapes reuses
// the decisions (nothing timed again, the same engines, the same results). Run it in a process of
// its own or first (an earlier tuned network of the same shapes would have decided them already).
TEST(CudaNetwork, AutotuningKeepsTheResultsAndIsDecidedOncePerProcess) {
  SKIP_WITHOUT_GPU();
  for (const Precision precision : {Precision::kFloat32, Precision::kBFloat16}) {
    for (const int c : {1, 3}) {
      SCOPED_TRACE(fmt::format("{} {}", Cases()[c].name, PrecisionName(precision)));
      const Tolerance tol = For(precision);
      NetworkOptions o = Options(Cases()[c].layers, precision, 32, 32);
      ASSERT_OK_AND_ASSIGN(auto plain, CudaNetwork::Create(o));
      EXPECT_EQ(plain->AutotuneSummary(), "");
      EXPECT_EQ(plain->Autotuned().timed + plain->Autotuned().single, 0);
      o.autotune = true;
      ASSERT_OK_AND_ASSIGN(auto tuned, CudaNetwork::Create(o));
      std::printf("[%s %s] %s\n", Cases()[c].name.c_str(), std::string(PrecisionName(precision)).c_str(),
                  tuned->AutotuneSummary().c_str());
      EXPECT_NE(tuned->AutotuneSummary().find("convolution shapes timed"), std::string::npos);
      // Every convolution shape is either timed or has a single usable engine; none was decided
      // before (each case and precision has its own shapes).
      const CudaNetwork::AutotuneCounts first = tuned->Autotuned();
      EXPECT_GT(first.timed + first.single, 0);
      EXPECT_EQ(first.reused, 0);
      EXPECT_LE(first.changed, first.timed);
      ASSERT_OK_AND_ASSIGN(auto again, CudaNetwork::Create(o));
      const CudaNetwork::AutotuneCounts second = again->Autotuned();
      EXPECT_EQ(second.timed, 0) << "the decisions of the first tuned network were not reused";
      EXPECT_EQ(second.reused, first.timed);

      const RandomBatch in(32, 32, 5);
      ASSERT_OK_AND_ASSIGN(BatchStats want, plain->ForwardBackward(in.input, in.labels, 1));
      ASSERT_OK_AND_ASSIGN(BatchStats got, tuned->ForwardBackward(in.input, in.labels, 1));
      ASSERT_OK_AND_ASSIGN(BatchStats same, again->ForwardBackward(in.input, in.labels, 1));
      EXPECT_NEAR(got.loss(), want.loss(), tol.loss * std::max(1.0, want.loss()));
      EXPECT_LE(RelativeError(tuned->LastLogits(), plain->LastLogits()), tol.logits);
      // The same engines give the same bits, unless cuDNN had only non-deterministic ones for a
      // step (listed, and then compared within the tolerance).
      const bool exact = tuned->NondeterministicSteps().empty();
      for (const auto& f : tuned->NondeterministicSteps()) std::printf("non-deterministic engine: %s\n", f.c_str());
      if (exact) {
        EXPECT_EQ(same.loss_sum, got.loss_sum);
        EXPECT_EQ(again->LastLogits(), tuned->LastLogits());
      } else {
        EXPECT_NEAR(same.loss(), got.loss(), tol.loss * std::max(1.0, got.loss()));
        EXPECT_LE(RelativeError(again->LastLogits(), tuned->LastLogits()), tol.logits);
      }
      ASSERT_OK_AND_ASSIGN(const auto want_grads, plain->Gradients());
      ASSERT_OK_AND_ASSIGN(const auto got_grads, tuned->Gradients());
      ASSERT_OK_AND_ASSIGN(const auto same_grads, again->Gradients());
      for (size_t i = 0; i < want_grads.size(); ++i) {
        EXPECT_LE(RelativeError(got_grads[i].values, want_grads[i].values), tol.grads) << want_grads[i].name;
        if (exact) {
          EXPECT_EQ(same_grads[i].values, got_grads[i].values) << want_grads[i].name;
        } else {
          EXPECT_LE(RelativeError(same_grads[i].values, got_grads[i].values), tol.grads) << want_grads[i].name;
        }
      }
    }
  }
}

// cuda.input_channels: the input padded with zero channels for the first convolution computes
// what 3 channels compute (up to the engines' rounding), keeps its checkpoints at 3 input channels,
// trains to the same state, and is not applied in float32 or where another layer reads the input.
TEST(CudaNetwork, PaddedInputChannelsComputeTheSameModel) {
  SKIP_WITHOUT_GPU();
  const Task task = MakeTask(3, 8, 16);
  SgdOptions sgd;
  for (const Precision precision : {Precision::kBFloat16, Precision::kFloat16}) {
    const Tolerance tol = For(precision);
    NetworkOptions o = Options(Cases()[1].layers, precision);
    ASSERT_OK_AND_ASSIGN(auto plain, CudaNetwork::Create(o));
    ASSERT_OK_AND_ASSIGN(const auto start, plain->State());
    const RandomBatch in(8, 16, 9);
    ASSERT_OK_AND_ASSIGN(const BatchStats want, plain->ForwardBackward(in.input, in.labels, 1));
    ASSERT_OK_AND_ASSIGN(const auto want_grads, plain->Gradients());
    for (int s = 0; s < 3; ++s) ASSERT_OK(plain->TrainStep(task.Get(s, 8, 16), 0.05f, sgd, s).status());
    ASSERT_OK_AND_ASSIGN(const auto want_state, plain->State());
    for (const int channels : {4, 8}) {
      SCOPED_TRACE(fmt::format("{}, {} channels", PrecisionName(precision), channels));
      o.input_channels = channels;
      ASSERT_OK_AND_ASSIGN(auto padded, CudaNetwork::Create(o));
      EXPECT_EQ(padded->InputChannels(), channels);
      ASSERT_OK_AND_ASSIGN(const auto padded_start, padded->State());
      ASSERT_EQ(padded_start.size(), start.size());
      for (size_t i = 0; i < start.size(); ++i) {
        EXPECT_EQ(padded_start[i].dims, start[i].dims) << start[i].name;
        EXPECT_EQ(padded_start[i].values, start[i].values) << start[i].name;
      }
      ASSERT_OK_AND_ASSIGN(const BatchStats got, padded->ForwardBackward(in.input, in.labels, 1));
      EXPECT_NEAR(got.loss(), want.loss(), tol.loss * std::max(1.0, want.loss()));
      ASSERT_OK_AND_ASSIGN(const auto got_grads, padded->Gradients());
      ASSERT_EQ(got_grads.size(), want_grads.size());
      for (size_t i = 0; i < want_grads.size(); ++i) {
        EXPECT_EQ(got_grads[i].dims, want_grads[i].dims) << want_grads[i].name;
        EXPECT_LE(RelativeError(got_grads[i].values, want_grads[i].values), tol.grads) << want_grads[i].name;
      }
      // Three steps from the host's pixels (the device normalisation writes the zero channels).
      for (int s = 0; s < 3; ++s) ASSERT_OK(padded->TrainStep(task.Get(s, 8, 16), 0.05f, sgd, s).status());
      ASSERT_OK_AND_ASSIGN(const auto got_state, padded->State());
      for (size_t i = 0; i < want_state.size(); ++i) {
        EXPECT_LE(RelativeError(got_state[i].values, want_state[i].values), tol.grads) << want_state[i].name;
      }
    }
  }
  // A layer other than a convolution reads the input, or float32 (no tensor-core engine): 3 channels.
  NetworkOptions vectors = Options(Cases()[5].layers, Precision::kBFloat16);
  vectors.input_channels = 4;
  ASSERT_OK_AND_ASSIGN(auto kept, CudaNetwork::Create(vectors));
  EXPECT_EQ(kept->InputChannels(), 3);
  NetworkOptions f32 = Options(Cases()[1].layers, Precision::kFloat32);
  f32.input_channels = 8;
  ASSERT_OK_AND_ASSIGN(auto unpadded, CudaNetwork::Create(f32));
  EXPECT_EQ(unpadded->InputChannels(), 3);
}

// Refused before any device is touched, so this runs everywhere.
TEST(CudaNetwork, InputChannelsOtherThan348AreRefused) {
  NetworkOptions o = Options(Cases()[1].layers, Precision::kBFloat16);
  for (const int channels : {0, 2, 5, 16}) {
    o.input_channels = channels;
    const auto refused = CudaNetwork::Create(o);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("input channels must be 3, 4 or 8"), std::string::npos)
        << refused.status().ToString();
  }
}

// Also with batch norm: the skipped step leaves its running statistics as they were (the forward
// pass had updated them with the overflowing batch).
TEST(CudaNetwork, Float16OverflowSkipsTheUpdateAndHalvesTheLossScale) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : {Cases()[0], Cases()[1]}) {
    SCOPED_TRACE(c.name);
    ASSERT_OK_AND_ASSIGN(auto gpu, CudaNetwork::Create(Options(c.layers, Precision::kFloat16)));
    // Weights large enough that float16 activations overflow.
    ASSERT_OK_AND_ASSIGN(auto state, gpu->State());
    for (auto& t : state) {
      if (t.name.ends_with("weight")) {
        for (auto& v : t.values) v *= 3000.f;
      }
    }
    ASSERT_OK(gpu->LoadState(state));
    const float scale = gpu->loss_scale();
    const Task task = MakeTask(1, 8, 16);
    SgdOptions sgd;
    ASSERT_OK_AND_ASSIGN(const BatchStats stats, gpu->TrainStep(task.Get(0, 8, 16), 0.1f, sgd, 0));
    EXPECT_EQ(stats.overflowed, 1);  // the trainer leaves the step out of its loss figures
    EXPECT_EQ(stats.skipped, 0);
    EXPECT_EQ(gpu->skipped_steps(), 1);
    EXPECT_EQ(gpu->loss_scale(), scale / 2);
    ASSERT_OK_AND_ASSIGN(const auto after, gpu->State());
    ASSERT_EQ(after.size(), state.size());
    for (size_t i = 0; i < state.size(); ++i) EXPECT_EQ(after[i].values, state[i].values) << state[i].name;
  }
}

// Attaches `dp` (a world of one) through the device's averaging path that `net` was built for
// (NetworkOptions::device_comm), as STOKE_NCCL_ALWAYS=1 does for a benchmark.
Status AttachAtAWorldOfOne(CudaNetwork& net, DataParallel& dp) {
  ::setenv("STOKE_NCCL_ALWAYS", "1", 1);
  Status attached = net.SetStepSync(&dp);
  ::unsetenv("STOKE_NCCL_ALWAYS");
  return attached;
}
// NCCL is not on this machine, or not in this build (the tests then skip, saying why).
bool NcclMissing(const Status& s) {
  return s.code() == StatusCode::kUnavailable && (s.message().find("could not be loaded") != std::string::npos ||
                                                  s.message().find("did not find nccl.h") != std::string::npos);
}
// The network of `o`, averaging through `how`, attached to `dp` at a world of one; the error says
// why not (NcclMissing: the caller skips).
Result<std::unique_ptr<CudaNetwork>> AtAWorldOfOne(NetworkOptions o, DeviceComm how, DataParallel& dp) {
  o.device_comm = how;
  STOKE_ASSIGN_OR_RETURN(auto net, CudaNetwork::Create(std::move(o)));
  STOKE_RETURN_IF_ERROR(AttachAtAWorldOfOne(*net, dp));
  return net;
}

// The averaging path at a world of one: buckets launched while backward runs, statistics summed,
// the wait; dividing by one rank changes nothing (the host's path converts bfloat16 to float32 and
// back, which is exact), so ten steps give bit-identical parameters to the same network without
// it, and the communication is timed.
void WorldOfOneChangesNothing(DeviceComm how) {
  auto comm = dist::Communicator::Single();
  DataParallel dp(*comm);
  auto made = AtAWorldOfOne(Options(Cases()[3].layers, Precision::kBFloat16), how, dp);
  if (!made.ok() && NcclMissing(made.status())) GTEST_SKIP() << made.status().message();
  ASSERT_OK_AND_ASSIGN(auto with, std::move(made));
  ASSERT_OK_AND_ASSIGN(auto without, CudaNetwork::Create(Options(Cases()[3].layers, Precision::kBFloat16)));
  const Task task = MakeTask(2, 8, 16);
  SgdOptions sgd;
  sgd.momentum = 0.9;
  for (int step = 0; step < 10; ++step) {
    ASSERT_OK_AND_ASSIGN(BatchStats a, with->TrainStep(task.Get(step % 2, 8, 16), 0.05f, sgd, step));
    ASSERT_OK_AND_ASSIGN(BatchStats b, without->TrainStep(task.Get(step % 2, 8, 16), 0.05f, sgd, step));
    EXPECT_EQ(a.loss_sum, b.loss_sum) << step;
    EXPECT_EQ(a.top1, b.top1) << step;
    EXPECT_EQ(a.count, b.count) << step;
  }
  ASSERT_OK_AND_ASSIGN(auto sa, with->State());
  ASSERT_OK_AND_ASSIGN(auto sb, without->State());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(sa[i].values, sb[i].values) << sa[i].name;
  EXPECT_EQ(dp.stats().steps, 10);
  EXPECT_GT(dp.stats().buckets, 0);
  if (how == DeviceComm::kNccl) {
    // Timed by events on the device; the host's collectives at a world of one have nothing to time.
    EXPECT_GT(dp.stats().comm_s, 0);
    std::printf("NCCL at a world of one: %.3f ms of averaging per step, %.0f%% of it during backward\n",
                1e3 * dp.stats().comm_s / 10, 100 * dp.stats().overlapped_s / dp.stats().comm_s);
  }
  ASSERT_OK(with->AverageRunningStats());
}

TEST(CudaDataParallel, NcclAtAWorldOfOneChangesNothing) {
  SKIP_WITHOUT_GPU();
  WorldOfOneChangesNothing(DeviceComm::kNccl);
}

TEST(CudaDataParallel, HostStagedAtAWorldOfOneChangesNothing) {
  SKIP_WITHOUT_GPU();
  WorldOfOneChangesNothing(DeviceComm::kHost);
}

// Data-parallel, a loss that is not finite skips the step on every rank (the summed flag) and says
// so in BatchStats::skipped, as the CPU backend does, rather than ending the run; the parameters
// stay as they were and the next finite step trains.
void NonFiniteLossSkipsTheStep(DeviceComm how) {
  // Case 1 has batch norm: its running statistics, moved by the non-finite forward pass, are put
  // back with the parameters (State() holds them).
  for (const Case& c : {Cases()[0], Cases()[1]}) {
    SCOPED_TRACE(c.name);
    auto comm = dist::Communicator::Single();
    DataParallel dp(*comm);
    auto made = AtAWorldOfOne(Options(c.layers, Precision::kBFloat16), how, dp);
    if (!made.ok() && NcclMissing(made.status())) GTEST_SKIP() << made.status().message();
    ASSERT_OK_AND_ASSIGN(auto net, std::move(made));
    ASSERT_OK_AND_ASSIGN(const auto start, net->State());
    auto huge = start;
    for (auto& t : huge) {
      if (t.name.ends_with("weight")) {
        for (auto& v : t.values) v *= 1e35f;  // bfloat16 logits overflow to infinity
      }
    }
    ASSERT_OK(net->LoadState(huge));
    const Task task = MakeTask(1, 8, 16);
    SgdOptions sgd;
    ASSERT_OK_AND_ASSIGN(const BatchStats bad, net->TrainStep(task.Get(0, 8, 16), 0.1f, sgd, 0));
    EXPECT_EQ(bad.skipped, 1);
    ASSERT_OK_AND_ASSIGN(const auto after, net->State());
    ASSERT_EQ(after.size(), huge.size());
    for (size_t i = 0; i < huge.size(); ++i) EXPECT_EQ(after[i].values, huge[i].values) << huge[i].name;
    ASSERT_OK(net->LoadState(start));
    ASSERT_OK_AND_ASSIGN(const BatchStats good, net->TrainStep(task.Get(0, 8, 16), 0.1f, sgd, 1));
    EXPECT_EQ(good.skipped, 0);
    EXPECT_TRUE(std::isfinite(good.loss_sum));
  }
}

TEST(CudaDataParallel, NcclNonFiniteLossSkipsTheStep) {
  SKIP_WITHOUT_GPU();
  NonFiniteLossSkipsTheStep(DeviceComm::kNccl);
}

TEST(CudaDataParallel, HostStagedNonFiniteLossSkipsTheStep) {
  SKIP_WITHOUT_GPU();
  NonFiniteLossSkipsTheStep(DeviceComm::kHost);
}

// Synchronised batch norm's kernels without NCCL: W slices of a batch, each taking its moments and
// gradient sums alone, the sums added between the halves as the ranks' all-reduce adds them, must
// give what batch norm over the whole batch gives: the same outputs, running statistics, input
// gradients, and parameter gradients that add up to the whole batch's. The running mean starts away
// from the batch mean (the moments are taken about it).
// Float buffers on the device for the kernel tests, freed with the object.
struct DeviceFloats {
  std::vector<void*> owned;
  DeviceFloats() = default;
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  ~DeviceFloats() {
    for (void* p : owned) cudaFree(p);
  }
  float* From(const std::vector<float>& v) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    owned.push_back(p);
    return static_cast<float*>(p);
  }
  float* Zeros(size_t n) { return From(std::vector<float>(n, 0.f)); }
  static std::vector<float> Host(const float* p, size_t n) {
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// The fused batch norm + ReLU kernels against the separate ones (BatchNormTrain, then ReLU; the
// ReLU's mask applied to dz, then BatchNormBackward) over shapes that exercise the vector layout:
// channel groups fewer and more than a block row (and more with a partly idle block: 160 channels),
// rows not a multiple of anything, one chunk and many.
TEST(CudaKernels, FusedBatchNormReluIsBatchNormThenRelu) {
  SKIP_WITHOUT_GPU();
  using cuda::DType;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const auto& [rows, channels] : std::vector<std::pair<int64_t, int>>{
           {300, 8}, {1001, 4}, {37, 2048}, {20011, 64}, {4099, 96}, {70000, 16}, {997, 160}}) {
    SCOPED_TRACE(fmt::format("{} rows x {} channels", rows, channels));
    ASSERT_TRUE(cuda::FusedBatchNormReluFits(DType::kF32, channels));
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(channels);
    std::vector<float> x(n), dz(n), scale(static_cast<size_t>(channels)), shift(scale.size());
    for (size_t i = 0; i < n; ++i) x[i] = 2.f + 1.5f * normal(rng), dz[i] = normal(rng);
    for (size_t c = 0; c < scale.size(); ++c) scale[c] = 1.f + 0.2f * normal(rng), shift[c] = 0.5f * normal(rng);
    DeviceFloats mem;
    auto device = [&](const std::vector<float>& v) { return mem.From(v); };
    auto zeros = [&](size_t k) { return mem.Zeros(k); };
    auto host = &DeviceFloats::Host;
    const size_t c = scale.size();
    const float eps = 1e-5f, momentum = 0.1f;
    float *dxin = device(x), *ddz = device(dz), *dscale = device(scale), *dshift = device(shift);
    float* partials = zeros(cuda::BatchNormWorkspace(rows, channels));
    // Fused.
    float *z = zeros(n), *rm = device(std::vector<float>(c, 0.5f)), *rv = device(std::vector<float>(c, 2.f)),
          *mean = zeros(c), *inv = zeros(c), *affine = zeros(2 * c), *gx = zeros(n), *gscale = zeros(c),
          *gshift = zeros(c);
    cuda::BatchNormReluTrain(dxin, z, DType::kF32, rows, channels, dscale, dshift, eps, momentum, rm, rv, mean, inv,
                             affine, partials, nullptr);
    cuda::BatchNormReluBackward(dxin, ddz, gx, DType::kF32, rows, channels, mean, inv, affine, gscale, gshift,
                                partials, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto z_got = host(z, n);
    // Separate: the ReLU's mask taken from the fused output (z > 0 exactly where the fused
    // pre-activation was), so a value within rounding of 0 cannot flip between the two.
    float *y = zeros(n), *rm2 = device(std::vector<float>(c, 0.5f)), *rv2 = device(std::vector<float>(c, 2.f)),
          *mean2 = zeros(c), *inv2 = zeros(c), *gx2 = zeros(n), *gscale2 = zeros(c), *gshift2 = zeros(c);
    cuda::BatchNormTrain(dxin, y, DType::kF32, rows, channels, dscale, dshift, eps, momentum, rm2, rv2, mean2, inv2,
                         partials, nullptr);
    std::vector<float> dy(n);
    for (size_t i = 0; i < n; ++i) dy[i] = z_got[i] > 0.f ? dz[i] : 0.f;
    float* ddy = device(dy);
    cuda::BatchNormBackward(dxin, ddy, gx2, DType::kF32, rows, channels, dscale, mean2, inv2, gscale2, gshift2,
                            partials, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> z_want = host(y, n);
    for (float& v : z_want) v = std::max(v, 0.f);
    EXPECT_LT(RelativeError(z_got, z_want), 1e-5);
    EXPECT_LT(RelativeError(host(mean, c), host(mean2, c)), 1e-5);
    EXPECT_LT(RelativeError(host(inv, c), host(inv2, c)), 1e-5);
    EXPECT_LT(RelativeError(host(rm, c), host(rm2, c)), 1e-5);
    EXPECT_LT(RelativeError(host(rv, c), host(rv2, c)), 1e-5);
    EXPECT_LT(RelativeError(host(gscale, c), host(gscale2, c)), 1e-4);
    EXPECT_LT(RelativeError(host(gshift, c), host(gshift2, c)), 1e-4);
    EXPECT_LT(RelativeError(host(gx, n), host(gx2, n)), 1e-4);
  }
}

TEST(CudaKernels, SyncBatchNormOverSlicesIsBatchNormOverTheWholeBatch) {
  SKIP_WITHOUT_GPU();
  constexpr int kC = 6, kR = 300, kW = 3;
  constexpr int64_t kAll = int64_t{kW} * kR;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random = [&](size_t n, float mean, float sd) {
    std::vector<float> v(n);
    for (float& f : v) f = mean + sd * normal(rng);
    return v;
  };
  const auto x = random(kAll * kC, 3.f, 1.5f), dy = random(kAll * kC, 0.f, 1.f);
  const auto scale = random(kC, 1.f, 0.2f), shift = random(kC, 0.f, 0.5f);
  DeviceFloats mem;
  auto device = [&](const std::vector<float>& v) { return mem.From(v); };
  auto zeros = [&](size_t n) { return mem.Zeros(n); };
  auto host = &DeviceFloats::Host;
  using cuda::DType;
  const float eps = 1e-5f, momentum = 0.1f;
  float* partials = zeros(cuda::BatchNormWorkspace(kAll, kC));
  float* dx_ = device(x);
  float* ddy = device(dy);
  float* dscale = device(scale);
  float* dshift = device(shift);
  // The whole batch.
  float *y_all = zeros(kAll * kC), *dx_all = zeros(kAll * kC), *rm_all = device(std::vector<float>(kC, 2.5f)),
        *rv_all = device(std::vector<float>(kC, 1.f)), *mean_all = zeros(kC), *inv_all = zeros(kC),
        *gscale_all = zeros(kC), *gshift_all = zeros(kC);
  cuda::BatchNormTrain(dx_, y_all, DType::kF32, kAll, kC, dscale, dshift, eps, momentum, rm_all, rv_all, mean_all,
                       inv_all, partials, nullptr);
  cuda::BatchNormBackward(dx_, ddy, dx_all, DType::kF32, kAll, kC, dscale, mean_all, inv_all, gscale_all, gshift_all,
                          partials, nullptr);
  // The slices, as ranks: each with its own running statistics (equal at the start) and sums.
  struct Slice {
    float *y, *dx, *rm, *rv, *mean, *inv, *gscale, *gshift, *scratch;
    double* sums;
  };
  std::vector<Slice> slices(kW);
  for (Slice& s : slices) {
    s = {zeros(kR * kC), zeros(kR * kC), device(std::vector<float>(kC, 2.5f)), device(std::vector<float>(kC, 1.f)),
         zeros(kC), zeros(kC), zeros(kC), zeros(kC), zeros(2 * kC), nullptr};
    s.sums = reinterpret_cast<double*>(zeros(4 * kC));  // 2 x C doubles
  }
  auto all_reduce = [&] {  // what NCCL's sum does across the ranks
    std::vector<double> total(2 * kC, 0.0), part(2 * kC);
    for (Slice& s : slices) {
      ASSERT_EQ(cudaMemcpy(part.data(), s.sums, part.size() * sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < part.size(); ++i) total[i] += part[i];
    }
    for (Slice& s : slices) {
      ASSERT_EQ(cudaMemcpy(s.sums, total.data(), total.size() * sizeof(double), cudaMemcpyHostToDevice), cudaSuccess);
    }
  };
  auto at = [&](const float* base, int k) { return base + static_cast<int64_t>(k) * kR * kC; };
  for (int k = 0; k < kW; ++k) {
    cuda::BatchNormLocalMoments(at(dx_, k), DType::kF32, kR, kC, slices[k].rm, slices[k].sums, partials, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  all_reduce();
  for (int k = 0; k < kW; ++k) {
    Slice& s = slices[static_cast<size_t>(k)];
    cuda::BatchNormTrainFromMoments(at(dx_, k), s.y, DType::kF32, kR, kC, dscale, dshift, s.sums, kAll, eps, momentum,
                                    s.rm, s.rv, s.mean, s.inv, nullptr);
    cuda::BatchNormLocalGradSums(at(dx_, k), at(ddy, k), DType::kF32, kR, kC, s.mean, s.inv, s.gscale, s.gshift,
                                 s.sums, partials, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  all_reduce();
  for (Slice& s : slices) {
    const int k = static_cast<int>(&s - slices.data());
    cuda::BatchNormBackwardFromSums(at(dx_, k), at(ddy, k), s.dx, DType::kF32, kR, kC, dscale, s.mean, s.inv, s.sums,
                                    kAll, s.scratch, nullptr);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto y_whole = host(y_all, kAll * kC), dx_whole = host(dx_all, kAll * kC);
  const auto rm_whole = host(rm_all, kC), rv_whole = host(rv_all, kC);
  std::vector<float> gscale_sum(kC, 0.f), gshift_sum(kC, 0.f);
  for (int k = 0; k < kW; ++k) {
    SCOPED_TRACE(fmt::format("slice {}", k));
    const Slice& s = slices[static_cast<size_t>(k)];
    const auto begin = static_cast<ptrdiff_t>(k) * kR * kC;
    const std::vector<float> y_want(y_whole.begin() + begin, y_whole.begin() + begin + kR * kC);
    const std::vector<float> dx_want(dx_whole.begin() + begin, dx_whole.begin() + begin + kR * kC);
    EXPECT_LT(RelativeError(host(s.y, kR * kC), y_want), 1e-5);
    EXPECT_LT(RelativeError(host(s.dx, kR * kC), dx_want), 1e-4);
    EXPECT_LT(RelativeError(host(s.rm, kC), rm_whole), 1e-6);
    EXPECT_LT(RelativeError(host(s.rv, kC), rv_whole), 1e-5);
    const auto gs = host(s.gscale, kC), gh = host(s.gshift, kC);
    for (int c = 0; c < kC; ++c) {
      gscale_sum[c] += gs[c];
      gshift_sum[c] += gh[c];
    }
  }
  EXPECT_LT(RelativeError(gscale_sum, host(gscale_all, kC)), 1e-4);
  EXPECT_LT(RelativeError(gshift_sum, host(gshift_all, kC)), 1e-4);
}

// model.sync_batchnorm through NCCL at a world of one: the per-channel sums of both passes go
// through ncclAllReduce and stoke's split batch-norm kernels; summed over one rank they are this
// rank's own, so ten float32 steps train what plain batch norm (cuDNN's, where it has an engine)
// trains, within float32 tolerance (different kernels sum in different orders).
// Synchronised batch norm through each averaging path at a world of one trains what plain batch
// norm trains, within float32 tolerance.
void SyncBatchNormAtAWorldOfOne(DeviceComm how) {
  for (int k : {1, 3, 5}) {  // image batch norm, batch norm before a residual add, batch norm of vectors
    const Case& c = Cases()[static_cast<size_t>(k)];
    ASSERT_TRUE(std::any_of(c.layers.begin(), c.layers.end(),
                            [](const LayerSpec& l) { return l.type == LayerType::kBatchNorm; }))
        << c.name;
    SCOPED_TRACE(c.name);
    auto comm = dist::Communicator::Single();
    DataParallel dp(*comm);
    NetworkOptions sync_opt = Options(c.layers, Precision::kFloat32);
    sync_opt.sync_batchnorm = true;
    auto made = AtAWorldOfOne(sync_opt, how, dp);
    if (!made.ok() && NcclMissing(made.status())) GTEST_SKIP() << made.status().message();
    ASSERT_OK_AND_ASSIGN(auto with, std::move(made));
    ASSERT_OK_AND_ASSIGN(auto without, CudaNetwork::Create(Options(c.layers, Precision::kFloat32)));
    const Task task = MakeTask(2, 8, 16);
    SgdOptions sgd;
    sgd.momentum = 0.9;
    for (int step = 0; step < 10; ++step) {
      ASSERT_OK_AND_ASSIGN(BatchStats a, with->TrainStep(task.Get(step % 2, 8, 16), 0.05f, sgd, step));
      ASSERT_OK_AND_ASSIGN(BatchStats b, without->TrainStep(task.Get(step % 2, 8, 16), 0.05f, sgd, step));
      EXPECT_NEAR(a.loss(), b.loss(), 1e-4 * (1 + b.loss())) << step;
      EXPECT_EQ(a.count, b.count) << step;
    }
    ASSERT_OK_AND_ASSIGN(auto sa, with->State());
    ASSERT_OK_AND_ASSIGN(auto sb, without->State());
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_LT(RelativeError(sa[i].values, sb[i].values), 2e-3) << sa[i].name;
    }
  }
}

TEST(CudaDataParallel, SyncBatchNormAtAWorldOfOneIsBatchNorm) {
  SKIP_WITHOUT_GPU();
  SyncBatchNormAtAWorldOfOne(DeviceComm::kNccl);
}

TEST(CudaDataParallel, HostStagedSyncBatchNormAtAWorldOfOneIsBatchNorm) {
  SKIP_WITHOUT_GPU();
  SyncBatchNormAtAWorldOfOne(DeviceComm::kHost);
}

TEST(CudaTrain, LearnsFromTheRingsDeviceBuffersAndMeasuresDataWait) {
  SKIP_WITHOUT_GPU();
  testing::TempDir dir;
  PackSmallSyntheticSet(dir);
  const std::string yaml = fmt::format(R"(data:
  train: {0}/train.lmdb
  val: {0}/train_val.lmdb
  batch_size: 16
  threads: 2
  image_size: 16
  val_resize: 18
  normalize: {{dtype: bfloat16}}
  augment: {{scale: [0.5, 1.0]}}
model:
  classes: 4
  layers:
{1}    - {{type: linear, out: 4}}
optimizer: {{lr: 0.4, momentum: 0.9, nesterov: true}}
schedule: {{type: cosine, warmup_epochs: 1}}
epochs: 6
seed: 5
backend: cuda
run_dir: {0}/run
)",
                                       dir.path().string(), kSmallConvBnLayers);
  ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseConfig(yaml, "cuda.yaml"));
  TrainRunOptions run;
  run.progress = false;
  ASSERT_OK_AND_ASSIGN(TrainSummary s, Train(c, run));
  EXPECT_EQ(s.backend, "cuda");
  EXPECT_TRUE(s.device_batches) << "the batches did not come through the pinned ring's device copies";
  ASSERT_TRUE(s.has_val);
  EXPECT_GE(s.val.top1_rate(), 0.75) << FormatSummary(s);
  EXPECT_GE(s.data_wait, 0.0);
  EXPECT_LE(s.data_wait, 1.0);
  std::printf("%s", FormatSummary(s).c_str());
}

// ---------------------------------------------------------------- without a GPU

// cuDNN checks descriptors on the host: every graph the backend builds for whole models, through
// its own per-layer builders, must finalise (tensors, operation, operation graph). Every preset at
// its usual input (ResNet-50's 7x7/2 stem on 3 channels, bottlenecks, strided projections, pools)
// and the parity models (BN on vectors, padded average pooling), in each precision; and the graphs
// of the layers reading the input again with it padded to 4 and 8 channels (bfloat16 and float16,
// where padding applies). Engines and plans need the GPU.
TEST(CudnnGraph, EveryGraphOfEveryPresetFinalisesWithoutADevice) {
  struct Model {
    std::string name;
    ModelSpec spec;
    int size;
  };
  std::vector<Model> models;
  for (const auto& [preset, size] : std::vector<std::pair<std::string, int>>{
           {"lenet", 32}, {"resnet20", 32}, {"resnet18", 224}, {"resnet50", 224}}) {
    ModelSpec m;
    m.preset = preset;
    m.classes = 1000;
    ASSERT_OK_AND_ASSIGN(m.layers, ExpandPreset(preset, m.classes));
    models.push_back({preset, m, size});
  }
  for (const Case& c : Cases()) {
    ModelSpec m;
    m.classes = 5;
    m.layers = c.layers;
    models.push_back({c.name, m, 16});
  }
  size_t checked = 0, padded = 0;
  for (auto& [name, spec, size] : models) {
    ASSERT_OK_AND_ASSIGN(auto shapes, ResolveModel(spec, Shape{3, size, size}));
    std::set<std::string> first;  // the layers reading the input, whose graphs padding changes
    for (const LayerSpec& l : spec.layers) {
      if (l.type == LayerType::kConv && l.inputs[0] == "input") first.insert(l.name + ": ");
    }
    for (Precision p : {Precision::kFloat32, Precision::kBFloat16, Precision::kFloat16}) {
      for (int channels : {3, 4, 8}) {
        if (channels != 3 && cuda::DeviceInputChannels(spec, p, channels) == 3) continue;  // not applied
        for (const auto& [what, op] : cuda::ModelGraphs(spec, shapes, 8, size, p, channels)) {
          if (channels != 3 && !first.contains(what.substr(0, what.find(": ") + 2))) continue;
          const Status s = cuda::Graphs::Validate(op);
          EXPECT_TRUE(s.ok()) << name << " " << PrecisionName(p) << " " << channels << " channels " << what << ": "
                              << s.ToString();
          ++(channels == 3 ? checked : padded);
        }
      }
    }
  }
  std::printf("%zu graphs finalised (4 presets and %zu parity models, 3 precisions), and %zu of them with the input "
              "padded to 4 or 8 channels\n",
              checked, Cases().size(), padded);
  EXPECT_GT(checked, 1000u);
  EXPECT_GT(padded, 40u);
}

TEST(CudnnGraph, ShapeMistakesAreRefusedWithCudnnsReason) {
  using cuda::OpSpec;
  const auto t = CUDNN_DATA_FLOAT;
  OpSpec conv;
  conv.kind = OpSpec::Kind::kConvForward;
  conv.pad = 1;
  conv.stride = 2;
  conv.tensors = {cuda::Nhwc(0, t, 8, 16, 32, 32), cuda::Nhwc(0, t, 32, 16, 3, 3), cuda::Nhwc(0, t, 8, 32, 15, 15)};
  Status s = cuda::Graphs::Validate(conv);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("convolution operation"), std::string::npos) << s.ToString();
  OpSpec bn;
  bn.kind = OpSpec::Kind::kBatchNormBackward;
  bn.tensors = {cuda::Nhwc(0, t, 8, 16, 8, 8), cuda::Nhwc(0, t, 8, 16, 8, 8), cuda::ChannelVector(0, 8),
                cuda::ChannelVector(0, 16), cuda::ChannelVector(0, 16), cuda::ChannelVector(0, 16),
                cuda::ChannelVector(0, 16), cuda::Nhwc(0, t, 8, 16, 8, 8)};
  s = cuda::Graphs::Validate(bn);
  EXPECT_NE(s.message().find("batch norm backward"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace stoke::train
