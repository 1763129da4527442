#include "train/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <type_traits>

#include <fmt/format.h>

#include "augment/transform.h"
#include "common/file_util.h"
#include "common/limits.h"
#include "common/logging.h"

namespace stoke::train {
namespace {

int Line(const YAML::Node& node) { return node.Mark().line >= 0 ? node.Mark().line + 1 : 0; }

// Where each YAML document starts, and where each quoted string does.
class DocumentOutline : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> marks;
  std::vector<YAML::Mark> quoted;
  void OnDocumentStart(const YAML::Mark& mark) override { marks.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  // Plain scalars carry the tag "?", quoted and block ones "!".
  void OnScalar(const YAML::Mark& mark, const std::string& tag, YAML::anchor_t, const std::string&) override {
    if (tag == "!") quoted.push_back(mark);
  }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// What the sections of one config share: its file's name, who wrote it, and where its keys are.
struct ParseContext {
  const std::string& source;
  ConfigOrigin origin;
  std::map<std::string, int, std::less<>>& lines;  // TrainConfig::lines
};

// One mapping of the config: reads keys with type and range checks and remembers which keys it
// read, so Finish() can name the unknown ones.
class Section {
 public:
  Section(const YAML::Node& node, std::string path, ParseContext& context)
      : node_(node), path_(std::move(path)), context_(context) {}

  // A mapping (or nothing), each key given once: YAML readers keep one of two equal keys
  // silently, so a key appended to override another would be ignored.
  Status Check() const {
    if (node_.IsNull()) return OkStatus();
    if (!node_.IsMap()) return Error(node_, path_, "expected a mapping of keys to values");
    std::map<std::string, int> seen;
    for (const auto& kv : node_) {
      const std::string key = kv.first.Scalar();
      if (auto [it, fresh] = seen.emplace(key, Line(kv.first)); !fresh) {
        return Error(kv.first, Path(key), fmt::format("given twice (first on line {}); keep one", it->second));
      }
    }
    return OkStatus();
  }

  // Refuses a key of `family` that `read` does not hold: a key of another kind of layer, schedule
  // or optimizer ({type: relu, kernel: 2}, {type: cosine, milestones: [30]}) was meant for something
  // this config does not do, and ignoring it would train what nobody asked for. `why` ends the
  // message: "does not apply to <why>". A key whose value is its default (`at_default`) is only
  // warned of: stoke before 2026-12-04 wrote every key into run_dir/config.yaml and --print-config,
  // and those files still read. Stored configs may hold such keys (ConfigOrigin).
  Status RefuseUnread(std::span<const std::string_view> family, const std::vector<std::string>& read,
                      std::string_view why, const std::function<bool(std::string_view)>& at_default = {}) const {
    if (!node_.IsMap() || context_.origin == ConfigOrigin::kStored) return OkStatus();
    std::vector<std::string> ignored;
    int line = 0;
    for (const auto& kv : node_) {
      const std::string key = kv.first.Scalar();
      if (std::find(family.begin(), family.end(), key) == family.end() ||
          std::find(read.begin(), read.end(), key) != read.end()) {
        continue;
      }
      if (!at_default || !at_default(key)) return Error(kv.first, Path(key), fmt::format("does not apply to {}", why));
      ignored.push_back(Path(key));
      if (line == 0) line = Line(kv.first);
    }
    if (!ignored.empty()) {
      const bool one = ignored.size() == 1;
      STOKE_LOG(WARN, "{}:{}: {}: ignored, at {}: {} not apply to {}; remove {}", context_.source, line,
                fmt::join(ignored, ", "), one ? "its default" : "their defaults", one ? "it does" : "they do", why,
                one ? "it" : "them");
    }
    return OkStatus();
  }
  ConfigOrigin origin() const { return context_.origin; }
  ParseContext& context() const { return context_; }

  // An error about this mapping as a whole (a rule between its keys).
  Status ErrorHere(const std::string& what) const { return Error(node_, path_, what); }
  Status Error(const YAML::Node& at, const std::string& path, const std::string& what) const {
    return InvalidArgumentError(fmt::format("{}:{}: {}: {}", context_.source, Line(at), path, what));
  }
  std::string Path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  // Looks up `key`; false when absent (the default stays).
  bool Has(const std::string& key, YAML::Node* out) {
    YAML::Node n = Find(key);
    if (!n.IsDefined() || n.IsNull()) return false;
    *out = n;
    return true;
  }

  // Looks up the value of `key`; false when absent (the default stays). A key given without a
  // value (`lr:` or `lr: ~`) is refused, not read as the default: a value deleted by mistake, or
  // one a template left blank, would otherwise train with a number nobody chose.
  Result<bool> Value(const std::string& key, YAML::Node* out) {
    YAML::Node n = Find(key);
    if (!n.IsDefined()) return false;
    if (n.IsNull()) {
      // The key's line: an empty value's mark is where the next token starts.
      YAML::Node at = n;
      for (const auto& kv : node_) {
        if (kv.first.Scalar() == key) at = kv.first;
      }
      return Error(at, Path(key), "no value; give one, or remove the key for its default");
    }
    *out = n;
    return true;
  }

  template <typename T>
  Status Number(const std::string& key, T* out, double lo, double hi, bool hi_open = false) {
    YAML::Node n;
    STOKE_ASSIGN_OR_RETURN(const bool given, Value(key, &n));
    if (!given) return OkStatus();
    STOKE_RETURN_IF_ERROR(ScalarAs(n, Path(key), out, lo, hi, hi_open));
    return OkStatus();
  }

  template <typename T>
  Status ScalarAs(const YAML::Node& n, const std::string& path, T* out, double lo, double hi, bool hi_open) const {
    constexpr bool integral = std::is_integral_v<T>;
    constexpr double kMax = std::numeric_limits<double>::max();
    const std::string kind = integral ? "an integer" : "a number";
    const std::string range = lo == -kMax && hi == kMax ? fmt::format("any finite {}", integral ? "integer" : "number")
                              : hi == kMax              ? fmt::format("{} >= {} (finite)", kind, lo)
                                           : fmt::format("{} in [{}, {}{}", kind, lo, hi, hi_open ? ")" : "]");
    // Integers are read as int64 and checked before narrowing to T: 4294967304 is not an int's 8.
    std::conditional_t<integral, int64_t, T> value{};
    try {
      if (!n.IsScalar()) throw YAML::Exception(n.Mark(), "not a scalar");
      if constexpr (integral) {
        // Decimal only: yaml-cpp reads 010 as octal 8 and 0x10 as 16, where a config means 10.
        const std::string& text = n.Scalar();
        const size_t digits = text.starts_with('-') || text.starts_with('+') ? 1 : 0;
        const bool decimal = text.size() > digits && text.find_first_not_of("0123456789", digits) == std::string::npos &&
                             !(text.size() > digits + 1 && text[digits] == '0');
        if (!decimal) throw YAML::Exception(n.Mark(), "not a decimal integer");
      }
      value = n.as<decltype(value)>();
      if constexpr (!integral) {
        // Past a double's range yaml-cpp gives 0 or inf without a word: 1e-400 is not a rate of 0.
        const std::string& text = n.Scalar();
        char* end = nullptr;
        errno = 0;
        std::strtod(text.c_str(), &end);
        if (errno == ERANGE && end == text.c_str() + text.size()) {
          return Error(n, path, fmt::format("{} is beyond what a double holds; expected {}", text, range));
        }
      }
    } catch (const YAML::Exception&) {
      if (n.IsNull()) return Error(n, path, fmt::format("no value; expected {}", range));
      return Error(n, path, fmt::format("'{}' is not {}; expected {}", n.IsScalar() ? n.Scalar() : "(a list or map)",
                                        integral ? "an integer" : "a number", range));
    }
    const auto v = static_cast<double>(value);
    if (!(v >= lo && (hi_open ? v < hi : v <= hi))) {
      return Error(n, path, fmt::format("{} is out of range; expected {}", n.Scalar(), range));
    }
    *out = static_cast<T>(value);
    return OkStatus();
  }

  Status Bool(const std::string& key, bool* out) {
    YAML::Node n;
    STOKE_ASSIGN_OR_RETURN(const bool given, Value(key, &n));
    if (!given) return OkStatus();
    try {
      if (!n.IsScalar()) throw YAML::Exception(n.Mark(), "not a scalar");
      *out = n.as<bool>();
    } catch (const YAML::Exception&) {
      return Error(n, Path(key), fmt::format("'{}' is not a boolean; expected true or false",
                                             n.IsScalar() ? n.Scalar() : "(a list or map)"));
    }
    return OkStatus();
  }

  Status String(const std::string& key, std::string* out, const std::vector<std::string>& allowed = {}) {
    YAML::Node n;
    STOKE_ASSIGN_OR_RETURN(const bool given, Value(key, &n));
    if (!given) return OkStatus();
    if (!n.IsScalar()) return Error(n, Path(key), "expected a string");
    // A control character in a path or a name is a slip ("\t" typed for a folder \t...), and a NUL
    // cut every message about it short.
    const std::string& text = n.Scalar();
    if (auto c = std::find_if(text.begin(), text.end(), [](char ch) { return ch >= 0 && ch < 0x20; });
        context_.origin == ConfigOrigin::kWritten && (c != text.end() || text.find('\x7f') != std::string::npos)) {
      return Error(n, Path(key), fmt::format("holds the control character 0x{:02X}; expected printable text",
                                             c != text.end() ? static_cast<unsigned char>(*c) : 0x7fu));
    }
    if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), n.Scalar()) == allowed.end()) {
      return Error(n, Path(key), fmt::format("'{}' is not allowed; expected one of: {}", n.Scalar(),
                                             fmt::join(allowed, ", ")));
    }
    *out = n.Scalar();
    return OkStatus();
  }

