// The native half of the Python package: stoke's datasets and its loader, one epoch at a time,
// with batches handed out as DLPack capsules that view the ring's slot in place. The slot goes
// back to the ring when the last tensor made from the batch's capsules is freed.
//
// The Python half (stoke/torch.py) turns the capsules into torch tensors, keeps the epoch count
// and the resume position, and reads rank and world size from torch.distributed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlpack/dlpack.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cxxabi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "augment/transform.h"
#include "common/limits.h"
#include "common/status.h"
#include "common/sys_memory.h"
#include "dataset/dataset.h"
#include "dataset/sampler.h"
#include "prefetch/batch_memory.h"
#include "prefetch/device_batch.h"
#include "prefetch/loader.h"
#include "tools/inspect/inspect.h"
#include "tools/pack/packer.h"

namespace py = pybind11;

namespace stoke::python {
namespace {

// Every ring slot is held by the consumer's tensors: nothing was taken from the pipeline, which
// goes on once they are freed (stoke._stoke.BuffersHeldError, a RuntimeError).
struct BuffersHeld : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The interpreter's main thread (set at import): the one that finalises it.
unsigned long g_main_thread = 0;

bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Once the interpreter shuts down, a thread other than the main one that asks for the GIL is ended
// by the interpreter with a forced unwind (pthread_exit). Through a destructor, or through frames
// not made for it (the pack's threads), that aborts the process. Such a thread sleeps instead until
// the process is gone, as newer Pythons do with their own daemon threads. Checking Finalizing()
// first is not enough: shutdown may begin while the thread already waits for the GIL.
[[noreturn]] void SleepUntilTheProcessEnds() {
  for (;;) ::pause();
}
void RestoreThread(PyThreadState* state) {  // not noexcept: the forced unwind is caught here
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    SleepUntilTheProcessEnds();  // never rethrown: the thread never leaves this handler
  }
}

// Releases the GIL for a scope, as py::gil_scoped_release does, but takes it back through
// RestoreThread: a daemon thread waiting here for a batch while the main thread exits sleeps
// instead of aborting the process. The main thread finalises the interpreter and takes the GIL back
// as usual.
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;
  ~GilReleased() {
    if (Finalizing() && PyThread_get_thread_ident() != g_main_thread) SleepUntilTheProcessEnds();
    RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// Takes the GIL on a thread Python did not start (the pack's), as py::gil_scoped_acquire does,
// sleeping instead of aborting when the interpreter is shutting down.
class GilAcquired {
 public:
  GilAcquired() {
    if (Finalizing() && PyThread_get_thread_ident() != g_main_thread) SleepUntilTheProcessEnds();
    try {
      state_ = PyGILState_Ensure();
    } catch (abi::__forced_unwind&) {
      SleepUntilTheProcessEnds();
    }
  }
  GilAcquired(const GilAcquired&) = delete;
  GilAcquired& operator=(const GilAcquired&) = delete;
  ~GilAcquired() { PyGILState_Release(state_); }

 private:
  PyGILState_STATE state_{};
};

// A stoke error as a Python exception carrying stoke's message: ValueError for bad arguments and
// data, FileNotFoundError for a missing path, OSError for I/O, RuntimeError for the rest.
// stoke's messages and paths name files as the file system spells them, which need not be UTF-8.
// A path becomes a str the way os.fsdecode makes one (os.fsencode gives the bytes back); a message
// shows such bytes as \xNN escapes (it can be printed).
py::str PathText(const std::string& s) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}
py::str MessageText(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}
[[noreturn]] void RaiseText(PyObject* type, const std::string& text) {
  py::str message = MessageText(text);
  PyErr_SetObject(type, message.ptr());
  throw py::error_already_set();
}

[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kCorrupt:
      RaiseText(PyExc_ValueError, s.ToString());
    case StatusCode::kNotFound:
      RaiseText(PyExc_FileNotFoundError, s.ToString());
    case StatusCode::kIoError:
      RaiseText(PyExc_OSError, s.ToString());
    default:
      RaiseText(PyExc_RuntimeError, s.ToString());
  }
}
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

// ---------------------------------------------------------------- datasets

// A dataset with one reader for record(): the dataset stays put (readers point at it).
struct PyDataset {
  std::unique_ptr<dataset::Dataset> ds;
  std::unique_ptr<dataset::Reader> reader;
};

// The bytes of one record, as a buffer that keeps its dataset open: memoryview(RecordBytes) is a
// zero-copy view into the LMDB map.
struct RecordBytes {
  std::shared_ptr<PyDataset> owner;
  const std::byte* data = nullptr;
  size_t size = 0;
};

