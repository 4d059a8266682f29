// nonstop._core.Directory: the Env seam (nonstop/env.h) for the Python side.
// Every file and directory operation the Python modules make (staging,
// fetching, the local-path remote, markers) goes through a Directory here,
// so that files are created with O_CREAT|O_EXCL|O_NOFOLLOW relative to a
// directory fd and symlinks are refused, never followed. Thin: no logic
// beyond forwarding; the GIL is released around every call that does I/O.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "env/write_folder.h"
#include "nonstop/env.h"
#include "python/bindings.h"
#include "tier/pacer.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

using GilRelease = py::gil_scoped_release;

const char* TypeName(EntryType t) {
  switch (t) {
    case EntryType::kFile: return "file";
    case EntryType::kDirectory: return "dir";
    case EntryType::kSymlink: return "symlink";
    case EntryType::kOther: break;
  }
  return "other";
}

// A new file being written: created exclusively, appended to, then either
// committed (sync, close, rename over `dest`, SyncDir) or aborted (closed
// and removed). Owns a reference to its Directory.
class PyWriter {
 public:
  PyWriter(std::shared_ptr<Directory> dir, std::string name, std::unique_ptr<Medium> m)
      : dir_(std::move(dir)), name_(std::move(name)), medium_(std::move(m)) {}

  void Write(const py::buffer& b) {
    py::buffer_info info = b.request();
    const size_t n = static_cast<size_t>(info.size * info.itemsize);
    Medium* m = Open();
    Status s;
    {
      GilRelease g;
      s = m->Write(offset_, info.ptr, n);
    }
    Check(s);
    offset_ += n;
  }

  void Commit(const std::string& dest) {
    Medium* m = Open();
    Status s;
    {
      GilRelease g;
      s = m->Sync();
      if (s.ok()) {
        medium_.reset();
        s = dir_->Rename(name_, dest);
      }
      if (s.ok()) s = dir_->SyncDir();
    }
    if (!s.ok()) {
      Abort();
      throw StatusError(s);
    }
    medium_.reset();
    done_ = true;
  }

  void Abort() {
    if (done_) return;
    done_ = true;
    GilRelease g;
    medium_.reset();
    (void)dir_->Unlink(name_);  // best effort: a stale temp is removed by the next writer
  }

  uint64_t written() const { return offset_; }

 private:
  Medium* Open() {
    if (done_ || !medium_) throw StatusError(Status::FailedPrecondition(
        dir_->path() + "/" + name_ + " is already committed or aborted"));
    return medium_.get();
  }

  std::shared_ptr<Directory> dir_;
  std::string name_;
  std::unique_ptr<Medium> medium_;
  uint64_t offset_ = 0;
  bool done_ = false;
};

// A file opened for reading through the seam (O_NOFOLLOW relative to the
// directory fd): a sequential binary reader with the file-object methods
// obstore and the crc pass need. Each read allocates the bytes object first
// and fills it with the GIL released.
class PyReadFile {
 public:
  // bps > 0: reads keep to that many bytes a second (the upload bandwidth
  // limit, tier/pacer.h); `abort` (an object with is_set(), a
  // threading.Event; None: never) stops a paced read with Aborted.
  PyReadFile(std::shared_ptr<Directory> dir, std::string name, std::unique_ptr<Medium> m,
             double bps = 0, py::object abort = py::none())
      : dir_(std::move(dir)), name_(std::move(name)), medium_(std::move(m)), pace_(bps),
        paced_(bps > 0), abort_(std::move(abort)) {}