  template <typename T>
  Status List(const std::string& key, std::vector<T>* out, size_t min_len, size_t max_len, double lo, double hi,
              bool hi_open = false) {
    YAML::Node n;
    STOKE_ASSIGN_OR_RETURN(const bool given, Value(key, &n));
    if (!given) return OkStatus();
    if (!n.IsSequence() || n.size() < min_len || n.size() > max_len) {
      return Error(n, Path(key), min_len == max_len ? fmt::format("expected a list of {} numbers", min_len)
                                                    : fmt::format("expected a list of {} to {} numbers", min_len, max_len));
    }
    std::vector<T> values(n.size());
    for (size_t i = 0; i < n.size(); ++i) {
      STOKE_RETURN_IF_ERROR(ScalarAs(n[i], fmt::format("{}[{}]", Path(key), i), &values[i], lo, hi, hi_open));
    }
    *out = std::move(values);
    return OkStatus();
  }

  Result<Section> Sub(const std::string& key) {
    YAML::Node n;
    Has(key, &n);
    Section s(n, Path(key), context_);
    STOKE_RETURN_IF_ERROR(s.Check());
    return s;
  }

  Status Finish() const {
    if (!node_.IsMap()) return OkStatus();
    for (const auto& kv : node_) {
      const std::string key = kv.first.Scalar();
      if (key == "<<") {
        // yaml-cpp keeps a merge key as a plain key: its keys would be dropped unread.
        return Error(kv.first, Path(key), "a YAML merge key, which configs do not expand; write its keys out here");
      }
      if (!keys_.count(key)) {
        return Error(kv.first, Path(key), fmt::format("unknown key; expected one of: {}", fmt::join(keys_, ", ")));
      }
    }
    return OkStatus();
  }

  const YAML::Node& node() const { return node_; }

