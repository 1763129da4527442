#include "train/network.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

namespace stoke::train {

std::string_view PrecisionName(Precision p) {
  switch (p) {
    case Precision::kFloat32:
      return "float32";
    case Precision::kBFloat16:
      return "bfloat16";
    case Precision::kFloat16:
      return "float16";
  }
  return "?";
}

std::string_view LayerAdaptationName(LayerAdaptation a) {
  switch (a) {
    case LayerAdaptation::kNone:
      return "sgd";
    case LayerAdaptation::kLars:
      return "lars";
    case LayerAdaptation::kLarc:
      return "larc";
  }
  return "?";
}

float TrustRatio(const SgdOptions& sgd, double weight_norm, double grad_norm, double weight_decay, float lr) {
  if (sgd.adaptation == LayerAdaptation::kNone || weight_norm <= 0 || grad_norm <= 0) return 1.f;
  double r = sgd.trust() * weight_norm / (grad_norm + weight_decay * weight_norm + sgd.eps);
  if (sgd.adaptation == LayerAdaptation::kLarc && sgd.clip && lr > 0) r = std::min(r / lr, 1.0);
  return static_cast<float>(r);
}

Result<DeviceComm> ChooseDeviceComm(DeviceComm wanted, int ranks_sharing_a_gpu, const Status& nccl_usable,
                                    std::string* why) {
  why->clear();
  if (wanted == DeviceComm::kHost) {
    *why = "dist.device_comm: host";
    return DeviceComm::kHost;
  }
  if (ranks_sharing_a_gpu > 0) {
    if (wanted == DeviceComm::kNccl) {
      return InvalidArgumentError(fmt::format(
          "dist.device_comm: nccl, but {} ranks share their GPU with another rank, and NCCL refuses two ranks on one "
          "GPU: start one rank per GPU, or set dist.device_comm to host or auto",
          ranks_sharing_a_gpu));
    }
    *why = fmt::format("{} ranks share their GPU with another rank (NCCL refuses that)", ranks_sharing_a_gpu);
    return DeviceComm::kHost;
  }
  if (!nccl_usable.ok()) {
    if (wanted == DeviceComm::kNccl) {
      return UnavailableError(fmt::format("dist.device_comm: nccl: {}", nccl_usable.message()));
    }
    *why = std::string(nccl_usable.message());
    return DeviceComm::kHost;
  }
  *why = "every rank has a GPU of its own";
  return DeviceComm::kNccl;
}

Status CheckBatch(const NetworkOptions& opt, const prefetch::Batch& b, bool full) {
  if (b.width != opt.image_size || b.height != opt.height()) {
    return InvalidArgumentError(fmt::format("batch images are {}x{}, the network was built for {}x{}", b.width,
                                            b.height, opt.image_size, opt.height()));
  }
  if (b.size < 1 || b.size > opt.batch || (full && b.size != opt.batch)) {
    return InvalidArgumentError(fmt::format("batch of {} samples; the network takes {}{}", b.size,
                                            full ? "exactly " : "at most ", opt.batch));
  }
  for (int i = 0; i < b.size; ++i) {
    const int32_t y = b.labels[static_cast<size_t>(i)];
    if (y < 0 || y >= opt.model.classes) {
      const int64_t record = i < static_cast<int>(b.indices.size()) ? b.indices[static_cast<size_t>(i)] : -1;
      return InvalidArgumentError(
          fmt::format("record {} has label {}, outside the model's {} classes", record, y, opt.model.classes));
    }
  }
  return OkStatus();
}

Result<std::vector<const NamedTensor*>> FindState(
    const std::vector<NamedTensor>& state, const std::vector<std::pair<std::string, std::vector<int64_t>>>& wanted,
    bool exact) {
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : state) by_name[t.name] = &t;
  if (exact) {
    std::set<std::string> names;
    for (const auto& w : wanted) names.insert(w.first);
    for (const auto& t : state) {
      if (!names.count(t.name)) {
        return InvalidArgumentError(fmt::format("the state holds tensor '{}', which this model has no place for", t.name));
      }
    }
  }
  std::vector<const NamedTensor*> out;
  for (const auto& [name, dims] : wanted) {
    auto it = by_name.find(name);
    if (it == by_name.end()) return InvalidArgumentError(fmt::format("the state has no tensor '{}'", name));
    const NamedTensor* t = it->second;
    int64_t count = 1;
    for (auto d : dims) count *= d;
    if (t->dims != dims || static_cast<int64_t>(t->values.size()) != count) {
      return InvalidArgumentError(fmt::format("tensor '{}' has shape [{}], the model needs [{}]", name,
                                              fmt::join(t->dims, ", "), fmt::join(dims, ", ")));
    }
    out.push_back(t);
  }
  return out;
}

std::string FirstNonFiniteTensor(const std::vector<NamedTensor>& tensors) {
  for (const NamedTensor& t : tensors) {
    const auto bad = std::count_if(t.values.begin(), t.values.end(), [](float v) { return !std::isfinite(v); });
    if (bad > 0) {
      return fmt::format("tensor '{}' holds {} of {} values that are not finite (NaN or infinity)", t.name, bad,
                         t.values.size());
    }
  }
  return std::string();
}

int LabelRank(std::span<const float> logits, int label) {
  const float zy = logits[static_cast<size_t>(label)];
  int ahead = 0;
  for (size_t k = 0; k < logits.size(); ++k) {
    const float v = logits[k];
    if (std::isnan(v)) return static_cast<int>(logits.size());
    ahead += v > zy || (v == zy && static_cast<int>(k) < label) ? 1 : 0;
  }
  return ahead;
}

BatchStats ScoreLogits(std::span<const float> logits, int classes, std::span<const int32_t> labels, double smoothing,
                       std::span<const uint8_t> skip) {
  BatchStats stats;
  const double off = smoothing / classes, on = 1.0 - smoothing + off;
  for (size_t r = 0; r < labels.size(); ++r) {
    if (r < skip.size() && skip[r] != 0) continue;
    const std::span<const float> z = logits.subspan(r * static_cast<size_t>(classes), static_cast<size_t>(classes));
    const int y = labels[r];
    double zmax = z[0], zsum = 0, sum = 0;
    for (float v : z) zmax = std::max(zmax, static_cast<double>(v));
    for (float v : z) {
      sum += std::exp(v - zmax);
      zsum += v;
    }
    stats.loss_sum += zmax + std::log(sum) - (on - off) * z[static_cast<size_t>(y)] - off * zsum;
    const int rank = LabelRank(z, y);
    stats.top1 += rank < 1 ? 1 : 0;
    stats.top5 += rank < 5 ? 1 : 0;
    ++stats.count;
  }
  return stats;
}

}  // namespace stoke::train
