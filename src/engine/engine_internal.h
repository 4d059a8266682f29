// Seams of the engine for tests and tools: open it over media that are not
// plain files (the FaultDisk of src/media/fault_medium.h).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "nonstop/engine.h"
#include "nonstop/medium.h"

namespace nonstop {

struct EngineMedia {
  // Opens the medium at `path`; with create=false it returns NotFound when
  // there is none (the engine then starts with no checkpoint).
  std::function<Result<std::unique_ptr<Medium>>(const std::string& path, bool create)> open;
  // Atomically replaces `to` with `from` and makes that durable (a slot file
  // resize commits this way).
  std::function<Status(const std::string& from, const std::string& to)> rename;
};

// The media Engine::Open uses: OpenMedium(opts.medium) on real files,
// rename(2) + fsync of the directory.
EngineMedia FileMedia(MediumKind kind);

Result<std::unique_ptr<Engine>> OpenEngine(const EngineOptions& opts, EngineMedia media);

}  // namespace nonstop