 private:
  // `key`'s node (undefined when absent), noted as a key this section reads, and its line.
  YAML::Node Find(const std::string& key) {
    keys_.insert(key);
    if (!node_.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    for (const auto& kv : node_) {
      if (kv.first.Scalar() == key) context_.lines[Path(key)] = Line(kv.first);
    }
    return node_[key];
  }

  YAML::Node node_;
  std::string path_;
  ParseContext& context_;
  std::set<std::string> keys_;
};

constexpr double kInf = std::numeric_limits<double>::max();

// The keys that only some shuffles, schedule types and optimizer types read, and which of them
// each one reads (ConfigToYaml writes those alone).
constexpr std::string_view kBlockKeys[] = {"block_size", "window_blocks"};
constexpr std::string_view kScheduleKeys[] = {"step_epochs", "milestones", "gamma", "min_lr"};
std::vector<std::string> ScheduleKeys(const std::string& type) {
  if (type == "step") return {"step_epochs", "gamma"};
  if (type == "multistep") return {"milestones", "gamma"};
  if (type == "cosine") return {"min_lr"};
  return {};
}
constexpr std::string_view kAdaptationKeys[] = {"trust_coefficient", "clip", "eps"};
std::vector<std::string> OptimizerKeys(LayerAdaptation adaptation) {
  switch (adaptation) {
    case LayerAdaptation::kLars:
      return {"trust_coefficient", "eps"};
    case LayerAdaptation::kLarc:
      return {"trust_coefficient", "clip", "eps"};
    case LayerAdaptation::kNone:
      break;
  }
  return {};
}

Status ParseData(Section& top, DataConfig& d) {
  STOKE_ASSIGN_OR_RETURN(Section s, top.Sub("data"));
  STOKE_RETURN_IF_ERROR(s.String("train", &d.train));
  STOKE_RETURN_IF_ERROR(s.String("val", &d.val));
  STOKE_RETURN_IF_ERROR(s.Number("batch_size", &d.batch_size, 1, 65536));
  STOKE_RETURN_IF_ERROR(s.Number("threads", &d.threads, 0, kMaxThreads));
  STOKE_RETURN_IF_ERROR(s.Number("ring", &d.ring, 2, prefetch::kMaxRingSize));
  STOKE_RETURN_IF_ERROR(s.String("shuffle", &d.shuffle, {"full", "block", "sequential"}));
  STOKE_RETURN_IF_ERROR(s.Number("block_size", &d.block_size, 1, 1 << 24));
  STOKE_RETURN_IF_ERROR(s.Number("window_blocks", &d.window_blocks, 1, 1 << 20));
  const std::vector<std::string> block_keys_read =
      d.shuffle == "block" ? std::vector<std::string>(std::begin(kBlockKeys), std::end(kBlockKeys))
                           : std::vector<std::string>{};
  STOKE_RETURN_IF_ERROR(s.RefuseUnread(kBlockKeys, block_keys_read,
                                       fmt::format("shuffle: {}; block_size and window_blocks are read by shuffle: "
                                                   "block", d.shuffle),
                                       [&d, defaults = DataConfig{}](std::string_view key) {
                                         return key == "block_size" ? d.block_size == defaults.block_size
                                                                    : d.window_blocks == defaults.window_blocks;
                                       }));
  {
    STOKE_ASSIGN_OR_RETURN(Section io, s.Sub("io"));
    STOKE_RETURN_IF_ERROR(io.Bool("read_ahead", &d.io_read_ahead));
    STOKE_RETURN_IF_ERROR(io.Number("memory_mb", &d.io_memory_mb, 0, 1 << 24));
    STOKE_RETURN_IF_ERROR(io.Number("threads", &d.io_threads, 0, 1024));
    STOKE_RETURN_IF_ERROR(io.Finish());
  }
  STOKE_RETURN_IF_ERROR(s.String("on_error", &d.on_error, {"skip", "fail"}));
  STOKE_RETURN_IF_ERROR(s.Number("max_skip_fraction", &d.max_skip_fraction, 0, 1));
  STOKE_RETURN_IF_ERROR(s.Number("image_size", &d.image_size, 8, 4096));
  STOKE_RETURN_IF_ERROR(s.Number("val_resize", &d.val_resize, 8, 8192));
  if (YAML::Node vr; s.Has("val_resize", &vr) && d.val_resize < d.image_size) {
    return s.Error(vr, s.Path("val_resize"),
                   fmt::format("expected >= data.image_size ({}): validation resizes the shorter side to val_resize, "
                               "then centre-crops image_size",
                               d.image_size));
  }
  STOKE_ASSIGN_OR_RETURN(Section a, s.Sub("augment"));
  std::vector<double> scale = {d.scale_min, d.scale_max}, ratio = {d.ratio_min, d.ratio_max};
  STOKE_RETURN_IF_ERROR(a.List("scale", &scale, 2, 2, 1e-6, 1));
  STOKE_RETURN_IF_ERROR(a.List("ratio", &ratio, 2, 2, 1e-3, 1e3));
  STOKE_RETURN_IF_ERROR(a.Number("flip", &d.flip, 0, 1));
  STOKE_RETURN_IF_ERROR(a.Number("brightness", &d.brightness, 0, 1, true));
  STOKE_RETURN_IF_ERROR(a.Number("contrast", &d.contrast, 0, 1, true));
  STOKE_RETURN_IF_ERROR(a.Number("saturation", &d.saturation, 0, 1, true));
  YAML::Node n;
  if (scale[0] > scale[1] && a.Has("scale", &n)) return a.Error(n, a.Path("scale"), "expected [min, max] with min <= max");
  if (ratio[0] > ratio[1] && a.Has("ratio", &n)) return a.Error(n, a.Path("ratio"), "expected [min, max] with min <= max");
  d.scale_min = scale[0];
  d.scale_max = scale[1];
  d.ratio_min = ratio[0];
  d.ratio_max = ratio[1];
  STOKE_RETURN_IF_ERROR(a.Finish());
  STOKE_ASSIGN_OR_RETURN(Section nz, s.Sub("normalize"));
  STOKE_RETURN_IF_ERROR(nz.List("mean", &d.mean, 3, 3, -kInf, kInf));
  STOKE_RETURN_IF_ERROR(nz.List("std", &d.std, 3, 3, 1e-6, kInf));
  STOKE_RETURN_IF_ERROR(nz.String("layout", &d.layout, {"nchw", "nhwc"}));
  STOKE_RETURN_IF_ERROR(nz.String("dtype", &d.dtype, {"float32", "float16", "bfloat16"}));
  STOKE_RETURN_IF_ERROR(nz.Finish());
  {
    const auto f = [](const std::vector<double>& v) {
      return std::array<float, 3>{static_cast<float>(v[0]), static_cast<float>(v[1]), static_cast<float>(v[2])};
    };
    if (Status v = augment::ValidateNormalize(f(d.mean), f(d.std), augment::NormalizeLimit(d.dtype == "float16"));
        !v.ok()) {
      std::string what = v.message();
      if (what.starts_with("normalize: ")) what.erase(0, 11);  // the path names it already
      return nz.ErrorHere(fmt::format("{} (dtype {})", what, d.dtype));
    }
  }
  if (d.train.empty()) {
    return s.Error(s.node().IsMap() ? s.node() : top.node(), s.Path("train"),
                   "missing; expected the path of a packed training dataset");
  }
  return s.Finish();
}

// The option keys of each layer type (besides name, type and inputs, which every layer has).
constexpr std::array<std::string_view, 7> kLayerOptionKeys = {"out", "kernel", "stride", "pad", "bias", "p", "zero_init"};
std::vector<std::string> LayerKeys(LayerType type) {
  switch (type) {
    case LayerType::kConv:
      return {"out", "kernel", "stride", "pad", "bias"};
    case LayerType::kLinear:
      return {"out", "bias"};
    case LayerType::kMaxPool:
    case LayerType::kAvgPool:
      return {"kernel", "stride", "pad"};
    case LayerType::kBatchNorm:
      return {"zero_init"};
    case LayerType::kDropout:
      return {"p"};
    case LayerType::kRelu:
    case LayerType::kGlobalAvgPool:
    case LayerType::kAdd:
    case LayerType::kFlatten:
      return {};
  }
  return {};
}

Status ParseLayer(Section& l, LayerSpec& spec) {
  std::string type;
  YAML::Node type_node;
  if (!l.Has("type", &type_node)) {
    return l.Error(l.node(), l.Path("type"), "missing; expected a layer type");
  }
  STOKE_RETURN_IF_ERROR(l.String("type", &type));
  auto parsed = ParseLayerType(type);
  if (!parsed.ok()) return l.Error(type_node, l.Path("type"), parsed.status().message());
  spec.type = *parsed;
  const std::vector<std::string> own = LayerKeys(spec.type);
  STOKE_RETURN_IF_ERROR(l.RefuseUnread(kLayerOptionKeys, own,
                                       fmt::format("a {} layer; its keys are: name, type, inputs{}{}", type,
                                                   own.empty() ? "" : ", ", fmt::join(own, ", "))));
  // The window of a convolution or a pool has no default worth guessing: {type: maxpool} with a
  // kernel of 1 passed its input through unchanged.
  if (YAML::Node k; std::find(own.begin(), own.end(), "kernel") != own.end() && !l.Has("kernel", &k)) {
    return l.Error(l.node(), l.Path("kernel"), fmt::format("missing; a {} layer needs the size of its window", type));
  }
  STOKE_RETURN_IF_ERROR(l.String("name", &spec.name));
  YAML::Node inputs;
  if (l.Has("inputs", &inputs)) {
    if (inputs.IsScalar()) {
      spec.inputs = {inputs.Scalar()};
    } else if (inputs.IsSequence()) {
      for (const auto& i : inputs) {
        if (!i.IsScalar()) return l.Error(i, l.Path("inputs"), "expected layer names");
        spec.inputs.push_back(i.Scalar());
      }
    } else {
      return l.Error(inputs, l.Path("inputs"), "expected a layer name or a list of them");
    }
  }
  STOKE_RETURN_IF_ERROR(l.Number("out", &spec.out, 1, 1 << 20));
  STOKE_RETURN_IF_ERROR(l.Number("kernel", &spec.kernel, 1, 64));
  STOKE_RETURN_IF_ERROR(l.Number("stride", &spec.stride, 1, 64));
  STOKE_RETURN_IF_ERROR(l.Number("pad", &spec.pad, 0, 63));
  STOKE_RETURN_IF_ERROR(l.Bool("bias", &spec.bias));
  STOKE_RETURN_IF_ERROR(l.Number("p", &spec.p, 0, 1, true));
  STOKE_RETURN_IF_ERROR(l.Bool("zero_init", &spec.zero_init));
  if (spec.type == LayerType::kMaxPool || spec.type == LayerType::kAvgPool) {
    YAML::Node n;
    if (!l.Has("stride", &n)) spec.stride = 0;  // pools: the kernel size
  }
  return l.Finish();
}

Status ParseModel(Section& top, ModelConfig& m) {
  STOKE_ASSIGN_OR_RETURN(Section s, top.Sub("model"));
  STOKE_RETURN_IF_ERROR(s.String("preset", &m.preset, PresetNames()));
  STOKE_RETURN_IF_ERROR(s.Number("classes", &m.classes, 2, 1 << 24));
  STOKE_RETURN_IF_ERROR(s.Number("label_smoothing", &m.label_smoothing, 0, 1, true));
  STOKE_RETURN_IF_ERROR(s.Number("bn_momentum", &m.bn_momentum, 0, 1));
  STOKE_RETURN_IF_ERROR(s.Number("bn_epsilon", &m.bn_epsilon, 1e-12, 1));
  STOKE_RETURN_IF_ERROR(s.Bool("sync_batchnorm", &m.sync_batchnorm));
  YAML::Node layers;
  const bool has_layers = s.Has("layers", &layers);
  const YAML::Node& at = s.node().IsMap() ? s.node() : top.node();
  if (has_layers) {
    if (!layers.IsSequence() || layers.size() == 0) {
      return s.Error(layers, s.Path("layers"), "expected a non-empty list of layers");
    }
    m.layers.clear();
    for (size_t i = 0; i < layers.size(); ++i) {
      Section l(layers[i], fmt::format("{}[{}]", s.Path("layers"), i), s.context());
      STOKE_RETURN_IF_ERROR(l.Check());
      LayerSpec spec;
      STOKE_RETURN_IF_ERROR(ParseLayer(l, spec));
      m.layers.push_back(std::move(spec));
    }
  }
  if (m.classes == 0) return s.Error(at, s.Path("classes"), "missing; expected the number of classes (>= 2)");
  if (has_layers == !m.preset.empty()) {
    return s.Error(at, s.Path("preset"),
                   fmt::format("give either a preset ({}) or a layers list, not {}", fmt::join(PresetNames(), ", "),
                               has_layers ? "both" : "neither"));
  }
  return s.Finish();
}

Status ParseOptimizer(Section& top, OptimizerConfig& o) {
  STOKE_ASSIGN_OR_RETURN(Section s, top.Sub("optimizer"));
  STOKE_RETURN_IF_ERROR(s.Number("lr", &o.lr, 0, 100));
  STOKE_RETURN_IF_ERROR(s.Number("base_batch", &o.base_batch, 0, 1 << 24));
  STOKE_RETURN_IF_ERROR(s.Number("momentum", &o.sgd.momentum, 0, 1, true));
  STOKE_RETURN_IF_ERROR(s.Bool("nesterov", &o.sgd.nesterov));
  STOKE_RETURN_IF_ERROR(s.Number("weight_decay", &o.sgd.weight_decay, 0, 1));
  STOKE_RETURN_IF_ERROR(s.Bool("decay_bn_and_bias", &o.sgd.decay_bn_and_bias));
  std::string type(LayerAdaptationName(o.sgd.adaptation));
  STOKE_RETURN_IF_ERROR(s.String("type", &type, {"sgd", "lars", "larc"}));
  o.sgd.adaptation = type == "lars" ? LayerAdaptation::kLars : type == "larc" ? LayerAdaptation::kLarc : LayerAdaptation::kNone;
  const std::vector<std::string> read = OptimizerKeys(o.sgd.adaptation);
  STOKE_RETURN_IF_ERROR(s.Number("trust_coefficient", &o.sgd.trust_coefficient, 0, 1));
  STOKE_RETURN_IF_ERROR(s.Bool("clip", &o.sgd.clip));
  STOKE_RETURN_IF_ERROR(s.Number("eps", &o.sgd.eps, 0, 1));
  STOKE_RETURN_IF_ERROR(s.RefuseUnread(
      kAdaptationKeys, read,
      read.empty() ? fmt::format("type: {}; trust_coefficient and eps are read by lars and larc, clip by larc", type)
                   : fmt::format("type: {}; it reads {}", type, fmt::join(read, ", ")),
      [&o, defaults = SgdOptions{}](std::string_view key) {
        return key == "trust_coefficient" ? o.sgd.trust_coefficient == defaults.trust_coefficient
               : key == "clip"            ? o.sgd.clip == defaults.clip
                                          : o.sgd.eps == defaults.eps;
      }));
  return s.Finish();
}

Status ParseSchedule(Section& top, ScheduleConfig& c) {
  STOKE_ASSIGN_OR_RETURN(Section s, top.Sub("schedule"));
  STOKE_RETURN_IF_ERROR(s.String("type", &c.type, {"constant", "step", "multistep", "cosine"}));
  STOKE_RETURN_IF_ERROR(s.Number("warmup_epochs", &c.warmup_epochs, 0, 1e6));
  STOKE_RETURN_IF_ERROR(s.Number("warmup_start", &c.warmup_start, 0, 1));
  STOKE_RETURN_IF_ERROR(s.Number("step_epochs", &c.step_epochs, 1, 1 << 24));
  STOKE_RETURN_IF_ERROR(s.List("milestones", &c.milestones, 0, 64, 1, 1 << 24));
  STOKE_RETURN_IF_ERROR(s.Number("gamma", &c.gamma, 1e-9, 1));
  STOKE_RETURN_IF_ERROR(s.Number("min_lr", &c.min_lr, 0, 1));
  const std::vector<std::string> read = ScheduleKeys(c.type);
  STOKE_RETURN_IF_ERROR(s.RefuseUnread(kScheduleKeys, read,
                                       fmt::format("a {} schedule; it reads warmup_epochs, warmup_start{}{}", c.type,
                                                   read.empty() ? "" : ", ", fmt::join(read, ", ")),
                                       [&c, defaults = ScheduleConfig{}](std::string_view key) {
                                         return key == "step_epochs"  ? c.step_epochs == defaults.step_epochs
                                                : key == "milestones" ? c.milestones == defaults.milestones
                                                : key == "gamma"      ? c.gamma == defaults.gamma
                                                                      : c.min_lr == defaults.min_lr;
                                       }));
  YAML::Node n;
  if (s.origin() == ConfigOrigin::kWritten && c.type == "multistep" && c.milestones.empty()) {
    return s.Error(s.Has("milestones", &n) ? n : s.node(), s.Path("milestones"),
                   "missing; a multistep schedule needs the epochs at which to multiply the rate by gamma");
  }
  // Each milestone once: [30, 30] multiplied by gamma twice at epoch 30 (a stored config is held
  // to the earlier rule, which allowed that).
  const bool ordered = s.origin() == ConfigOrigin::kWritten
                           ? std::adjacent_find(c.milestones.begin(), c.milestones.end(), std::greater_equal<>()) ==
                                 c.milestones.end()
                           : std::is_sorted(c.milestones.begin(), c.milestones.end());
  if (!ordered && s.Has("milestones", &n)) {
    return s.Error(n, s.Path("milestones"), "expected epochs in increasing order, each once");
  }
  return s.Finish();
}

// A number as the shortest text that reads back as exactly the same double (0.35, not
// 0.34999999999999998; 0.12345678901234567 in full, where 15 digits lost the last two).
std::string Shortest(double v) { return fmt::format("{}", v); }
template <typename T>
decltype(auto) Emitted(const T& value) {
  if constexpr (std::is_same_v<T, double>) {
    return Shortest(value);
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    std::vector<std::string> out;
    for (double v : value) out.push_back(Shortest(v));
    return out;
  } else {
    return (value);
  }
}

// One `key: value` of a mapping being emitted (PutFlow: a list on one line).
template <typename T>
void Put(YAML::Emitter& e, const char* key, const T& value) {
  e << YAML::Key << key << YAML::Value << Emitted(value);
}
template <typename T>
void PutFlow(YAML::Emitter& e, const char* key, const T& value) {
  e << YAML::Key << key << YAML::Value << YAML::Flow << Emitted(value);
}

Result<TrainConfig> ParseConfigUnguarded(const std::string& yaml, const std::string& source, ConfigOrigin origin);

}  // namespace

