#include "train/cuda/cudnn_graph.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <mutex>
#include <utility>

#include <cuda_runtime_api.h>

#include <fmt/format.h>

namespace stoke::train::cuda {

Status CudaError(cudaError_t rc, std::string_view what) {
  return InternalError(fmt::format("CUDA: {}: {} ({})", what, cudaGetErrorString(rc), cudaGetErrorName(rc)));
}

Status CudnnError(cudnnStatus_t status, const std::string& what) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof detail);
  return InternalError(fmt::format("cuDNN: {}: {}{}{}", what, cudnnGetErrorString(status), detail[0] ? ": " : "",
                                   detail));
}

#define STOKE_CUDNN_RETURN(call, what)                         \
  do {                                                          \
    cudnnStatus_t stoke_st_ = (call);                           \
    if (stoke_st_ != CUDNN_STATUS_SUCCESS) return CudnnError(stoke_st_, what); \
  } while (0)

Result<Desc> Desc::Make(cudnnBackendDescriptorType_t type) {
  Desc d;
  STOKE_CUDNN_RETURN(cudnnBackendCreateDescriptor(type, &d.d_), fmt::format("create descriptor {}", static_cast<int>(type)));
  return d;
}

Desc& Desc::operator=(Desc&& o) noexcept {
  if (this != &o) {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
    d_ = o.d_;
    o.d_ = nullptr;
  }
  return *this;
}

Desc::~Desc() {
  if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
}

Status Desc::Set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                 const void* values) {
  STOKE_CUDNN_RETURN(cudnnBackendSetAttribute(d_, name, type, count, values),
                     fmt::format("set attribute {}", static_cast<int>(name)));
  return OkStatus();
}

Status Desc::SetDesc(cudnnBackendAttributeName_t name, const Desc& other) {
  cudnnBackendDescriptor_t d = other.get();
  return Set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
}

Status Desc::Finalize(const char* what) {
  STOKE_CUDNN_RETURN(cudnnBackendFinalize(d_), fmt::format("finalize {}", what));
  return OkStatus();
}

TensorSpec Nhwc(int64_t uid, cudnnDataType_t type, int64_t n, int64_t c, int64_t h, int64_t w) {
  return TensorSpec{uid, type, {n, c, h, w}, {c * h * w, 1, w * c, c}, false};
}
TensorSpec ChannelVector(int64_t uid, int64_t c) {
  return TensorSpec{uid, CUDNN_DATA_FLOAT, {1, c, 1, 1}, {c, 1, c, c}, false};
}
TensorSpec Scalar(int64_t uid) { return TensorSpec{uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, true}; }

std::string_view OpKindName(OpSpec::Kind kind) {
  switch (kind) {
    case OpSpec::Kind::kConvForward: return "convolution forward";
    case OpSpec::Kind::kConvBackwardData: return "convolution backward data";
    case OpSpec::Kind::kConvBackwardFilter: return "convolution backward filter";
    case OpSpec::Kind::kRelu: return "ReLU";
    case OpSpec::Kind::kReluBackward: return "ReLU backward";
    case OpSpec::Kind::kAdd: return "add";
    case OpSpec::Kind::kBatchNormTrain: return "batch norm";
    case OpSpec::Kind::kBatchNormBackward: return "batch norm backward";
    case OpSpec::Kind::kPool: return "pooling";
    case OpSpec::Kind::kPoolBackward: return "pooling backward";
  }
  return "operation";
}

std::string OpSpec::Key() const {
  std::string key = fmt::format("{}:{}:{}:{}:{}", static_cast<int>(kind), pad, stride, window, max_pool);
  for (const auto& t : tensors) {
    key += fmt::format("|{}:{}:{}:{}", static_cast<int>(t.type), fmt::join(t.dims, ","), fmt::join(t.strides, ","),
                       t.by_value);
  }
  return key;
}

namespace {

Result<Desc> MakeTensor(const TensorSpec& t) {
  STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR));
  const int64_t alignment = t.by_value ? 4 : 16;
  const auto rank = static_cast<int64_t>(t.dims.size());
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t.type));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, rank, t.dims.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, rank, t.strides.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment));
  if (t.by_value) {
    const bool yes = true;
    STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes));
  }
  STOKE_RETURN_IF_ERROR(d.Finalize("tensor"));
  return d;
}

