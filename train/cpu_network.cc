#include "train/cpu_network.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numbers>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "common/logging.h"
#include "common/random.h"
#include "common/sys_memory.h"

namespace stoke::train {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using Dims = memory::dims;
using ArgMap = std::unordered_map<int, memory>;
constexpr auto kF32 = memory::data_type::f32;

memory::desc Any(const Dims& dims) { return memory::desc(dims, kF32, Tag::any); }
float* Data(const memory& m) { return static_cast<float*>(m.get_data_handle()); }
size_t Floats(const memory& m) { return m.get_desc().get_size() / sizeof(float); }
bool IsReference(const dnnl::primitive_desc_base& pd) { return std::string_view(pd.impl_info_str()).starts_with("ref"); }

// Converts a memory into another layout when the two differ; a no-op (returns its input) otherwise.
struct Converter {
  bool needed = false;
  dnnl::reorder prim;
  memory out;
  void Init(const memory::desc& from, const memory::desc& to, const dnnl::engine& eng) {
    needed = from != to;
    if (!needed) return;
    out = memory(to, eng);
    prim = dnnl::reorder(dnnl::reorder::primitive_desc(eng, from, eng, to));
  }
  memory Run(const memory& in, dnnl::stream& s) {
    if (!needed) return in;
    memory src = in;
    prim.execute(s, src, out);
    return out;
  }
};

// A learnable tensor with its gradient and momentum, all in the layout its primitive chose.
struct Param {
  std::string name;
  Dims dims;  // plain (checkpoint) dims
  Tag plain = Tag::x;
  memory value, grad, momentum;  // grad points into Net::grad_flat
  bool decay = true;  // false for BN scale/shift and biases
  int layer = -1;     // the layer that owns it
};

// 64-byte aligned floats (the flat gradient buffer).
struct AlignedFloats {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
  size_t size = 0;
  void Allocate(size_t floats) {
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    data.reset(static_cast<float*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
    if (!data) throw std::bad_alloc();
    std::memset(data.get(), 0, bytes);
    size = floats;
  }
  std::span<float> span() const { return {data.get(), size}; }
};

// Floats reserved after the gradients in the flat buffer for this rank's step statistics, which
// are averaged with them: loss sum, top-1, top-5, count.
constexpr size_t kTailFloats = 16;

// A non-learned tensor kept in checkpoints (BN running statistics).
struct Buffer {
  std::string name;
  memory value;  // plain 1-D
};

// Where a layer delivers the gradient for one of its inputs.
struct DiffSink {
  int node = -1;        // -1: the network input (no gradient needed)
  bool direct = false;  // the primitive writes straight into the node's gradient
  memory scratch;       // otherwise it writes here, and Deliver() converts and accumulates
  Converter to_node;
};

struct Node {
  memory out;   // the layer's output
  memory diff;  // gradient of the loss with respect to `out`
  int consumers = 0;
  int writes = 0;  // gradient contributions received in this backward pass
};

class Net;

class Layer {
 public:
  virtual ~Layer() = default;
  virtual void Forward(Net& net, bool training, int64_t step) = 0;
  virtual void Backward(Net& net) = 0;
};

class Net {
 public:
  NetworkOptions opt;
  std::vector<Shape> shapes;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  memory input;
  std::vector<Node> nodes;
  std::vector<std::unique_ptr<Layer>> layers;
  std::vector<std::unique_ptr<Param>> params;
  std::vector<Buffer> buffers;
  // The buffers (batch norm's running statistics) as they were before the data-parallel step in
  // flight: a skipped step puts them back, so a batch whose forward pass overflowed cannot leave them
  // infinite for good.
  std::vector<float> buffers_saved;
  memory logits_plain;  // N x classes, plain
  Converter logits_conv;
  memory loss_diff;  // N x classes, plain
  Converter loss_diff_conv;

  // Every parameter gradient in one buffer, the last layer's first (the order backward finishes
  // them), each slice padded to 64 bytes, then kTailFloats for the step statistics.
  AlignedFloats grad_flat;
  std::vector<GradientSlice> grad_slices;    // per parameter, in backward order; then the tail
  std::vector<std::vector<int>> layer_slices;  // per layer: its parameters' slices
  StepSync* sync = nullptr;                  // data-parallel: set by SetStepSync
  bool Parallel() const { return sync != nullptr && sync->world() > 1; }
  bool SyncBatchNorm() const { return Parallel() && opt.sync_batchnorm; }

  std::vector<bool> needs_grad;  // per layer: its output's gradient is used (LayersNeedingGradient)
  int running = -1;              // the layer being built or run, for error messages
  const char* phase = "";        // what it was doing: "build", "forward", "backward"

  std::vector<std::string> reference_kernels;  // "layer: kernel" for each slow fallback in use
  void Note(int layer, const dnnl::primitive_desc_base& pd) {
    if (IsReference(pd)) {
      reference_kernels.push_back(fmt::format("{}: {} (primitive kind {})",
                                              opt.model.layers[static_cast<size_t>(layer)].name, pd.impl_info_str(),
                                              static_cast<int>(pd.get_kind())));
    }
  }

  Node& node(int i) { return nodes[static_cast<size_t>(i)]; }
  // Whether the backward pass needs the gradient of node `i`'s output; never for the input (-1).
  bool NeedsGrad(int i) const { return i >= 0 && needs_grad[static_cast<size_t>(i)]; }
  // Allocates a layer's output and, when the backward pass needs it, its gradient, both in `md`.
  Node& SetOutput(int i, const memory::desc& md) {
    Node& n = node(i);
    n.out = memory(md, eng);
    if (NeedsGrad(i)) n.diff = memory(md, eng);
    return n;
  }

  const memory& Out(int node) const { return node < 0 ? input : nodes[static_cast<size_t>(node)].out; }
  memory::desc OutMd(int node) const { return Out(node).get_desc(); }

  Param* AddParam(const std::string& name, const Dims& dims, Tag plain, const memory::desc& md, bool decay,
                  const std::vector<float>& init) {
    auto p = std::make_unique<Param>();
    p->name = name;
    p->dims = dims;
    p->plain = plain;
    p->decay = decay;
    p->layer = running;
    p->value = memory(md, eng);
    p->grad = memory(md, eng, DNNL_MEMORY_NONE);  // placed in grad_flat by LayOutGradients()
    p->momentum = memory(md, eng);
    std::memset(p->momentum.get_data_handle(), 0, md.get_size());
    FromPlain(init, dims, plain, p->value);
    params.push_back(std::move(p));
    return params.back().get();
  }
  memory AddBuffer(const std::string& name, int64_t size, float fill) {
    memory m(memory::desc({size}, kF32, Tag::x), eng);
    std::fill_n(Data(m), size, fill);
    buffers.push_back({name, m});
    return m;
  }

  // Places every gradient in grad_flat (see there); once, after the layers are built.
  void LayOutGradients() {
    auto padded = [](size_t bytes) { return (bytes + 63) / 64 * 16; };  // floats
    size_t total = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) total += padded((*it)->grad.get_desc().get_size());
    grad_flat.Allocate(total + kTailFloats);
    layer_slices.assign(layers.size(), {});
    size_t offset = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      Param& p = **it;
      const size_t count = padded(p.grad.get_desc().get_size());
      p.grad.set_data_handle(grad_flat.data.get() + offset);
      layer_slices[static_cast<size_t>(p.layer)].push_back(static_cast<int>(grad_slices.size()));
      grad_slices.push_back({offset, count});
      offset += count;
    }
    grad_slices.push_back({offset, kTailFloats});
  }
  float* Tail() { return grad_flat.data.get() + grad_slices.back().offset; }