Result<TrainConfig> ParseConfig(const std::string& yaml, const std::string& source, ConfigOrigin origin) {
  // yaml-cpp reports some mistakes by throwing; every one becomes an error naming the file.
  return CatchExceptions(source, [&] { return ParseConfigUnguarded(yaml, source, origin); });
}

namespace {

// The line (1-based) of the first byte of `text` that is not part of valid UTF-8, or 0. Strings
// of the config travel into checkpoints and metrics as JSON, which holds only UTF-8: a Latin-1
// path passed parsing and failed the run at its first checkpoint.
int FirstNonUtf8Line(std::string_view text, unsigned* byte) {
  int line = 1;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n') ++line;
    int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (c == 0xC0 || c == 0xC1 || c > 0xF4) extra = -1;  // overlong or past U+10FFFF
    bool ok = extra >= 0 && i + static_cast<size_t>(extra) < text.size() + (extra == 0 ? 1 : 0);
    for (int k = 1; ok && k <= extra; ++k) ok = (static_cast<unsigned char>(text[i + k]) & 0xC0) == 0x80;
    if (ok && extra >= 2) {  // overlong forms, UTF-16 surrogates, past U+10FFFF
      const auto next = static_cast<unsigned char>(text[i + 1]);
      ok = !(c == 0xE0 && next < 0xA0) && !(c == 0xED && next >= 0xA0) && !(c == 0xF0 && next < 0x90) &&
           !(c == 0xF4 && next >= 0x90);
    }
    if (!ok) {
      *byte = c;
      return line;
    }
    i += 1 + static_cast<size_t>(extra);
  }
  return 0;
}

