// What a job directory at a path holds, checked before a job opens or
// creates it (the Python front end's check_directory, and the ranks a
// consolidating reader opens). Through the Env seam; internal to nonstop.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "nonstop/status.h"

namespace nonstop {

// The ranks of the slot files (rank-NNNNN.nsck) in `path`, ascending:
// NotFound "checkpoint directory P does not exist" when it is missing or
// no directory, NotFound "no nonstop checkpoint in P" when it holds none.
// `env` null: DefaultEnv().
Result<std::vector<int>> RankFiles(const std::string& path, Env* env = nullptr);

// Whether `path` holds rank `rank`'s slot file: NotFound for a missing
// directory or slot file when `must_exist` (false otherwise);
// FailedPrecondition, one line, for a file, a directory holding neither
// slot files nor a job's other entries (world-W/, agreed records, a temp
// slot file, remote/, peer/), or one written by a larger world than
// `world_size`.
Result<bool> CheckJobDirectory(const std::string& path, int rank, std::optional<int> world_size,
                               bool must_exist, Env* env = nullptr);

// nonstop.lightning's last.ckpt (docs/LIGHTNING.md "Files"): the small JSON
// marker NonstopCheckpoint writes once step `step` committed, naming the
// nonstop directory beside it (and Lightning's global_step, step + 1).
inline constexpr char kLightningMarkerFormat[] = "nonstop.lightning/1";
std::string LightningMarkerJson(int64_t step);
struct LightningMarker {
  std::string dir;          // one path component, beside the marker
  std::string nonstop_dir;  // that directory: the marker's folder + "/" + dir
  int64_t step = 0;
};
// The marker at `path` (through the Env: a link is refused, never followed;
// at most 64 KiB), or nullopt when `path` holds none: missing, unreadable, a
// link, a torch file (bigger, or not JSON), JSON of another format, a `dir`
// that is not one path component, a `step` that is no integer >= 0. `env`
// null: DefaultEnv().
std::optional<LightningMarker> ReadLightningMarker(const std::string& path, Env* env = nullptr);

}  // namespace nonstop
