#include "train/trained_model.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "common/limits.h"
#include "common/logging.h"
#include "dataset/dataset.h"
#include "train/trainer.h"

namespace stoke::train {

std::string Describe(const TrainedModel& m) {
  if (m.config_path.empty()) return fmt::format("checkpoint {}", m.checkpoint_path.string());
  return fmt::format("checkpoint {} with config {}", m.checkpoint_path.string(), m.config_path.string());
}

Result<TrainedModel> LoadTrainedModel(const TrainedModelSource& source) {
  TrainedModel m;
  if (!source.checkpoint.empty()) {
    m.checkpoint_path = source.checkpoint;
    STOKE_ASSIGN_OR_RETURN(m.checkpoint, LoadCheckpoint(m.checkpoint_path));
  } else {
    if (source.run_dir.empty()) return InvalidArgumentError("give a run directory or a checkpoint file");
    std::error_code ec;
    if (std::filesystem::is_regular_file(source.run_dir, ec)) {
      return InvalidArgumentError(fmt::format("{} is a file, not a run directory; give a checkpoint file with --checkpoint",
                                              source.run_dir.string()));
    }
    if (!std::filesystem::is_directory(source.run_dir, ec)) {
      if (std::filesystem::exists(source.run_dir, ec)) {
        return InvalidArgumentError(fmt::format("{} is not a run directory (neither a folder nor a file)",
                                                source.run_dir.string()));
      }
      return NotFoundError(fmt::format("run directory {} does not exist", source.run_dir.string()));
    }
    auto all = ListCheckpoints(source.run_dir);
    if (all.empty()) {
      return NotFoundError(fmt::format("{} holds no checkpoints (looked in {}/checkpoints)", source.run_dir.string(),
                                       source.run_dir.string()));
    }
    m.checkpoint_path = all.back();
    auto newest = LoadCheckpoint(m.checkpoint_path);
    if (!newest.ok()) {
      // A run's newest checkpoint damaged (cut by a full disk, say): the one before it may be whole.
      const Status& s = newest.status();
      if (all.size() < 2) return s;
      return Status(s.code(), fmt::format("{} (the run's newest checkpoint; the one before it is {}: give that "
                                          "with --checkpoint)", s.message(), all[all.size() - 2].string()));
    }
    m.checkpoint = std::move(newest).value();
  }
  if (!source.config.empty()) {
    m.config_path = source.config;
    STOKE_ASSIGN_OR_RETURN(m.config, LoadConfig(source.config.string()));
  } else {
    auto config = ParseConfig(m.checkpoint.config_yaml, m.checkpoint_path.string() + " (its stored config)",
                              ConfigOrigin::kStored);
    if (!config.ok()) {
      return CorruptError(fmt::format("checkpoint {}: its stored config does not parse: {}", m.checkpoint_path.string(),
                                      config.status().message()));
    }
    m.config = std::move(config).value();
  }

  // The config's model must be the checkpoint's: same layers, same tensors, nothing left over.
  ModelSpec model = ModelFromConfig(m.config.model);
  const Shape input{3, m.config.data.image_size, m.config.data.image_size};
  auto shapes = ResolveModel(model, input);
  if (!shapes.ok()) {
    return InvalidArgumentError(fmt::format("{}: {}", m.config_path.empty() ? m.checkpoint_path.string()
                                                                             : m.config_path.string(),
                                            shapes.status().message()));
  }
  const auto wanted = ModelTensors(model, *shapes, input);
  auto found = FindState(m.checkpoint.tensors, wanted);
  std::string mismatch = found.ok() ? "" : found.status().message();
  if (mismatch.empty()) {
    std::set<std::string> names;
    for (const auto& [name, dims] : wanted) names.insert(name);
    for (const NamedTensor& t : m.checkpoint.tensors) {
      if (!names.count(t.name) && !(t.name.ends_with(".momentum") && names.count(t.name.substr(0, t.name.size() - 9)))) {
        mismatch = fmt::format("the checkpoint holds tensor '{}', which the model has no place for", t.name);
        break;
      }
    }
  }
  if (!mismatch.empty()) {
    if (m.config_path.empty()) {
      return CorruptError(fmt::format("checkpoint {} does not match its own stored config: {}",
                                      m.checkpoint_path.string(), mismatch));
    }
    return InvalidArgumentError(fmt::format("config {} does not match checkpoint {}: {}", m.config_path.string(),
                                            m.checkpoint_path.string(), mismatch));
  }

  if (!m.config_path.empty() && !m.checkpoint.config_yaml.empty()) {
    // Tensors of the same names and shapes do not make the same model (a relu given as a max pool
    // evaluates and exports another function of the same weights).
    if (auto stored = ParseConfig(m.checkpoint.config_yaml, m.checkpoint_path.string() + " (its stored config)",
                              ConfigOrigin::kStored);
        stored.ok()) {
      if (const std::string d = ConfigModelDifference(m.config, "the config", *stored, "the checkpoint's stored config");
          !d.empty()) {
        return InvalidArgumentError(fmt::format(
            "config {} does not describe the model of checkpoint {}: {}; leave --config out to use the stored one",
            m.config_path.string(), m.checkpoint_path.string(), d));
      }
      // Allowed (evaluating at another resolution is a use of --config), but said: the figures
      // and an export's metadata then follow the given config, not what the model trained on.
      if (const std::string p = PreprocessingDifference(m.config, *stored, "trained with"); !p.empty()) {
        STOKE_LOG(WARN, "config {} prepares images unlike checkpoint {}'s run: {}", m.config_path.string(),
                  m.checkpoint_path.string(), p);
      }
    }
  }
  // A run that diverged before this checkpoint: its outputs would be NaN, and look like a model.
  if (const std::string bad = FirstNonFiniteTensor(m.checkpoint.tensors); !bad.empty()) {
    return InvalidArgumentError(fmt::format(
        "checkpoint {}: {}; the run diverged before this step: use an earlier checkpoint", m.checkpoint_path.string(),
        bad));
  }

  // Class names: the checkpoint's (written since 0.3), else the training dataset's manifest.
  m.classes = m.checkpoint.classes;
  if (m.classes.empty()) {
    // (A relative data.train is taken from the working directory, as the run took it.)
    if (auto ds = dataset::Dataset::Open(m.config.data.train); ds.ok()) {
      m.classes = ds->manifest().classes;
    } else {
      STOKE_LOG(WARN, "{} holds no class names and its data.train cannot be opened ({}): classes are named by number",
                Describe(m), ds.status().message());
    }
  }
  if (static_cast<int>(m.classes.size()) > m.config.model.classes) {
    return InvalidArgumentError(fmt::format("{}: {} class names for a model of {} classes", Describe(m),
                                            m.classes.size(), m.config.model.classes));
  }
  for (auto c = static_cast<int>(m.classes.size()); c < m.config.model.classes; ++c) {
    m.classes.push_back(std::to_string(c));
  }
  return m;
}

Result<std::unique_ptr<Network>> CreateTrainedNetwork(const TrainedModel& model, const std::string& backend,
                                                      int batch, int threads) {
  TrainConfig c = model.config;
  c.data.batch_size = batch;
  if (!backend.empty()) c.backend = backend;
  if (threads < 0 || threads > kMaxThreads) {
    return InvalidArgumentError(fmt::format("threads {} (expected 0 to {}; 0 = the model's config)", threads, kMaxThreads));
  }
  if (threads > 0) c.compute_threads = threads;
  // A model trained in bfloat16 or float16 keeps float32 weights: the CPU backend runs it in float32.
  if (!SelectsCudaBackend(c)) c.data.dtype = "float32";
  STOKE_ASSIGN_OR_RETURN(auto net, CreateNetwork(c));
  Status s = net->LoadState(model.checkpoint.tensors);
  if (!s.ok()) return Status(s.code(), fmt::format("{}: {}", Describe(model), s.message()));
  return net;
}

}  // namespace stoke::train