// Whether the quoted string starting at yaml[pos] runs to the end of the text unclosed. yaml-cpp
// closes it there without a word, so `run_dir: "runs/a` swallowed every key after it into the path.
bool QuoteNeverCloses(std::string_view yaml, size_t pos) {
  if (pos >= yaml.size() || (yaml[pos] != '"' && yaml[pos] != '\'')) return false;  // a block scalar, a tag
  const char quote = yaml[pos];
  for (size_t i = pos + 1; i < yaml.size(); ++i) {
    if (quote == '"' && yaml[i] == '\\') {
      ++i;  // an escape: the next character is not the end
    } else if (yaml[i] == quote) {
      if (quote == '\'' && i + 1 < yaml.size() && yaml[i + 1] == '\'') {
        ++i;  // '' inside single quotes is one quote
      } else {
        return false;
      }
    }
  }
  return true;
}

Result<TrainConfig> ParseConfigUnguarded(const std::string& yaml, const std::string& source, ConfigOrigin origin) {
  unsigned bad_byte = 0;
  if (const int line = FirstNonUtf8Line(yaml, &bad_byte); line > 0) {
    return InvalidArgumentError(fmt::format("{}:{}: byte 0x{:02X} is not UTF-8 text; a config is UTF-8 (a path in "
                                            "another encoding: rename it, or reach it through a link)",
                                            source, line, bad_byte));
  }
  YAML::Node root;
  try {
    // One document: a second one after `---` (an appended override, say) was silently ignored.
    // Counted here, two at most: YAML::LoadAll loops for ever, allocating, on a stray ',' (yaml-cpp
    // 0.7 starts a new empty document at the same token again and again).
    std::istringstream in(yaml);
    YAML::Parser parser(in);
    DocumentOutline starts;
    while (starts.marks.size() < 2 && parser.HandleNextDocument(starts)) {
    }
    if (starts.marks.size() == 2) {
      const YAML::Mark& second = starts.marks[1];
      const size_t at = second.pos >= 0 ? std::min(static_cast<size_t>(second.pos), yaml.size()) : 0;
      // A document begins with "---" or follows an end marker ("..." on a line of its own);
      // anything else is a token yaml-cpp could not place (a stray ',') and skipped past.
      const bool marked = yaml.compare(at, 3, "---") == 0;
      bool ended = false;
      std::istringstream lines(yaml.substr(0, at));
      for (std::string line; std::getline(lines, line);) {
        if (line.starts_with("...") && line.find_first_not_of(" \t", 3) == std::string::npos) ended = true;
      }
      if (!marked && !ended && at < yaml.size()) {
        return InvalidArgumentError(
            fmt::format("{}:{}: not valid YAML: unexpected '{}'", source, second.line + 1, yaml[at]));
      }
      return InvalidArgumentError(fmt::format("{}:{}: a second YAML document; a config is one document (merge it "
                                              "into the first)",
                                              source, second.line + 1));
    }
    // yaml-cpp's positions count from after a byte-order mark.
    const size_t bom = yaml.starts_with("\xEF\xBB\xBF") ? 3 : 0;
    for (const YAML::Mark& mark : starts.quoted) {
      const size_t at = static_cast<size_t>(mark.pos) + bom;
      if (mark.pos >= 0 && QuoteNeverCloses(yaml, at)) {
        return InvalidArgumentError(fmt::format("{}:{}: not valid YAML: the string quoted here has no closing {}",
                                                source, mark.line + 1, yaml[at]));
      }
    }
    root = YAML::Load(yaml);
  } catch (const YAML::ParserException& e) {
    return InvalidArgumentError(fmt::format("{}:{}: not valid YAML: {}", source, e.mark.line + 1, e.msg));
  }
  TrainConfig c;
  c.source = source;
  ParseContext context{c.source, origin, c.lines};
  Section top(root, "", context);
  if (!root.IsMap()) return InvalidArgumentError(fmt::format("{}: expected a YAML mapping at the top", source));
  STOKE_RETURN_IF_ERROR(top.Check());
  STOKE_RETURN_IF_ERROR(ParseData(top, c.data));
  STOKE_RETURN_IF_ERROR(ParseModel(top, c.model));
  STOKE_RETURN_IF_ERROR(ParseOptimizer(top, c.optimizer));
  STOKE_RETURN_IF_ERROR(ParseSchedule(top, c.schedule));
  STOKE_ASSIGN_OR_RETURN(Section ev, top.Sub("eval"));
  STOKE_RETURN_IF_ERROR(ev.Number("every_epochs", &c.eval.every_epochs, 0, 1 << 24));
  STOKE_RETURN_IF_ERROR(ev.Number("every_steps", &c.eval.every_steps, 0, 1e15));
  STOKE_RETURN_IF_ERROR(ev.Finish());
  STOKE_ASSIGN_OR_RETURN(Section ck, top.Sub("checkpoint"));
  STOKE_RETURN_IF_ERROR(ck.Number("every_epochs", &c.checkpoint.every_epochs, 0, 1 << 24));
  STOKE_RETURN_IF_ERROR(ck.Number("every_steps", &c.checkpoint.every_steps, 0, 1e15));
  STOKE_RETURN_IF_ERROR(ck.Number("keep", &c.checkpoint.keep, 1, 1000));
  STOKE_RETURN_IF_ERROR(ck.Finish());
  STOKE_RETURN_IF_ERROR(top.Number("epochs", &c.epochs, 1, 1 << 24));
  STOKE_RETURN_IF_ERROR(top.Number("seed", &c.seed, 0, 9.0e15));
  STOKE_RETURN_IF_ERROR(top.String("backend", &c.backend, {"auto", "cpu", "cuda"}));
  STOKE_RETURN_IF_ERROR(top.Number("compute_threads", &c.compute_threads, 0, kMaxThreads));
  STOKE_RETURN_IF_ERROR(top.String("run_dir", &c.run_dir));
  if (YAML::Node rd; c.run_dir.empty() && top.Has("run_dir", &rd)) {
    return top.Error(rd, "run_dir", "expected the directory for checkpoints and metrics, got an empty string");
  }
  STOKE_RETURN_IF_ERROR(top.Number("log_every_steps", &c.log_every_steps, 1, 1e15));
  STOKE_ASSIGN_OR_RETURN(Section di, top.Sub("dist"));
  STOKE_RETURN_IF_ERROR(di.Number("bucket_mb", &c.dist.bucket_mb, 0.001, 4096));
  STOKE_RETURN_IF_ERROR(di.Number("timeout_s", &c.dist.timeout_s, 1, 86400));
  STOKE_RETURN_IF_ERROR(di.Number("check_every_steps", &c.dist.check_every_steps, 0, 1e15));
  STOKE_RETURN_IF_ERROR(di.String("device_comm", &c.dist.device_comm, {"auto", "nccl", "host"}));
  STOKE_RETURN_IF_ERROR(di.Finish());
  STOKE_ASSIGN_OR_RETURN(Section cu, top.Sub("cuda"));
  STOKE_RETURN_IF_ERROR(cu.Bool("autotune", &c.cuda.autotune));
  STOKE_RETURN_IF_ERROR(cu.Bool("fuse_bn_relu", &c.cuda.fuse_bn_relu));
  std::string channels = std::to_string(c.cuda.input_channels);
  STOKE_RETURN_IF_ERROR(cu.String("input_channels", &channels, {"3", "4", "8"}));
  c.cuda.input_channels = std::stoi(channels);
  STOKE_RETURN_IF_ERROR(cu.Finish());
  STOKE_RETURN_IF_ERROR(top.Finish());
  // What is checked against other sections names the line of its own key.
  // A rate change at epoch `epochs` or later never happens: the run ends first. (A stored config
  // is not held to this: its run may since have been resumed with more epochs.)
  for (int m : c.schedule.milestones) {
    if (m >= c.epochs && origin == ConfigOrigin::kWritten) {
      return InvalidArgumentError(fmt::format("{}: schedule.milestones: epoch {} is not before the end of the run "
                                              "(epochs: {}), so the rate would never change there",
                                              c.Where("schedule.milestones"), m, c.epochs));
    }
  }
  if (c.schedule.type == "step" && c.schedule.step_epochs >= c.epochs && origin == ConfigOrigin::kWritten) {
    const bool given = c.lines.contains("schedule.step_epochs");
    return InvalidArgumentError(fmt::format("{}: schedule.step_epochs: {}{} is not below epochs ({}), so the rate "
                                            "would never step; expected step_epochs below epochs, or type constant",
                                            c.Where(given ? "schedule.step_epochs" : "schedule"),
                                            c.schedule.step_epochs, given ? "" : " (the default)", c.epochs));
  }
  if (c.schedule.warmup_epochs > c.epochs) {
    return InvalidArgumentError(fmt::format(
        "{}: schedule.warmup_epochs: {} is past the last epoch ({}): the learning rate would never reach "
        "optimizer.lr; expected at most epochs", c.Where("schedule.warmup_epochs"), c.schedule.warmup_epochs,
        c.epochs));
  }
  // The model must fit the input: resolve it now so its errors come with the file name.
  ModelSpec spec = ModelFromConfig(c.model);
  auto shapes = ResolveModel(spec, {3, c.data.image_size, c.data.image_size});
  if (!shapes.ok()) {
    return InvalidArgumentError(fmt::format("{}: model: {} (input 3x{}x{})", c.Where("model"),
                                            shapes.status().message(), c.data.image_size, c.data.image_size));
  }
  return c;
}

}  // namespace

