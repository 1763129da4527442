// ONNX export without an inference engine: every model exports and passes ONNX's checker and
// shape inference (inside ExportOnnx), batch norms fold where they can and only there, dropout
// disappears, the metadata is there, and what cannot be exported is refused by name. The numbers
// are checked against ONNX Runtime by tests/export/onnx_runtime_test.sh.
#include <fstream>

#include <gtest/gtest.h>

#include <set>
#include <nlohmann/json.hpp>
#include <onnx/onnx_pb.h>

#include "tests/export/export_models.h"
#include "tests/testing/test_util.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/trained_model.h"
#include "train/trainer.h"

namespace stoke::train::export_cases {
namespace {

onnx::ModelProto Parse(const std::string& bytes) {
  onnx::ModelProto m;
  EXPECT_TRUE(m.ParseFromString(bytes));
  return m;
}

// ONNX Runtime refuses a graph with two nodes of one name (the checker does not).
void ExpectUniqueNodeNames(const onnx::ModelProto& m) {
  std::set<std::string> names;
  for (const auto& node : m.graph().node()) EXPECT_TRUE(names.insert(node.name()).second) << node.name();
}

int CountOps(const onnx::ModelProto& m, const std::string& op) {
  int n = 0;
  for (const auto& node : m.graph().node()) n += node.op_type() == op;
  return n;
}

std::string Meta(const onnx::ModelProto& m, const std::string& key) {
  for (const auto& e : m.metadata_props()) {
    if (e.key() == key) return e.value();
  }
  return "";
}

ExportSource SourceFor(const ExportCase& c, const CpuNetwork& net) {
  auto state = net.State();
  EXPECT_TRUE(state.ok());
  return {.model = c.model, .image_width = c.size, .image_height = c.size, .normalize = c.normalize,
          .state = state.ok() ? *state : std::vector<NamedTensor>{}, .origin = c.name};
}

TEST(ExportOnnx, EveryCasePassesOnnxCheckerAndFoldsEveryFoldableBatchNorm) {
  ASSERT_OK_AND_ASSIGN(auto cases, ExportCases(STOKE_SOURCE_DIR));
  for (const ExportCase& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_OK_AND_ASSIGN(auto net, BuildPerturbed(c, 2, 3));
    const ExportSource source = SourceFor(c, *net);
    ModelSpec resolved = c.model;
    ASSERT_OK(ResolveModel(resolved, {3, c.size, c.size}).status());
    int bns = 0, dropouts = 0;
    for (const LayerSpec& l : resolved.layers) {
      bns += l.type == LayerType::kBatchNorm;
      dropouts += l.type == LayerType::kDropout;
    }
    ASSERT_OK_AND_ASSIGN(ExportReport r, ExportOnnx(source, {}));
    const onnx::ModelProto m = Parse(r.bytes);
    ExpectUniqueNodeNames(m);
    EXPECT_EQ(m.opset_import(0).version(), kOnnxOpset);
    EXPECT_EQ(r.folded_batchnorms + r.kept_batchnorms, bns);
    EXPECT_EQ(CountOps(m, "BatchNormalization"), r.kept_batchnorms);
    EXPECT_EQ(CountOps(m, "Dropout"), 0);
    EXPECT_EQ(r.removed_dropouts, dropouts);
    if (c.name == "every_layer") {
      EXPECT_EQ(r.folded_batchnorms, 1);  // bn_fc1 into fc1; bn_c2 (c2 read twice) and the one named logits kept
      EXPECT_EQ(r.kept_batchnorms, 2);
    } else {
      EXPECT_EQ(r.kept_batchnorms, 0) << "every preset's batch norm follows a convolution read only by it";
    }
    // Dynamic batch, fixed classes.
    ASSERT_EQ(m.graph().output_size(), 1);
    const auto& out = m.graph().output(0).type().tensor_type().shape();
    ASSERT_EQ(out.dim_size(), 2);
    EXPECT_EQ(out.dim(0).dim_param(), "N");
    EXPECT_EQ(out.dim(1).dim_value(), c.model.classes);
    const auto& in = m.graph().input(0).type().tensor_type();
    EXPECT_EQ(in.elem_type(), onnx::TensorProto::FLOAT);
    EXPECT_EQ(in.shape().dim(1).dim_value(), 3);
    // The metadata a user needs to feed it.
    const auto classes = nlohmann::json::parse(Meta(m, "stoke.classes"));
    EXPECT_EQ(classes.size(), static_cast<size_t>(c.model.classes));
    EXPECT_EQ(nlohmann::json::parse(Meta(m, "stoke.mean")).size(), 3u);
    EXPECT_EQ(Meta(m, "stoke.layout"), "NCHW");
    EXPECT_EQ(Meta(m, "stoke.image_height"), std::to_string(c.size));

    ASSERT_OK_AND_ASSIGN(ExportReport kept, ExportOnnx(source, {.fold_batchnorm = false}));
    EXPECT_EQ(kept.kept_batchnorms, bns);
    EXPECT_EQ(CountOps(Parse(kept.bytes), "BatchNormalization"), bns);
    ExpectUniqueNodeNames(Parse(kept.bytes));

    ASSERT_OK_AND_ASSIGN(ExportReport u8, ExportOnnx(source, {.uint8_input = true}));
    const onnx::ModelProto mu = Parse(u8.bytes);
    ExpectUniqueNodeNames(mu);
    EXPECT_EQ(u8.input_name, "image");
    const auto& in8 = mu.graph().input(0).type().tensor_type();
    EXPECT_EQ(in8.elem_type(), onnx::TensorProto::UINT8);
    EXPECT_EQ(in8.shape().dim(3).dim_value(), 3);  // N x H x W x 3
    EXPECT_EQ(Meta(mu, "stoke.layout"), "NHWC");
  }
}

TEST(ExportOnnx, FoldingScalesTheWeightsByTheBatchNorm) {
  // conv (no bias) -> BN -> ... : the folded weight is w * gamma / sqrt(var + eps), the bias
  // beta - mean * gamma / sqrt(var + eps).
  ExportCase c{.name = "fold", .size = 8};
  c.model.classes = 2;
  LayerSpec conv = Layer(LayerType::kConv, "conv");
  conv.out = 2, conv.kernel = 1, conv.bias = false;
  LayerSpec fc = Layer(LayerType::kLinear, "fc");
  fc.out = 2;
  c.model.layers = {conv, Layer(LayerType::kBatchNorm, "bn"), Layer(LayerType::kGlobalAvgPool, "gap"), fc};
  ASSERT_OK_AND_ASSIGN(auto net, BuildPerturbed(c, 1, 9));
  ExportSource source = SourceFor(c, *net);
  std::map<std::string, std::vector<float>> t;
  for (const NamedTensor& x : source.state) t[x.name] = x.values;
  ASSERT_OK_AND_ASSIGN(ExportReport r, ExportOnnx(source, {}));
  const onnx::ModelProto m = Parse(r.bytes);
  std::map<std::string, std::vector<float>> init;
  for (const auto& x : m.graph().initializer()) {
    std::vector<float> v(x.raw_data().size() / sizeof(float));
    std::memcpy(v.data(), x.raw_data().data(), x.raw_data().size());
    init[x.name()] = v;
  }
  ASSERT_TRUE(init.count("conv.weight") && init.count("conv.bias"));
  for (size_t o = 0; o < 2; ++o) {
    const double k = t["bn.weight"][o] / std::sqrt(t["bn.running_var"][o] + 1e-5);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(init["conv.weight"][o * 3 + i], t["conv.weight"][o * 3 + i] * k, 1e-6);
    }
    EXPECT_NEAR(init["conv.bias"][o], t["bn.bias"][o] - t["bn.running_mean"][o] * k, 1e-6);
  }
  EXPECT_EQ(CountOps(m, "Conv"), 1);
  EXPECT_EQ(m.graph().node(0).output(0), "bn");  // the conv computes the batch norm's tensor
}

TEST(ExportOnnx, RefusesMissingOrMisShapedTensorsByName) {
  ASSERT_OK_AND_ASSIGN(auto cases, ExportCases(STOKE_SOURCE_DIR));
  const ExportCase& c = cases.back();  // every_layer
  ASSERT_OK_AND_ASSIGN(auto net, BuildPerturbed(c, 1, 3));
  ExportSource source = SourceFor(c, *net);
  ExportSource missing = source;
  std::erase_if(missing.state, [](const NamedTensor& t) { return t.name == "bn_c2.running_var"; });
  auto r = ExportOnnx(missing, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("bn_c2.running_var"), std::string::npos) << r.status().message();

  ExportSource shaped = source;
  for (NamedTensor& t : shaped.state) {
    if (t.name == "fc2.weight") {
      t.dims = {t.dims[0] + 1, t.dims[1]};
      t.values.resize(static_cast<size_t>(t.dims[0] * t.dims[1]));
    }
  }
  r = ExportOnnx(shaped, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fc2.weight"), std::string::npos) << r.status().message();

  ExportSource names = source;
  names.classes = {"a", "b"};
  r = ExportOnnx(names, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("2 class names"), std::string::npos) << r.status().message();
}

// A checkpoint of a small model with its config, as the trainer writes them.
struct SavedRun {
  stoke::testing::TempDir dir;
  std::filesystem::path checkpoint;
  TrainConfig config;
};

void SaveRun(SavedRun& run, const std::string& layers_yaml) {
  const std::string yaml = "data: {train: none.lmdb, image_size: 16, batch_size: 2}\nmodel:\n  classes: 3\n  layers:\n" +
                           layers_yaml;
  ASSERT_OK_AND_ASSIGN(run.config, ParseConfig(yaml, "run.yaml"));
  ASSERT_OK_AND_ASSIGN(auto net, CreateNetwork(run.config));
  ASSERT_OK_AND_ASSIGN(auto tensors, net->State());
  run.checkpoint = run.dir / "step-1.ckpt";
  ASSERT_OK(SaveCheckpoint(run.checkpoint, {.step = 1, .steps_per_epoch = 1, .backend = "cpu",
                                            .config_yaml = ConfigToYaml(run.config), .classes = {"x", "y", "z"},
                                            .tensors = tensors}));
}

constexpr const char* kLayers =
    "    - {name: c, type: conv, out: 4, kernel: 3, pad: 1}\n"
    "    - {name: bn, type: batchnorm}\n"
    "    - {name: gap, type: global_avgpool}\n"
    "    - {name: fc, type: linear, out: 3}\n";

TEST(TrainedModel, LoadsTheCheckpointWithItsOwnConfigAndClassNames) {
  SavedRun run;
  ASSERT_NO_FATAL_FAILURE(SaveRun(run, kLayers));
  ASSERT_OK_AND_ASSIGN(TrainedModel m, LoadTrainedModel({.checkpoint = run.checkpoint}));
  EXPECT_EQ(m.classes, (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(m.config.model.layers.size(), 4u);
  ASSERT_OK_AND_ASSIGN(auto net, CreateTrainedNetwork(m, "cpu", 2, 1));
  EXPECT_EQ(net->backend(), "cpu");
}

// A checkpoint of no class names (written before they were stored) whose training dataset is gone:
// classes named by number, and a warning saying why, not a silent fallback.
TEST(TrainedModel, ACheckpointWithoutClassNamesWarnsWhenItsDatasetIsGone) {
  SavedRun run;
  ASSERT_NO_FATAL_FAILURE(SaveRun(run, kLayers));
  ASSERT_OK_AND_ASSIGN(Checkpoint ck, LoadCheckpoint(run.checkpoint));
  ck.classes.clear();
  ASSERT_OK(SaveCheckpoint(run.checkpoint, ck));
  ::testing::internal::CaptureStderr();
  auto m = LoadTrainedModel({.checkpoint = run.checkpoint});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_OK(m.status());
  EXPECT_EQ(m->classes, (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_NE(err.find("holds no class names and its data.train cannot be opened"), std::string::npos) << err;
  EXPECT_NE(err.find("none.lmdb"), std::string::npos) << err;
}

TEST(TrainedModel, AReducedPrecisionRunEvaluatesOnTheCpuInFloat32) {
  SavedRun run;
  ASSERT_NO_FATAL_FAILURE(SaveRun(run, kLayers));
  ASSERT_OK_AND_ASSIGN(TrainedModel m, LoadTrainedModel({.checkpoint = run.checkpoint}));
  for (const char* dtype : {"bfloat16", "float16"}) {
    m.config.data.dtype = dtype;  // as a GPU run stores it; its checkpoint holds float32 weights
    ASSERT_OK_AND_ASSIGN(auto net, CreateTrainedNetwork(m, "cpu", 2, 1));
    EXPECT_EQ(net->backend(), "cpu");
  }
}

TEST(TrainedModel, RefusesWeightsThatAreNotFiniteAndARunDirThatIsAFile) {
  SavedRun run;
  ASSERT_NO_FATAL_FAILURE(SaveRun(run, kLayers));
  ASSERT_OK_AND_ASSIGN(Checkpoint ck, LoadCheckpoint(run.checkpoint));
  for (NamedTensor& t : ck.tensors) {
    if (t.name == "fc.weight") t.values[1] = std::nanf("");
  }
  ASSERT_OK(SaveCheckpoint(run.dir / "diverged.ckpt", ck));
  auto m = LoadTrainedModel({.checkpoint = run.dir / "diverged.ckpt"});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tensor 'fc.weight' holds 1 of 12 values that are not finite"),
            std::string::npos)
      << m.status().message();
  m = LoadTrainedModel({.run_dir = run.checkpoint});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("is a file, not a run directory"), std::string::npos) << m.status().message();
  m = LoadTrainedModel({.run_dir = "/dev/null"});  // there, but neither: not "does not exist"
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("/dev/null is not a run directory"), std::string::npos) << m.status().message();
}

TEST(TrainedModel, RefusesATruncatedCheckpointNamingTheFile) {
  SavedRun run;
  ASSERT_NO_FATAL_FAILURE(SaveRun(run, kLayers));
  std::filesystem::resize_file(run.checkpoint, std::filesystem::file_size(run.checkpoint) / 2);
  auto m = LoadTrainedModel({.checkpoint = run.checkpoint});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(m.status().message().find(run.checkpoint.string()), std::string::npos) << m.status().message();
}

TEST(TrainedModel, RefusesAConfigThatDoesNotMatchNamingBothFiles) {
  SavedRun run;
  ASSERT_NO_FATAL_FAILURE(SaveRun(run, kLayers));
  // Wider convolution: the checkpoint's c.weight is 4 x 3 x 3 x 3, this config wants 8 x ...
  const std::string other = (run.dir / "other.yaml").string();
  auto write_layers = [&](const std::string& layers) {  // a config of this model's data and classes
    std::ofstream(other) << "data: {train: none.lmdb, image_size: 16}\nmodel:\n  classes: 3\n  layers:\n" << layers;
  };
  write_layers("    - {name: c, type: conv, out: 8, kernel: 3, pad: 1}\n"
               "    - {name: bn, type: batchnorm}\n"
               "    - {name: gap, type: global_avgpool}\n"
               "    - {name: fc, type: linear, out: 3}\n");
  auto m = LoadTrainedModel({.checkpoint = run.checkpoint, .config = other});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  for (const std::string& needle : {other, run.checkpoint.string(), std::string("c.weight")}) {
    EXPECT_NE(m.status().message().find(needle), std::string::npos) << m.status().message();
  }
  // One layer fewer: the checkpoint holds a tensor the model has no place for.
  write_layers("    - {name: c, type: conv, out: 4, kernel: 3, pad: 1}\n"
               "    - {name: gap, type: global_avgpool}\n"
               "    - {name: fc, type: linear, out: 3}\n");
  m = LoadTrainedModel({.checkpoint = run.checkpoint, .config = other});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("bn."), std::string::npos) << m.status().message();
  // The same tensors in another model (a ReLU more, a pooling layer for another): other functions
  // of the same weights, which evaluated and exported without a word.
  write_layers("    - {name: c, type: conv, out: 4, kernel: 3, pad: 1}\n"
               "    - {name: bn, type: batchnorm}\n"
               "    - {name: r, type: relu}\n"
               "    - {name: gap, type: global_avgpool}\n"
               "    - {name: fc, type: linear, out: 3}\n");
  m = LoadTrainedModel({.checkpoint = run.checkpoint, .config = other});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("layer 2 is 'r' (relu of bn) in the config, 'gap' (global_avgpool of bn)"),
            std::string::npos)
      << m.status().message();
  write_layers("    - {name: c, type: conv, out: 4, kernel: 3, pad: 1}\n"
               "    - {name: bn, type: batchnorm}\n"
               "    - {name: gap, type: maxpool, kernel: 16}\n"
               "    - {name: fc, type: linear, out: 3}\n");
  m = LoadTrainedModel({.checkpoint = run.checkpoint, .config = other});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("maxpool kernel 16"), std::string::npos) << m.status().message();
  // The stored config given again is the same model.
  std::ofstream(other) << ConfigToYaml(run.config);
  EXPECT_OK(LoadTrainedModel({.checkpoint = run.checkpoint, .config = other}).status());
}

TEST(TrainedModel, RunDirectoryWithoutCheckpointsIsNotFound) {
  stoke::testing::TempDir dir;
  auto m = LoadTrainedModel({.run_dir = dir.path()});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find(dir.path().string()), std::string::npos);
}

}  // namespace
}  // namespace stoke::train::export_cases
