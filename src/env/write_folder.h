// A folder of small files written through the Env seam as one call
// (nonstop.hf's Trainer checkpoint folders; bound as _core.Directory.write_folder).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nonstop/env.h"

namespace nonstop {

// Writes the folder `name` in `dir` holding `files` [(file name, bytes)],
// replacing whatever had that name: `name`.tmp is removed (RemoveTree) and
// made afresh, each file written into it with WriteFileAtomic, then `name`
// removed (RemoveTree) and `name`.tmp renamed over it, `dir` synced. A
// symlink at either name or inside the old folder goes as a link, never
// followed.
Status WriteFolder(Directory& dir, std::string_view name,
                   const std::vector<std::pair<std::string, std::string>>& files);

}  // namespace nonstop