std::string TrainConfig::Where(std::string_view key) const {
  auto it = lines.find(key);
  return it == lines.end() || it->second <= 0 ? source : fmt::format("{}:{}", source, it->second);
}

Result<TrainConfig> LoadConfig(const std::string& path) {
  STOKE_ASSIGN_OR_RETURN(auto bytes, ReadFileBytes(path));
  return ParseConfig(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path);
}

std::string ConfigToYaml(const TrainConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  const DataConfig& d = c.data;
  Put(e, "data", YAML::BeginMap);
  Put(e, "train", d.train);
  Put(e, "val", d.val);
  Put(e, "batch_size", d.batch_size);
  Put(e, "threads", d.threads);
  Put(e, "ring", d.ring);
  Put(e, "shuffle", d.shuffle);
  if (d.shuffle == "block") {
    Put(e, "block_size", d.block_size);
    Put(e, "window_blocks", d.window_blocks);
  }
  Put(e, "io", YAML::BeginMap);
  Put(e, "read_ahead", d.io_read_ahead);
  Put(e, "memory_mb", d.io_memory_mb);
  Put(e, "threads", d.io_threads);
  e << YAML::EndMap;
  Put(e, "on_error", d.on_error);
  Put(e, "max_skip_fraction", d.max_skip_fraction);
  Put(e, "image_size", d.image_size);
  Put(e, "val_resize", ValResize(d));
  Put(e, "augment", YAML::BeginMap);
  PutFlow(e, "scale", std::vector<double>{d.scale_min, d.scale_max});
  PutFlow(e, "ratio", std::vector<double>{d.ratio_min, d.ratio_max});
  Put(e, "flip", d.flip);
  Put(e, "brightness", d.brightness);
  Put(e, "contrast", d.contrast);
  Put(e, "saturation", d.saturation);
  e << YAML::EndMap;
  Put(e, "normalize", YAML::BeginMap);
  PutFlow(e, "mean", d.mean);
  PutFlow(e, "std", d.std);
  Put(e, "layout", d.layout);
  Put(e, "dtype", d.dtype);
  e << YAML::EndMap << YAML::EndMap;

  const ModelConfig& m = c.model;
  Put(e, "model", YAML::BeginMap);
  if (!m.preset.empty()) Put(e, "preset", m.preset);
  Put(e, "classes", m.classes);
  Put(e, "label_smoothing", m.label_smoothing);
  Put(e, "bn_momentum", m.bn_momentum);
  Put(e, "bn_epsilon", m.bn_epsilon);
  Put(e, "sync_batchnorm", m.sync_batchnorm);
  if (m.preset.empty()) {
    Put(e, "layers", YAML::BeginSeq);
    for (const LayerSpec& l : m.layers) {
      e << YAML::Flow << YAML::BeginMap;
      if (!l.name.empty()) Put(e, "name", l.name);
      Put(e, "type", std::string(LayerTypeName(l.type)));
      if (!l.inputs.empty()) PutFlow(e, "inputs", l.inputs);
      switch (l.type) {
        case LayerType::kConv:
        case LayerType::kLinear:
          Put(e, "out", l.out);
          if (l.type == LayerType::kConv) {
            Put(e, "kernel", l.kernel);
            Put(e, "stride", l.stride);
            Put(e, "pad", l.pad);
          }
          Put(e, "bias", l.bias);
          break;
        case LayerType::kMaxPool:
        case LayerType::kAvgPool:
          Put(e, "kernel", l.kernel);
          if (l.stride != 0) Put(e, "stride", l.stride);
          Put(e, "pad", l.pad);
          break;
        case LayerType::kDropout:
          Put(e, "p", l.p);
          break;
        case LayerType::kBatchNorm:
          if (l.zero_init) Put(e, "zero_init", true);
          break;
        default:
          break;
      }
      e << YAML::EndMap;
    }
    e << YAML::EndSeq;
  }
  e << YAML::EndMap;

  const OptimizerConfig& o = c.optimizer;
  Put(e, "optimizer", YAML::BeginMap);
  Put(e, "lr", o.lr);
  Put(e, "base_batch", o.base_batch);
  Put(e, "momentum", o.sgd.momentum);
  Put(e, "nesterov", o.sgd.nesterov);
  Put(e, "weight_decay", o.sgd.weight_decay);
  Put(e, "decay_bn_and_bias", o.sgd.decay_bn_and_bias);
  Put(e, "type", std::string(LayerAdaptationName(o.sgd.adaptation)));
  for (const std::string& key : OptimizerKeys(o.sgd.adaptation)) {
    if (key == "trust_coefficient") Put(e, "trust_coefficient", o.sgd.trust_coefficient);
    if (key == "clip") Put(e, "clip", o.sgd.clip);
    if (key == "eps") Put(e, "eps", o.sgd.eps);
  }
  e << YAML::EndMap;

  const ScheduleConfig& s = c.schedule;
  Put(e, "schedule", YAML::BeginMap);
  Put(e, "type", s.type);
  Put(e, "warmup_epochs", s.warmup_epochs);
  Put(e, "warmup_start", s.warmup_start);
  for (const std::string& key : ScheduleKeys(s.type)) {
    if (key == "step_epochs") Put(e, "step_epochs", s.step_epochs);
    if (key == "milestones") PutFlow(e, "milestones", s.milestones);
    if (key == "gamma") Put(e, "gamma", s.gamma);
    if (key == "min_lr") Put(e, "min_lr", s.min_lr);
  }
  e << YAML::EndMap;

  Put(e, "eval", YAML::BeginMap);
  Put(e, "every_epochs", c.eval.every_epochs);
  Put(e, "every_steps", c.eval.every_steps);
  e << YAML::EndMap;
  Put(e, "checkpoint", YAML::BeginMap);
  Put(e, "every_epochs", c.checkpoint.every_epochs);
  Put(e, "every_steps", c.checkpoint.every_steps);
  Put(e, "keep", c.checkpoint.keep);
  e << YAML::EndMap;
  Put(e, "epochs", c.epochs);
  Put(e, "seed", c.seed);
  Put(e, "backend", c.backend);
  Put(e, "compute_threads", c.compute_threads);
  Put(e, "run_dir", c.run_dir);
  Put(e, "log_every_steps", c.log_every_steps);
  Put(e, "dist", YAML::BeginMap);
  Put(e, "bucket_mb", c.dist.bucket_mb);
  Put(e, "timeout_s", c.dist.timeout_s);
  Put(e, "check_every_steps", c.dist.check_every_steps);
  Put(e, "device_comm", c.dist.device_comm);
  e << YAML::EndMap;
  Put(e, "cuda", YAML::BeginMap);
  Put(e, "autotune", c.cuda.autotune);
  Put(e, "fuse_bn_relu", c.cuda.fuse_bn_relu);
  Put(e, "input_channels", c.cuda.input_channels);
  e << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

augment::NormalizeOptions NormalizeFromConfig(const DataConfig& d) {
  augment::NormalizeOptions n;
  for (int i = 0; i < 3; ++i) {
    n.mean[static_cast<size_t>(i)] = static_cast<float>(d.mean[static_cast<size_t>(i)]);
    n.std[static_cast<size_t>(i)] = static_cast<float>(d.std[static_cast<size_t>(i)]);
  }
  n.layout = d.layout == "nhwc" ? augment::Layout::kNHWC : augment::Layout::kNCHW;
  n.dtype = d.dtype == "float32" ? augment::DType::kFloat32 : augment::DType::kFloat16;
  return n;
}

ModelSpec ModelFromConfig(const ModelConfig& m) {
  ModelSpec spec;
  spec.preset = m.preset;
  spec.classes = m.classes;
  if (!m.preset.empty()) {
    auto layers = ExpandPreset(m.preset, m.classes);
    if (layers.ok()) spec.layers = std::move(*layers);
  } else {
    spec.layers = m.layers;
  }
  return spec;
}

namespace {
// Every scalar of a YAML document under its dotted path ("data.threads", "model.layers[3].type"),
// in document order.
void FlattenYaml(const YAML::Node& node, const std::string& at, std::vector<std::pair<std::string, std::string>>* out) {
  if (node.IsMap()) {
    for (const auto& kv : node) FlattenYaml(kv.second, at.empty() ? kv.first.Scalar() : at + "." + kv.first.Scalar(), out);
  } else if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) FlattenYaml(node[i], fmt::format("{}[{}]", at, i), out);
    if (node.size() == 0) out->emplace_back(at, "[]");
  } else {
    out->emplace_back(at, node.IsNull() ? std::string("null") : node.Scalar());
  }
}
}  // namespace

