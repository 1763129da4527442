// What a trained model does on data it did not train on: `stoke eval` (accuracy, loss and a per-class
// confusion summary over a packed dataset) and `stoke predict` (the top classes of image files).
// Both run the validation path: resize the shorter side, centre crop, the backend's evaluation mode.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "train/trained_model.h"

namespace stoke::evaluate {

struct EvalOptions {
  train::TrainedModelSource model;
  std::string data;         // packed dataset
  int batch = 0;            // 0: the config's data.batch_size (at most 64 on the CPU backend)
  int threads = 0;          // decoding and compute threads; 0: every core
  std::string backend = "cpu";  // cpu | cuda | auto
  // The fraction of the records that may be bad (each left out) before eval fails; < 0: the
  // config's data.max_skip_fraction.
  double max_skip_fraction = -1;
  bool progress = true;
  const std::atomic<bool>* stop = nullptr;
};

struct ClassResult {
  std::string name;
  int64_t samples = 0;        // with this label
  int64_t top1 = 0;           // of them, predicted right
  int64_t top5 = 0;
  int64_t predicted = 0;      // samples (of any label) predicted as this class
  int confused_with = -1;     // the wrong class its samples were most often predicted as
  int64_t confused_count = 0;
};

struct EvalReport {
  std::string model;  // Describe(trained model)
  std::string data;
  std::string backend;
  int64_t samples = 0;
  double loss = 0, top1 = 0, top5 = 0;  // loss: mean cross-entropy; rates in [0, 1]
  std::vector<ClassResult> classes;
  std::vector<std::string> bad_records;
  double seconds = 0;
  double images_per_s = 0;
};

// kInvalidArgument when the dataset's classes are not the model's (naming both), plus the errors
// of LoadTrainedModel, the loader and the backend.
Result<EvalReport> Evaluate(const EvalOptions& options);
// The totals, then the classes sorted from the least accurate, `max_classes` of them (0: all).
std::string FormatEvalReport(const EvalReport& report, size_t max_classes = 20);
nlohmann::json EvalReportJson(const EvalReport& report);

struct PredictOptions {
  train::TrainedModelSource model;
  std::vector<std::string> inputs;  // image files, or folders (every file below, sorted)
  int top_k = 5;
  int batch = 32;
  int threads = 0;
  std::string backend = "cpu";
  // Set from another thread (a signal handler) to stop: Predict then returns kUnavailable, its
  // scratch files removed. Not owned.
  const std::atomic<bool>* stop = nullptr;
};

struct Prediction {
  std::string path;
  std::string error;  // empty when it ran
  std::vector<int> top;                // class indices, most probable first
  std::vector<double> probabilities;   // softmax of the logits, same order
  std::vector<std::string> names;
};

// Every input file gets a Prediction, in input order: bad images carry their error and the rest
// still run. Inputs are prepared as `stoke pack` prepares them (so PNG and other formats work where
// pack takes them), in a temporary dataset that is removed afterwards. kNotFound when an input does
// not exist; errors of LoadTrainedModel and the backend.
Result<std::vector<Prediction>> Predict(const PredictOptions& options);
std::string FormatPredictions(const std::vector<Prediction>& predictions);
nlohmann::json PredictionsJson(const std::vector<Prediction>& predictions);

}  // namespace stoke::evaluate