Result<Desc> MakeConv(int64_t pad, int64_t stride) {
  STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR));
  const int64_t dims = 2;
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const std::array<int64_t, 2> pads{pad, pad}, strides{stride, stride}, dilations{1, 1};
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pads.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pads.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, strides.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilations.data()));
  STOKE_RETURN_IF_ERROR(d.Finalize("convolution"));
  return d;
}

Result<Desc> MakePointwise(cudnnPointwiseMode_t mode) {
  STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR));
  const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec));
  STOKE_RETURN_IF_ERROR(d.Finalize("pointwise"));
  return d;
}

Result<Desc> MakeResample(const OpSpec& op) {
  STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_RESAMPLE_DESCRIPTOR));
  const cudnnResampleMode_t mode = op.max_pool ? CUDNN_RESAMPLE_MAXPOOL : CUDNN_RESAMPLE_AVGPOOL_INCLUDE_PADDING;
  const cudnnPaddingMode_t padding = op.max_pool ? CUDNN_NEG_INF_PAD : CUDNN_ZERO_PAD;
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const int64_t dims = 2;
  const std::array<cudnnFraction_t, 2> window{{{op.window, 1}, {op.window, 1}}};
  const std::array<cudnnFraction_t, 2> stride{{{op.stride, 1}, {op.stride, 1}}};
  const std::array<cudnnFraction_t, 2> pad{{{op.pad, 1}, {op.pad, 1}}};
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_MODE, CUDNN_TYPE_RESAMPLE_MODE, 1, &mode));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_PADDING_MODE, CUDNN_TYPE_PADDING_MODE, 1, &padding));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_WINDOW_DIMS, CUDNN_TYPE_FRACTION, 2, window.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_STRIDES, CUDNN_TYPE_FRACTION, 2, stride.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_PRE_PADDINGS, CUDNN_TYPE_FRACTION, 2, pad.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_RESAMPLE_POST_PADDINGS, CUDNN_TYPE_FRACTION, 2, pad.data()));
  STOKE_RETURN_IF_ERROR(d.Finalize("resample"));
  return d;
}

