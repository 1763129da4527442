#include "tools/eval/eval.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <random>

#include <fmt/format.h>

#include "common/file_util.h"
#include "common/logging.h"
#include "common/progress.h"
#include "common/sys_memory.h"
#include "dataset/dataset.h"
#include "prefetch/loader.h"
#include "tools/pack/packer.h"
#include "train/config.h"
#include "train/trainer.h"

namespace stoke::evaluate {
namespace fs = std::filesystem;
namespace {

// Indices of the k largest values, largest first (ties: the lower index first; NaN below all).
std::vector<int> TopK(std::span<const float> v, int k) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  k = std::min<int>(k, static_cast<int>(v.size()));
  auto key = [&](int i) {
    const float x = v[static_cast<size_t>(i)];
    return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x;
  };
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
  order.resize(static_cast<size_t>(k));
  return order;
}

// The validation loader of `model` over `data` (resize, centre crop), in batches of `batch` for `net`.
// Bad records are handled as the run's config says (data.on_error, data.max_skip_fraction) unless
// `skip_budget` is given: then each is skipped, up to that fraction of the records, whatever policy
// the run trained with (a run trained with `on_error: fail` is still evaluated past a bad record
// when the caller asked for a budget).
Result<std::unique_ptr<prefetch::Loader>> ValidationLoader(const train::TrainedModel& model, const train::Network& net,
                                                           const dataset::Dataset& data, int batch, int threads,
                                                           std::optional<double> skip_budget) {
  prefetch::LoaderOptions lo = train::ValLoaderOptions(model.config);
  lo.batch_size = batch;
  lo.threads = threads;
  if (skip_budget) {
    lo.on_error = prefetch::ErrorPolicy::kSkip;
    lo.max_skip_fraction = *skip_budget;
  }
  train::FeedNetwork(net, lo);
  return prefetch::Loader::Create(data, lo);
}

// A scratch directory removed when it goes out of scope.
struct ScratchDir {
  fs::path path;
  ~ScratchDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

}  // namespace

Result<EvalReport> Evaluate(const EvalOptions& options) {
  STOKE_ASSIGN_OR_RETURN(train::TrainedModel model, train::LoadTrainedModel(options.model));
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset data, dataset::Dataset::Open(options.data));
  const std::vector<std::string>& data_classes = data.manifest().classes;
  if (static_cast<int>(data_classes.size()) > model.config.model.classes) {
    return InvalidArgumentError(fmt::format("{} has {} classes; the model of {} has {}", options.data,
                                            data_classes.size(), train::Describe(model), model.config.model.classes));
  }
  for (size_t c = 0; c < data_classes.size(); ++c) {
    if (data_classes[c] != model.classes[c]) {
      return InvalidArgumentError(fmt::format(
          "{}: class {} is '{}', but the model of {} calls class {} '{}'; evaluate on a dataset packed with the "
          "training dataset's classes",
          options.data, c, data_classes[c], train::Describe(model), c, model.classes[c]));
    }
  }
  if (data.size() == 0) return InvalidArgumentError(fmt::format("{} holds no records", options.data));

  const int threads = ThreadsOrCores(options.threads);
  // The batch changes no figure (batch norm runs on its running statistics): by default the
  // training batch, at most 64 on the CPU backend, where a GPU run's batch of 256 at 224 px would
  // need tens of GB for its activations.
  int wanted = options.batch > 0 ? options.batch : model.config.data.batch_size;
  if (options.batch <= 0) {
    train::TrainConfig chosen = model.config;
    if (!options.backend.empty()) chosen.backend = options.backend;
    if (!train::SelectsCudaBackend(chosen)) wanted = std::min(wanted, 64);
  }
  const int batch = static_cast<int>(std::min<int64_t>(wanted, data.size()));
  STOKE_ASSIGN_OR_RETURN(auto net, train::CreateTrainedNetwork(model, options.backend, batch, threads));
  const bool own_budget = options.max_skip_fraction >= 0;
  STOKE_ASSIGN_OR_RETURN(auto loader, ValidationLoader(model, *net, data, batch, threads,
                                                        own_budget ? std::optional(options.max_skip_fraction)
                                                                   : std::nullopt));

