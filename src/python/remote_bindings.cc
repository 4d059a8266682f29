// nonstop._core.copy_checkpoint: the one C++ call the remote tier
// (python/nonstop/_remote.py) needs: a committed checkpoint of a rank's slot
// file copied into a new one-slot file (the same bytes, counter, step,
// tensors, metadata and checksums; store.h CopyCheckpoint), verifying every
// chunk crc on the way. The copy is what gets uploaded and what a replaced
// node fetches back. A slot reused while it is being copied fails the crc
// check: the copy is then an error, never a mix of two checkpoints.
//
// nonstop._core.remote_layout: the layout and commit rules of a remote
// checkpoint (jobdir/remote_layout.h) for the transfer in _remote.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "jobdir/remote_layout.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

namespace {

namespace rl = nonstop::remote;

py::dict DocDict(const rl::Doc& d) {
  py::dict o;
  o["step"] = d.step;
  o["world_size"] = d.world_size;
  o["lineage"] = d.lineage;
  o["counter"] = d.counter ? py::cast(*d.counter) : py::none();
  o["rank"] = d.rank ? py::cast(*d.rank) : py::none();
  o["unix_s"] = d.unix_s ? py::cast(*d.unix_s) : py::none();
  return o;
}

py::dict ManifestDict(const rl::Manifest& m) {
  py::dict o;
  o["step"] = m.step;
  o["counter"] = m.counter;
  o["rank"] = m.rank;
  o["world_size"] = m.world_size;
  o["lineage"] = m.lineage;
  o["bytes"] = m.bytes;
  o["part_bytes"] = m.part_bytes;
  o["part_crc32"] = m.part_crc32;
  return o;
}

std::string_view View(const py::bytes& b) {
  char* p = nullptr;
  Py_ssize_t n = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &p, &n) != 0) throw py::error_already_set();
  return {p, static_cast<size_t>(n)};
}

rl::Doc MakeDoc(int64_t step, uint32_t world, int64_t lineage) {
  rl::Doc d;
  d.step = step;
  d.world_size = world;
  d.lineage = lineage;
  return d;
}

const char* KindName(rl::Key::Kind k) {
  switch (k) {
    case rl::Key::Kind::kPart: return "part";
    case rl::Key::Kind::kManifest: return "manifest";
    case rl::Key::Kind::kMarker: return "marker";
    case rl::Key::Kind::kLead: return "lead";
    case rl::Key::Kind::kSkip: return "skip";
    case rl::Key::Kind::kOther: return "other";
  }
  return "other";
}