// The operation of `op`, given its tensors' descriptors; `keep` holds helper descriptors alive.
Result<Desc> MakeOperation(const OpSpec& op, const std::vector<Desc>& t, std::vector<Desc>& keep) {
  using K = OpSpec::Kind;
  const float one = 1.f, zero = 0.f;
  switch (op.kind) {
    case K::kConvForward:
    case K::kConvBackwardData:
    case K::kConvBackwardFilter: {
      STOKE_ASSIGN_OR_RETURN(Desc conv, MakeConv(op.pad, op.stride));
      Desc d;
      if (op.kind == K::kConvForward) {
        STOKE_ASSIGN_OR_RETURN(d, Desc::Make(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, t[0]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, t[1]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, t[2]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, conv));
        STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, 1, &one));
        STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, 1, &zero));
      } else if (op.kind == K::kConvBackwardData) {
        STOKE_ASSIGN_OR_RETURN(d, Desc::Make(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, t[0]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, t[1]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, t[2]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, conv));
        STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_TYPE_FLOAT, 1, &one));
        STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, CUDNN_TYPE_FLOAT, 1, &zero));
      } else {
        STOKE_ASSIGN_OR_RETURN(d, Desc::Make(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, t[0]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, t[1]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, t[2]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, conv));
        STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_TYPE_FLOAT, 1, &one));
        STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, CUDNN_TYPE_FLOAT, 1, &zero));
      }
      keep.push_back(std::move(conv));
      STOKE_RETURN_IF_ERROR(d.Finalize("convolution operation"));
      return d;
    }
    case K::kRelu:
    case K::kReluBackward:
    case K::kAdd: {
      const cudnnPointwiseMode_t mode = op.kind == K::kRelu           ? CUDNN_POINTWISE_RELU_FWD
                                        : op.kind == K::kReluBackward ? CUDNN_POINTWISE_RELU_BWD
                                                                      : CUDNN_POINTWISE_ADD;
      STOKE_ASSIGN_OR_RETURN(Desc pw, MakePointwise(mode));
      STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR));
      STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw));
      if (op.kind == K::kReluBackward) {
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, t[0]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, t[1]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, t[2]));
      } else {
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, t[0]));
        if (op.kind == K::kAdd) STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, t[1]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, t[op.kind == K::kAdd ? 2 : 1]));
      }
      keep.push_back(std::move(pw));
      STOKE_RETURN_IF_ERROR(d.Finalize("pointwise operation"));
      return d;
    }
    case K::kBatchNormTrain: {
      STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR));
      const cudnnBackendNormMode_t mode = CUDNN_BATCH_NORM;
      const cudnnBackendNormFwdPhase_t phase = CUDNN_NORM_FWD_TRAINING;
      STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_NORM_FWD_MODE, CUDNN_TYPE_NORM_MODE, 1, &mode));
      STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_NORM_FWD_PHASE, CUDNN_TYPE_NORM_FWD_PHASE, 1, &phase));
      const std::array<cudnnBackendAttributeName_t, 12> roles{
          CUDNN_ATTR_OPERATION_NORM_FWD_XDESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_EXP_AVG_FACTOR_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_MEAN_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_VAR_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_MEAN_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_VAR_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC,
          CUDNN_ATTR_OPERATION_NORM_FWD_YDESC};
      for (size_t i = 0; i < roles.size(); ++i) STOKE_RETURN_IF_ERROR(d.SetDesc(roles[i], t[i]));
      STOKE_RETURN_IF_ERROR(d.Finalize("batch norm forward"));
      return d;
    }
    case K::kBatchNormBackward: {
      STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_OPERATION_NORM_BACKWARD_DESCRIPTOR));
      const cudnnBackendNormMode_t mode = CUDNN_BATCH_NORM;
      STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_OPERATION_NORM_BWD_MODE, CUDNN_TYPE_NORM_MODE, 1, &mode));
      const std::array<cudnnBackendAttributeName_t, 8> roles{
          CUDNN_ATTR_OPERATION_NORM_BWD_XDESC,          CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC,
          CUDNN_ATTR_OPERATION_NORM_BWD_SCALE_DESC,     CUDNN_ATTR_OPERATION_NORM_BWD_MEAN_DESC,
          CUDNN_ATTR_OPERATION_NORM_BWD_INV_VARIANCE_DESC, CUDNN_ATTR_OPERATION_NORM_BWD_DSCALE_DESC,
          CUDNN_ATTR_OPERATION_NORM_BWD_DBIAS_DESC,     CUDNN_ATTR_OPERATION_NORM_BWD_DXDESC};
      for (size_t i = 0; i < roles.size(); ++i) STOKE_RETURN_IF_ERROR(d.SetDesc(roles[i], t[i]));
      STOKE_RETURN_IF_ERROR(d.Finalize("batch norm backward"));
      return d;
    }
    case K::kPool:
    case K::kPoolBackward: {
      STOKE_ASSIGN_OR_RETURN(Desc rs, MakeResample(op));
      Desc d;
      if (op.kind == K::kPool) {
        STOKE_ASSIGN_OR_RETURN(d, Desc::Make(CUDNN_BACKEND_OPERATION_RESAMPLE_FWD_DESCRIPTOR));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_FWD_XDESC, t[0]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_FWD_YDESC, t[1]));
        if (t.size() > 2) STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_FWD_IDXDESC, t[2]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_FWD_DESC, rs));
      } else {
        STOKE_ASSIGN_OR_RETURN(d, Desc::Make(CUDNN_BACKEND_OPERATION_RESAMPLE_BWD_DESCRIPTOR));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_BWD_DYDESC, t[0]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_BWD_DXDESC, t[1]));
        if (t.size() > 2) STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_BWD_IDXDESC, t[2]));
        STOKE_RETURN_IF_ERROR(d.SetDesc(CUDNN_ATTR_OPERATION_RESAMPLE_BWD_DESC, rs));
      }
      keep.push_back(std::move(rs));
      STOKE_RETURN_IF_ERROR(d.Finalize("resample operation"));
      return d;
    }
  }
  return InternalError("unknown operation");
}

bool HasNote(const std::vector<cudnnBackendNumericalNote_t>& notes, cudnnBackendNumericalNote_t note) {
  return std::find(notes.begin(), notes.end(), note) != notes.end();
}

// The notes of kind `type` (attribute `name`) an engine carries; none when cuDNN will not say.
template <typename Note>
std::vector<Note> ReadNotes(cudnnBackendDescriptor_t engine, cudnnBackendAttributeName_t name,
                            cudnnBackendAttributeType_t type, int64_t most) {
  std::vector<Note> notes(static_cast<size_t>(most));
  int64_t count = 0;
  if (cudnnBackendGetAttribute(engine, name, type, most, &count, notes.data()) != CUDNN_STATUS_SUCCESS) return {};
  notes.resize(static_cast<size_t>(count));
  return notes;
}