  void FromPlain(const std::vector<float>& values, const Dims& dims, Tag plain, memory& dst) {
    memory::desc md(dims, kF32, plain);
    memory src(md, eng, const_cast<float*>(values.data()));
    dnnl::reorder(src, dst).execute(strm, src, dst);
    strm.wait();
  }
  std::vector<float> ToPlain(const memory& m, const Dims& dims, Tag plain) {
    memory::desc md(dims, kF32, plain);
    std::vector<float> values(md.get_size() / sizeof(float));
    memory dst(md, eng, values.data());
    memory src = m;
    dnnl::reorder(src, dst).execute(strm, src, dst);
    strm.wait();
    return values;
  }

  void InitSink(DiffSink& s, int node, const memory::desc& produced) {
    s.node = NeedsGrad(node) ? node : -1;
    if (s.node < 0) return;
    const Node& n = nodes[static_cast<size_t>(node)];
    s.direct = n.consumers == 1 && produced == n.out.get_desc();
    if (!s.direct) {
      s.scratch = memory(produced, eng);
      s.to_node.Init(produced, n.out.get_desc(), eng);
    }
  }
  memory SinkTarget(const DiffSink& s) {
    return s.direct ? nodes[static_cast<size_t>(s.node)].diff : s.scratch;
  }
  void Deliver(DiffSink& s) {
    if (s.node < 0) return;
    if (s.direct) {
      nodes[static_cast<size_t>(s.node)].writes++;
      return;
    }
    Give(s.node, s.scratch, s.to_node);
  }
  // Adds `d` (converted into the node's layout) to the node's gradient.
  void Give(int node, const memory& d, Converter& conv) {
    if (!NeedsGrad(node)) return;
    memory src = conv.Run(d, strm);
    strm.wait();
    Node& n = nodes[static_cast<size_t>(node)];
    float* dst = Data(n.diff);
    const float* from = Data(src);
    const size_t count = Floats(n.diff);
    if (n.writes++ == 0) {
      std::memcpy(dst, from, count * sizeof(float));
    } else {
      for (size_t i = 0; i < count; ++i) dst[i] += from[i];
    }
  }
};

// ---------------------------------------------------------------- convolution and linear

class WeightedLayer final : public Layer {
 public:
  WeightedLayer(Net& net, const LayerSpec& l, int self, int in_node, uint64_t init_seed) : self_(self), in_(in_node) {
    const bool conv = l.type == LayerType::kConv;
    const int n = net.opt.batch;
    const memory::desc in_md = net.OutMd(in_node);
    Dims src_dims = in_md.dims();
    src_dims[0] = n;
    Dims w_dims = src_dims;
    w_dims[0] = l.out;
    const Shape out_shape = net.shapes[static_cast<size_t>(self)];
    Dims dst_dims = conv ? Dims{n, out_shape.c, out_shape.h, out_shape.w} : Dims{n, l.out};
    const Dims strides{l.stride, l.stride}, pad{l.pad, l.pad};
    if (conv) w_dims = {l.out, src_dims[1], l.kernel, l.kernel};
    const Dims b_dims{l.out};
    const memory::desc bias_md = l.bias ? memory::desc(b_dims, kF32, Tag::x) : memory::desc();
    const memory::desc dst_req = conv ? Any(dst_dims) : memory::desc(dst_dims, kF32, Tag::nc);
    const auto fwd_kind = dnnl::prop_kind::forward_training;
    const auto alg = dnnl::algorithm::convolution_direct;

    memory::desc src_md, w_md, dst_md;
    if (conv) {
      auto d = l.bias ? dnnl::convolution_forward::desc(fwd_kind, alg, Any(src_dims), Any(w_dims), bias_md,
                                                         dst_req, strides, pad, pad)
                      : dnnl::convolution_forward::desc(fwd_kind, alg, Any(src_dims), Any(w_dims), dst_req,
                                                         strides, pad, pad);
      conv_pd_ = dnnl::convolution_forward::primitive_desc(d, net.eng);
      net.Note(self, conv_pd_);
      fwd_ = dnnl::convolution_forward(conv_pd_);
      src_md = conv_pd_.src_desc();
      w_md = conv_pd_.weights_desc();
      dst_md = conv_pd_.dst_desc();
    } else {
      auto d = l.bias ? dnnl::inner_product_forward::desc(fwd_kind, Any(src_dims), Any(w_dims), bias_md, dst_req)
                      : dnnl::inner_product_forward::desc(fwd_kind, Any(src_dims), Any(w_dims), dst_req);
      ip_pd_ = dnnl::inner_product_forward::primitive_desc(d, net.eng);
      net.Note(self, ip_pd_);
      fwd_ = dnnl::inner_product_forward(ip_pd_);
      src_md = ip_pd_.src_desc();
      w_md = ip_pd_.weights_desc();
      dst_md = ip_pd_.dst_desc();
    }
    src_conv_.Init(in_md, src_md, net.eng);

    const InitialParameters init = InitialWeights(l, w_dims, init_seed);
    const Tag w_plain = w_dims.size() == 4 ? Tag::oihw : Tag::oi;
    weight_ = net.AddParam(l.name + ".weight", w_dims, w_plain, w_md, true, init.weight);
    if (l.bias) {
      bias_ = net.AddParam(l.name + ".bias", b_dims, Tag::x, bias_md, false, init.bias);
    }
    net.SetOutput(self, dst_md);

    // Backward weights: ask for gradients in the weights' own layout (so SGD is elementwise);
    // when no kernel offers that, take the preferred one and convert.
    memory::desc bw_diff_w, bw_diff_dst;
    bool bw_reference = false;
    auto make_bwd_weights = [&](const memory::desc& dw) {
      if (conv) {
        auto d = l.bias ? dnnl::convolution_backward_weights::desc(alg, src_md, dw, bias_md, Any(dst_dims),
                                                                    strides, pad, pad)
                        : dnnl::convolution_backward_weights::desc(alg, src_md, dw, Any(dst_dims), strides,
                                                                    pad, pad);
        dnnl::convolution_backward_weights::primitive_desc pd(d, net.eng, conv_pd_);
        bwd_w_ = dnnl::convolution_backward_weights(pd);
        bw_diff_w = pd.diff_weights_desc();
        bw_diff_dst = pd.diff_dst_desc();
        bw_reference = IsReference(pd);
      } else {
        auto d = l.bias ? dnnl::inner_product_backward_weights::desc(src_md, dw, bias_md, Any(dst_dims))
                        : dnnl::inner_product_backward_weights::desc(src_md, dw, Any(dst_dims));
        dnnl::inner_product_backward_weights::primitive_desc pd(d, net.eng, ip_pd_);
        bwd_w_ = dnnl::inner_product_backward_weights(pd);
        bw_diff_w = pd.diff_weights_desc();
        bw_diff_dst = pd.diff_dst_desc();
        bw_reference = IsReference(pd);
      }
    };
    // oneDNN's reference kernels accept any layout, so a fixed layout "succeeds" slowly: fall
    // back to the preferred layout when that is what was picked.
    bool fixed_ok = true;
    try {
      make_bwd_weights(w_md);
      fixed_ok = !bw_reference;
    } catch (const dnnl::error&) {
      fixed_ok = false;
    }
    if (!fixed_ok) make_bwd_weights(Any(w_dims));
    if (bw_reference) net.reference_kernels.push_back(fmt::format("{}: backward weights", l.name));
    if (bw_diff_w != w_md) {
      grad_scratch_ = memory(bw_diff_w, net.eng);
      grad_conv_ = dnnl::reorder(dnnl::reorder::primitive_desc(net.eng, bw_diff_w, net.eng, w_md));
    }
    dd_w_.Init(dst_md, bw_diff_dst, net.eng);

    // Backward data, unless nothing upstream learns (the network input, or parameter-free layers
    // on it).
    data_grad_ = net.NeedsGrad(in_node);
    if (!data_grad_) return;
    memory::desc bd_w, bd_diff_dst, bd_diff_src;
    auto make_bwd_data = [&](const memory::desc& wmd) {
      if (conv) {
        dnnl::convolution_backward_data::desc d(alg, Any(src_dims), wmd, Any(dst_dims), strides, pad, pad);
        dnnl::convolution_backward_data::primitive_desc pd(d, net.eng, conv_pd_);
        net.Note(self, pd);
        bwd_d_ = dnnl::convolution_backward_data(pd);
        bd_w = pd.weights_desc();
        bd_diff_dst = pd.diff_dst_desc();
        bd_diff_src = pd.diff_src_desc();
      } else {
        dnnl::inner_product_backward_data::desc d(Any(src_dims), wmd, Any(dst_dims));
        dnnl::inner_product_backward_data::primitive_desc pd(d, net.eng, ip_pd_);
        net.Note(self, pd);
        bwd_d_ = dnnl::inner_product_backward_data(pd);
        bd_w = pd.weights_desc();
        bd_diff_dst = pd.diff_dst_desc();
        bd_diff_src = pd.diff_src_desc();
      }
    };
    // The data gradient wants the weights in a transposed blocking: let it choose, and convert
    // the weights (small next to the activations) each step.
    make_bwd_data(Any(w_dims));
    w_for_data_.Init(w_md, bd_w, net.eng);
    dd_d_.Init(dst_md, bd_diff_dst, net.eng);
    net.InitSink(sink_, in_node, bd_diff_src);
  }

