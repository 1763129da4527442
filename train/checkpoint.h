// Checkpoints: the whole training state in one file, written atomically (temporary file, fsync,
// rename) so a crash or a full disk leaves the previous checkpoint as it was.
//
// Layout: "STOKECKP", u32 format version, u64 header length, the header (JSON: step, steps per
// epoch, seed, backend, the resolved config, the class names, and each tensor's name/shape/offset), the tensors as
// little-endian float32, and a CRC-32C of everything before it.
//
// Every source of randomness in a run is keyed by (seed, epoch, sample) or (seed, step), so the
// seed and the step are the whole RNG and loader state: a resumed run draws exactly the crops,
// flips, sample order and dropout masks the uninterrupted run would have drawn.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/status.h"
#include "train/network.h"

namespace stoke::train {

inline constexpr uint32_t kCheckpointFormatVersion = 1;

struct Checkpoint {
  int64_t step = 0;             // optimizer steps taken
  int64_t steps_per_epoch = 0;  // loader position: epoch = step / spe, batch = step % spe
  uint64_t seed = 0;
  std::string backend;
  std::string config_yaml;
  std::vector<std::string> classes;  // the training dataset's class names (may be empty: older files)
  std::vector<NamedTensor> tensors;  // Network::State()
  // The trainer's sums at `step` for the log interval and the epoch under way (loss, top-1,
  // top-5, count), so that a run resumed mid-epoch logs the figures of an uninterrupted one (zero
  // in older files).
  BatchStats interval, epoch;
};

std::vector<std::byte> SerializeCheckpoint(const Checkpoint& checkpoint);
// kCorrupt (naming `source`) for a wrong magic, an unknown version, a checksum mismatch, a
// truncated file or an inconsistent header.
Result<Checkpoint> ParseCheckpoint(std::span<const std::byte> bytes, const std::string& source);

Status SaveCheckpoint(const std::filesystem::path& path, const Checkpoint& checkpoint);
Result<Checkpoint> LoadCheckpoint(const std::filesystem::path& path);

// run_dir/checkpoints/step-<step>.ckpt
std::filesystem::path CheckpointPath(const std::filesystem::path& run_dir, int64_t step);
// Checkpoint files in run_dir/checkpoints, oldest (lowest step) first.
std::vector<std::filesystem::path> ListCheckpoints(const std::filesystem::path& run_dir);
// Removes all but the newest `keep` checkpoints.
void PruneCheckpoints(const std::filesystem::path& run_dir, int keep);
// A run resumed from an older checkpoint at `step` goes another way than the one that wrote the
// later checkpoints: those move to run_dir/checkpoints/after-step-<step>/ (.2, .3, ... when that
// exists; kept, not deleted), so that pruning and `--resume latest` see only the run that goes
// on. Returns that folder, or an empty path when nothing moved.
Result<std::filesystem::path> SetAsideCheckpointsAfter(const std::filesystem::path& run_dir, int64_t step);

}  // namespace stoke::train