// What the engine behind an engine configuration is: read into `engine` (kept by the caller).
struct EngineInfo {
  int64_t index = -1;  // cuDNN's global engine index
  std::vector<cudnnBackendNumericalNote_t> notes;
  std::vector<cudnnBackendBehaviorNote_t> behaviour;
};
EngineInfo ReadEngine(cudnnBackendDescriptor_t config, const Desc& engine) {
  EngineInfo info;
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t n = 0;
  if (cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw) !=
      CUDNN_STATUS_SUCCESS) {
    return info;
  }
  info.notes = ReadNotes<cudnnBackendNumericalNote_t>(raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                                      CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT);
  info.behaviour = ReadNotes<cudnnBackendBehaviorNote_t>(raw, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
                                                         CUDNN_TYPE_BEHAVIOR_NOTE, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT);
  cudnnBackendGetAttribute(raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &info.index);
  return info;
}

}  // namespace

Result<std::unique_ptr<Graphs>> Graphs::Create(cudnnHandle_t handle, bool allow_reduced_precision, bool autotune) {
  // Plans are built for a device-property descriptor, which cuDNN has from 9.8 on: an older
  // library loaded at run time (the machine's, not the headers') is named rather than failing
  // on an unknown descriptor type.
  if (const size_t loaded = cudnnGetVersion(); loaded < 90800) {
    return UnavailableError(fmt::format(
        "cuda backend: cuDNN {} is loaded (stoke was built with {}); it needs cuDNN 9.8 or later (set "
        "LD_LIBRARY_PATH to a newer libcudnn.so.9)",
        loaded, CUDNN_VERSION));
  }
  std::unique_ptr<Graphs> g(new Graphs(handle, allow_reduced_precision, autotune));
  STOKE_ASSIGN_OR_RETURN(g->device_, Desc::Make(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR));
  STOKE_RETURN_IF_ERROR(g->device_.Set(CUDNN_ATTR_DEVICEPROP_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle));
  STOKE_RETURN_IF_ERROR(g->device_.Finalize("device properties"));
  if (const cudaError_t e = cudaGetDevice(&g->ordinal_); e != cudaSuccess) return CudaError(e, "which device");
  return g;
}

namespace {

// The finalised one-operation graph of `op`, and the descriptors it refers to.
struct BuiltGraph {
  std::vector<Desc> tensors, keep;
  Desc operation, graph;
};
Result<std::unique_ptr<BuiltGraph>> BuildGraph(const OpSpec& op) {
  auto g = std::make_unique<BuiltGraph>();
  for (const auto& t : op.tensors) {
    STOKE_ASSIGN_OR_RETURN(Desc d, MakeTensor(t));
    g->tensors.push_back(std::move(d));
  }
  STOKE_ASSIGN_OR_RETURN(g->operation, MakeOperation(op, g->tensors, g->keep));
  STOKE_ASSIGN_OR_RETURN(g->graph, Desc::Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR));
  cudnnBackendDescriptor_t ops[] = {g->operation.get()};
  STOKE_RETURN_IF_ERROR(g->graph.Set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, ops));
  STOKE_RETURN_IF_ERROR(g->graph.Finalize("operation graph"));
  return g;
}

}  // namespace

Status Graphs::Validate(const OpSpec& op) {
  OpSpec numbered = op;
  for (size_t k = 0; k < numbered.tensors.size(); ++k) numbered.tensors[k].uid = static_cast<int64_t>(k) + 1;
  return BuildGraph(numbered).status();
}

namespace {

bool IsConvolution(OpSpec::Kind k) {
  return k == OpSpec::Kind::kConvForward || k == OpSpec::Kind::kConvBackwardData ||
         k == OpSpec::Kind::kConvBackwardFilter;
}

// What autotuning decided, for the whole process: "device|precision|shape" -> the position of the
// winner in heuristics A's list (cuDNN returns the same list for the same graph and device) and its
// engine (checked on reuse), so a second network of the same shapes (a test's reference, an
// evaluation model) runs the same engines without timing them again.
struct Decision {
  int64_t rank = -1, engine = -1;
};
std::mutex tuned_mu;
std::map<std::string, Decision>& Tuned() {
  static auto* tuned = new std::map<std::string, Decision>;
  return *tuned;
}

// Everything the plans of one operation were made from; shared by its candidates.
struct Sources {
  std::unique_ptr<BuiltGraph> graph;
  Desc heur;
  std::vector<Desc> configs, engines;
};

}  // namespace