  void Forward(Net& net, bool, int64_t) override {
    src_ = src_conv_.Run(net.Out(in_), net.strm);
    ArgMap args{{DNNL_ARG_SRC, src_},
                {DNNL_ARG_WEIGHTS, weight_->value},
                {DNNL_ARG_DST, net.node(self_).out}};
    if (bias_) args[DNNL_ARG_BIAS] = bias_->value;
    fwd_.execute(net.strm, args);
  }

  void Backward(Net& net) override {
    const memory& diff = net.node(self_).diff;
    ArgMap args{{DNNL_ARG_SRC, src_},
                {DNNL_ARG_DIFF_DST, dd_w_.Run(diff, net.strm)},
                {DNNL_ARG_DIFF_WEIGHTS, grad_scratch_ ? grad_scratch_ : weight_->grad}};
    if (bias_) args[DNNL_ARG_DIFF_BIAS] = bias_->grad;
    bwd_w_.execute(net.strm, args);
    if (grad_scratch_) grad_conv_.execute(net.strm, grad_scratch_, weight_->grad);
    if (!data_grad_) return;
    bwd_d_.execute(net.strm, {{DNNL_ARG_DIFF_DST, dd_d_.Run(diff, net.strm)},
                              {DNNL_ARG_WEIGHTS, w_for_data_.Run(weight_->value, net.strm)},
                              {DNNL_ARG_DIFF_SRC, net.SinkTarget(sink_)}});
    net.Deliver(sink_);
  }

 private:
  int self_, in_;
  bool data_grad_ = false;  // the input's gradient is needed
  dnnl::convolution_forward::primitive_desc conv_pd_;
  dnnl::inner_product_forward::primitive_desc ip_pd_;
  dnnl::primitive fwd_, bwd_w_, bwd_d_;
  dnnl::reorder grad_conv_;
  memory grad_scratch_;
  Converter src_conv_, dd_w_, dd_d_, w_for_data_;
  memory src_;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;
  DiffSink sink_;
};

// ---------------------------------------------------------------- batch normalisation

class BatchNormLayer final : public Layer {
 public:
  BatchNormLayer(Net& net, const LayerSpec& l, int self, int in_node) : self_(self), in_(in_node) {
    const memory::desc md = net.OutMd(in_node);
    const Dims dims = md.dims();
    channels_ = dims[1];
    per_channel_ = 1;
    for (size_t i = 0; i < dims.size(); ++i) per_channel_ *= i == 1 ? 1 : dims[i];
    const auto eps = static_cast<float>(net.opt.bn_epsilon);
    const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    fwd_pd_ = dnnl::batch_normalization_forward::primitive_desc(
        {dnnl::prop_kind::forward_training, md, eps, flags}, net.eng);
    fwd_ = dnnl::batch_normalization_forward(fwd_pd_);
    dnnl::batch_normalization_forward::primitive_desc inf_pd(
        {dnnl::prop_kind::forward_inference, md, eps, flags | dnnl::normalization_flags::use_global_stats},
        net.eng);
    inf_ = dnnl::batch_normalization_forward(inf_pd);
    dnnl::batch_normalization_backward::primitive_desc bwd_pd(
        {dnnl::prop_kind::backward, md, md, eps, flags}, net.eng, fwd_pd_);
    bwd_ = dnnl::batch_normalization_backward(bwd_pd);
    if (net.opt.sync_batchnorm) {
      // Batch norm over the global batch: normalise with the combined statistics, and correct
      // the local input gradient by what the other ranks' samples add to it (see Backward).
      fwd_global_ = dnnl::batch_normalization_forward(dnnl::batch_normalization_forward::primitive_desc(
          {dnnl::prop_kind::forward_training, md, eps, flags | dnnl::normalization_flags::use_global_stats},
          net.eng));
      correction_ = memory(md, net.eng);
      k1_ = memory(memory::desc({channels_}, kF32, Tag::x), net.eng);
      k2_ = memory(memory::desc({channels_}, kF32, Tag::x), net.eng);
      add_ = dnnl::binary(dnnl::binary::primitive_desc({dnnl::algorithm::binary_add, md, md, md}, net.eng));
    }
    net.Note(self, fwd_pd_);
    net.Note(self, inf_pd);
    net.Note(self, bwd_pd);

    const memory::desc vec({channels_}, kF32, Tag::x);
    scale_ = net.AddParam(l.name + ".weight", {channels_}, Tag::x, vec, false,
                          std::vector<float>(static_cast<size_t>(channels_), l.zero_init ? 0.f : 1.f));
    shift_ = net.AddParam(l.name + ".bias", {channels_}, Tag::x, vec, false,
                          std::vector<float>(static_cast<size_t>(channels_), 0.f));
    mean_ = memory(fwd_pd_.mean_desc(), net.eng);
    var_ = memory(fwd_pd_.variance_desc(), net.eng);
    running_mean_ = net.AddBuffer(l.name + ".running_mean", channels_, 0.f);
    running_var_ = net.AddBuffer(l.name + ".running_var", channels_, 1.f);
    net.SetOutput(self, fwd_pd_.dst_desc());
    dd_.Init(fwd_pd_.dst_desc(), bwd_pd.diff_dst_desc(), net.eng);
    net.InitSink(sink_, in_node, bwd_pd.diff_src_desc());
    // oneDNN's backward always writes the input gradient; when nothing needs it, it goes here.
    if (sink_.node < 0) discard_ = memory(bwd_pd.diff_src_desc(), net.eng);
  }