  // The state is touched with the GIL held only; the read itself runs
  // without it on a reference to the medium (a close meanwhile cannot free
  // it) and into a range reserved before the GIL is dropped.
  py::bytes Read(int64_t n) {
    std::shared_ptr<Medium> m = Open();
    const uint64_t size = m->Size();
    const uint64_t at = pos_;
    const uint64_t left = at < size ? size - at : 0;
    const uint64_t take = n < 0 ? left : std::min<uint64_t>(left, static_cast<uint64_t>(n));
    PyObject* obj = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(take));
    if (obj == nullptr) throw py::error_already_set();
    py::bytes out = py::reinterpret_steal<py::bytes>(obj);
    pos_ = at + take;
    read_ += take;
    const uint64_t read = read_;
    if (take > 0 || paced_) {
      char* dst = PyBytes_AS_STRING(obj);
      Status s;
      {
        GilRelease g;
        if (take > 0) s = m->Read(at, dst, take);
        if (s.ok() && paced_) {
          s = pace_.Wait(read, [this] {
            py::gil_scoped_acquire gil;
            return !abort_.is_none() && abort_.attr("is_set")().cast<bool>();
          });
        }
      }
      Check(s);
    }
    return out;
  }

  uint64_t Seek(int64_t offset, int whence) {
    if (whence < 0 || whence > 2) {
      throw StatusError(Status::InvalidArgument("seek in " + dir_->path() + "/" + name_ +
                                                ": whence must be 0, 1 or 2"));
    }
    const int64_t base = whence == 0   ? 0
                         : whence == 1 ? static_cast<int64_t>(pos_)
                                       : static_cast<int64_t>(Open()->Size());
    if (base + offset < 0) {
      throw StatusError(Status::InvalidArgument("seek in " + dir_->path() + "/" + name_ +
                                                ": before the start of the file"));
    }
    pos_ = static_cast<uint64_t>(base + offset);
    return pos_;
  }

  uint64_t Tell() const { return pos_; }
  uint64_t Size() { return Open()->Size(); }
  void Close() {
    std::shared_ptr<Medium> m = std::move(medium_);
    GilRelease g;
    m.reset();  // closed here unless a read still runs (then when it ends)
  }

 private:
  std::shared_ptr<Medium> Open() {
    if (!medium_) {
      throw StatusError(
          Status::FailedPrecondition(dir_->path() + "/" + name_ + " is already closed"));
    }
    return medium_;
  }

  std::shared_ptr<Directory> dir_;
  std::string name_;
  std::shared_ptr<Medium> medium_;
  uint64_t pos_ = 0;
  uint64_t read_ = 0;  // bytes read in all (the pace's count)
  tier::Pacer pace_;
  bool paced_;
  py::object abort_;
};

std::shared_ptr<Directory> OpenDirectory(const std::string& path, bool create) {
  Result<std::unique_ptr<Directory>> r = Status::Internal("unset");
  {
    GilRelease g;
    r = DefaultEnv()->OpenDirectory(path, create);
  }
  return std::shared_ptr<Directory>(Take(std::move(r)));
}

}  // namespace