std::string ConfigYamlDifference(std::string_view here, std::string_view other, std::string_view other_is) {
  std::vector<std::pair<std::string, std::string>> a, b;
  try {
    FlattenYaml(YAML::Load(std::string(here)), "", &a);
    FlattenYaml(YAML::Load(std::string(other)), "", &b);
  } catch (const YAML::Exception&) {
    return here == other ? std::string() : std::string("(the configs could not be compared)");
  }
  std::map<std::string, std::string> theirs(b.begin(), b.end());
  auto shown = [](const std::string& v) { return v.empty() ? std::string("''") : v; };
  for (const auto& [key, value] : a) {
    const auto it = theirs.find(key);
    if (it == theirs.end()) return fmt::format("{}: {} ({}: not set)", key, shown(value), other_is);
    if (it->second != value) return fmt::format("{}: {} ({}: {})", key, shown(value), other_is, shown(it->second));
    theirs.erase(it);
  }
  if (!theirs.empty()) {
    // In document order of the other.
    for (const auto& [key, value] : b) {
      if (theirs.contains(key)) return fmt::format("{}: not set ({}: {})", key, other_is, shown(value));
    }
  }
  return {};
}

std::string ConfigModelDifference(const TrainConfig& here, std::string_view here_is, const TrainConfig& other,
                                  std::string_view other_is) {
  ModelSpec a = ModelFromConfig(here.model), b = ModelFromConfig(other.model);
  if (!ResolveModel(a, {3, here.data.image_size, here.data.image_size}).ok() ||
      !ResolveModel(b, {3, other.data.image_size, other.data.image_size}).ok()) {
    return std::string();
  }
  return ModelDifference(a, here_is, b, other_is);
}