// `path`: a str, bytes or any path-like object (pathlib.Path, os.DirEntry), in any encoding the
// file system takes (os.fsencode gives its bytes).
std::shared_ptr<PyDataset> OpenDataset(const py::object& path_like) {
  py::module_ os = py::module_::import("os");
  py::object fs = os.attr("fspath")(path_like);  // a TypeError naming the type for anything else
  if (!py::isinstance<py::str>(fs) && !py::isinstance<py::bytes>(fs)) {
    throw py::type_error(fmt::format("stoke.Dataset: path {}: expected a str or path-like object naming a dataset",
                                     py::repr(path_like).cast<std::string>()));
  }
  // Absolute: verify() opens the dataset again, perhaps after the program changed its working
  // directory (a relative name would then check another dataset, or none).
  // A NUL byte would end the name at it for the system calls: another file. (abspath accepts it.)
  if (py::bytes(os.attr("fsencode")(fs)).cast<std::string>().find('\0') != std::string::npos) {
    throw py::value_error(fmt::format("stoke.Dataset: path {}: holds a NUL byte; expected the path of a dataset",
                                      py::repr(path_like).cast<std::string>()));
  }
  const std::string path = os.attr("fsencode")(os.attr("path").attr("abspath")(fs)).cast<std::string>();
  auto d = std::make_shared<PyDataset>();
  d->ds = std::make_unique<dataset::Dataset>(Take(dataset::Dataset::Open(path)));
  d->reader = std::make_unique<dataset::Reader>(Take(d->ds->NewReader()));
  return d;
}

// ---------------------------------------------------------------- DLPack

// A batch on a GPU goes back to the ring on the stream its consumer was given it on: the next
// copy into the slot waits for the work queued there up to the moment the last tensor went.
struct DeviceLease {
  prefetch::BatchLease lease;
  void* stream = nullptr;
  ~DeviceLease() { lease.Release(stream); }
};

// What a capsule's tensor keeps alive: the lease on the ring slot (shared by every tensor viewing
// the slot), and the shape and strides DLPack points at.
struct TensorOwner {
  std::shared_ptr<void> lease;
  std::vector<int64_t> shape, strides;
  std::vector<int64_t> values;  // labels and indices (owned here)
  std::vector<std::byte> bytes;  // normalised pixels (owned here)
};

void DeleteManaged(DLManagedTensor* t) {
  delete static_cast<TensorOwner*>(t->manager_ctx);
  delete t;
}