void InitEnv(py::module_& m) {
  py::class_<PyWriter>(m, "FileWriter",
                       "A file created exclusively by Directory.create (O_EXCL|O_NOFOLLOW); "
                       "commit(dest) syncs it, renames it over dest and syncs the directory; "
                       "abort() removes it. As a context manager it aborts unless committed.")
      .def("write", &PyWriter::Write, py::arg("data"))
      .def("commit", &PyWriter::Commit, py::arg("dest"))
      .def("abort", &PyWriter::Abort)
      .def_property_readonly("written", &PyWriter::written)
      .def("__enter__", [](PyWriter& w) -> PyWriter& { return w; },
           py::return_value_policy::reference)
      .def("__exit__", [](PyWriter& w, const py::args&) { w.Abort(); });

  py::class_<PyReadFile>(m, "FileReader",
                         "A file opened by Directory.open (O_NOFOLLOW relative to the directory "
                         "fd): read(n=-1), seek, tell, size, close; reads release the GIL.")
      .def("read", &PyReadFile::Read, py::arg("n") = -1)
      .def("seek", &PyReadFile::Seek, py::arg("offset"), py::arg("whence") = 0)
      .def("tell", &PyReadFile::Tell)
      .def("close", &PyReadFile::Close)
      .def("readable", [](PyReadFile&) { return true; })
      .def("seekable", [](PyReadFile&) { return true; })
      .def_property_readonly("size", &PyReadFile::Size)
      .def("__enter__", [](PyReadFile& f) -> PyReadFile& { return f; },
           py::return_value_policy::reference)
      .def("__exit__", [](PyReadFile& f, const py::args&) { f.Close(); });

  py::class_<Directory, std::shared_ptr<Directory>>(
      m, "Directory",
      "An open directory fd of the Env seam: every name is one path component, files are "
      "created O_CREAT|O_EXCL|O_NOFOLLOW relative to it and symlinks are refused.")
      .def(py::init(&OpenDirectory), py::arg("path"), py::arg("create") = false)
      .def_property_readonly("path", &Directory::path)
      .def(
          "subdir",
          [](Directory& d, const std::string& name, bool create) {
            Result<std::unique_ptr<Directory>> r = Status::Internal("unset");
            {
              GilRelease g;
              r = d.OpenDir(name, create);
            }
            return std::shared_ptr<Directory>(Take(std::move(r)));
          },
          py::arg("name"), py::arg("create") = false)
      .def(
          "write_atomic",
          [](Directory& d, const std::string& name, const py::bytes& data) {
            std::string_view content = data;
            Status s;
            {
              GilRelease g;
              s = WriteFileAtomic(d, name, content);
            }
            Check(s);
          },
          py::arg("name"), py::arg("data"))
      .def(
          "write_folder",
          [](Directory& d, const std::string& name,
             const std::vector<std::pair<std::string, py::bytes>>& files) {
            std::vector<std::pair<std::string, std::string>> content;
            for (const auto& [file, data] : files) content.emplace_back(file, std::string(data));
            Status s;
            {
              GilRelease g;
              s = WriteFolder(d, name, content);
            }
            Check(s);
          },
          py::arg("name"), py::arg("files"),
          "Writes the folder `name` holding files [(name, bytes)], replacing it: made as "
          "NAME.tmp, renamed over NAME; links removed, never followed (env/write_folder.h).")
      .def(
          "create",
          [](const std::shared_ptr<Directory>& d, const std::string& name) {
            Result<std::unique_ptr<Medium>> r = Status::Internal("unset");
            {
              GilRelease g;
              r = d->CreateFile(name, MediumKind::kBuffered, MediumOptions{});
            }
            return std::make_unique<PyWriter>(d, name, Take(std::move(r)));
          },
          py::arg("name"))
      .def(
          "open",
          [](const std::shared_ptr<Directory>& d, const std::string& name, double bps,
             py::object abort) {
            MediumOptions ro;
            ro.read_only = true;
            Result<std::unique_ptr<Medium>> r = Status::Internal("unset");
            {
              GilRelease g;
              r = d->OpenFile(name, MediumKind::kBuffered, ro);
            }
            return std::make_unique<PyReadFile>(d, name, Take(std::move(r)), bps,
                                                std::move(abort));
          },
          py::arg("name"), py::arg("bps") = 0.0, py::arg("abort") = py::none(),
          "Opens an existing regular file for reading (a symlink is refused). bps > 0: its "
          "reads keep to that many bytes a second (an upload's bandwidth limit) until "
          "abort.is_set() (a threading.Event), then raise CheckpointError.")
      .def(
          "read",
          [](Directory& d, const std::string& name, uint64_t max_bytes) -> py::object {
            Result<std::string> r = Status::Internal("unset");
            {
              GilRelease g;
              r = ReadSmallFile(d, name, max_bytes);
            }
            if (!r.ok() && r.status().code() == StatusCode::kNotFound) return py::none();
            return py::bytes(Take(std::move(r)));
          },
          py::arg("name"), py::arg("max_bytes"),
          "The whole file (at most max_bytes, else CorruptCheckpointError), or None when "
          "missing; a symlink is refused.")
      .def(
          "remove_tree",
          [](Directory& d, const std::string& name, bool missing_ok) {
            Status s;
            {
              GilRelease g;
              s = RemoveTree(d, name);
              if (s.ok()) s = d.SyncDir();
            }
            if (missing_ok && s.code() == StatusCode::kNotFound) return false;
            Check(s);
            return true;
          },
          py::arg("name"), py::arg("missing_ok") = true,
          "Removes a file, a symlink (never what it names) or a directory and everything "
          "under it, each subdirectory opened O_NOFOLLOW relative to its parent.")
      .def(
          "remove_dir",
          [](Directory& d, const std::string& name) {
            Status s;
            {
              GilRelease g;
              s = d.RemoveDir(name);
              if (s.ok()) s = d.SyncDir();
            }
            Check(s);
          },
          py::arg("name"), "Removes an empty subdirectory (an error when it is not empty).")
      .def(
          "unlink",
          [](Directory& d, const std::string& name, bool missing_ok) {
            Status s;
            {
              GilRelease g;
              s = d.Unlink(name);
            }
            if (missing_ok && s.code() == StatusCode::kNotFound) return false;
            Check(s);
            return true;
          },
          py::arg("name"), py::arg("missing_ok") = false)
      .def(
          "rename",
          [](Directory& d, const std::string& from, const std::string& to, Directory* to_dir) {
            Status s;
            {
              GilRelease g;
              s = d.Rename(from, to, to_dir);
            }
            Check(s);
          },
          py::arg("src"), py::arg("dst"), py::arg("dst_dir") = nullptr)
      .def(
          "sync",
          [](Directory& d) {
            Status s;
            {
              GilRelease g;
              s = d.SyncDir();
            }
            Check(s);
          })
      .def(
          "list",
          [](Directory& d) {
            Result<std::vector<DirEntry>> r = Status::Internal("unset");
            {
              GilRelease g;
              r = d.List();
            }
            std::vector<std::pair<std::string, std::string>> out;
            for (const DirEntry& e : Take(std::move(r))) out.emplace_back(e.name, TypeName(e.type));
            return out;
          },
          "[(name, 'file'|'dir'|'symlink'|'other')], sorted by name")
      .def(
          "stat",
          [](Directory& d, const std::string& name) -> py::object {
            Result<FileStat> r = Status::Internal("unset");
            {
              GilRelease g;
              r = d.Stat(name);
            }
            if (!r.ok() && r.status().code() == StatusCode::kNotFound) return py::none();
            FileStat st = Take(std::move(r));
            return py::make_tuple(TypeName(st.type), st.size);
          },
          py::arg("name"), "(type, size) without following a symlink, or None when missing");
}

}  // namespace nonstop::py_bindings