  void Forward(Net& net, bool training, int64_t) override {
    const memory& out = net.node(self_).out;
    if (!training) {
      inf_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_DST, out},
                              {DNNL_ARG_SCALE, scale_->value}, {DNNL_ARG_SHIFT, shift_->value},
                              {DNNL_ARG_MEAN, running_mean_}, {DNNL_ARG_VARIANCE, running_var_}});
      return;
    }
    fwd_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_DST, out},
                            {DNNL_ARG_SCALE, scale_->value}, {DNNL_ARG_SHIFT, shift_->value},
                            {DNNL_ARG_MEAN, mean_}, {DNNL_ARG_VARIANCE, var_}});
    net.strm.wait();
    int64_t samples = per_channel_;  // values behind each channel's statistics
    if (net.SyncBatchNorm()) {
      Check(net.sync->CombineMoments({Data(mean_), static_cast<size_t>(channels_)},
                                     {Data(var_), static_cast<size_t>(channels_)}));
      fwd_global_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_DST, out},
                                     {DNNL_ARG_SCALE, scale_->value}, {DNNL_ARG_SHIFT, shift_->value},
                                     {DNNL_ARG_MEAN, mean_}, {DNNL_ARG_VARIANCE, var_}});
      net.strm.wait();
      samples *= net.sync->world();
    }
    // Running statistics as in common frameworks: the variance is the unbiased batch estimate.
    const auto m = static_cast<float>(net.opt.bn_momentum);
    const float unbias = samples > 1 ? static_cast<float>(samples) / static_cast<float>(samples - 1) : 1.f;
    float* rm = Data(running_mean_);
    float* rv = Data(running_var_);
    const float* bm = Data(mean_);
    const float* bv = Data(var_);
    for (int64_t c = 0; c < channels_; ++c) {
      rm[c] = (1 - m) * rm[c] + m * bm[c];
      rv[c] = (1 - m) * rv[c] + m * bv[c] * unbias;
    }
  }

  void Backward(Net& net) override {
    const memory& diff = net.node(self_).diff;
    bwd_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_MEAN, mean_}, {DNNL_ARG_VARIANCE, var_},
                            {DNNL_ARG_DIFF_DST, dd_.Run(diff, net.strm)}, {DNNL_ARG_SCALE, scale_->value},
                            {DNNL_ARG_SHIFT, shift_->value},
                            {DNNL_ARG_DIFF_SRC, sink_.node < 0 ? discard_ : net.SinkTarget(sink_)},
                            {DNNL_ARG_DIFF_SCALE, scale_->grad}, {DNNL_ARG_DIFF_SHIFT, shift_->grad}});
    if (net.SyncBatchNorm()) CorrectForGlobalBatch(net);
    net.Deliver(sink_);
  }

 private:
  // With the global mean and variance, oneDNN's backward gives this rank's share of the gradients:
  //   s1 = sum dy * xhat, s2 = sum dy over the local N_l values of each channel, and
  //   dx_local = gamma / sigma * (dy - s2 / N_l - xhat * s1 / N_l).
  // Over the global batch (N_g = world * N_l, S = the sum of s over the ranks) the input gradient is
  //   dx = gamma / sigma * (dy - S2 / N_g - xhat * S1 / N_g) = dx_local + k1 + k2 * xhat,
  //   k1 = gamma / sigma * (s2 / N_l - S2 / N_g),  k2 = gamma / sigma * (s1 / N_l - S1 / N_g).
  // k1 + k2 * xhat is a batch-norm inference with scale k2 and shift k1, added by a binary
  // primitive. The parameter gradients s1, s2 are averaged with the others by the reducer.
  void CorrectForGlobalBatch(Net& net) {
    net.strm.wait();
    const auto c = static_cast<size_t>(channels_);
    std::vector<float> sums(2 * c);
    std::copy_n(Data(scale_->grad), c, sums.begin());
    std::copy_n(Data(shift_->grad), c, sums.begin() + static_cast<ptrdiff_t>(c));
    Check(net.sync->SumOverRanks(sums));
    if (sink_.node < 0) return;  // no input gradient wanted
    const double nl = static_cast<double>(per_channel_), ng = nl * net.sync->world();
    const float* gamma = Data(scale_->value);
    const float* var = Data(var_);
    const float* s1 = Data(scale_->grad);
    const float* s2 = Data(shift_->grad);
    float* k1 = Data(k1_);
    float* k2 = Data(k2_);
    for (size_t i = 0; i < c; ++i) {
      const double g = gamma[i] / std::sqrt(static_cast<double>(var[i]) + net.opt.bn_epsilon);
      k1[i] = static_cast<float>(g * (s2[i] / nl - sums[c + i] / ng));
      k2[i] = static_cast<float>(g * (s1[i] / nl - sums[i] / ng));
    }
    inf_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_DST, correction_},
                            {DNNL_ARG_SCALE, k2_}, {DNNL_ARG_SHIFT, k1_},
                            {DNNL_ARG_MEAN, mean_}, {DNNL_ARG_VARIANCE, var_}});
    const memory target = net.SinkTarget(sink_);
    add_.execute(net.strm, {{DNNL_ARG_SRC_0, target}, {DNNL_ARG_SRC_1, correction_}, {DNNL_ARG_DST, target}});
    net.strm.wait();
  }
  // A collective that failed leaves the ranks out of step: the step cannot finish.
  static void Check(const Status& s) {
    if (!s.ok()) throw std::runtime_error("synchronised batch norm: " + s.ToString());
  }

  int self_, in_;
  int64_t channels_ = 0, per_channel_ = 0;
  dnnl::batch_normalization_forward::primitive_desc fwd_pd_;
  dnnl::primitive fwd_, inf_, bwd_, fwd_global_, add_;
  Param* scale_ = nullptr;
  Param* shift_ = nullptr;
  memory mean_, var_, running_mean_, running_var_, discard_, correction_, k1_, k2_;
  Converter dd_;
  DiffSink sink_;
};

// ---------------------------------------------------------------- ReLU

class ReluLayer final : public Layer {
 public:
  ReluLayer(Net& net, int self, int in_node) : self_(self), in_(in_node) {
    const memory::desc md = net.OutMd(in_node);
    dnnl::eltwise_forward::primitive_desc fwd_pd(
        {dnnl::prop_kind::forward_training, dnnl::algorithm::eltwise_relu, md, 0.f}, net.eng);
    fwd_ = dnnl::eltwise_forward(fwd_pd);
    dnnl::eltwise_backward::primitive_desc bwd_pd({dnnl::algorithm::eltwise_relu, md, md, 0.f}, net.eng, fwd_pd);
    net.Note(self, fwd_pd);
    net.Note(self, bwd_pd);
    bwd_ = dnnl::eltwise_backward(bwd_pd);
    net.SetOutput(self, fwd_pd.dst_desc());
    dd_.Init(fwd_pd.dst_desc(), bwd_pd.diff_dst_desc(), net.eng);
    net.InitSink(sink_, in_node, bwd_pd.diff_src_desc());
  }
  void Forward(Net& net, bool, int64_t) override {
    fwd_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_DST, net.node(self_).out}});
  }
  void Backward(Net& net) override {
    if (sink_.node < 0) return;
    bwd_.execute(net.strm, {{DNNL_ARG_SRC, net.Out(in_)},
                            {DNNL_ARG_DIFF_DST, dd_.Run(net.node(self_).diff, net.strm)},
                            {DNNL_ARG_DIFF_SRC, net.SinkTarget(sink_)}});
    net.Deliver(sink_);
  }

 private:
  int self_, in_;
  dnnl::primitive fwd_, bwd_;
  Converter dd_;
  DiffSink sink_;
};

// ---------------------------------------------------------------- pooling (max, average, global)