// A "dltensor" capsule; if nothing consumes it, the capsule's destructor frees the tensor.
py::capsule Capsule(void* data, DLDataType type, std::unique_ptr<TensorOwner> owner, DLDevice device = {kDLCPU, 0}) {
  auto* t = new DLManagedTensor{};
  t->dl_tensor.data = data;
  t->dl_tensor.device = device;
  t->dl_tensor.ndim = static_cast<int32_t>(owner->shape.size());
  t->dl_tensor.dtype = type;
  t->dl_tensor.shape = owner->shape.data();
  t->dl_tensor.strides = owner->strides.empty() ? nullptr : owner->strides.data();
  t->dl_tensor.byte_offset = 0;
  t->manager_ctx = owner.release();
  t->deleter = DeleteManaged;
  PyObject* cap = PyCapsule_New(t, "dltensor", [](PyObject* self) {
    // A consumer renames the capsule "used_dltensor" and becomes responsible for the tensor.
    // PyCapsule_IsValid sets no error; an exception already pending (the capsule freed while it
    // propagates) must survive this destructor.
    if (PyCapsule_IsValid(self, "dltensor")) {
      auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(self, "dltensor"));
      if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
    }
  });
  if (cap == nullptr) {
    DeleteManaged(t);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

// A host int64 vector tensor owning a copy of `values` (labels, record indices).
template <typename T>
py::capsule HostInt64(std::span<const T> values) {
  auto owner = std::make_unique<TensorOwner>();
  owner->values.assign(values.begin(), values.end());
  owner->shape = {static_cast<int64_t>(values.size())};
  int64_t* data = owner->values.data();  // before the owner moves into the capsule
  return Capsule(data, {kDLInt, 64, 1}, std::move(owner));
}

// ---------------------------------------------------------------- one epoch of the loader

struct EpochOptions {
  int batch_size = 256;
  bool train = true;
  int size = 224;
  int resize = 0;  // evaluation: shorter side before the centre crop; 0: size * 256 / 224
  double scale_min = 0.08, scale_max = 1.0;
  double flip = 0.5;
  uint64_t seed = 0;
  int threads = 0;
  int ring = 4;
  bool drop_last = false;
  std::string on_error = "skip";
  double max_skip_fraction = 0.01;  // on_error skip: bad records allowed per epoch, as a fraction of its samples
  // Bad records an earlier pipeline of the same run met (LoaderOptions::known_bad).
  std::vector<std::tuple<int64_t, std::string, bool>> known_bad;  // index, reason, own
  int rank = 0, world_size = 1;
  int64_t epoch = 0, start_batch = 0;
  int64_t epochs = 1;  // 0: endless (epochs follow each other without draining the pipeline)
  // Normalised float tensors instead of uint8: (x / 255 - mean) / std, float32 or float16.
  bool normalize = false;
  std::array<float, 3> mean = {0.485f, 0.456f, 0.406f};
  std::array<float, 3> std = {0.229f, 0.224f, 0.225f};
  std::string dtype = "float32";
  int device = -1;  // >= 0: batches are copied to this GPU (see EpochLoader::Next)
};

prefetch::LoaderOptions ToLoaderOptions(const EpochOptions& e, int64_t records) {
  prefetch::LoaderOptions o;
  o.batch_size = e.batch_size;
  o.drop_last_batch = e.drop_last;
  o.threads = e.threads;
  o.ring_size = e.ring;
  o.on_error = Take(prefetch::ParseErrorPolicy(e.on_error));
  o.max_skip_fraction = e.max_skip_fraction;
  for (const auto& [index, reason, own] : e.known_bad) o.known_bad.push_back({index, reason, own});
  o.sampler.seed = e.seed;
  o.sampler.rank = e.rank;
  o.sampler.world_size = e.world_size;
  o.sampler.drop_last = e.drop_last;
  if (e.world_size > 1) {
    // As `stoke train` under mpirun slices its global batches: rank r takes samples
    // [kG + rB, kG + (r+1)B) of the epoch order, G = B x world.
    o.sampler.sharding = dataset::Sharding::kGlobalBatch;
    o.sampler.global_batch = int64_t{e.batch_size} * e.world_size;
    // The bad-record budget is a fraction of the global epoch, as `stoke train` under mpirun holds
    // it: this rank's share of the epoch may hold all of the run's bad records (a rank that held
    // it to its own share ended where one process with the same fraction would go on).
    if (auto sampler = dataset::Sampler::Create(records, o.sampler); sampler.ok()) {
      o.skip_budget_samples = sampler->samples_per_rank() * e.world_size;
    }  // (invalid options: Loader::Create says why)
  }
  if (e.train) {
    o.sampler.mode = dataset::ShuffleMode::kFull;
    o.augment.mode = prefetch::CropMode::kRandomResized;
    o.augment.random.size = e.size;
    o.augment.random.scale_min = e.scale_min;
    o.augment.random.scale_max = e.scale_max;
    o.augment.random.flip_p = e.flip;
  } else {
    o.sampler.mode = dataset::ShuffleMode::kSequential;
    o.augment.mode = prefetch::CropMode::kCenter;
    o.augment.crop = e.size;
    // The default resize keeps ImageNet's 256 / 224; a size whose resize is past int is refused.
    const int64_t resize = e.resize > 0 ? e.resize : (int64_t{e.size} * 256 + 223) / 224;
    if (resize > std::numeric_limits<int>::max()) {
      throw py::value_error(fmt::format("stoke: size {}: its evaluation resize ({} x 256 / 224) is too large", e.size,
                                        e.size));
    }
    o.augment.resize = static_cast<int>(resize);
  }
  o.device = e.device >= 0 ? prefetch::DeviceMode::kCuda : prefetch::DeviceMode::kHost;
  o.device_id = std::max(e.device, 0);
  o.start_epoch = e.epoch;
  o.start_batch = e.start_batch;
  o.epochs = e.epochs;
  return o;
}

class EpochLoader {
 public:
  EpochLoader(std::shared_ptr<PyDataset> ds, const EpochOptions& e) : ds_(std::move(ds)), pid_(::getpid()) {
    if (e.normalize) {
      if (e.dtype != "float32" && e.dtype != "float16") {
        throw py::value_error(fmt::format("stoke: dtype {}: normalised batches are float32 or float16", e.dtype));
      }
      const Status valid = augment::ValidateNormalize(e.mean, e.std, augment::NormalizeLimit(e.dtype == "float16"));
      if (!valid.ok()) throw py::value_error("stoke: " + valid.message());
      normalize_.emplace();
      normalize_->mean = e.mean;
      normalize_->std = e.std;
      normalize_->layout = augment::Layout::kNHWC;  // viewed as [N, 3, H, W] channels-last
      normalize_->dtype = e.dtype == "float16" ? augment::DType::kFloat16 : augment::DType::kFloat32;
    }
    const prefetch::LoaderOptions options = ToLoaderOptions(e, ds_->ds->size());
    std::optional<Result<std::unique_ptr<prefetch::Loader>>> created;
    {
      GilReleased unlocked;  // the ring's allocation can take a while
      created.emplace(prefetch::Loader::Create(*ds_->ds, options));
    }
    loader_ = Take(std::move(*created));
  }
  ~EpochLoader() { Close(); }

  int64_t batches() const { return loader_ ? loader_->batches_per_epoch() : 0; }

  // The next batch as (images, labels, indices, epoch, number, replaced), or None at the end of the
  // epoch. Waits with the GIL released, checking for Ctrl-C every 50 ms.
  //
  // On a GPU, `stream` (a cudaStream_t as an integer, 0: the legacy default stream) is the
  // consumer's: it waits there for the batch's copy, images (uint8) and labels (int32) are views of
  // the slot's device memory, and the slot returns to the ring, ordered after the work queued on
  // `stream`, once the last of those views is freed. Indices stay on the host. Normalisation on
  // the device is the caller's (NormalizeOnDevice into a tensor of its own, then drop the view).
  //
  // close() may run while this waits (from another thread, or from a signal handler that runs in
  // the Ctrl-C check): this call holds the loader until it returns, and then returns None.
  py::object Next(uintptr_t stream) {
    if (Forked()) {
      throw std::runtime_error(
          "stoke: this loader was made in another process, before a fork(); its threads are not in this one: "
          "make a new Loader in this process");
    }
    Held loader{loader_};
    if (!loader.it) return py::none();
    while (true) {
      bool ready = false;
      {
        GilReleased unlocked;
        ready = loader.it->WaitReady(std::chrono::milliseconds(50));
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (loader_ != loader.it) return py::none();
      if (ready) break;
    }
    std::optional<Result<prefetch::BatchLease>> got;
    {
      GilReleased unlocked;
      got.emplace(loader.it->Next());
    }
    if (loader_ != loader.it) return py::none();  // the lease (if any) goes back as `got` goes
    Result<prefetch::BatchLease>& next = *got;
    if (!next.ok()) {
      const Status& s = next.status();
      if (s.message().find("ring buffers are held by the consumer") != std::string::npos) {
        throw BuffersHeld(fmt::format(
            "stoke: every one of the loader's {} batch buffers is still in use by tensors you hold; a batch's "
            "tensors view the loader's memory until they are freed: .clone() what you keep beyond the next "
            "iteration (or pass a larger ring=)",
            loader.it->options().ring_size));
      }
      Raise(s);
    }
    if (!*next) return py::none();
    if ((*next)->device_images != nullptr) {
      return DeviceBatch(std::move(*next), reinterpret_cast<void*>(stream), loader.it->options().device_id);
    }
    auto lease = std::make_shared<prefetch::BatchLease>(std::move(*next));
    const prefetch::Batch& b = **lease;
    const int64_t n = b.size, h = b.height, w = b.width;

    // images: [N, 3, H, W] over NHWC memory, so channels-last: the slot's own bytes, or (with
    // normalize) floats of their own, in which case the slot goes back to the ring at once.
    auto img = std::make_unique<TensorOwner>();
    img->shape = {n, 3, h, w};
    img->strides = {h * w * 3, 1, w * 3, 3};
    py::capsule images;
    if (normalize_) {
      const bool half = normalize_->dtype == augment::DType::kFloat16;
      img->bytes.resize(augment::NormalizedBytes(b.size, b.width, b.height, normalize_->dtype));
      Status st;
      {
        GilReleased unlocked;
        st = augment::Normalize(b.images, b.size, b.width, b.height, *normalize_, img->bytes);
      }
      if (!st.ok()) Raise(st);
      void* data = img->bytes.data();
      images = Capsule(data, {kDLFloat, static_cast<uint8_t>(half ? 16 : 32), 1}, std::move(img));
    } else {
      img->lease = lease;
      images = Capsule(const_cast<uint8_t*>(b.images.data()), {kDLUInt, 8, 1}, std::move(img));
    }

    py::capsule labels = HostInt64(b.labels);
    py::capsule indices = HostInt64(b.indices);
    py::tuple out = py::make_tuple(images, labels, indices, b.epoch, b.number, b.replaced);
    lease.reset();  // only the uint8 images tensor (when there is one) keeps the slot
    return out;
  }

  py::object DeviceBatch(prefetch::BatchLease got, void* stream, int device_id) {
    const prefetch::Batch& b = *got;
    const int64_t n = b.size, h = b.height, w = b.width;
    const DLDevice device{kDLCUDA, device_id};
    if (Status st = prefetch::WaitForCopy(b, stream); !st.ok()) Raise(st);
    auto shared = std::make_shared<DeviceLease>();
    shared->lease = std::move(got);
    shared->stream = stream;
    const prefetch::Batch& kept = *shared->lease;
    auto* base = static_cast<uint8_t*>(const_cast<void*>(kept.device_images));

    auto img = std::make_unique<TensorOwner>();
    img->lease = shared;
    img->shape = {n, 3, h, w};
    img->strides = {h * w * 3, 1, w * 3, 3};
    py::capsule images = Capsule(base, {kDLUInt, 8, 1}, std::move(img), device);

    auto lab = std::make_unique<TensorOwner>();
    lab->lease = shared;
    lab->shape = {n};
    py::capsule labels = Capsule(base + kept.device_labels_offset, {kDLInt, 32, 1}, std::move(lab), device);

    py::capsule indices = HostInt64(kept.indices);
    py::tuple out = py::make_tuple(images, labels, indices, kept.epoch, kept.number, kept.replaced);
    shared.reset();  // the two device views keep the slot
    return out;
  }

  // Stops the pipeline and joins its threads; batches still held stay valid. A next() in flight
  // holds the loader and joins its threads as it returns.
  void Close() {
    std::shared_ptr<prefetch::Loader> loader = std::move(loader_);
    if (!loader) return;
    if (Forked()) {
      // A copy of the parent's loader, whose threads were not copied: stopping it would wait for
      // them for ever. Its memory is left as it is (the parent owns the real one).
      new std::shared_ptr<prefetch::Loader>(std::move(loader));
      return;
    }
    {
      GilReleased unlocked;
      loader->Stop();
    }
    closed_bad_ = loader->bad_records();  // still listed after close()
    GilReleased unlocked;
    loader.reset();
  }

  py::dict Stats() const {
    py::dict d;
    if (!loader_) return d;
    const prefetch::LoaderStats s = loader_->stats();
    d["batches"] = s.batches;
    d["samples"] = s.samples;
    d["bad_records"] = s.bad_records;
    d["images_per_s"] = s.images_per_s;
    d["consumer_wait_s"] = s.consumer_wait_s;
    return d;
  }
  py::list BadRecords() const {
    py::list out;
    for (const prefetch::BadRecord& r : loader_ ? loader_->bad_records() : closed_bad_) {
      out.append(py::make_tuple(r.index, MessageText(r.reason), r.own));
    }
    return out;
  }

 private:
  std::vector<prefetch::BadRecord> closed_bad_;  // the pipeline's, once closed

  // A next()'s reference to the loader: when it is the last one (close() ran meanwhile), the
  // loader's threads are joined with the GIL released.
  struct Held {
    std::shared_ptr<prefetch::Loader> it;
    ~Held() {
      if (it.use_count() == 1) {
        GilReleased unlocked;
        it.reset();
      }
    }
  };

  bool Forked() const { return ::getpid() != pid_; }

  std::shared_ptr<PyDataset> ds_;  // outlives the loader
  pid_t pid_;                      // the process that made it
  std::optional<augment::NormalizeOptions> normalize_;
  std::shared_ptr<prefetch::Loader> loader_;  // null once closed
};

// Normalises `count` uint8 HWC images of `pixels` pixels at device address `images` into `out`
// (float32, float16 or bfloat16, same layout), on `stream`, on the current device.
void NormalizeOnDevice(uintptr_t images, int count, int64_t pixels, const std::array<float, 3>& mean,
                       const std::array<float, 3>& std, const std::string& dtype, uintptr_t out, uintptr_t stream) {
  prefetch::DeviceDType t = prefetch::DeviceDType::kFloat32;
  if (dtype == "float16") {
    t = prefetch::DeviceDType::kFloat16;
  } else if (dtype == "bfloat16") {
    t = prefetch::DeviceDType::kBFloat16;
  } else if (dtype != "float32") {
    throw py::value_error(fmt::format("stoke: dtype {}: expected float32, float16 or bfloat16", dtype));
  }
  Status st = prefetch::NormalizeOnDevice(reinterpret_cast<const uint8_t*>(images), count, count, pixels, mean, std,
                                          t, reinterpret_cast<void*>(out), reinterpret_cast<void*>(stream));
  if (!st.ok()) Raise(st);
}

// ---------------------------------------------------------------- pack and verify

// Runs `fn` on a thread of its own while this (the main) thread waits with the GIL released,
// checking for Ctrl-C: on one, `stop` is set (the work ends at its next safe point, leaving
// resumable state) and KeyboardInterrupt is raised once it has. The worker holds no GIL, so
// its result comes back as it is, to be raised (Take) here.
template <typename T>
Result<T> RunInterruptibly(std::atomic<bool>& stop, std::function<Result<T>()> fn) {
  std::optional<Result<T>> result;
  std::exception_ptr error;
  std::atomic<bool> done{false};
  std::thread worker([&] {
    try {
      result.emplace(fn());
    } catch (...) {
      error = std::current_exception();
    }
    done.store(true);
  });
  bool interrupted = false;
  while (!done.load()) {
    {
      GilReleased unlocked;
      for (int i = 0; i < 50 && !done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!interrupted && PyErr_CheckSignals() != 0) {
      interrupted = true;  // the KeyboardInterrupt stays set and is raised after the join
      stop.store(true);
    }
  }
  {
    GilReleased unlocked;
    worker.join();
  }
  if (interrupted) throw py::error_already_set();
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

py::dict Pack(const std::string& source, const std::string& output, const py::dict& o, py::object progress) {
  pack::PackOptions p;
  p.source = source;
  p.output = output;
  p.progress = false;
  auto get = [&](const char* key, auto def) {
    return o.contains(key) && !o[key].is_none() ? o[key].cast<decltype(def)>() : def;
  };
  p.list_file = get("list_file", std::string());
  p.val_output = get("val_output", std::string());
  p.threads = get("threads", 0);
  p.max_side = get("max_side", 0);
  p.quality = get("quality", 0);
  p.shuffle = get("shuffle", false);
  p.seed = get("seed", uint64_t{0});
  p.val_fraction = get("val_fraction", 0.0);
  p.resume = get("resume", false);
  p.overwrite = get("overwrite", false);
  p.store_paths = get("store_paths", true);
  p.report_file = get("report", std::string());
  p.index_intervals_per_row = get("index_intervals", 8);
  p.commit_every = get("commit_every", int64_t{2048});
  const std::string encoding = get("encoding", std::string("jpeg"));
  const std::string on_error = get("on_error", std::string("skip"));
  const std::string validate = get("validate", std::string("coefficients"));
  const std::string index = get("index", std::string("restart"));
  auto choose = [](const std::string& key, const std::string& v, std::initializer_list<const char*> allowed) {
    for (const char* a : allowed) {
      if (v == a) return;
    }
    std::string list;
    for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    throw py::value_error(fmt::format("stoke.pack: {}='{}': expected one of {}", key, v, list));
  };
  choose("encoding", encoding, {"jpeg", "raw"});
  choose("on_error", on_error, {"skip", "fail"});
  choose("validate", validate, {"coefficients", "pixels"});
  choose("index", index, {"restart", "none"});
  p.encoding = encoding == "raw" ? dataset::PayloadEncoding::kRaw : dataset::PayloadEncoding::kJpeg;
  p.on_error = on_error == "fail" ? pack::OnError::kFail : pack::OnError::kSkip;
  p.validate = validate == "pixels" ? pack::ValidateMode::kPixels : pack::ValidateMode::kCoefficients;
  p.index = index == "none" ? pack::IndexMode::kNone : pack::IndexMode::kRestart;
  std::atomic<bool> stop{false};
  std::optional<py::error_already_set> callback_error;  // written and read under the GIL
  if (!progress.is_none()) {
    // Called on the writer thread after each commit with the records committed so far.
    // The options (and so this function) are copied and dropped on the pack's threads, without the
    // GIL: they share one reference to the callable, taken and given back under the GIL.
    std::shared_ptr<py::object> callable(new py::object(std::move(progress)), [](py::object* o) {
      GilAcquired locked;
      delete o;
    });
    // An exception it raises stops the pack at once (as Ctrl-C does: resumable) and is raised
    // from stoke.pack.
    p.after_commit = [callable, &callback_error, &stop](int64_t records) {
      GilAcquired locked;
      if (callback_error) return;
      try {
        (*callable)(records);
      } catch (py::error_already_set& e) {
        callback_error = std::move(e);
        stop.store(true);
      }
    };
  }
  p.stop = &stop;
  Result<pack::PackSummary> packed = RunInterruptibly<pack::PackSummary>(stop, [&] { return pack::Pack(p); });
  if (callback_error) throw std::move(*callback_error);
  pack::PackSummary summary = Take(std::move(packed));
  py::dict r;
  py::list splits;
  for (const auto& sp : summary.splits) {
    py::dict d;
    d["name"] = sp.name;
    d["output"] = PathText(sp.output.string());
    d["inputs"] = sp.inputs;
    d["records"] = sp.records;
    d["payload_bytes"] = sp.payload_bytes;
    d["already_complete"] = sp.already_complete;
    splits.append(d);
  }
  py::list bad;
  for (const auto& b : summary.bad) bad.append(py::make_tuple(PathText(b.path), MessageText(b.reason)));
  r["splits"] = splits;
  r["inputs"] = summary.inputs;
  r["classes"] = summary.classes;
  r["converted"] = summary.converted;
  r["reencoded"] = summary.reencoded;
  r["reoriented"] = summary.reoriented;
  r["bad"] = bad;
  r["seconds"] = summary.seconds;
  r["threads"] = summary.threads;
  return r;
}

// Every record's CRC checked and image strictly decoded: [(index, source, reason)] of the bad ones.
py::list Verify(const std::string& path, int threads) {
  inspect::InspectOptions o;
  o.verify = true;
  o.threads = threads;
  o.progress = false;
  std::atomic<bool> stop{false};
  o.stop = &stop;
  inspect::InspectReport report =
      Take(RunInterruptibly<inspect::InspectReport>(stop, [&] { return inspect::Inspect(path, o); }));
  py::list bad;
  for (const auto& b : report.bad) bad.append(py::make_tuple(b.index, PathText(b.source_path), MessageText(b.reason)));
  // A manifest whose totals disagree with the records is listed under index -1.
  for (const auto& p : report.manifest_problems) bad.append(py::make_tuple(-1, std::string("manifest"), MessageText(p)));
  return bad;
}

// The C++ loader's batches consumed directly (copied out), for the tests that compare the
// zero-copy path with it: a list of (images bytes, labels, indices).
py::list ReferenceBatches(const std::shared_ptr<PyDataset>& ds, const EpochOptions& e, int max_batches) {
  auto loader = Take(prefetch::Loader::Create(*ds->ds, ToLoaderOptions(e, ds->ds->size())));
  py::list out;
  for (int i = 0; i < max_batches; ++i) {
    auto lease = Take(loader->Next());
    if (!lease) break;
    const prefetch::Batch& b = *lease;
    out.append(py::make_tuple(py::bytes(reinterpret_cast<const char*>(b.images.data()), b.images.size()),
                              std::vector<int32_t>(b.labels.begin(), b.labels.end()),
                              std::vector<int64_t>(b.indices.begin(), b.indices.end())));
  }
  return out;
}

}  // namespace
}  // namespace stoke::python

PYBIND11_MODULE(_stoke, m) {
  using namespace stoke::python;
  namespace ds = stoke::dataset;
  m.doc() = "stoke's native module: packed datasets and the loader (see the stoke package)";
  m.attr("__version__") = STOKE_VERSION;
  py::register_exception<BuffersHeld>(m, "BuffersHeldError", PyExc_RuntimeError);
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

  py::class_<RecordBytes>(m, "RecordBytes", py::buffer_protocol())
      .def_buffer([](RecordBytes& r) {
        return py::buffer_info(const_cast<std::byte*>(r.data), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size)}, {1}, /*readonly=*/true);
      })
      .def("__len__", [](const RecordBytes& r) { return r.size; });

  py::class_<PyDataset, std::shared_ptr<PyDataset>>(m, "Dataset")
      .def(py::init(&OpenDataset), py::arg("path"),
           "Opens a dataset made by `stoke pack` (its directory or its data file).")
      .def("__len__", [](const PyDataset& d) { return d.ds->size(); })
      .def_property_readonly("path", [](const PyDataset& d) { return PathText(d.ds->path().string()); })
      .def_property_readonly("classes", [](const PyDataset& d) { return d.ds->manifest().classes; })
      .def_property_readonly("class_counts", [](const PyDataset& d) { return d.ds->manifest().class_counts; })
      .def_property_readonly("format_version", [](const PyDataset& d) { return d.ds->manifest().format_version; })
      .def_property_readonly("payload_bytes", [](const PyDataset& d) { return d.ds->manifest().payload_bytes; })
      .def_property_readonly(
          "fingerprint",
          [](const PyDataset& d) {
            // stoke pack's hash of the inputs (names, labels, classes) and options (order, seed):
            // two datasets with the same one hold the same records in the same order.
            const auto it = d.ds->manifest().packing.find("fingerprint");
            return it != d.ds->manifest().packing.end() && it->is_string() ? it->get<std::string>() : std::string();
          },
          "stoke pack's fingerprint of the inputs and options this dataset was packed from ('' if none).")
      .def(
          "record",
          [](const std::shared_ptr<PyDataset>& d, const py::object& index_object) {
            // Any integer (numpy's too, through __index__); one beyond int64 is out of range too. A
            // bool (Python's or numpy's) is no index: record(True) was record 1.
            if (PyBool_Check(index_object.ptr()) || std::string_view(Py_TYPE(index_object.ptr())->tp_name) == "numpy.bool_") {
              RaiseText(PyExc_TypeError, fmt::format("stoke: record {}: expected an int index, not a bool",
                                                     py::str(index_object).cast<std::string>()));
            }
            const auto index = py::reinterpret_steal<py::int_>(PyNumber_Index(index_object.ptr()));
            if (!index) throw py::error_already_set();
            const int64_t n = d->ds->size();
            if (index < py::int_(-n) || index >= py::int_(n)) {
              const std::string text = py::str(static_cast<const py::object&>(index));
              RaiseText(PyExc_IndexError, fmt::format("stoke: record {} out of range: the dataset {} has {} records",
                                                      text, d->ds->path().string(), n));
            }
            const int64_t asked = index.cast<int64_t>();
            const int64_t i = asked < 0 ? asked + n : asked;
            auto view = Take(d->reader->Get(i));
            // A missing or damaged paths table costs the source only (verify() reports it): the
            // record itself is intact (its CRC is checked).
            std::string source;
            if (d->ds->manifest().has_paths && d->ds->paths_status().ok()) {
              stoke::Result<std::string> path = d->reader->SourcePath(i);
              if (path.ok()) {
                source = std::move(path).value();
              } else if (path.status().code() != stoke::StatusCode::kCorrupt) {
                Raise(path.status());  // an I/O error, not damage to the dataset
              }
            }
            RecordBytes bytes{d, view.image.data(), view.image.size()};
            py::dict r;
            r["index"] = i;
            r["label"] = view.header.label;
            r["width"] = view.header.width;
            r["height"] = view.header.height;
            r["source"] = PathText(source);
            r["bytes"] = py::memoryview(py::cast(std::move(bytes)));
            return r;
          },
          py::arg("index"),
          "Record `index`: its label, size, source path and encoded bytes (a read-only memoryview into the "
          "dataset's map, valid while it is referenced).")
      .def(
          "verify",
          [](const PyDataset& d, const py::object& threads_arg) {
            // A bool is an int to pybind11, and an int past C's range a TypeError listing overloads.
            const auto refuse = [&](PyObject* type) {
              RaiseText(type, fmt::format("stoke.Dataset.verify: threads={}: expected an int from 0 to {} (0 = "
                                          "every core)",
                                          py::repr(threads_arg).cast<std::string>(), stoke::kMaxThreads));
            };
            if (PyBool_Check(threads_arg.ptr()) || !PyIndex_Check(threads_arg.ptr())) refuse(PyExc_TypeError);
            const py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(threads_arg.ptr()));  // numpy ints
            if (!index) throw py::error_already_set();
            int overflow = 0;
            const long long t = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
            if (overflow != 0 || t < 0 || t > stoke::kMaxThreads) refuse(PyExc_ValueError);
            const int threads = static_cast<int>(t);
            // Verify opens the dataset again by its path: the one there now must be the one open
            // (it checked whatever had been moved or copied there since).
            struct stat open_file {}, named {};
            const std::string data = (d.ds->path() / "data.mdb").string();
            if (d.ds->data_fd() >= 0 && ::fstat(d.ds->data_fd(), &open_file) == 0 &&
                (::stat(data.c_str(), &named) != 0 || named.st_dev != open_file.st_dev ||
                 named.st_ino != open_file.st_ino)) {
              RaiseText(PyExc_ValueError,
                        fmt::format("stoke.Dataset.verify: {}: no longer the dataset this object opened (moved or "
                                    "replaced since); open it where it is now",
                                    d.ds->path().string()));
            }
            return Verify(d.ds->path().string(), threads);
          },
          py::arg("threads") = 0,
          "Checks every record's CRC and strictly decodes every image: a list of (index, source, reason) of "
          "the bad records, plus (-1, 'manifest', reason) where the manifest's class counts or payload bytes "
          "disagree with the records (empty when the dataset is intact).");

  py::class_<EpochOptions>(m, "EpochOptions")
      .def(py::init<>())
      .def_readwrite("batch_size", &EpochOptions::batch_size)
      .def_readwrite("train", &EpochOptions::train)
      .def_readwrite("size", &EpochOptions::size)
      .def_readwrite("resize", &EpochOptions::resize)
      .def_readwrite("scale_min", &EpochOptions::scale_min)
      .def_readwrite("scale_max", &EpochOptions::scale_max)
      .def_readwrite("flip", &EpochOptions::flip)
      .def_readwrite("seed", &EpochOptions::seed)
      .def_readwrite("threads", &EpochOptions::threads)
      .def_readwrite("ring", &EpochOptions::ring)
      .def_readwrite("drop_last", &EpochOptions::drop_last)
      .def_readwrite("on_error", &EpochOptions::on_error)
      .def_readwrite("max_skip_fraction", &EpochOptions::max_skip_fraction)
      .def_readwrite("known_bad", &EpochOptions::known_bad)
      .def_readwrite("rank", &EpochOptions::rank)
      .def_readwrite("world_size", &EpochOptions::world_size)
      .def_readwrite("epoch", &EpochOptions::epoch)
      .def_readwrite("start_batch", &EpochOptions::start_batch)
      .def_readwrite("epochs", &EpochOptions::epochs)
      .def_readwrite("normalize", &EpochOptions::normalize)
      .def_readwrite("mean", &EpochOptions::mean)
      .def_readwrite("std", &EpochOptions::std)
      .def_readwrite("dtype", &EpochOptions::dtype)
      .def_readwrite("device", &EpochOptions::device);

  py::class_<EpochLoader>(m, "EpochLoader")
      .def(py::init<std::shared_ptr<PyDataset>, const EpochOptions&>(), py::arg("dataset"), py::arg("options"))
      .def("batches", &EpochLoader::batches, "Batches in this epoch for this rank (from the first, not the start).")
      .def("next", &EpochLoader::Next, py::arg("stream") = 0)
      .def("close", &EpochLoader::Close)
      .def("stats", &EpochLoader::Stats)
      .def("bad_records", &EpochLoader::BadRecords);

  m.def("_normalize_on_device", &NormalizeOnDevice, py::arg("images"), py::arg("count"), py::arg("pixels"),
        py::arg("mean"), py::arg("std"), py::arg("dtype"), py::arg("out"), py::arg("stream"));
  m.def("_core_share", &stoke::CoreShare, py::arg("processes"),
        "one process's share of the usable cores when `processes` of a job share this machine");
  m.def("_cuda", [] {
    const stoke::prefetch::CudaProbe p = stoke::prefetch::ProbeCuda();
    return py::make_tuple(p.built, p.devices, p.reason);
  }, "(built with CUDA, usable GPUs, why none) as the loader sees them");
  m.def("_pack", &Pack, py::arg("source"), py::arg("output"), py::arg("options"), py::arg("progress"));
  m.def("_verify", &Verify, py::arg("path"), py::arg("threads"));
  m.def("_reference_batches", &ReferenceBatches, py::arg("dataset"), py::arg("options"), py::arg("max_batches"));
}