  EvalReport report;
  report.model = train::Describe(model);
  report.data = options.data;
  report.backend = std::string(net->backend());
  const int classes = model.config.model.classes;
  report.classes.resize(static_cast<size_t>(classes));
  for (int c = 0; c < classes; ++c) report.classes[static_cast<size_t>(c)].name = model.classes[static_cast<size_t>(c)];
  std::vector<int64_t> confusion(static_cast<size_t>(classes) * static_cast<size_t>(classes), 0);
  train::BatchStats total;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t batches = loader->batches_per_epoch();
  // A line on a terminal, plain lines now and then in a pipe; ended before any error is printed.
  std::optional<ProgressReporter> progress;
  if (options.progress) progress.emplace("eval", batches);
  while (true) {
    if (options.stop != nullptr && options.stop->load()) return UnavailableError("stopped (interrupted)");
    auto next = loader->Next();
    if (!next.ok()) {
      const Status& s = next.status();
      if (own_budget || s.message().find("max_skip_fraction") == std::string::npos) return s;
      return Status(s.code(), fmt::format("{} (the budget is the config's data.max_skip_fraction; "
                                          "--max-skip-fraction sets eval's own)", s.message()));
    }
    prefetch::BatchLease lease = std::move(*next);
    if (!lease) break;
    STOKE_RETURN_IF_ERROR(net->Evaluate(*lease).status());
    const std::vector<float> logits = net->LastLogits();
    if (logits.size() < static_cast<size_t>(lease->size) * static_cast<size_t>(classes)) {
      return InternalError(fmt::format("{} backend: no logits for batch {}", net->backend(), lease->number));
    }
    // Scored here rather than by the backend: plain cross-entropy (whatever label smoothing the run
    // trained with), and the loader's stand-ins for bad records left out, so that every good record
    // counts once.
    total += train::ScoreLogits(logits, classes, lease->labels, 0.0, lease->stand_in);
    for (int i = 0; i < lease->size; ++i) {
      if (lease->stand_in[static_cast<size_t>(i)] != 0) continue;
      const std::span<const float> row(logits.data() + static_cast<size_t>(i) * static_cast<size_t>(classes),
                                       static_cast<size_t>(classes));
      const int label = lease->labels[static_cast<size_t>(i)];
      const int rank = train::LabelRank(row, label);
      const int predicted = TopK(row, 1)[0];
      ClassResult& r = report.classes[static_cast<size_t>(label)];
      ++r.samples;
      r.top1 += rank < 1 ? 1 : 0;
      r.top5 += rank < 5 ? 1 : 0;
      ++report.classes[static_cast<size_t>(predicted)].predicted;
      ++confusion[static_cast<size_t>(label) * static_cast<size_t>(classes) + static_cast<size_t>(predicted)];
    }
    lease.Release(net->stream());
    if (progress) progress->Advance();
  }
  if (progress) progress->Finish();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.samples = total.count;
  report.loss = total.loss();
  report.top1 = total.top1_rate();
  report.top5 = total.top5_rate();
  report.images_per_s = report.seconds > 0 ? static_cast<double>(total.count) / report.seconds : 0;
  for (int c = 0; c < classes; ++c) {
    ClassResult& r = report.classes[static_cast<size_t>(c)];
    for (int p = 0; p < classes; ++p) {
      const int64_t n = confusion[static_cast<size_t>(c) * static_cast<size_t>(classes) + static_cast<size_t>(p)];
      if (p != c && n > r.confused_count) {
        r.confused_count = n;
        r.confused_with = p;
      }
    }
  }
  for (const prefetch::BadRecord& b : loader->bad_records()) report.bad_records.push_back(b.reason);
  return report;
}