void InitRemoteLayout(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "remote_layout", "The layout and commit rules of a remote checkpoint (remote_layout.h).");
  m.attr("FORMAT") = rl::kFormat;
  m.attr("MAX_DOC_BYTES") = rl::kMaxDocBytes;
  m.attr("MAX_WORLD") = rl::kMaxWorld;
  m.def("step_dir", &rl::StepDir, py::arg("step"));
  m.def("part_key", &rl::PartKey, py::arg("step"), py::arg("rank"));
  m.def("manifest_key", &rl::ManifestKey, py::arg("step"), py::arg("rank"));
  m.def("marker_key", &rl::MarkerKey, py::arg("step"));
  m.def("lead_key", &rl::LeadKey, py::arg("step"));
  m.def("skip_key", &rl::SkipKey, py::arg("step"), py::arg("rank"));
  m.def("job_key", &rl::JobKey);
  m.def("encode_job", [](const std::string& job, double unix_s) {
    return py::bytes(rl::EncodeJob(job, unix_s));
  }, py::arg("job"), py::arg("unix_s"));
  m.def(
      "decode_job",
      [](const py::bytes& text, const std::string& what) {
        return Take(rl::DecodeJob(View(text), what));
      },
      py::arg("text"), py::arg("what"),
      "The job name of a JOB document; CorruptCheckpointError naming `what` otherwise.");
  m.def(
      "parse_key",
      [](const std::string& key) -> py::object {
        std::optional<rl::Key> k = rl::ParseKey(key);
        if (!k) return py::none();
        return py::make_tuple(k->step, KindName(k->kind), k->rank);
      },
      py::arg("key"), "(step, kind, rank) of step-N/NAME, kind one of part, manifest, marker, "
      "lead, skip, other; None for any other key.");
  m.def("checksum_unit", &rl::ChecksumUnit, py::arg("size"), py::arg("preferred"));
  m.def(
      "decode_doc",
      [](const py::bytes& text, const std::string& what) {
        return DocDict(Take(rl::DecodeDoc(View(text), what)));
      },
      py::arg("text"), py::arg("what"),
      "A COMMITTED marker, LEAD or skip note as {step, world_size, lineage, counter, rank}; "
      "CorruptCheckpointError naming `what` when it is not one.");
  m.def(
      "decode_manifest",
      [](const py::bytes& text, const std::string& what) {
        return ManifestDict(Take(rl::DecodeManifest(View(text), what)));
      },
      py::arg("text"), py::arg("what"),
      "A manifest as a dict, every field checked (the checksum count against the size before "
      "the list is copied); CorruptCheckpointError naming `what` otherwise.");
  m.def(
      "check_fetch",
      [](const py::bytes& marker, const py::bytes& manifest, int64_t step, uint32_t rank,
         const std::string& where) {
        rl::Doc d = Take(rl::DecodeDoc(View(marker), where + "/COMMITTED"));
        rl::Manifest man = Take(rl::DecodeManifest(
            View(manifest), where + "/" + rl::ManifestKey(step, rank).substr(18)));
        Check(rl::CheckFetch(d, man, step, rank, where));
        return ManifestDict(man);
      },
      py::arg("marker"), py::arg("manifest"), py::arg("step"), py::arg("rank"),
      py::arg("where"),
      "Before fetching rank `rank`'s part of `step`: the marker and manifest decoded and of "
      "that step, rank and lineage; returns the manifest.");
  m.def(
      "encode_manifest",
      [](int64_t step, uint64_t counter, uint32_t rank, uint32_t world, int64_t lineage,
         uint64_t bytes, uint64_t part_bytes, std::vector<uint32_t> crcs, double unix_s) {
        rl::Manifest man;
        man.step = step;
        man.counter = counter;
        man.rank = rank;
        man.world_size = world;
        man.lineage = lineage;
        man.bytes = bytes;
        man.part_bytes = part_bytes;
        man.part_crc32 = std::move(crcs);
        std::string text = rl::EncodeManifest(man, unix_s);
        // what is written must read back: the writer checks its own document
        Take(rl::DecodeManifest(text, "the manifest being written"));
        return py::bytes(text);
      },
      py::arg("step"), py::arg("counter"), py::arg("rank"), py::arg("world_size"),
      py::arg("lineage"), py::arg("bytes"), py::arg("part_bytes"), py::arg("part_crc32"),
      py::arg("unix_s"));
  m.def(
      "commit_marker",
      [](int64_t step, uint32_t world, int64_t lineage, uint64_t counter,
         const std::vector<py::bytes>& manifests, double unix_s) -> py::object {
        rl::Doc marker = MakeDoc(step, world, lineage);
        marker.counter = counter;
        std::vector<rl::Manifest> mans;
        for (size_t i = 0; i < manifests.size(); ++i) {
          mans.push_back(Take(rl::DecodeManifest(View(manifests[i]), "a manifest")));
        }
        if (!rl::Committed(marker, mans)) return py::none();
        return py::bytes(rl::EncodeMarker(marker, mans, unix_s));
      },
      py::arg("step"), py::arg("world_size"), py::arg("lineage"), py::arg("counter"),
      py::arg("manifests"), py::arg("unix_s"),
      "The COMMITTED marker when `manifests` (one text per rank) satisfy the commit rule, "
      "else None.");
  m.def(
      "encode_lead",
      [](int64_t step, uint32_t world, int64_t lineage, double unix_s) {
        return py::bytes(rl::EncodeLead(MakeDoc(step, world, lineage), unix_s));
      },
      py::arg("step"), py::arg("world_size"), py::arg("lineage"), py::arg("unix_s"));
  m.def(
      "encode_skip",
      [](int64_t step, uint32_t world, int64_t lineage, uint32_t rank, double unix_s) {
        rl::Doc d = MakeDoc(step, world, lineage);
        d.rank = rank;
        return py::bytes(rl::EncodeSkip(d, unix_s));
      },
      py::arg("step"), py::arg("world_size"), py::arg("lineage"), py::arg("rank"),
      py::arg("unix_s"));
  m.def(
      "steps_to_delete",
      [](const std::vector<std::tuple<int64_t, bool, std::optional<uint64_t>>>& steps,
         uint32_t max_to_keep, uint64_t keep_every, uint32_t keep_max) {
        std::vector<rl::StepState> v;
        for (const auto& [step, committed, counter] : steps) v.push_back({step, committed, counter});
        return rl::StepsToDelete(v, {max_to_keep, keep_every, keep_max});
      },
      py::arg("steps"), py::arg("max_to_keep"), py::arg("keep_every"), py::arg("keep_max"),
      "Retention: the steps to delete, oldest first, of [(step, committed, counter or None)].");
  m.def(
      "looks_like_remote_root",
      [](const std::string& path) {
        py::gil_scoped_release release;
        return rl::LooksLikeRemoteRoot(DefaultEnv(), path);
      },
      py::arg("path"),
      "True for a directory used as a remote (a step-N directory, no slot file).");
  m.def("delete_batches", &rl::DeleteBatches, py::arg("keys"),
        "The keys of one step in deletion order: [marker], [manifests, notes], [parts, rest].");
}

}  // namespace

void InitRemote(py::module_& m) {
  m.def(
      "copy_checkpoint",
      [](const std::string& dir, uint32_t rank, uint64_t counter, const std::string& dest,
         Directory* dest_dir) {
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
          std::unique_ptr<Medium> out;
          std::string where = dest;
          if (dest_dir != nullptr) {  // `dest` a name in dest_dir: O_EXCL|O_NOFOLLOW relative to it
            where = dest_dir->path() + "/" + dest;
            out = Take(dest_dir->CreateFile(dest, MediumKind::kBuffered, MediumOptions{}));
          } else {
            MediumOptions wo;
            wo.create = true;
            out = Take(OpenMedium(dest, MediumKind::kBuffered, wo));
          }
          Check(CopyCheckpoint(*src, *info, std::move(out)).Annotate("copying to " + where));
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
      py::arg("dest_dir") = nullptr,
      "Copies committed checkpoint `counter` of `dir`/rank-R.nsck into the new one-slot "
      "file `dest` (a path, or with dest_dir a name created O_EXCL|O_NOFOLLOW in that "
      "_core.Directory), verifying every chunk; returns {counter, step, data_bytes}.");
  InitRemoteLayout(m);
}

}  // namespace nonstop::py_bindings
