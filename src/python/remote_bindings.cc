// nonstop._core.copy_checkpoint: the one C++ call the remote tier
// (python/nonstop/_remote.py) needs: a committed checkpoint of a rank's slot
// file copied into a new one-slot file (the same bytes, counter, step,
// tensors, metadata and checksums; store.h CopyCheckpoint), verifying every
// chunk crc on the way. The copy is what gets uploaded and what a replaced
// node fetches back. A slot reused while it is being copied fails the crc
// check: the copy is then an error, never a mix of two checkpoints.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

void InitRemote(py::module_& m) {
  m.def(
      "copy_checkpoint",
      [](const std::string& dir, uint32_t rank, uint64_t counter, const std::string& dest) {
        int64_t step = 0;
        uint64_t data_bytes = 0;
        {
          py::gil_scoped_release release;
          const std::string path = (std::filesystem::path(dir) / SlotFileName(rank)).string();
          MediumOptions ro;
          ro.read_only = true;
          auto src = Take(SlotFile::Open(Take(OpenMedium(path, MediumKind::kBuffered, ro))));
          ScanOptions so;
          so.verify_data = false;  // CopyCheckpoint verifies every chunk it copies
          ScanReport report = Take(src->Scan(so));
          const CheckpointInfo* info = nullptr;
          for (const auto& c : report.checkpoints) {
            if (c.state == CheckpointState::kCommitted && c.info.counter == counter) {
              info = &c.info;
              break;
            }
          }
          if (info == nullptr) {
            throw StatusError(Status::NotFound("no committed checkpoint with counter " +
                                               std::to_string(counter) + " in " + path));
          }
          MediumOptions wo;
          wo.create = true;
          auto out = Take(OpenMedium(dest, MediumKind::kBuffered, wo));
          Check(CopyCheckpoint(*src, *info, std::move(out)).Annotate("copying to " + dest));
          step = info->step;
          data_bytes = info->data_bytes;
        }
        py::dict d;
        d["counter"] = counter;
        d["step"] = step;
        d["data_bytes"] = data_bytes;
        return d;
      },
      py::arg("dir"), py::arg("rank"), py::arg("counter"), py::arg("dest"),
      "Copies committed checkpoint `counter` of `dir`/rank-R.nsck into the new one-slot "
      "file `dest`, verifying every chunk; returns {counter, step, data_bytes}.");
}

}  // namespace nonstop::py_bindings
