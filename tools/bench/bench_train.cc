#include <algorithm>
#include <chrono>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "dataset/dataset.h"
#include "prefetch/loader.h"
#include "tools/bench/bench_commands.h"
#include "train/config.h"
#include "train/trainer.h"

namespace stoke::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The model as the PyTorch peer builds it: layers with their input channel counts.
nlohmann::json ModelJson(const train::TrainConfig& c) {
  train::ModelSpec m = train::ModelFromConfig(c.model);
  const train::Shape input{3, c.data.image_size, c.data.image_size};
  auto shapes = train::ResolveModel(m, input);
  std::map<std::string, train::Shape> by_name{{"input", input}};
  nlohmann::json layers = nlohmann::json::array();
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const auto& l = m.layers[i];
    const train::Shape in = by_name[l.inputs[0]];
    layers.push_back({{"name", l.name}, {"type", std::string(train::LayerTypeName(l.type))}, {"inputs", l.inputs},
                      {"out", l.out}, {"kernel", l.kernel}, {"stride", l.stride}, {"pad", l.pad}, {"bias", l.bias},
                      {"p", l.p}, {"zero_init", l.zero_init}, {"in_c", in.c}, {"in_h", in.h}, {"in_w", in.w},
                      {"in_vector", in.vector}});
    by_name[l.name] = (*shapes)[i];
  }
  return {{"params", train::CountParameters(m, *shapes, input)},
          {"image_size", c.data.image_size}, {"classes", c.model.classes}, {"batch", c.data.batch_size},
          {"threads", c.compute_threads}, {"label_smoothing", c.model.label_smoothing},
          {"momentum", c.optimizer.sgd.momentum}, {"nesterov", c.optimizer.sgd.nesterov},
          {"weight_decay", c.optimizer.sgd.weight_decay}, {"bn_momentum", c.model.bn_momentum},
          {"bn_epsilon", c.model.bn_epsilon}, {"layers", layers}};
}

}  // namespace

Result<std::string> BenchTrain(const BenchOptions& o, const TrainBenchOptions& t) {
  STOKE_ASSIGN_OR_RETURN(train::TrainConfig c, train::LoadConfig(t.config.string()));
  if (o.threads > 0) c.compute_threads = o.threads, c.data.threads = o.threads;
  if (!t.model_json.empty()) STOKE_RETURN_IF_ERROR(WriteFileAtomic(t.model_json, ModelJson(c).dump(1) + "\n"));
  STOKE_ASSIGN_OR_RETURN(auto db, dataset::Dataset::Open(c.data.train));
  STOKE_ASSIGN_OR_RETURN(auto net, train::CreateNetwork(c));
  prefetch::LoaderOptions lo = train::TrainLoaderOptions(c);
  lo.epochs = 0;  // endless
  STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(db, lo));
  const auto lr = static_cast<float>(std::min(0.01, train::ScaledLr(c)));
  int64_t step = 0;

  // Compute alone: the first batch, copied out of the ring and used for every step.
  std::vector<uint8_t> images;
  std::vector<int32_t> labels;
  prefetch::Batch fixed;
  {
    STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
    if (!lease) return InternalError("bench train: the loader gave no batch");
    images.assign(lease->images.begin(), lease->images.end());
    labels.assign(lease->labels.begin(), lease->labels.end());
    fixed = *lease;
  }
  fixed.images = images;
  fixed.labels = labels;
  fixed.indices = {};
  std::vector<double> compute_rates, e2e_rates, waits;
  for (int r = 0; r < o.repeats; ++r) {
    for (int i = 0; i < t.warmup; ++i) STOKE_RETURN_IF_ERROR(net->TrainStep(fixed, lr, c.optimizer.sgd, step++).status());
    const auto start = Clock::now();
    for (int i = 0; i < t.steps; ++i) STOKE_RETURN_IF_ERROR(net->TrainStep(fixed, lr, c.optimizer.sgd, step++).status());
    compute_rates.push_back(t.steps * c.data.batch_size / Since(start));

    // End to end: batches from the loader, as `stoke train` takes them.
    auto run_steps = [&](int n, double* wait) -> Status {
      for (int i = 0; i < n; ++i) {
        const auto w0 = Clock::now();
        STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
        if (wait) *wait += Since(w0);
        if (!lease) return InternalError("bench train: the loader stopped");
        STOKE_RETURN_IF_ERROR(net->TrainStep(*lease, lr, c.optimizer.sgd, step++).status());
      }
      return OkStatus();
    };
    STOKE_RETURN_IF_ERROR(run_steps(t.warmup, nullptr));
    double wait = 0;
    const auto e2e = Clock::now();
    STOKE_RETURN_IF_ERROR(run_steps(t.steps, &wait));
    const double secs = Since(e2e);
    e2e_rates.push_back(t.steps * c.data.batch_size / secs);
    waits.push_back(wait / secs);
  }
  loader->Stop();
  const double compute = MedianOf(compute_rates), end_to_end = MedianOf(e2e_rates), wait = MedianOf(waits);
  const std::string model = c.model.preset.empty() ? fmt::format("{}-layer list", c.model.layers.size()) : c.model.preset;
  std::string out = fmt::format(
      "train bench: {} ({} classes) at {}x{}, batch {}, backend {}, compute threads {}, loader threads {}\n"
      "  {} timed steps per run after {} warm-up, median of {} runs\n"
      "  compute only (one batch repeated)  {:8.1f} img/s  {:6.2f} steps/s   runs: {}\n"
      "  end to end (loader -> backend)     {:8.1f} img/s  {:6.2f} steps/s   data-wait {:.1f}% of step time\n",
      model, c.model.classes, c.data.image_size, c.data.image_size, c.data.batch_size, net->backend(),
      c.compute_threads, c.data.threads, t.steps, t.warmup, o.repeats, compute, compute / c.data.batch_size,
      fmt::format("{:.0f}", fmt::join(compute_rates, ", ")), end_to_end, end_to_end / c.data.batch_size, 100 * wait);
  if (!o.json_out.empty()) {
    nlohmann::json j{{"config", t.config.string()}, {"batch", c.data.batch_size}, {"backend", net->backend()},
                     {"compute_img_s", compute}, {"compute_runs", compute_rates}, {"e2e_img_s", end_to_end},
                     {"e2e_runs", e2e_rates}, {"data_wait_fraction", wait}};
    STOKE_RETURN_IF_ERROR(WriteFileAtomic(o.json_out, j.dump(2) + "\n"));
  }
  return out;
}

}  // namespace stoke::bench