class PoolLayer final : public Layer {
 public:
  PoolLayer(Net& net, const LayerSpec& l, int self, int in_node) : self_(self), in_(in_node) {
    const memory::desc md = net.OutMd(in_node);
    const Dims src_dims = md.dims();
    const Shape out = net.shapes[static_cast<size_t>(self)];
    const Dims dst_dims{src_dims[0], out.c, out.h, out.w};
    Dims kernel{l.kernel, l.kernel}, strides{l.stride, l.stride}, pad{l.pad, l.pad};
    auto alg = dnnl::algorithm::pooling_max;
    if (l.type == LayerType::kAvgPool) alg = dnnl::algorithm::pooling_avg_include_padding;
    if (l.type == LayerType::kGlobalAvgPool) {
      alg = dnnl::algorithm::pooling_avg_exclude_padding;
      kernel = {src_dims[2], src_dims[3]};
      strides = kernel;
      pad = {0, 0};
    }
    dnnl::pooling_forward::primitive_desc fwd_pd(
        {dnnl::prop_kind::forward_training, alg, md, Any(dst_dims), strides, kernel, pad, pad}, net.eng);
    fwd_ = dnnl::pooling_forward(fwd_pd);
    // Gradients in the forward layouts; left to choose, oneDNN may pick a layout that only its
    // reference kernel handles (seen for global pooling: 50x slower).
    dnnl::pooling_backward::primitive_desc bwd_pd(
        {alg, md, fwd_pd.dst_desc(), strides, kernel, pad, pad}, net.eng, fwd_pd);
    if (IsReference(bwd_pd)) {
      bwd_pd = dnnl::pooling_backward::primitive_desc({alg, Any(src_dims), Any(dst_dims), strides, kernel, pad, pad},
                                                      net.eng, fwd_pd);
    }
    bwd_ = dnnl::pooling_backward(bwd_pd);
    net.Note(self, fwd_pd);
    net.Note(self, bwd_pd);
    if (alg == dnnl::algorithm::pooling_max) workspace_ = memory(fwd_pd.workspace_desc(), net.eng);
    net.SetOutput(self, fwd_pd.dst_desc());
    dd_.Init(fwd_pd.dst_desc(), bwd_pd.diff_dst_desc(), net.eng);
    net.InitSink(sink_, in_node, bwd_pd.diff_src_desc());
  }
  void Forward(Net& net, bool, int64_t) override {
    ArgMap args{{DNNL_ARG_SRC, net.Out(in_)}, {DNNL_ARG_DST, net.node(self_).out}};
    if (workspace_) args[DNNL_ARG_WORKSPACE] = workspace_;
    fwd_.execute(net.strm, args);
  }
  void Backward(Net& net) override {
    if (sink_.node < 0) return;
    ArgMap args{{DNNL_ARG_DIFF_DST, dd_.Run(net.node(self_).diff, net.strm)},
                {DNNL_ARG_DIFF_SRC, net.SinkTarget(sink_)}};
    if (workspace_) args[DNNL_ARG_WORKSPACE] = workspace_;
    bwd_.execute(net.strm, args);
    net.Deliver(sink_);
  }

 private:
  int self_, in_;
  dnnl::primitive fwd_, bwd_;
  memory workspace_;
  Converter dd_;
  DiffSink sink_;
};

// ---------------------------------------------------------------- residual add

class AddLayer final : public Layer {
 public:
  AddLayer(Net& net, int self, int a, int b) : self_(self), a_(a), b_(b) {
    const memory::desc md = net.OutMd(a);
    b_conv_.Init(net.OutMd(b), md, net.eng);
    dnnl::binary::primitive_desc pd({dnnl::algorithm::binary_add, md, md, md}, net.eng);
    net.Note(self, pd);
    fwd_ = dnnl::binary(pd);
    net.SetOutput(self, md);
    if (net.NeedsGrad(a)) to_a_.Init(md, net.OutMd(a), net.eng);
    if (net.NeedsGrad(b)) to_b_.Init(md, net.OutMd(b), net.eng);
  }
  void Forward(Net& net, bool, int64_t) override {
    fwd_.execute(net.strm, {{DNNL_ARG_SRC_0, net.Out(a_)},
                            {DNNL_ARG_SRC_1, b_conv_.Run(net.Out(b_), net.strm)},
                            {DNNL_ARG_DST, net.node(self_).out}});
  }
  void Backward(Net& net) override {
    const memory& diff = net.node(self_).diff;
    net.Give(a_, diff, to_a_);
    net.Give(b_, diff, to_b_);
  }

 private:
  int self_, a_, b_;
  dnnl::primitive fwd_;
  Converter b_conv_, to_a_, to_b_;
};

// ---------------------------------------------------------------- flatten

class FlattenLayer final : public Layer {
 public:
  FlattenLayer(Net& net, int self, int in_node) : self_(self), in_(in_node) {
    const memory::desc md = net.OutMd(in_node);
    Dims dims = md.dims();
    int64_t features = 1;
    for (size_t i = 1; i < dims.size(); ++i) features *= dims[i];
    const memory::desc flat({dims[0], features}, kF32, Tag::nc);
    plain_md_ = memory::desc(dims, kF32, dims.size() == 4 ? Tag::nchw : Tag::nc);
    Node& node = net.SetOutput(self, flat);
    out_view_ = memory(plain_md_, net.eng, node.out.get_data_handle());
    to_plain_ = dnnl::reorder(dnnl::reorder::primitive_desc(net.eng, md, net.eng, plain_md_));
    if (net.NeedsGrad(in_node)) {
      diff_view_ = memory(plain_md_, net.eng, node.diff.get_data_handle());
      back_.Init(plain_md_, md, net.eng);
    }
  }
  void Forward(Net& net, bool, int64_t) override {
    memory src = net.Out(in_);
    to_plain_.execute(net.strm, src, out_view_);
  }
  void Backward(Net& net) override {
    if (net.NeedsGrad(in_)) net.Give(in_, diff_view_, back_);
  }

 private:
  int self_, in_;
  memory::desc plain_md_;
  memory out_view_, diff_view_;
  dnnl::reorder to_plain_;
  Converter back_;
};

// ---------------------------------------------------------------- dropout

class DropoutLayer final : public Layer {
 public:
  DropoutLayer(Net& net, const LayerSpec& l, int self, int in_node, uint64_t seed)
      : self_(self), in_(in_node), p_(l.p), seed_(seed) {
    const memory::desc md = net.OutMd(in_node);
    net.SetOutput(self, md);
    mask_ = memory(md, net.eng);
    // The mask is drawn in logical order (N, C, H, W), whatever layout oneDNN chose for the
    // activations (channel-blocked ones differ from machine to machine): the same (seed, step)
    // drops the same units here, on another CPU and on the CUDA backend.
    const Dims dims = md.dims();
    n_values_ = 1;
    for (auto d : dims) n_values_ *= static_cast<uint64_t>(d);
    const Tag plain = dims.size() == 4 ? Tag::nchw : dims.size() == 2 ? Tag::nc : Tag::undef;
    if (plain != Tag::undef) {
      const memory::desc plain_md(dims, kF32, plain);
      to_layout_.Init(plain_md, md, net.eng);
      if (to_layout_.needed) {
        plain_mask_ = memory(plain_md, net.eng);
        mask_ = to_layout_.out;  // the reorder writes the mask in place
      }
    }
    std::memset(Data(mask_), 0, md.get_size());  // padding of blocked layouts included
    net.InitSink(sink_, in_node, md);
  }
  void Forward(Net& net, bool training, int64_t step) override {
    net.strm.wait();
    const float* in = Data(net.Out(in_));
    float* out = Data(net.node(self_).out);
    float* mask = Data(mask_);
    const size_t n = Floats(mask_);
    if (!training || p_ == 0) {
      std::fill(mask, mask + n, 1.f);
    } else {
      // One mask per step: the same (seed, step) always drops the same units.
      SplitMix64 rng(MixSeed(seed_, static_cast<uint64_t>(step)));
      // This rank's rows of the global batch's mask (first_sample: see NetworkOptions).
      rng.Skip(static_cast<uint64_t>(net.opt.first_sample) * (n_values_ / static_cast<uint64_t>(net.opt.batch)));
      const auto keep = static_cast<float>(1.0 / (1.0 - p_));
      const bool reorder = to_layout_.needed;
      float* drawn = reorder ? Data(plain_mask_) : mask;
      const size_t count = reorder ? Floats(plain_mask_) : n;
      for (size_t i = 0; i < count; ++i) drawn[i] = Uniform01(rng) < p_ ? 0.f : keep;
      if (reorder) {
        // Into the activations' layout; padding (blocked layouts) is zero on both sides.
        to_layout_.Run(plain_mask_, net.strm);
        net.strm.wait();
      }
    }
    for (size_t i = 0; i < n; ++i) out[i] = in[i] * mask[i];
  }
  void Backward(Net& net) override {
    if (sink_.node < 0) return;
    net.strm.wait();
    const float* diff = Data(net.node(self_).diff);
    float* dst = Data(net.SinkTarget(sink_));
    const float* mask = Data(mask_);
    const size_t n = Floats(mask_);
    for (size_t i = 0; i < n; ++i) dst[i] = diff[i] * mask[i];
    net.Deliver(sink_);
  }