Result<const Plan*> Graphs::PlanFor(const OpSpec& op) {
  const std::string key = op.Key();
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  STOKE_ASSIGN_OR_RETURN(auto built, BuildGraph(op));
  auto sources = std::make_shared<Sources>();
  sources->graph = std::move(built);
  const Desc& graph = sources->graph->graph;

  // Autotuning applies to convolutions, the bulk of the time; other operations keep heuristics'
  // first choice (batch norm's plans also update running statistics, so they cannot be timed on
  // live buffers).
  const bool tune = autotune_ && IsConvolution(op.kind);
  const std::string tuned_key = fmt::format("{}|{}|{}", ordinal_, reduced_, key);
  Decision decision;
  if (tune) {
    std::lock_guard<std::mutex> lock(tuned_mu);
    if (auto it = Tuned().find(tuned_key); it != Tuned().end()) decision = it->second;
  }
  const int64_t decided = decision.rank;

  std::string tried;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristics A" : "fallback heuristics";
    STOKE_ASSIGN_OR_RETURN(Desc heur, Desc::Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
    STOKE_RETURN_IF_ERROR(heur.SetDesc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph));
    STOKE_RETURN_IF_ERROR(heur.Set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode));
    STOKE_RETURN_IF_ERROR(heur.SetDesc(CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, device_));
    if (Status f = heur.Finalize("engine heuristics"); !f.ok()) {
      tried += fmt::format(" {}: {};", mode_name, f.message());  // cuDNN's reason, kept for the error
      continue;
    }
    int64_t count = 0;
    if (const cudnnStatus_t st = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
        st != CUDNN_STATUS_SUCCESS || count <= 0) {
      tried += st != CUDNN_STATUS_SUCCESS ? fmt::format(" {}: results: {};", mode_name, cudnnGetErrorString(st))
                                          : fmt::format(" {}: no configurations;", mode_name);
      continue;
    }
    std::vector<Desc> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      STOKE_ASSIGN_OR_RETURN(Desc c, Desc::Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(c.get());
      configs.push_back(std::move(c));
    }
    int64_t got = 0;
    STOKE_CUDNN_RETURN(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()),
                       "engine heuristics results");
    // The order to try: heuristics' own, with an earlier autotuning decision first.
    std::vector<int64_t> order;
    bool use_decision = mode == CUDNN_HEUR_MODE_A && decided >= 0 && decided < got;
    if (use_decision) order.push_back(decided);
    for (int64_t i = 0; i < got; ++i) {
      if (!use_decision || i != decided) order.push_back(i);
    }
    // With autotuning (and no decision yet), heuristics A's first few plans that pass, to be timed.
    bool collect = tune && mode == CUDNN_HEUR_MODE_A && !use_decision;
    std::vector<std::unique_ptr<Plan>> found;
    // Deterministic engines first (the same inputs give the same bits, which the equivalence
    // checks rely on); the others only when no deterministic one runs the operation. In float32,
    // engines that round their inputs (TF32 tensor cores) come last, only when nothing else runs
    // the operation: an operation cuDNN runs that way beats no network at all, and is listed.
    for (int pass = 0; pass < (reduced_ ? 2 : 3); ++pass) {
      if (!found.empty()) break;
      const bool nondeterministic_pass = pass == 1, rounding_pass = pass == 2;
      for (int64_t i : order) {
        // The engine behind the configuration: its numerical and behaviour notes and index.
        STOKE_ASSIGN_OR_RETURN(Desc engine, Desc::Make(CUDNN_BACKEND_ENGINE_DESCRIPTOR));
        const EngineInfo info = ReadEngine(raw[static_cast<size_t>(i)], engine);
        const auto& notes = info.notes;
        const auto& behaviour = info.behaviour;
        const int64_t index = info.index;
        int64_t n = 0;
        const bool rounds = !reduced_ && (HasNote(notes, CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) ||
                                          HasNote(notes, CUDNN_NUMERICAL_NOTE_TENSOR_CORE));
        if (rounding_pass) {
          if (!rounds) continue;  // tried in the first two passes
        } else {
          if (HasNote(notes, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) != nondeterministic_pass) continue;
          // Float32 reference: no engine that rounds inputs (TF32 tensor cores on float data).
          if (rounds) {
            if (!nondeterministic_pass) tried += fmt::format(" engine {} (reduced precision);", index);
            continue;
          }
        }
        if (use_decision && i == decided && index != decision.engine) {
          // The list changed since the decision (it should not): heuristics' own order, untuned.
          use_decision = false;
          continue;
        }
        // Extra candidates only: none compiled at run time (slow to build), none with a large
        // workspace, and in float32 none that computes by FFT or Winograd (the reference stays direct).
        const bool extra = !found.empty();
        if (extra && !reduced_ &&
            (HasNote(notes, CUDNN_NUMERICAL_NOTE_FFT) || HasNote(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD) ||
             HasNote(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4) ||
             HasNote(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6) ||
             HasNote(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13))) {
          continue;
        }
        if (extra && std::find(behaviour.begin(), behaviour.end(), CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) !=
                         behaviour.end()) {
          continue;
        }
        STOKE_ASSIGN_OR_RETURN(Desc plan, Desc::Make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
        STOKE_RETURN_IF_ERROR(plan.Set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                       &raw[static_cast<size_t>(i)]));
        STOKE_RETURN_IF_ERROR(plan.SetDesc(CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, device_));
        if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) {
          if (!extra) tried += fmt::format(" engine {} (plan refused);", index);
          continue;
        }
        auto p = std::make_unique<Plan>();
        p->plan = std::move(plan);
        STOKE_CUDNN_RETURN(cudnnBackendGetAttribute(p->plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                    CUDNN_TYPE_INT64, 1, &n, &p->workspace),
                           "plan workspace size");
        if (extra && p->workspace > kAutotuneWorkspaceLimit) continue;
        p->engine = fmt::format("engine {}", index);
        p->heuristic_rank = i;
        p->engine_index = index;
        p->nondeterministic = HasNote(notes, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC);
        p->rounds_inputs = rounds;
        sources->engines.push_back(std::move(engine));
        found.push_back(std::move(p));
        if (!collect || static_cast<int>(found.size()) >= kAutotuneCandidates) break;
      }
    }
    if (found.empty()) continue;
    sources->heur = std::move(heur);
    sources->configs = std::move(configs);
    for (auto& p : found) {
      p->sources = sources;
      max_workspace_ = std::max(max_workspace_, p->workspace);
    }
    if (tune && use_decision) ++reused_;
    if (collect && found.size() == 1) ++single_;
    std::unique_ptr<Plan> first = std::move(found.front());
    const Plan* out = first.get();
    plans_.emplace(key, std::move(first));
    if (found.size() > 1) {
      found.erase(found.begin());
      candidates_.emplace(key, Candidates{tuned_key, std::move(found)});
    }
    return out;
  }
  return UnavailableError(fmt::format("cuDNN has no engine for this operation ({}){}", OpKindName(op.kind),
                                        tried.empty() ? "" : ":" + tried));
}