std::string PreprocessingDifference(const TrainConfig& here, const TrainConfig& other, std::string_view other_is) {
  std::vector<std::string> d;
  auto compare = [&](std::string_view key, const auto& a, const auto& b) {
    if (a != b) d.push_back(fmt::format("data.{} {} ({}: {})", key, a, other_is, b));
  };
  compare("image_size", here.data.image_size, other.data.image_size);
  compare("val_resize", ValResize(here.data), ValResize(other.data));
  auto list = [](const std::vector<double>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); };
  compare("mean", list(here.data.mean), list(other.data.mean));
  compare("std", list(here.data.std), list(other.data.std));
  compare("layout", here.data.layout, other.data.layout);
  compare("dtype", here.data.dtype, other.data.dtype);
  return fmt::format("{}", fmt::join(d, "; "));
}

double ScaledLr(const TrainConfig& c) {
  if (c.optimizer.base_batch <= 0) return c.optimizer.lr;
  return c.optimizer.lr * c.data.batch_size / c.optimizer.base_batch;
}

int ValResize(const DataConfig& d) {
  // A config built in code may leave an explicit val_resize below the crop; the parser refuses one.
  return d.val_resize > 0 ? std::max(d.val_resize, d.image_size)
                          : (d.image_size * 256 + 223) / 224;  // as stoke.torch.Loader's default
}

prefetch::LoaderOptions TrainLoaderOptions(const TrainConfig& c, int rank, int world) {
  const DataConfig& d = c.data;
  prefetch::LoaderOptions o;
  o.sampler.mode = d.shuffle == "sequential"   ? dataset::ShuffleMode::kSequential
                   : d.shuffle == "block" ? dataset::ShuffleMode::kBlock
                                          : dataset::ShuffleMode::kFull;
  o.sampler.seed = c.seed;
  o.sampler.block_size = d.block_size;
  o.sampler.window_blocks = d.window_blocks;
  o.storage.enabled = d.io_read_ahead;
  o.storage.memory_bytes = int64_t{d.io_memory_mb} << 20;
  o.storage.io_threads = d.io_threads;
  o.augment.mode = prefetch::CropMode::kRandomResized;
  o.augment.random.size = d.image_size;
  o.augment.random.scale_min = d.scale_min;
  o.augment.random.scale_max = d.scale_max;
  o.augment.random.ratio_min = d.ratio_min;
  o.augment.random.ratio_max = d.ratio_max;
  o.augment.random.flip_p = d.flip;
  o.augment.random.brightness = d.brightness;
  o.augment.random.contrast = d.contrast;
  o.augment.random.saturation = d.saturation;
  o.batch_size = d.batch_size / world;
  o.drop_last_batch = true;  // every training step sees a full batch
  o.sampler.rank = rank;
  o.sampler.world_size = world;
  o.sampler.sharding = dataset::Sharding::kGlobalBatch;
  o.sampler.global_batch = d.batch_size;
  // The records past the last whole global batch are left out on every rank (each rank's share of
  // them would pad to a batch of its own): an epoch is records / batch_size steps on any world size.
  o.sampler.drop_last = true;
  o.threads = d.threads;
  o.ring_size = d.ring;
  o.on_error = d.on_error == "fail" ? prefetch::ErrorPolicy::kFail : prefetch::ErrorPolicy::kSkip;
  o.max_skip_fraction = d.max_skip_fraction;
  o.device = prefetch::DeviceMode::kHost;
  return o;
}

prefetch::LoaderOptions ValLoaderOptions(const TrainConfig& c, int rank, int world) {
  prefetch::LoaderOptions o = TrainLoaderOptions(c, rank, world);
  o.sampler.mode = dataset::ShuffleMode::kSequential;
  o.sampler.sharding = dataset::Sharding::kExact;  // every record once across the ranks
  o.augment.mode = prefetch::CropMode::kCenter;
  o.augment.resize = ValResize(c.data);
  o.augment.crop = c.data.image_size;
  o.drop_last_batch = false;  // every validation sample counts
  o.epochs = 1;
  return o;
}

dist::ReducerOptions ReducerOptionsFromConfig(const TrainConfig& c) {
  dist::ReducerOptions o;
  o.bucket_bytes = static_cast<size_t>(c.dist.bucket_mb * (1 << 20));
  o.first_bucket_bytes = std::min(o.first_bucket_bytes, o.bucket_bytes);
  return o;
}

}  // namespace stoke::train