std::string FormatEvalReport(const EvalReport& r, size_t max_classes) {
  std::string out = fmt::format("{}\n  on {} ({} backend): {} samples, {:.1f} img/s\n", r.model, r.data, r.backend,
                                r.samples, r.images_per_s);
  out += fmt::format("  top-1 {:.2f}%  top-5 {:.2f}%  loss {:.4f}\n", 100 * r.top1, 100 * r.top5, r.loss);
  std::vector<const ClassResult*> rows;
  for (const ClassResult& c : r.classes) {
    if (c.samples > 0) rows.push_back(&c);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const ClassResult* a, const ClassResult* b) {
    return a->top1 * b->samples < b->top1 * a->samples;  // lower accuracy first
  });
  const size_t shown = max_classes == 0 ? rows.size() : std::min(rows.size(), max_classes);
  if (shown > 0) {
    out += fmt::format("  per class ({} of {} with samples, least accurate first):\n", shown, rows.size());
    out += fmt::format("    {:<24} {:>8} {:>8} {:>8} {:>10}  {}\n", "class", "samples", "top-1", "top-5", "predicted",
                       "most often mistaken for");
    for (size_t i = 0; i < shown; ++i) {
      const ClassResult& c = *rows[i];
      std::string confused = "-";
      if (c.confused_with >= 0) {
        confused = fmt::format("{} ({})", r.classes[static_cast<size_t>(c.confused_with)].name, c.confused_count);
      }
      out += fmt::format("    {:<24} {:>8} {:>7.1f}% {:>7.1f}% {:>10}  {}\n", c.name, c.samples,
                         100.0 * static_cast<double>(c.top1) / static_cast<double>(c.samples),
                         100.0 * static_cast<double>(c.top5) / static_cast<double>(c.samples), c.predicted, confused);
    }
  }
  if (!r.bad_records.empty()) {
    out += fmt::format("  skipped {} bad record(s):\n", r.bad_records.size());
    for (size_t i = 0; i < std::min<size_t>(r.bad_records.size(), 10); ++i) out += "    " + r.bad_records[i] + "\n";
  }
  return out;
}

nlohmann::json EvalReportJson(const EvalReport& r) {
  nlohmann::json classes = nlohmann::json::array();
  for (const ClassResult& c : r.classes) {
    nlohmann::json j{{"name", c.name}, {"samples", c.samples}, {"top1", c.top1}, {"top5", c.top5},
                     {"predicted", c.predicted}};
    if (c.confused_with >= 0) {
      j["confused_with"] = r.classes[static_cast<size_t>(c.confused_with)].name;
      j["confused_count"] = c.confused_count;
    }
    classes.push_back(std::move(j));
  }
  return {{"model", r.model},     {"data", r.data},         {"backend", r.backend},
          {"samples", r.samples}, {"top1", r.top1},         {"top5", r.top5},
          {"loss", r.loss},       {"seconds", r.seconds},   {"images_per_s", r.images_per_s},
          {"classes", classes},   {"bad_records", r.bad_records}};
}

