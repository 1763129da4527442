// Writes what tests/export/check_onnxruntime.py compares ONNX Runtime against:
//   export_reference models OUT_DIR        every export case: the exported models (float input,
//       float input without folding, uint8 input), a random uint8 batch, the same batch normalised,
//       and the CPU backend's logits on it; OUT_DIR/index.json lists them.
//   export_reference val RUN_DIR OUT_DIR   the validation set of a trained run as the trainer sees
//       it (uint8 centre crops and labels) with the CPU backend's top-1 on it.
#include <cstdio>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "augment/transform.h"
#include "dataset/dataset.h"
#include "prefetch/loader.h"
#include "tests/export/export_models.h"
#include "train/export.h"
#include "train/trained_model.h"

namespace stoke::train::export_cases {
namespace {

template <typename T>
Status WriteRaw(const std::string& path, std::span<const T> values) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size_bytes()));
  return out ? OkStatus() : IoError("cannot write " + path);
}

Status Models(const std::string& out_dir) {
  STOKE_ASSIGN_OR_RETURN(auto cases, ExportCases(STOKE_SOURCE_DIR));
  nlohmann::json index = nlohmann::json::array();
  constexpr int kBatch = 3;
  for (const ExportCase& c : cases) {
    STOKE_ASSIGN_OR_RETURN(auto net, BuildPerturbed(c, kBatch, 11));
    const std::vector<uint8_t> images = RandomImages(kBatch, c.size, 5);
    std::vector<int32_t> labels(kBatch, 0);
    std::vector<int64_t> indices(kBatch, 0);
    prefetch::Batch batch;
    batch.size = kBatch;
    batch.width = batch.height = c.size;
    batch.images = images;
    batch.labels = labels;
    batch.indices = indices;
    STOKE_RETURN_IF_ERROR(net->Evaluate(batch).status());
    const std::vector<float> logits = net->LastLogits();
    augment::NormalizeOptions no = c.normalize;
    no.layout = augment::Layout::kNCHW;
    no.dtype = augment::DType::kFloat32;
    std::vector<float> normalised(static_cast<size_t>(kBatch) * 3 * c.size * c.size);
    STOKE_RETURN_IF_ERROR(augment::Normalize(images, kBatch, c.size, c.size, no,
                                             std::as_writable_bytes(std::span<float>(normalised))));
    STOKE_ASSIGN_OR_RETURN(auto state, net->State());
    ExportSource source{.model = c.model, .image_width = c.size, .image_height = c.size, .normalize = c.normalize,
                        .state = state, .origin = c.name};
    const std::string base = out_dir + "/" + c.name;
    STOKE_ASSIGN_OR_RETURN(ExportReport folded, WriteOnnx(source, {}, base + ".onnx"));
    STOKE_ASSIGN_OR_RETURN(ExportReport kept, WriteOnnx(source, {.fold_batchnorm = false}, base + "_nofold.onnx"));
    STOKE_ASSIGN_OR_RETURN(ExportReport u8, WriteOnnx(source, {.uint8_input = true}, base + "_u8.onnx"));
    STOKE_RETURN_IF_ERROR(WriteRaw(base + ".u8", std::span<const uint8_t>(images)));
    STOKE_RETURN_IF_ERROR(WriteRaw(base + ".f32", std::span<const float>(normalised)));
    STOKE_RETURN_IF_ERROR(WriteRaw(base + ".logits", std::span<const float>(logits)));
    index.push_back({{"name", c.name}, {"batch", kBatch}, {"size", c.size}, {"classes", c.model.classes},
                     {"folded_batchnorms", folded.folded_batchnorms}, {"kept_batchnorms", kept.kept_batchnorms},
                     {"nodes", folded.nodes}, {"nodes_u8", u8.nodes}});
    std::printf("%-16s %2d BN folded, %3d nodes, %lld parameters\n", c.name.c_str(), folded.folded_batchnorms,
                folded.nodes, static_cast<long long>(folded.parameters));
  }
  std::ofstream(out_dir + "/index.json") << index.dump(2) << "\n";
  return OkStatus();
}

Status Val(const std::string& run_dir, const std::string& out_dir) {
  STOKE_ASSIGN_OR_RETURN(TrainedModel model, LoadTrainedModel({.run_dir = run_dir}));
  STOKE_ASSIGN_OR_RETURN(dataset::Dataset data, dataset::Dataset::Open(model.config.data.val));
  constexpr int kBatch = 100;
  STOKE_ASSIGN_OR_RETURN(auto net, CreateTrainedNetwork(model, "cpu", kBatch, 2));
  prefetch::LoaderOptions lo = ValLoaderOptions(model.config);
  lo.batch_size = kBatch;
  lo.threads = 2;
  lo.device = prefetch::DeviceMode::kHost;
  STOKE_ASSIGN_OR_RETURN(auto loader, prefetch::Loader::Create(data, lo));
  std::vector<uint8_t> images;
  std::vector<int32_t> labels;
  BatchStats total;
  while (true) {
    STOKE_ASSIGN_OR_RETURN(auto lease, loader->Next());
    if (!lease) break;
    STOKE_ASSIGN_OR_RETURN(BatchStats s, net->Evaluate(*lease));
    total += s;
    images.insert(images.end(), lease->images.begin(), lease->images.end());
    labels.insert(labels.end(), lease->labels.begin(), lease->labels.end());
  }
  STOKE_RETURN_IF_ERROR(WriteRaw(out_dir + "/val.u8", std::span<const uint8_t>(images)));
  STOKE_RETURN_IF_ERROR(WriteRaw(out_dir + "/val.labels", std::span<const int32_t>(labels)));
  const nlohmann::json j{{"samples", total.count}, {"size", model.config.data.image_size},
                         {"top1", total.top1_rate()}, {"loss", total.loss()}};
  std::ofstream(out_dir + "/val.json") << j.dump(2) << "\n";
  std::printf("validation: %lld samples, stoke top-1 %.2f%%\n", static_cast<long long>(total.count),
              100 * total.top1_rate());
  return OkStatus();
}

}  // namespace
}  // namespace stoke::train::export_cases

int main(int argc, char** argv) {
  using namespace stoke::train::export_cases;
  stoke::Status s = stoke::InvalidArgumentError("usage: export_reference models OUT_DIR | val RUN_DIR OUT_DIR");
  if (argc == 3 && std::string(argv[1]) == "models") s = Models(argv[2]);
  if (argc == 4 && std::string(argv[1]) == "val") s = Val(argv[2], argv[3]);
  if (!s.ok()) {
    std::fprintf(stderr, "export_reference: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