 private:
  int self_, in_;
  double p_;
  uint64_t seed_;
  uint64_t n_values_ = 0;       // N x C x H x W (logical)
  memory mask_;                 // in the activations' layout
  memory plain_mask_;           // N x C x H x W or N x C, drawn here first when that is not the layout
  Converter to_layout_;
  DiffSink sink_;
};

// Stable softmax cross-entropy with label smoothing over rows of `logits`; writes d loss / d
// logits (already divided by `rows_for_grad`) when `grad` is not null.
BatchStats SoftmaxCrossEntropy(const float* logits, int classes, std::span<const int32_t> labels, int rows,
                               double smoothing, float* grad, int rows_for_grad) {
  BatchStats stats;
  std::vector<double> p(static_cast<size_t>(classes));
  for (int r = 0; r < rows; ++r) {
    const float* z = logits + static_cast<ptrdiff_t>(r) * classes;
    const int y = labels[static_cast<size_t>(r)];
    double zmax = z[0];
    for (int k = 1; k < classes; ++k) zmax = std::max(zmax, static_cast<double>(z[k]));
    double sum = 0, zsum = 0;
    for (int k = 0; k < classes; ++k) {
      p[static_cast<size_t>(k)] = std::exp(z[k] - zmax);
      sum += p[static_cast<size_t>(k)];
      zsum += z[k];
    }
    const double lse = zmax + std::log(sum);
    const double off = smoothing / classes, on = 1.0 - smoothing + off;
    stats.loss_sum += lse - (on - off) * z[y] - off * zsum;
    const int rank = LabelRank(std::span<const float>(z, static_cast<size_t>(classes)), y);
    stats.top1 += rank < 1 ? 1 : 0;
    stats.top5 += rank < 5 ? 1 : 0;
    if (grad) {
      float* g = grad + static_cast<ptrdiff_t>(r) * classes;
      for (int k = 0; k < classes; ++k) {
        const double q = k == y ? on : off;
        g[k] = static_cast<float>((p[static_cast<size_t>(k)] / sum - q) / rows_for_grad);
      }
    }
  }
  stats.count = rows;
  return stats;
}

}  // namespace

struct CpuNetwork::Impl {
  Net net;

  Status Normalise(const prefetch::Batch& b) {
    auto bytes = std::span<std::byte>(static_cast<std::byte*>(net.input.get_data_handle()),
                                      net.input.get_desc().get_size());
    const int w = net.opt.image_size, h = net.opt.height();
    const size_t used = augment::NormalizedBytes(b.size, w, h, augment::DType::kFloat32);
    STOKE_RETURN_IF_ERROR(augment::Normalize(b.images, b.size, w, h, net.opt.normalize, bytes.first(used)));
    // A short (evaluation) batch: the remaining rows are zeros and their outputs are ignored.
    std::memset(bytes.data() + used, 0, bytes.size() - used);
    return OkStatus();
  }

  void Forward(bool training, int64_t step) {
    net.phase = "forward";
    for (size_t i = 0; i < net.layers.size(); ++i) {
      net.running = static_cast<int>(i);
      net.layers[i]->Forward(net, training, step);
    }
    net.running = -1;
    net.logits_conv.Run(net.nodes.back().out, net.strm);
    net.strm.wait();
  }
  const float* Logits() const {
    return Data(net.logits_conv.needed ? net.logits_conv.out : net.nodes.back().out);
  }

  void SaveBuffers() {
    net.buffers_saved.clear();
    for (const auto& b : net.buffers) {
      net.buffers_saved.insert(net.buffers_saved.end(), Data(b.value), Data(b.value) + Floats(b.value));
    }
  }
  void RestoreBuffers() {
    size_t at = 0;
    for (auto& b : net.buffers) {
      std::copy_n(net.buffers_saved.data() + at, Floats(b.value), Data(b.value));
      at += Floats(b.value);
    }
  }

  BatchStats ForwardBackward(std::span<const int32_t> labels, int64_t step) {
    Forward(true, step);
    const int n = net.opt.batch;
    BatchStats stats = SoftmaxCrossEntropy(Logits(), net.opt.model.classes, labels, n, net.opt.label_smoothing,
                                           Data(net.loss_diff), n);
    for (auto& node : net.nodes) node.writes = 0;
    net.Give(static_cast<int>(net.nodes.size()) - 1, net.loss_diff, net.loss_diff_conv);
    net.phase = "backward";
    for (size_t i = net.layers.size(); i-- > 0;) {
      if (!net.needs_grad[i]) continue;  // nothing upstream of it learns
      net.running = static_cast<int>(i);
      Node& node = net.nodes[i];
      if (node.writes == 0) std::memset(node.diff.get_data_handle(), 0, node.diff.get_desc().get_size());
      net.layers[i]->Backward(net);
      if (net.Parallel() && !net.layer_slices[i].empty()) {
        net.strm.wait();  // the layer's gradients are final: their bucket may start averaging
        for (int slice : net.layer_slices[i]) net.sync->GradientReady(slice);
      }
    }
    net.running = -1;
    net.strm.wait();
    return stats;
  }

  void Update(float lr, const SgdOptions& sgd) {
    const auto mu = static_cast<float>(sgd.momentum);
    for (auto& p : net.params) {
      const float wd = (p->decay || sgd.decay_bn_and_bias) ? static_cast<float>(sgd.weight_decay) : 0.f;
      float* w = Data(p->value);
      const float* g = Data(p->grad);
      float* m = Data(p->momentum);
      const size_t count = Floats(p->value);
      // Layer-wise adaptation for weight tensors (padding, where a layout has it, is zero in both).
      float r = 1.f;
      if (sgd.adaptation != LayerAdaptation::kNone && p->decay) {
        double ww = 0, gg = 0;
        for (size_t i = 0; i < count; ++i) {
          ww += static_cast<double>(w[i]) * w[i];
          gg += static_cast<double>(g[i]) * g[i];
        }
        r = TrustRatio(sgd, std::sqrt(ww), std::sqrt(gg), wd, lr);
      }
      if (sgd.nesterov) {
        for (size_t i = 0; i < count; ++i) {
          const float gi = r * (g[i] + wd * w[i]);
          m[i] = mu * m[i] + gi;
          w[i] -= lr * (gi + mu * m[i]);
        }
      } else {
        for (size_t i = 0; i < count; ++i) {
          m[i] = mu * m[i] + r * (g[i] + wd * w[i]);
          w[i] -= lr * m[i];
        }
      }
    }
  }