Result<std::vector<Prediction>> Predict(const PredictOptions& options) {
  // Inputs in the order given; folders expand to every regular file below them, sorted, leaving
  // out hidden files and folders (names starting with '.') as `stoke pack` does.
  std::vector<fs::path> files;
  std::vector<bool> missing;  // by position in `files`: reported on its line, the others still run
  for (const std::string& in : options.inputs) {
    std::error_code ec;
    const fs::path p(in);
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(p, fs::directory_options::skip_permission_denied, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->path().filename().string().starts_with('.')) {
          if (it->is_directory(ec)) it.disable_recursion_pending();
          continue;
        }
        if (it->is_regular_file(ec)) found.push_back(it->path());
      }
      if (ec) return IoError(fmt::format("{}: {}", in, ec.message()));
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(p);
      missing.resize(files.size());
      missing.back() = !fs::exists(p, ec);
    }
  }
  missing.resize(files.size());
  if (files.empty()) return InvalidArgumentError("no image files among the inputs");
  if (options.top_k < 1) return InvalidArgumentError(fmt::format("--top {} must be >= 1", options.top_k));
  STOKE_ASSIGN_OR_RETURN(train::TrainedModel model, train::LoadTrainedModel(options.model));
  auto stopped = [&] { return options.stop != nullptr && options.stop->load(); };

  std::vector<Prediction> out(files.size());
  std::unordered_map<std::string, size_t> by_path;  // absolute path -> its first input position
  std::unordered_map<std::string, size_t> by_key;   // key in the scratch dataset -> input position
  std::vector<size_t> same_as(files.size(), SIZE_MAX);  // a repeated input: its first position
  ScratchDir scratch;
  {
    std::error_code ec;
    STOKE_ASSIGN_OR_RETURN(const fs::path tmp, TemporaryFolder("predict's scratch files"));
    std::random_device rd;
    scratch.path = tmp / fmt::format("stoke-predict-{}-{:08x}", getpid(), rd());
    fs::create_directories(scratch.path / "inputs", ec);
    if (ec) return IoError(fmt::format("{}: {}", scratch.path.string(), ec.message()));
  }
  // The images go through `stoke pack` (validation, orientation, other formats) into a scratch
  // dataset, then through the validation loader: exactly what evaluation sees. Each reaches pack
  // through a link named by its position, so the list holds none of the user's names (which may
  // begin or end with spaces, or hold line breaks) and every result maps back by that name.
  std::ofstream list(scratch.path / "inputs.txt");
  size_t listed = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    std::error_code ec;
    // Linked as given (made absolute): "dir/../x" goes through dir as the kernel resolves it, which
    // a textual normalisation would not when dir is a symlink. Repeats are found by the real path.
    const fs::path abs = fs::absolute(files[i], ec);
    out[i].path = files[i].string();
    if (missing[i]) {
      out[i].error = "no such file or folder";
      continue;
    }
    const fs::path real = fs::weakly_canonical(abs, ec);
    const std::string same_key = ec ? abs.lexically_normal().string() : real.string();
    if (auto first = by_path.find(same_key); first != by_path.end()) {
      same_as[i] = first->second;  // gets the first one's result below
      continue;
    }
    by_path[same_key] = i;
    const std::string key = fmt::format("inputs/{:08}", i);
    fs::create_symlink(abs, scratch.path / key, ec);
    if (ec) {
      out[i].error = fmt::format("cannot link it into {}: {}", scratch.path.string(), ec.message());
      continue;
    }
    by_key[key] = i;
    list << key << " 0\n";
    ++listed;
  }
  list.close();
  if (!list) return IoError(fmt::format("{}: cannot write the list of inputs", (scratch.path / "inputs.txt").string()));

  pack::PackOptions po;
  po.source = scratch.path;
  po.list_file = scratch.path / "inputs.txt";
  po.output = scratch.path / "inputs.lmdb";
  po.threads = options.threads;
  po.progress = false;
  po.on_error = pack::OnError::kSkip;
  po.stop = options.stop;
  auto packed = listed > 0 ? pack::Pack(po) : Result<pack::PackSummary>(pack::PackSummary{});
  if (stopped()) return UnavailableError("stopped (interrupted)");
  if (!packed.ok()) return Status(packed.status().code(), fmt::format("preparing the images: {}", packed.status().message()));
  for (const pack::BadInput& bad : packed->bad) {
    auto it = by_key.find(bad.path);
    if (it == by_key.end()) continue;
    // The reason may name the link (removed with the scratch folder): name the input instead.
    std::string reason = bad.reason;
    const std::string link = (scratch.path / bad.path).string();
    for (size_t at = reason.find(link); at != std::string::npos; at = reason.find(link, at + out[it->second].path.size())) {
      reason.replace(at, link.size(), out[it->second].path);
    }
    out[it->second].error = std::move(reason);
  }
  const int64_t records = packed->splits.empty() ? 0 : packed->splits[0].records;
  if (records > 0) {
    STOKE_ASSIGN_OR_RETURN(dataset::Dataset data, dataset::Dataset::Open(po.output));
    STOKE_ASSIGN_OR_RETURN(dataset::Reader reader, data.NewReader());
    const int threads = ThreadsOrCores(options.threads);
    const int batch = static_cast<int>(std::min<int64_t>(std::max(1, options.batch), data.size()));
    STOKE_ASSIGN_OR_RETURN(auto net, train::CreateTrainedNetwork(model, options.backend, batch, threads));
    // Every image is reported on its own, however many are bad.
    STOKE_ASSIGN_OR_RETURN(auto loader, ValidationLoader(model, *net, data, batch, threads, 1.0));
    const int classes = model.config.model.classes;
    auto position = [&](int64_t record) -> Result<size_t> {
      STOKE_ASSIGN_OR_RETURN(std::string key, reader.SourcePath(record));
      auto it = by_key.find(key);
      if (it == by_key.end()) return InternalError(fmt::format("record {} comes from {}, not an input", record, key));
      return it->second;
    };
    while (true) {
      if (stopped()) return UnavailableError("stopped (interrupted)");
      STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
      if (!lease) break;
      STOKE_RETURN_IF_ERROR(net->Evaluate(*lease).status());
      const std::vector<float> logits = net->LastLogits();
      for (int i = 0; i < lease->size; ++i) {
        if (lease->stand_in[static_cast<size_t>(i)] != 0) continue;  // its own record is reported bad
        STOKE_ASSIGN_OR_RETURN(const size_t at, position(lease->indices[static_cast<size_t>(i)]));
        const std::span<const float> row(logits.data() + static_cast<size_t>(i) * static_cast<size_t>(classes),
                                         static_cast<size_t>(classes));
        Prediction& p = out[at];
        if (!std::all_of(row.begin(), row.end(), [](float v) { return std::isfinite(v); })) {
          p.error = "the model's output for this image is not finite (NaN or infinity)";
          continue;
        }
        // Softmax in double, shifted by the maximum.
        const float max = *std::max_element(row.begin(), row.end());
        double sum = 0;
        for (float v : row) sum += std::exp(static_cast<double>(v) - max);
        p.top = TopK(row, options.top_k);
        for (int c : p.top) {
          p.probabilities.push_back(std::exp(static_cast<double>(row[static_cast<size_t>(c)]) - max) / sum);
          p.names.push_back(model.classes[static_cast<size_t>(c)]);
        }
      }
      lease.Release(net->stream());
    }
    for (const prefetch::BadRecord& b : loader->bad_records()) {
      if (auto at = position(b.index); at.ok()) out[*at].error = b.reason;
    }
  }
  // Repeated inputs share the first one's result.
  for (size_t i = 0; i < files.size(); ++i) {
    if (same_as[i] == SIZE_MAX) continue;
    const std::string path = out[i].path;
    out[i] = out[same_as[i]];
    out[i].path = path;
  }
  for (Prediction& p : out) {
    if (p.error.empty() && p.top.empty()) p.error = "not prepared (no reason given)";
  }
  return out;
}

std::string FormatPredictions(const std::vector<Prediction>& predictions) {
  std::string out;
  for (const Prediction& p : predictions) {
    if (!p.error.empty()) {
      out += fmt::format("{}: error: {}\n", p.path, p.error);
      continue;
    }
    out += p.path + ":";
    for (size_t k = 0; k < p.top.size(); ++k) {
      out += fmt::format("{} {} {:.4f}", k == 0 ? "" : ",", p.names[k], p.probabilities[k]);
    }
    out += "\n";
  }
  return out;
}

nlohmann::json PredictionsJson(const std::vector<Prediction>& predictions) {
  nlohmann::json all = nlohmann::json::array();
  for (const Prediction& p : predictions) {
    nlohmann::json j{{"path", p.path}};
    if (!p.error.empty()) {
      j["error"] = p.error;
    } else {
      nlohmann::json top = nlohmann::json::array();
      for (size_t k = 0; k < p.top.size(); ++k) {
        top.push_back({{"class", p.names[k]}, {"index", p.top[k]}, {"probability", p.probabilities[k]}});
      }
      j["top"] = std::move(top);
    }
    all.push_back(std::move(j));
  }
  return all;
}

}  // namespace stoke::evaluate