Result<AutotuneReport> Graphs::Autotune(cudaStream_t stream, const std::vector<PlanUse>& uses) {
  AutotuneReport report;
  report.reused = std::exchange(reused_, 0);
  report.single = std::exchange(single_, 0);
  if (candidates_.empty()) return report;
  const auto started = std::chrono::steady_clock::now();
  cudaEvent_t begin = nullptr, end = nullptr;
  struct Events {  // destroyed on every way out
    cudaEvent_t* b;
    cudaEvent_t* e;
    ~Events() {
      if (*b != nullptr) cudaEventDestroy(*b);
      if (*e != nullptr) cudaEventDestroy(*e);
    }
  } events{&begin, &end};
  // A CUDA failure while `what` ran: a fault on the device ends the context, so the run stops here.
  auto cuda_error = [](cudaError_t e, const std::string& what) { return CudaError(e, "autotuning: " + what); };
  if (cudaError_t e = cudaEventCreate(&begin); e != cudaSuccess) return cuda_error(e, "create event");
  if (cudaError_t e = cudaEventCreate(&end); e != cudaSuccess) return cuda_error(e, "create event");
  auto run = [&](const Plan& plan, const Desc& pack, int times) {
    for (int k = 0; k < times; ++k) {
      if (cudnnBackendExecute(handle_, plan.plan.get(), pack.get()) != CUDNN_STATUS_SUCCESS) return false;
    }
    return true;
  };
  // Milliseconds per run of `plan` with `pack` (the fastest of the trials, after a warm-up), or a
  // negative value when cuDNN refuses to run it on these buffers.
  auto time = [&](const Plan& plan, const Desc& pack, const std::string& shape) -> Result<double> {
    const std::string what = fmt::format("{} on {}", plan.engine, shape);
    if (!run(plan, pack, kAutotuneWarmup)) {
      cudaGetLastError();  // a refusal at launch leaves no sticky error
      return -1.0;
    }
    double best = -1;
    for (int trial = 0; trial < kAutotuneTrials; ++trial) {
      if (cudaError_t e = cudaEventRecord(begin, stream); e != cudaSuccess) return cuda_error(e, what);
      if (!run(plan, pack, kAutotuneRuns)) {
        cudaGetLastError();
        return -1.0;
      }
      if (cudaError_t e = cudaEventRecord(end, stream); e != cudaSuccess) return cuda_error(e, what);
      if (cudaError_t e = cudaEventSynchronize(end); e != cudaSuccess) return cuda_error(e, what);
      float ms = 0;
      if (cudaError_t e = cudaEventElapsedTime(&ms, begin, end); e != cudaSuccess) return cuda_error(e, what);
      const double per_run = static_cast<double>(ms) / kAutotuneRuns;
      if (best < 0 || per_run < best) best = per_run;
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_error(e, what);
    return best;
  };
  // The GPU out of idle before the first timing (clocks ramp up): the first shape's plan, ~20 runs.
  const Plan* first_plan = plans_.at(candidates_.begin()->first).get();
  if (const auto u = std::find_if(uses.begin(), uses.end(), [&](const PlanUse& p) { return p.plan == first_plan; });
      u != uses.end()) {
    run(*u->plan, *u->pack, 20);
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return cuda_error(e, "warm-up");
  }
  cudaGetLastError();
  for (auto& [key, cand] : candidates_) {
    Plan* current = plans_.at(key).get();
    const Desc* pack = nullptr;
    int use_count = 0;
    for (const PlanUse& u : uses) {
      if (u.plan != current) continue;
      if (pack == nullptr) pack = u.pack;
      ++use_count;
    }
    if (pack == nullptr) continue;  // planned but never bound: nothing runs it
    const std::string shape = key.size() > 160 ? key.substr(0, 160) + "..." : key;  // kind, geometry, tensors
    STOKE_ASSIGN_OR_RETURN(const double first, time(*current, *pack, shape));
    if (first < 0) {
      return InternalError(fmt::format("cuDNN: autotuning: {} (heuristics' first choice) did not run on {}",
                                       current->engine, shape));
    }
    double best = first;
    Plan* winner = current;
    for (auto& c : cand.plans) {
      STOKE_ASSIGN_OR_RETURN(const double ms, time(*c, *pack, shape));
      if (ms < 0) {
        ++report.failed;
        continue;
      }
      // A candidate must beat heuristics' choice clearly, and then the best so far.
      if (ms < (1 - kAutotuneMinGain) * first && ms < best) best = ms, winner = c.get();
    }
    ++report.shapes;
    report.first_ms += first * use_count;
    report.tuned_ms += best * use_count;
    if (winner != current) {
      ++report.changed;
      std::swap(*current, *winner);  // the layers' Plan pointers now run the winner
    }
    std::lock_guard<std::mutex> lock(tuned_mu);
    Tuned()[cand.tuned_key] = Decision{current->heuristic_rank, current->engine_index};
  }
  candidates_.clear();  // the losers' plans are freed
  max_workspace_ = 0;   // now the plans that run
  for (const auto& [key, plan] : plans_) max_workspace_ = std::max(max_workspace_, plan->workspace);
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

Result<Desc> Graphs::Bind(const std::vector<int64_t>& uids, const std::vector<void*>& pointers, void* workspace) {
  STOKE_ASSIGN_OR_RETURN(Desc d, Desc::Make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
  const auto n = static_cast<int64_t>(uids.size());
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, pointers.data()));
  STOKE_RETURN_IF_ERROR(d.Set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace));
  STOKE_RETURN_IF_ERROR(d.Finalize("variant pack"));
  return d;
}

Status Graphs::Execute(const Plan& plan, const Desc& variant_pack) const {
  STOKE_CUDNN_RETURN(cudnnBackendExecute(handle_, plan.plan.get(), variant_pack.get()), "execute " + plan.engine);
  return OkStatus();
}

}  // namespace stoke::train::cuda