  // Data-parallel end of a step: this rank's statistics ride in the tail of the gradient buffer, so
  // one round of averaging gives every rank the mean gradient and the global statistics.
  Result<BatchStats> FinishParallelStep(const BatchStats& local) {
    float* tail = net.Tail();
    std::fill_n(tail, kTailFloats, 0.f);
    tail[0] = static_cast<float>(local.loss_sum);
    tail[1] = static_cast<float>(local.top1);
    tail[2] = static_cast<float>(local.top5);
    tail[3] = static_cast<float>(local.count);
    net.sync->GradientReady(static_cast<int>(net.grad_slices.size()) - 1);
    STOKE_RETURN_IF_ERROR(net.sync->FinishGradients());
    const double world = net.sync->world();
    BatchStats global;
    global.loss_sum = tail[0] * world;
    global.top1 = std::llround(tail[1] * world);
    global.top5 = std::llround(tail[2] * world);
    global.count = std::llround(tail[3] * world);
    // Every rank holds the same averages, so every rank takes the same decision.
    bool finite = std::isfinite(global.loss_sum);
    const float* g = net.grad_flat.data.get();
    const size_t n = net.grad_slices.back().offset;
    for (size_t i = 0; finite && i < n; i += 4096) {
      float acc = 0;
      const size_t end = std::min(n, i + 4096);
      for (size_t k = i; k < end; ++k) acc += g[k] * 0.f;  // NaN or inf anywhere makes it NaN
      finite = acc == 0.f;
    }
    if (!finite) {
      global.skipped = 1;
      // Backward rewrites every gradient, but not the padding between slices: clear it all.
      std::memset(net.grad_flat.data.get(), 0, net.grad_flat.size * sizeof(float));
    }
    return global;
  }

  // Where a failure happened: "layer 3 ('relu3', relu), backward" or the operation alone.
  std::string Where(std::string_view what) const {
    if (net.running < 0) return std::string(what);
    const LayerSpec& l = net.opt.model.layers[static_cast<size_t>(net.running)];
    return fmt::format("{}: layer {} ('{}', {}), {}", what, net.running, l.name, LayerTypeName(l.type), net.phase);
  }

  // Runs `fn` (which returns a Status or Result), turning what oneDNN, the allocator or anything
  // else throws into an error that names the operation, the layer and the batch: no exception
  // leaves the backend.
  template <typename F>
  auto Guard(std::string_view what, F&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const dnnl::error& e) {
      const std::string where = Where(what);
      net.running = -1;
      if (e.status == dnnl_out_of_memory) {
        return ResourceExhaustedError(fmt::format("cpu backend: {}: out of memory (batch {}): {}", where,
                                                  net.opt.batch, e.what()));
      }
      return InternalError(fmt::format("cpu backend: {}: oneDNN: {} (status {})", where, e.what(),
                                       static_cast<int>(e.status)));
    } catch (const std::bad_alloc&) {
      const std::string where = Where(what);
      net.running = -1;
      return ResourceExhaustedError(
          fmt::format("cpu backend: {}: out of memory (batch {}; lower data.batch_size)", where, net.opt.batch));
    } catch (const std::exception& e) {
      const std::string where = Where(what);
      net.running = -1;
      return InternalError(fmt::format("cpu backend: {}: {}", where, e.what()));
    }
  }
};

CpuNetwork::CpuNetwork(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuNetwork::~CpuNetwork() = default;

const NetworkOptions& CpuNetwork::options() const { return impl_->net.opt; }

namespace {

// A floor on what the network's activations and their gradients take: every output once, and again
// for its gradient where the backward pass needs one.
double ActivationBytes(const NetworkOptions& o, const std::vector<Shape>& shapes, const std::vector<bool>& needs) {
  double floats = 3.0 * o.image_size * o.height();
  for (size_t i = 0; i < shapes.size(); ++i) {
    floats += static_cast<double>(shapes[i].size()) * (needs[i] ? 2 : 1);
  }
  return floats * o.batch * sizeof(float);
}

}  // namespace

Result<std::unique_ptr<CpuNetwork>> CpuNetwork::Create(NetworkOptions options) {
  if (options.batch < 1) return InvalidArgumentError(fmt::format("batch must be >= 1, got {}", options.batch));
  if (options.image_size < 1 || options.image_height < 0) {
    return InvalidArgumentError(
        fmt::format("image size must be >= 1, got {}x{}", options.image_size, options.height()));
  }
  if (!(options.label_smoothing >= 0 && options.label_smoothing < 1)) {
    return InvalidArgumentError(fmt::format("label smoothing must be in [0, 1), got {}", options.label_smoothing));
  }
  if (options.normalize.dtype != augment::DType::kFloat32 || options.precision != Precision::kFloat32) {
    return InvalidArgumentError("the CPU backend trains in float32; set the input dtype to float32");
  }
  const Shape input{3, options.height(), options.image_size};
  STOKE_ASSIGN_OR_RETURN(auto shapes, ResolveModel(options.model, input));
  std::vector<bool> needs = LayersNeedingGradient(options.model);
  // Weights, their gradients and the optimizer's momentum: three floats a parameter.
  const double parameter_bytes = 3.0 * static_cast<double>(CountParameters(options.model, shapes, input)) * sizeof(float);
  const double activation_bytes = ActivationBytes(options, shapes, needs);
  const double have_bytes = static_cast<double>(AvailableMemoryBytes());
  if (have_bytes > 0 && activation_bytes + parameter_bytes > have_bytes) {
    return ResourceExhaustedError(fmt::format(
        "cpu backend: batch {} at {}x{} needs at least {:.1f} GiB for activations and gradients and {:.1f} GiB for "
        "the parameters, their gradients and momentum; {:.1f} GiB of memory is available (lower {})",
        options.batch, options.image_size, options.height(), activation_bytes / (1 << 30),
        parameter_bytes / (1 << 30), have_bytes / (1 << 30),
        activation_bytes >= parameter_bytes ? "data.batch_size" : "the model's widths"));
  }
  // 0 (a network made without CreateNetwork): OpenMP's own default.
  if (options.threads > 0) omp_set_num_threads(options.threads);

  auto impl = std::make_unique<Impl>();
  Net& net = impl->net;
  net.opt = std::move(options);
  net.shapes = std::move(shapes);
  net.needs_grad = std::move(needs);
  net.phase = "build";
  const ModelSpec& model = net.opt.model;
  const int n = net.opt.batch;
  Status built = impl->Guard("building the model", [&]() -> Status {
    const Tag input_tag = net.opt.normalize.layout == augment::Layout::kNHWC ? Tag::nhwc : Tag::nchw;
    net.input = memory(memory::desc({n, 3, input.h, input.w}, kF32, input_tag), net.eng);
    std::map<std::string, int> index{{"input", -1}};
    for (size_t i = 0; i < model.layers.size(); ++i) index[model.layers[i].name] = static_cast<int>(i);
    net.nodes.resize(model.layers.size());
    const std::vector<std::vector<int>> readers = LayerReaders(model);
    for (size_t i = 0; i < readers.size(); ++i) net.nodes[i].consumers = static_cast<int>(readers[i].size());
    for (size_t i = 0; i < model.layers.size(); ++i) {
      const LayerSpec& l = model.layers[i];
      const int self = static_cast<int>(i);
      net.running = self;
      const int in = index[l.inputs[0]];
      const uint64_t seed = MixSeed(net.opt.seed, 0x6c61796572ull, i);
      std::unique_ptr<Layer> layer;
      switch (l.type) {
        case LayerType::kConv:
        case LayerType::kLinear:
          layer = std::make_unique<WeightedLayer>(net, l, self, in, seed);
          break;
        case LayerType::kBatchNorm:
          layer = std::make_unique<BatchNormLayer>(net, l, self, in);
          break;
        case LayerType::kRelu:
          layer = std::make_unique<ReluLayer>(net, self, in);
          break;
        case LayerType::kMaxPool:
        case LayerType::kAvgPool:
        case LayerType::kGlobalAvgPool:
          layer = std::make_unique<PoolLayer>(net, l, self, in);
          break;
        case LayerType::kAdd:
          layer = std::make_unique<AddLayer>(net, self, in, index[l.inputs[1]]);
          break;
        case LayerType::kFlatten:
          layer = std::make_unique<FlattenLayer>(net, self, in);
          break;
        case LayerType::kDropout:
          layer = std::make_unique<DropoutLayer>(net, l, self, in, seed);
          break;
      }
      net.layers.push_back(std::move(layer));
    }
    net.running = -1;
    const memory::desc plain({n, model.classes}, kF32, Tag::nc);
    net.logits_conv.Init(net.nodes.back().out.get_desc(), plain, net.eng);
    net.loss_diff = memory(plain, net.eng);
    net.loss_diff_conv.Init(plain, net.nodes.back().out.get_desc(), net.eng);
    net.LayOutGradients();
    return OkStatus();
  });
  STOKE_RETURN_IF_ERROR(built);
  if (!net.reference_kernels.empty()) {
    STOKE_LOG(WARN, "oneDNN uses slow reference kernels for {} primitive(s): {}", net.reference_kernels.size(),
              fmt::join(net.reference_kernels, "; "));
  }
  return std::unique_ptr<CpuNetwork>(new CpuNetwork(std::move(impl)));
}

Result<BatchStats> CpuNetwork::TrainStep(const prefetch::Batch& batch, float lr, const SgdOptions& sgd, int64_t step) {
  STOKE_RETURN_IF_ERROR(CheckBatch(impl_->net.opt, batch, true));
  return impl_->Guard(fmt::format("training step {}", step), [&]() -> Result<BatchStats> {
    STOKE_RETURN_IF_ERROR(impl_->Normalise(batch));
    if (impl_->net.Parallel()) impl_->SaveBuffers();  // only these steps can be skipped
    BatchStats stats = impl_->ForwardBackward(batch.labels, step);
    if (impl_->net.Parallel()) {
      STOKE_ASSIGN_OR_RETURN(stats, impl_->FinishParallelStep(stats));
      if (stats.skipped == 0) {
        impl_->Update(lr, sgd);
      } else {
        impl_->RestoreBuffers();
      }
      return stats;
    }
    if (!std::isfinite(stats.loss_sum)) {
      return InvalidArgumentError(
          fmt::format("the loss is not finite at step {} (learning rate {} too high?)", step, lr));
    }
    impl_->Update(lr, sgd);
    return stats;
  });
}

Result<BatchStats> CpuNetwork::Evaluate(const prefetch::Batch& batch) {
  STOKE_RETURN_IF_ERROR(CheckBatch(impl_->net.opt, batch, false));
  return impl_->Guard("evaluation", [&]() -> Result<BatchStats> {
    STOKE_RETURN_IF_ERROR(impl_->Normalise(batch));
    impl_->Forward(false, 0);
    return SoftmaxCrossEntropy(impl_->Logits(), impl_->net.opt.model.classes, batch.labels, batch.size,
                               impl_->net.opt.label_smoothing, nullptr, 1);
  });
}

Result<BatchStats> CpuNetwork::ForwardBackward(std::span<const float> input, std::span<const int32_t> labels,
                                               int64_t step) {
  Net& net = impl_->net;
  const int n = net.opt.batch, w = net.opt.image_size, h = net.opt.height();
  if (input.size() != static_cast<size_t>(n) * 3 * h * w || labels.size() != static_cast<size_t>(n)) {
    return InvalidArgumentError("ForwardBackward: input or labels do not match the batch shape");
  }
  return impl_->Guard("forward and backward", [&]() -> Result<BatchStats> {
    std::vector<float> values(input.begin(), input.end());
    net.FromPlain(values, {n, 3, h, w}, Tag::nchw, net.input);
    return impl_->ForwardBackward(labels, step);
  });
}

const std::vector<std::string>& CpuNetwork::ReferenceKernels() const { return impl_->net.reference_kernels; }

Result<std::vector<NamedTensor>> CpuNetwork::Gradients() const {
  Net& net = impl_->net;
  return impl_->Guard("reading the gradients", [&]() -> Result<std::vector<NamedTensor>> {
    std::vector<NamedTensor> out;
    for (const auto& p : net.params) out.push_back({p->name, p->dims, net.ToPlain(p->grad, p->dims, p->plain)});
    return out;
  });
}

Result<std::vector<NamedTensor>> CpuNetwork::State() const {
  Net& net = impl_->net;
  return impl_->Guard("reading the state", [&]() -> Result<std::vector<NamedTensor>> {
    std::vector<NamedTensor> out;
    for (const auto& p : net.params) out.push_back({p->name, p->dims, net.ToPlain(p->value, p->dims, p->plain)});
    for (const auto& b : net.buffers) {
      const int64_t size = static_cast<int64_t>(Floats(b.value));
      out.push_back({b.name, {size}, std::vector<float>(Data(b.value), Data(b.value) + size)});
    }
    for (const auto& p : net.params) {
      out.push_back({p->name + ".momentum", p->dims, net.ToPlain(p->momentum, p->dims, p->plain)});
    }
    return out;
  });
}

Status CpuNetwork::LoadState(const std::vector<NamedTensor>& state) {
  Net& net = impl_->net;
  // Check everything before changing anything.
  std::vector<std::pair<std::string, std::vector<int64_t>>> wanted;
  for (const auto& p : net.params) wanted.emplace_back(p->name, std::vector<int64_t>(p->dims.begin(), p->dims.end()));
  for (const auto& p : net.params) {
    wanted.emplace_back(p->name + ".momentum", std::vector<int64_t>(p->dims.begin(), p->dims.end()));
  }
  for (const auto& b : net.buffers) wanted.emplace_back(b.name, std::vector<int64_t>{static_cast<int64_t>(Floats(b.value))});
  STOKE_ASSIGN_OR_RETURN(auto found, FindState(state, wanted, /*exact=*/true));
  return impl_->Guard("loading the state", [&]() -> Status {
    size_t k = 0;
    for (auto& p : net.params) net.FromPlain(found[k++]->values, p->dims, p->plain, p->value);
    for (auto& p : net.params) net.FromPlain(found[k++]->values, p->dims, p->plain, p->momentum);
    for (auto& b : net.buffers) {
      const auto& v = found[k++]->values;
      std::copy(v.begin(), v.end(), Data(b.value));
    }
    return OkStatus();
  });
}

Status CpuNetwork::SetStepSync(StepSync* sync) {
  Net& net = impl_->net;
  if (sync != nullptr && sync->world() > 1) {
    STOKE_RETURN_IF_ERROR(sync->AttachGradients(net.grad_flat.span(), net.grad_slices));
  }
  net.sync = sync;
  return OkStatus();
}

Status CpuNetwork::AverageRunningStats() {
  Net& net = impl_->net;
  // Synchronised batch norm keeps the running statistics identical on every rank already.
  if (!net.Parallel() || net.buffers.empty() || net.SyncBatchNorm()) return OkStatus();
  std::vector<float> all;
  for (const auto& b : net.buffers) all.insert(all.end(), Data(b.value), Data(b.value) + Floats(b.value));
  STOKE_RETURN_IF_ERROR(net.sync->AverageOverRanks(all));
  size_t k = 0;
  for (auto& b : net.buffers) {
    std::copy_n(all.begin() + static_cast<ptrdiff_t>(k), Floats(b.value), Data(b.value));
    k += Floats(b.value);
  }
  return OkStatus();
}

std::vector<float> CpuNetwork::LastLogits() const {
  const float* z = impl_->Logits();
  return std::vector<float>(z, z + static_cast<size_t>(impl_->net.opt.batch) * impl_->net.opt.model.classes);
}

}  // namespace stoke::train
