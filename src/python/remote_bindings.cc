// nonstop._core.remote_layout: the names of a remote checkpoint's objects
// (jobdir/remote_layout.h), for listings and tests.
//
// nonstop._core.PathStore(root): a plain path as the remote, all in C++
// (tier/path_transport.h); a RemoteTier over it runs no Python per byte.
//
// nonstop._core.RemoteTier(transport): the remote tier (tier/remote_tier.h)
// over a PathStore, or a Python transport (_remote.ObjectStore: put_file,
// put_bytes, get_bytes, get_chunks, list, delete), as the distributed
// agreement takes a Comm; with the restore loop (tier/remote_restore.h
// RestoreFromRemote, RestoreFromRemoteDist, ExportRemote), the listing's rows
// and texts, and the object store's decisions (tier/s3_request.h). The
// C++ tier runs with the GIL released; the
// adapter (PyTransport) takes the GIL only around each call of a transport
// method, never while it waits. A transport's exception reaches C++ as a
// Status of its class; when that Status comes back out unchanged, the
// original exception is raised again (its type, message and attributes,
// e.g. CheckpointIOError.kind).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "engine/job_view.h"
#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/plan.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "jobdir/remote_layout.h"
#include "python/bindings.h"
#include "tier/remote_restore.h"
#include "tier/path_transport.h"
#include "tier/remote_tier.h"
#include "tier/s3_request.h"
#include "tier/transport.h"
#include "tier/uploader.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

// bindings.cc: whether a Python exception is a checkpoint's failure
// (nonstop's CheckpointError or an OSError), not a bug or an interrupt.
bool IsCheckpointFailure(PyObject* exc);

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

// warnings.warn("nonstop: " + line) at the caller's caller.
void Warn(const std::string& line) {
  if (PyErr_WarnEx(PyExc_UserWarning, ("nonstop: " + line).c_str(), 2) < 0) {
    throw py::error_already_set();
  }
}

std::string_view View(const py::bytes& b) {
  char* p = nullptr;
  Py_ssize_t n = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &p, &n) != 0) throw py::error_already_set();
  return {p, static_cast<size_t>(n)};
}

void InitRemoteLayout(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "remote_layout", "The layout and commit rules of a remote checkpoint (remote_layout.h).");
  m.attr("FORMAT") = rl::kFormat;
  m.attr("LOCAL_DIR") = tier::kLocalDir;  // DIR/remote/step-N: staged uploads, fetched parts
  m.def("step_dir", &rl::StepDir, py::arg("step"));
  m.def("part_key", &rl::PartKey, py::arg("step"), py::arg("rank"));
  m.def("manifest_key", &rl::ManifestKey, py::arg("step"), py::arg("rank"));
  m.def("marker_key", &rl::MarkerKey, py::arg("step"));
  m.def("job_key", &rl::JobKey);
  m.def(
      "looks_like_remote_root",
      [](const std::string& path) {
        py::gil_scoped_release release;
        return rl::LooksLikeRemoteRoot(DefaultEnv(), path);
      },
      py::arg("path"),
      "True for a directory used as a remote (a step-N directory, no slot file).");
}

// Whether the interpreter is shutting down: a C++ thread must not take the
// GIL then.
bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The Python transport as a tier::Transport. Every method takes the GIL for
// the Python call alone and drops it again before C++ goes on (a streamed
// read's buffers are checked and written with the GIL released).
class PyTransport final : public tier::Transport {
 public:
  explicit PyTransport(py::object store)
      : store_(std::move(store)),
        url_(py::str(store_.attr("url")).cast<std::string>()),
        part_(py::getattr(store_, "part_bytes", py::int_(8 << 20)).cast<uint64_t>()) {}

  std::string url() const override { return url_; }
  uint64_t part_bytes() const override { return part_; }

  Status PutFile(const std::string& key, const std::string& dir, const std::string& name,
                 double bps) override {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d,
                             DefaultEnv()->OpenDirectory(dir, false));
    return Call([&] {
      py::object src = py::cast(std::shared_ptr<Directory>(std::move(d)));
      store_.attr("put_file")(key, src, name, bps > 0 ? py::cast(bps) : py::none());
      return Status::OK();
    });
  }
  Status PutBytes(const std::string& key, std::string_view data) override {
    return Call([&] {
      store_.attr("put_bytes")(key, py::bytes(data.data(), data.size()));
      return Status::OK();
    });
  }
  Result<std::string> GetBytes(const std::string& key, uint64_t limit) override {
    return Call([&]() -> Result<std::string> {
      py::object got = store_.attr("get_bytes")(key, limit);
      if (got.is_none()) return Status::NotFound(url_ + "/" + key + ": not found");
      return std::string(View(py::bytes(got)));
    });
  }
  Status GetChunks(const std::string& key, const std::function<Status(uint64_t)>& on_size,
                   const std::function<Status(std::string_view)>& on_chunk) override {
    py::gil_scoped_acquire g;
    py::object it;
    uint64_t size = 0;
    Status s = Catch([&] {
      py::tuple got = store_.attr("get_chunks")(key);
      size = got[0].cast<uint64_t>();
      it = py::iter(got[1]);
      return Status::OK();
    });
    if (s.ok()) {
      py::gil_scoped_release r;
      s = on_size(size);
    }
    while (s.ok()) {
      py::object buf;
      Py_buffer view{};
      s = Catch([&] {
        buf = py::reinterpret_steal<py::object>(PyIter_Next(it.ptr()));
        if (!buf && PyErr_Occurred() != nullptr) throw py::error_already_set();
        if (buf && PyObject_GetBuffer(buf.ptr(), &view, PyBUF_SIMPLE) != 0) {
          throw py::error_already_set();
        }
        return Status::OK();
      });
      if (!s.ok() || !buf) break;  // a failure, or the end
      {
        py::gil_scoped_release r;  // buf and view stay referenced: nothing frees them
        s = on_chunk(std::string_view(static_cast<const char*>(view.buf),
                                      static_cast<size_t>(view.len)));
      }
      PyBuffer_Release(&view);
    }
    return s;
  }
  Result<std::vector<tier::StoredObject>> List(const std::string& prefix) override {
    return Call([&]() -> Result<std::vector<tier::StoredObject>> {
      std::vector<tier::StoredObject> out;
      for (py::handle row : store_.attr("list")(prefix)) {
        py::tuple t = py::reinterpret_borrow<py::tuple>(row);
        out.push_back({t[0].cast<std::string>(), t[1].cast<uint64_t>()});
      }
      return out;
    });
  }
  Status Delete(const std::vector<std::string>& keys) override {
    return Call([&] {
      store_.attr("delete")(keys);
      return Status::OK();
    });
  }

  // With the GIL held. Forgets this thread's last failure (before a call).
  void Forget() { errors_.erase(std::this_thread::get_id()); }
  // With the GIL held. Raises `s`: the transport's own exception when `s`
  // is the Status its failure on this thread became, else the class of its code.
  [[noreturn]] void Raise(const Status& s) {
    auto it = errors_.find(std::this_thread::get_id());
    if (it != errors_.end() && it->second.first == s.message()) {
      py::object exc = std::move(it->second.second);
      errors_.erase(it);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw py::error_already_set();
    }
    throw StatusError(s);
  }
  // With the GIL held: the `kind` attribute of the exception that `s` came
  // from on this thread (None when none).
  py::object KindOf(const Status& s) {
    auto it = errors_.find(std::this_thread::get_id());
    if (it == errors_.end() || it->second.first != s.message()) return py::none();
    return py::getattr(it->second.second, "kind", py::none());
  }
  // A throttled upload stops: the transport's abort() (its reads poll it).
  void Abort() override {
    if (Finalizing()) return;
    py::gil_scoped_acquire g;
    try {
      if (py::hasattr(store_, "abort")) store_.attr("abort")();
    } catch (py::error_already_set&) {  // best effort: the transfer then ends by itself
    }
  }

 private:
  // With the GIL held: fn() (a Status or Result), or the Status of the
  // transport's exception it raised (see Failed).
  template <typename Fn>
  auto Catch(Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (py::error_already_set& e) {
      return Failed(e);
    }
  }
  // One call of a transport method: the GIL taken for it alone.
  template <typename Fn>
  auto Call(Fn&& fn) -> decltype(fn()) {
    py::gil_scoped_acquire g;
    return Catch(std::forward<Fn>(fn));
  }
  // With the GIL held: the Status of a transport's exception, the
  // exception kept for Raise.
  Status Failed(py::error_already_set& e) {
    e.restore();
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != nullptr) PyException_SetTraceback(value, tb);
    py::object exc = py::reinterpret_steal<py::object>(value);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    const StatusCode code = StatusCodeOfException(exc.ptr());
    std::string text = py::str(exc).cast<std::string>();
    if (text.empty()) text = py::str(py::type::handle_of(exc).attr("__name__")).cast<std::string>();
    errors_[std::this_thread::get_id()] = {text, exc};
    return Status(code, text);
  }

  py::object store_;
  const std::string url_;
  const uint64_t part_;
  // Touched with the GIL held only.
  std::map<std::thread::id, std::pair<std::string, py::object>> errors_;
};

// nonstop._core.PathStore: a plain directory as the remote, all in C++
// (tier/path_transport.h): a RemoteTier over it runs no Python per byte.
// Its methods (for tests and tools) release the GIL.
struct PyPathStore {
  PyPathStore(const std::string& root, uint64_t part_bytes)
      : t(DefaultEnv(), Absolute(root), part_bytes) {}
  static std::string Absolute(const std::string& root) {
    std::string p = std::filesystem::absolute(root).lexically_normal().string();
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    return p;
  }
  template <typename Fn>
  auto Run(Fn&& fn) {
    decltype(fn()) got = Status::Internal("unset");
    {
      py::gil_scoped_release r;
      got = fn();
    }
    return got;
  }
  tier::PathTransport t;
};

// nonstop._core.RemoteTier: the tier over a transport: a PathStore's own,
// or a Python one through a PyTransport.
class PyRemoteTier {
 public:
  explicit PyRemoteTier(py::object store) {
    if (py::isinstance<PyPathStore>(store)) {
      t_ = &store.cast<PyPathStore&>().t;
      held_ = std::move(store);  // the transport lives as long as the tier
    } else {
      py_ = std::make_unique<PyTransport>(std::move(store));
      t_ = py_.get();
    }
    tier_ = std::make_unique<tier::RemoteTier>(t_, DefaultEnv());
  }

  // Runs `fn` on the tier with the GIL released; raises its error.
  template <typename Fn>
  auto Run(Fn&& fn) {
    Forget();
    decltype(fn(*tier_)) got = Status::Internal("unset");
    {
      py::gil_scoped_release r;
      got = fn(*tier_);
    }
    if constexpr (std::is_same_v<decltype(got), Status>) {
      if (!got.ok()) Raise(got);
    } else {
      if (!got.ok()) Raise(got.status());
      return std::move(got).value();
    }
  }
  // With the GIL held (see PyTransport).
  void Forget() {
    if (py_) py_->Forget();
  }
  [[noreturn]] void Raise(const Status& s) {
    if (py_) py_->Raise(s);
    throw StatusError(s);
  }
  // With the GIL held: whether waiting can make the failure `s` of this
  // thread's last transport call work (its exception's `kind`: not a
  // missing bucket, refused or missing credentials).
  bool WaitingHelps(const Status& s) {
    if (!py_) return true;
    py::object kind = py_->KindOf(s);
    if (kind.is_none()) return true;
    const std::string k = py::str(kind).cast<std::string>();
    return k != "bucket_missing" && k != "access_denied" && k != "no_credentials";
  }

  const tier::Transport& transport() const { return *t_; }
  tier::RemoteTier& tier() { return *tier_; }

 private:
  py::object held_;
  std::unique_ptr<PyTransport> py_;
  tier::Transport* t_ = nullptr;
  std::unique_ptr<tier::RemoteTier> tier_;
};

// nonstop._core.RemoteUploader: the upload thread (tier/uploader.h) over a
// RemoteTier. `newest` is a Python callable returning (counter, step) or
// None, called with the GIL taken for that call alone (as a transport
// method). Everything else runs in C++ without the GIL.
class PyUploader {
 public:
  PyUploader(py::object tier, py::object newest, tier::UploaderOptions o)
      : pid_(getpid()), held_(std::make_unique<Held>(Held{tier, std::move(newest)})) {
    PyRemoteTier& t = tier.cast<PyRemoteTier&>();
    py::object* fn = &held_->newest;  // lives as long as the uploader (see Close)
    tier::RemoteUploader::Newest newest_fn = [fn]() -> Result<std::optional<tier::UploadTarget>> {
      if (Finalizing()) return Status::Aborted("the interpreter is shutting down");
      py::gil_scoped_acquire g;
      try {
        py::object got = (*fn)();
        if (got.is_none()) return std::optional<tier::UploadTarget>();
        const auto p = got.cast<std::pair<uint64_t, int64_t>>();
        return std::optional<tier::UploadTarget>(tier::UploadTarget{p.first, p.second});
      } catch (py::error_already_set& e) {
        return Status(StatusCodeOfException(e.value().ptr()), py::str(e.value()).cast<std::string>());
      } catch (py::cast_error& e) {
        return Status::InvalidArgument(std::string("newest(): ") + e.what());
      }
    };
    Result<std::unique_ptr<tier::RemoteUploader>> u = Status::Internal("unset");
    {
      py::gil_scoped_release r;
      u = tier::RemoteUploader::Start(&t.tier(), DefaultEnv(), std::move(o), std::move(newest_fn));
    }
    uploader_ = Take(std::move(u));
  }
  // Stops the thread now; one still in a transfer past the abort keeps the
  // uploader, its tier and `newest` alive for good (it uses them).
  ~PyUploader() {
    if (!uploader_) return;
    if (getpid() != pid_) {  // a forked child: the thread was not copied, its locks may be held
      (void)uploader_.release();
      (void)held_.release();
      return;
    }
    py::gil_scoped_release r;  // its thread may be waiting for the GIL
    (void)uploader_->Close(false);
    if (uploader_->Running()) {
      (void)uploader_.release();
      (void)held_.release();
      return;
    }
    uploader_.reset();
  }

  void Started(uint64_t counter, int64_t step) { Get().Started(counter, step); }
  void BeforeSave() {
    tier::RemoteUploader& u = Get();
    py::gil_scoped_release r;
    u.BeforeSave();
  }
  py::dict Stats() {
    tier::UploaderStats s = Get().Stats();
    py::dict d;
    d["uploads"] = s.uploads;
    d["committed"] = s.committed;
    d["retries"] = s.retries;
    d["failures"] = s.failures;
    d["bytes"] = s.bytes;
    d["upload_s"] = s.upload_s;
    d["last_GBps"] = s.last_GBps;
    d["skipped_existing"] = s.skipped_existing;
    d["last_error"] = s.last_error.empty() ? py::object(py::none()) : py::cast(s.last_error);
    d["deleted_steps"] = s.deleted_steps;
    d["skipped_gone"] = s.skipped_gone;
    d["given_up"] = s.given_up;
    d["stage_s"] = s.stage_s;
    d["crc_s"] = s.crc_s;
    d["put_s"] = s.put_s;
    d["uploaded_step"] = s.uploaded_step ? py::cast(*s.uploaded_step) : py::none();
    d["uploading_step"] = s.uploading_step ? py::cast(*s.uploading_step) : py::none();
    d["manifest_notes"] = s.manifest_notes;
    d["manifest_error"] = s.manifest_error.empty() ? py::object(py::none()) : py::cast(s.manifest_error);
    return d;
  }
  // None, or the one line to warn about.
  std::optional<std::string> Close(bool wait) {
    if (getpid() != pid_) return std::nullopt;  // a forked child: the parent's thread
    tier::RemoteUploader& u = Get();
    Status s;
    {
      py::gil_scoped_release r;
      s = u.Close(wait);
    }
    if (s.ok()) return std::nullopt;
    return s.message();
  }

 private:
  struct Held {
    py::object tier;    // the PyRemoteTier the thread uses
    py::object newest;
  };
  tier::RemoteUploader& Get() {
    if (!uploader_ || getpid() != pid_) {
      throw StatusError(Status::FailedPrecondition("the uploader belongs to process " +
                                                   std::to_string(pid_)));
    }
    return *uploader_;
  }
  const pid_t pid_;
  std::unique_ptr<Held> held_;
  std::unique_ptr<tier::RemoteUploader> uploader_;  // declared last: goes first
};

const char* StateName(tier::StepState s) {
  switch (s) {
    case tier::StepState::kCommitted: return "committed";
    case tier::StepState::kUncommitted: return "uncommitted";
    case tier::StepState::kDamaged: return "damaged";
  }
  return "damaged";
}

void InitRemoteUploader(py::module_& m) {
  m.def("lower_thread_priority", &tier::LowerThreadPriority, py::arg("nice"),
        "Lowers the calling thread's CPU priority by nice and its I/O to the lowest "
        "best-effort level (best effort).");
  py::class_<PyUploader>(m, "RemoteUploader",
                         "One rank's upload thread (tier/uploader.h) over a RemoteTier.")
      .def_static(
          "from_options",
          [](py::object tier, py::object newest, const std::string& job_dir, uint32_t rank,
             uint32_t world_size, const py::dict& opts, uint64_t every, uint64_t keep_every,
             uint32_t keep_max, const std::string& job) {
            const int64_t max_to_keep = DictGet<int64_t>(opts, "max_to_keep", 2);
            if (max_to_keep < 1) {
              throw StatusError(
                  Status::InvalidArgument("remote_options max_to_keep must be at least 1"));
            }
            tier::UploaderOptions o;
            o.job = job;
            o.note_manifest = DictGet<bool>(opts, "note_manifest", true);
            o.job_dir = job_dir;
            o.rank = rank;
            o.world_size = world_size;
            o.every = every;
            o.retention = {static_cast<uint32_t>(max_to_keep), keep_every, keep_max};
            o.bps = opts.contains("bandwidth_bps") && !opts["bandwidth_bps"].is_none()
                        ? opts["bandwidth_bps"].cast<double>() : 0.0;
            o.poll_s = DictGet<double>(opts, "poll_s", 0.05);
            o.commit_timeout_s = DictGet<double>(opts, "commit_timeout_s", 120.0);
            o.retry_max_s = DictGet<double>(opts, "retry_max_s", 10.0);
            o.close_timeout_s = DictGet<double>(opts, "close_timeout_s", 600.0);
            o.nice = DictGet<int>(opts, "nice", 10);
            return std::make_unique<PyUploader>(std::move(tier), std::move(newest), o);
          },
          py::arg("tier"), py::arg("newest"), py::arg("job_dir"), py::arg("rank"),
          py::arg("world_size"), py::arg("options"), py::arg("every"), py::arg("keep_every"),
          py::arg("keep_max"), py::arg("job"),
          "The thread with the remote_options keys (max_to_keep >= 1, bandwidth_bps, poll_s, "
          "commit_timeout_s, retry_max_s, close_timeout_s, nice, note_manifest).")
      .def("started", &PyUploader::Started, py::arg("counter"), py::arg("step"),
           "After each checkpoint started: with every=n a selected one is queued.")
      .def("before_save", &PyUploader::BeforeSave,
           "every=n: waits until each queued checkpoint is copied out of the slot ring.")
      .def("stats", &PyUploader::Stats, "The counters (stats()['remote']).")
      .def("close", &PyUploader::Close, py::arg("wait") = true,
           "Stops the thread (wait: after the newest upload, within close_timeout_s); None or "
           "the one line to warn about.");
}

// The object store transport's decisions (tier/s3_request.h).
void InitStoreRequests(py::module_& m) {
  m.def(
      "store_failure",
      [](const std::string& text, bool denied, bool unauthenticated) {
        tier::StoreFailure f = tier::ClassifyStoreFailure(text, denied, unauthenticated);
        return py::make_tuple(f.kind, f.line);
      },
      py::arg("text"), py::arg("denied") = false, py::arg("unauthenticated") = false,
      "(kind, one line) of a failed store call: bucket_missing, access_denied, "
      "no_credentials, unreachable or other.");
  m.def("duration_s", [](const std::string& v) { return tier::DurationSeconds(v); },
        py::arg("value"), "A client option's duration ('5s', '500ms', '2min', a number) in s.");
  m.def(
      "s3_create_bucket",
      [](const std::string& prefix_url, const std::string& endpoint, const std::string& bucket,
         const std::string& region, const std::string& key, const std::string& secret,
         const std::string& token, const std::string& amz_date) {
        const tier::S3Credentials c = tier::WithEnvironmentCredentials({key, secret, token, region});
        tier::CreateBucket r = Take(tier::SignCreateBucket(prefix_url, endpoint, bucket, c.region,
                                                           c.key, c.secret, c.token, amz_date));
        py::dict headers;
        for (const auto& [k, v] : r.headers) headers[py::str(k)] = v;
        py::dict d;
        d["url"] = r.url;
        d["body"] = py::bytes(r.body);
        d["headers"] = headers;
        d["what"] = r.what;
        d["base"] = r.base;
        return d;
      },
      py::arg("prefix_url"), py::arg("endpoint"), py::arg("bucket"), py::arg("region"),
      py::arg("key"), py::arg("secret"), py::arg("token") = "", py::arg("amz_date") = "",
      "The signed S3 CreateBucket request (path style, Signature V4; credentials and region "
      "not given are the environment's, WithEnvironmentCredentials): {url, body, headers, "
      "what, base}; CheckpointIOError without credentials.");
  m.def(
      "store_options",
      [](const std::string& url, const py::object& options) {
        const py::dict opts = options.is_none() ? py::dict() : options.cast<py::dict>();
        std::vector<std::string> keys;
        std::map<std::string, std::string> text;
        for (const auto& [k, v] : opts) {
          const std::string key = py::str(k);
          keys.push_back(key);
          if (key == "client_kwargs" && !v.is_none()) {
            if (!py::isinstance<py::dict>(v)) {
              throw StatusError(Status::InvalidArgument(
                  "remote_options client_kwargs must be a dict, got " +
                  py::repr(v).cast<std::string>()));
            }
            const py::dict ck = py::reinterpret_borrow<py::dict>(v);
            if (ck.contains("endpoint_url") && !ck["endpoint_url"].is_none()) {
              text["client_kwargs.endpoint_url"] = py::str(ck["endpoint_url"]);
            }
          } else if (!v.is_none()) {
            text[key] = py::str(v);
          }
        }
        const tier::StoreOptions o = tier::SortStoreOptions(url, keys, text);
        py::dict kw;
        for (const auto& [k, to] : o.route) {
          if (!to.empty()) kw[py::str(to)] = opts[py::str(k)];
        }
        py::dict out;
        out["concurrency"] = opts.contains("max_concurrency") ? py::int_(opts["max_concurrency"])
                                                              : py::int_(8);
        out["part_bytes"] = opts.contains("part_bytes") ? py::int_(opts["part_bytes"])
                                                        : py::int_(8 << 20);
        out["kw"] = kw;
        out["s3"] = py::none();
        if (!o.s3) return out;
        py::dict client;
        client["timeout"] = o.timeout;
        client["connect_timeout"] = o.connect_timeout;
        if (!o.endpoint.empty()) {
          kw["endpoint"] = o.endpoint;
          client["allow_http"] = o.allow_http;
        }
        py::dict s3;
        s3["bucket"] = o.bucket;
        s3["endpoint"] = o.endpoint;
        s3["timeout"] = o.request_timeout_s;
        for (const char* k : {"key", "secret", "token", "region"}) {
          s3[k] = text.count(k) ? text.at(k) : "";
        }
        out["s3"] = s3;
        out["bucket"] = o.bucket;
        out["prefix"] = o.prefix.empty() ? py::object(py::none()) : py::str(o.prefix);
        out["client"] = client;
        return out;
      },
      py::arg("url"), py::arg("options"),
      "remote_options of an object store URL sorted out (tier/s3_request.h SortStoreOptions): "
      "{concurrency, part_bytes, s3: what CreateBucket needs or None, bucket, prefix, client "
      "(client_options), kw (the store's keywords)}.");
  m.def(
      "s3_create_bucket_answer",
      [](const std::string& what, int code, const py::bytes& body) {
        return Take(tier::CreateBucketAnswer(what, code, View(body)));
      },
      py::arg("what"), py::arg("code"), py::arg("body"),
      "A CreateBucket's HTTP error answer: False when the bucket is there already (ours); "
      "else CheckpointIOError with one line.");
}

void InitPathStore(py::module_& m) {
  py::class_<PyPathStore>(m, "PathStore",
                          "A directory (a shared file system) as the remote, in C++ "
                          "(tier/path_transport.h); a RemoteTier over it runs no Python.")
      .def(py::init<const std::string&, uint64_t>(), py::arg("root"),
           py::arg("part_bytes") = uint64_t{8} << 20)
      .def_property_readonly("url", [](PyPathStore& p) { return p.t.url(); })
      .def_property_readonly("part_bytes", [](PyPathStore& p) { return p.t.part_bytes(); })
      .def_property_readonly("s3", [](PyPathStore&) { return false; })
      .def(
          "put_bytes",
          [](PyPathStore& p, const std::string& key, const py::bytes& data) {
            std::string d(View(data));
            Check(p.Run([&] { return p.t.PutBytes(key, d); }));
          },
          py::arg("key"), py::arg("data"))
      .def(
          "get_bytes",
          [](PyPathStore& p, const std::string& key, uint64_t limit) -> py::object {
            Result<std::string> got = p.Run([&] { return p.t.GetBytes(key, limit); });
            if (!got.ok() && got.status().code() == StatusCode::kNotFound) return py::none();
            std::string b = Take(std::move(got));
            return py::bytes(b);
          },
          py::arg("key"), py::arg("limit"), "The object's bytes; None when missing.")
      .def(
          "get_chunks",
          [](PyPathStore& p, const std::string& key) {
            uint64_t size = 0;
            std::vector<std::string> chunks;
            Check(p.Run([&] {
              return p.t.GetChunks(key, [&](uint64_t n) { size = n; return Status::OK(); },
                                   [&](std::string_view c) {
                                     chunks.emplace_back(c);
                                     return Status::OK();
                                   });
            }));
            py::list out;
            for (const std::string& c : chunks) out.append(py::bytes(c));
            return py::make_tuple(size, out);
          },
          py::arg("key"), "(size, [buffers]).")
      .def(
          "list",
          [](PyPathStore& p, const std::string& prefix) {
            py::list out;
            for (const tier::StoredObject& o : Take(p.Run([&] { return p.t.List(prefix); }))) {
              out.append(py::make_tuple(o.key, o.size));
            }
            return out;
          },
          py::arg("prefix") = "", "(key, size) of every object (temps and links skipped).")
      .def(
          "delete",
          [](PyPathStore& p, const std::vector<std::string>& keys) {
            Check(p.Run([&] { return p.t.Delete(keys); }));
          },
          py::arg("keys"))
      .def("abort", [](PyPathStore& p) { p.t.Abort(); });
}

void InitRemoteTier(py::module_& m) {
  py::class_<PyRemoteTier>(m, "RemoteTier",
                           "The remote tier (tier/remote_tier.h) over a transport: a PathStore, "
                           "or a Python one.")
      .def(py::init<py::object>(), py::arg("transport"))
      .def(
          "rows",
          [](PyRemoteTier& t, uint32_t rank) {
            std::string job;  // the prefix's identity (its JOB document)
            Result<std::optional<std::string>> got = Status::Internal("unset");
            t.Forget();
            {
              py::gil_scoped_release r;
              got = t.tier().Job();
            }
            if (got.ok()) {
              job = got.value().value_or("");
            } else if (got.status().code() == StatusCode::kCorruption) {
              Warn("remote: " + got.status().message());
            } else {
              t.Raise(got.status());
            }
            const std::string url = t.transport().url();
            auto held = t.Run([&](tier::RemoteTier& r) { return r.List(rank); });
            py::list out;
            for (const tier::HeldStep& s : held) {
              if (!s.reason.empty()) Warn("remote: " + s.reason + "; skipped");
              const bool committed = s.state == tier::StepState::kCommitted;
              py::dict d;
              d["step"] = s.step;
              d["counter"] = s.marker && s.marker->counter ? py::cast(*s.marker->counter) : py::none();
              d["where"] = "remote";
              d["path"] = url + "/" + rl::PartKey(s.step, rank);
              d["state"] = StateName(s.state);
              d["reason"] = s.note;  // why rank `rank` cannot read it
              d["time"] = s.marker && s.marker->unix_s ? py::cast(*s.marker->unix_s) : py::none();
              d["bytes"] = s.bytes;
              d["metrics"] = py::dict();
              py::list tiers;  // the tiers holding it (one format with a local listing)
              if (committed && s.note.empty()) {
                py::dict h;
                h["tier"] = "remote";
                h["where"] = url;
                h["recorded"] = false;
                tiers.append(h);
              }
              d["tiers"] = tiers;
              d["job"] = job;
              d["world_size"] = s.marker ? py::cast(s.marker->world_size) : py::none();
              out.append(d);
            }
            return out;
          },
          py::arg("rank") = 0,
          "nonstop.list() of the remote: one row per step directory, newest first, in the "
          "shape of a local listing (where='remote'; bytes: rank `rank`'s part); warns of "
          "damaged markers and a JOB document that does not parse.")
      .def(
          "inspect",
          [](PyRemoteTier& t) {
            auto held = t.Run([&](tier::RemoteTier& r) { return r.List(0); });
            py::list rows;
            size_t committed = 0;
            std::string lines;
            for (const tier::HeldStep& s : held) {
              if (!s.reason.empty()) Warn("remote: " + s.reason + "; skipped");
              const std::optional<rl::Doc>& m = s.marker;
              std::string ranks;
              for (uint32_t r : s.ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
              py::dict d;
              d["step"] = s.step;
              d["committed"] = m.has_value();
              d["world_size"] = m ? py::cast(m->world_size) : py::none();
              d["lineage"] = m ? py::cast(m->lineage) : py::none();
              d["counter"] = m && m->counter ? py::cast(*m->counter) : py::none();
              d["ranks"] = s.ranks;
              d["objects"] = s.objects;
              d["bytes"] = s.total_bytes;
              rows.append(d);
              committed += m ? 1 : 0;
              lines += "  step " + std::to_string(s.step) + ": " +
                       (m ? "committed, world size " + std::to_string(m->world_size) +
                                ", lineage " + std::to_string(m->lineage)
                          : std::string("not committed (never read; retention deletes it)")) +
                       "; parts of rank(s) " + (ranks.empty() ? "none" : "[" + ranks + "]") +
                       ", " + std::to_string(s.objects) + " object(s), " +
                       std::to_string(s.total_bytes) + " bytes\n";
            }
            return py::make_tuple(rows, t.transport().url() + ": " + std::to_string(held.size()) +
                                            " step(s), " + std::to_string(committed) +
                                            " committed\n" + lines);
          },
          "`nonstop inspect URL`: ([{step, committed, world_size, lineage, counter, ranks, "
          "objects, bytes}], the text); nothing is downloaded but the markers.")
      .def(
          "export",
          [](PyRemoteTier& t, std::optional<int64_t> step, const std::string& fetch_dir,
             py::object run) {
            py::object err = py::reinterpret_borrow<py::object>(PySys_GetObject("stderr"));
            py::object fatal = py::none();
            std::function<int(int64_t, const std::string&)> run_fn = [&](int64_t s,
                                                                          const std::string& d) {
              py::gil_scoped_acquire g;
              try {
                return run(s, d).cast<int>();
              } catch (py::error_already_set& e) {
                fatal = e.value();
                return 2;
              }
            };
            std::function<void(const std::string&)> note = [&](const std::string& line) {
              py::gil_scoped_acquire g;
              err.attr("write")("nonstop export: " + line + "\n");
              err.attr("flush")();
            };
            t.Forget();
            Result<int> rc = Status::Internal("unset");
            {
              py::gil_scoped_release r;
              rc = tier::ExportRemote(DefaultEnv(), &t.tier(), step, fetch_dir, run_fn, note);
            }
            if (!fatal.is_none()) {
              PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(fatal.ptr())), fatal.ptr());
              throw py::error_already_set();
            }
            if (!rc.ok()) t.Raise(rc.status());
            return rc.value();
          },
          py::arg("step"), py::arg("fetch_dir"), py::arg("run"),
          "`nonstop export URL` (ExportRemote): run(step, dir) on each candidate downloaded "
          "whole into fetch_dir, falling back while the download fails or (no step asked) "
          "run returns 1; the exit code. Notes go to stderr.")
      .def(
          "candidates",
          [](PyRemoteTier& t, std::optional<int64_t> step) {
            std::vector<std::string> damaged;
            auto got = t.Run([&](tier::RemoteTier& r) {
              return tier::RemoteCandidates(DefaultEnv(), &r, step, &damaged);
            });
            for (const std::string& d : damaged) Warn("remote: " + d + "; skipped");
            py::list out;
            for (const auto& [s, doc] : got) out.append(py::make_tuple(s, DocDict(doc)));
            return out;
          },
          py::arg("step") = py::none(),
          "[(step, marker)] of the committed steps in the planner's order (`step` alone when "
          "given); CheckpointNotFoundError when there is none.")
      .def_property_readonly("url", [](PyRemoteTier& t) { return t.transport().url(); })
      .def(
          "committed_steps",
          [](PyRemoteTier& t) {
            std::vector<std::string> damaged;
            auto steps = t.Run([&](tier::RemoteTier& r) { return r.CommittedSteps(&damaged); });
            for (const std::string& d : damaged) Warn("remote: " + d + "; skipped");
            py::list out;
            for (const auto& [step, doc] : steps) out.append(py::make_tuple(step, DocDict(doc)));
            return out;
          },
          "[(step, marker)] newest first; warns of a marker that does not parse (skipped).")
      .def(
          "fetch",
          [](PyRemoteTier& t, int64_t step, uint32_t rank, const std::string& local_dir) {
            return t.Run([&](tier::RemoteTier& r) { return r.Fetch(step, rank, local_dir); });
          },
          py::arg("step"), py::arg("rank"), py::arg("local_dir"),
          "Rank `rank`'s part of committed `step`, verified (size, every unit's crc32), into "
          "local_dir/remote/step-N/rank-R.nsck; returns that directory.")
      .def(
          "fetch_all",
          [](PyRemoteTier& t, int64_t step, const std::string& local_dir) {
            return t.Run([&](tier::RemoteTier& r) { return r.FetchAll(step, local_dir); });
          },
          py::arg("step"), py::arg("local_dir"),
          "Every rank's part of committed `step`, each verified as fetch does, into "
          "local_dir/remote/step-N; returns that directory.")
      .def(
          "retain",
          [](PyRemoteTier& t, uint32_t max_to_keep, uint64_t keep_every, uint32_t keep_max) {
            return t.Run([&](tier::RemoteTier& r) {
              return r.Retain({max_to_keep, keep_every, keep_max});
            });
          },
          py::arg("max_to_keep"), py::arg("keep_every") = 0, py::arg("keep_max") = 0,
          "Deletes the steps retention does not keep (marker first); how many went.")
      .def(
          "claim",
          [](PyRemoteTier& t, const std::string& job, bool adopt, double unix_s) {
            t.Run([&](tier::RemoteTier& r) { return r.Claim(job, adopt, unix_s); });
          },
          py::arg("job"), py::arg("adopt"), py::arg("unix_s"),
          "This job owns the prefix (its JOB document); another job's is refused unless adopt.");
}

// {step, counter, where} rows: local copies of the memory tier (the peer
// tier's replica fetched for this rank).
std::vector<PlanCandidate> ExtraOf(const py::list& extra) {
  std::vector<PlanCandidate> out;
  for (py::handle row : extra) {
    py::dict d = py::reinterpret_borrow<py::dict>(row);
    PlanCandidate c;
    c.tier = Tier::kMemory;
    c.step = d["step"].cast<int64_t>();
    c.counter = d["counter"].cast<uint64_t>();
    c.where = d.contains("where") ? d["where"].cast<std::string>() : "memory";
    out.push_back(std::move(c));
  }
  return out;
}

// `nonstop ls URL`'s text of RemoteTier.rows: a local ls's (engine/job_view.h LsText).
std::string LsText(const py::list& rows, uint32_t rank, const std::string& url) {
  JobView view;
  for (py::handle h : rows) {
    py::dict r = py::reinterpret_borrow<py::dict>(h);
    ViewRow v;
    v.step = r["step"].cast<int64_t>();
    v.counter = r["counter"].is_none() ? 0 : r["counter"].cast<uint64_t>();
    v.where = r["where"].cast<std::string>();
    v.state = r["state"].cast<std::string>();
    v.reason = r["reason"].cast<std::string>();
    v.commit_unix_ns = r["time"].is_none() ? 0 : static_cast<uint64_t>(r["time"].cast<double>() * 1e9);
    v.bytes = r["bytes"].cast<uint64_t>();
    for (py::handle t : r["tiers"]) v.tiers.push_back({t["tier"].cast<std::string>(), "", false});
    view.job = r["job"].cast<std::string>();
    view.rows.push_back(std::move(v));
  }
  return nonstop::LsText(view, static_cast<int>(rank), url);
}

void InitRemoteRestore(py::module_& m) {
  m.def("remote_ls_text", &LsText, py::arg("rows"), py::arg("rank"), py::arg("url"),
        "`nonstop ls URL`'s text of RemoteTier.rows: a local ls's columns.");
  m.def(
      "restore_remote",
      [](PyRemoteTier& t, const std::string& job_dir, uint32_t rank, std::optional<int64_t> step,
         const py::list& extra, const std::string& fetch_dir, py::object read,
         std::optional<uint32_t> world, bool load, py::object gather) -> py::object {
        tier::RemoteRestoreRequest req;
        req.plan.job_dir = job_dir;
        req.plan.rank = rank;
        req.plan.step = step;
        req.plan.extra_local = ExtraOf(extra);
        req.fetch_dir = fetch_dir;
        req.world = world;
        req.load = load;
        req.waiting_helps = [&t](const Status& s) {
          py::gil_scoped_acquire g;
          return t.WaitingHelps(s);
        };
        py::object loaded = py::none(), fatal = py::none();
        tier::ReadFetched read_fn = [&](int64_t s, const std::string& dir) -> Status {
          py::gil_scoped_acquire g;
          try {
            py::object got = read(dir);
            if (got.is_none() || got.attr("step").cast<int64_t>() != s) {
              return Status::Corruption(dir + " holds no committed checkpoint of step " +
                                        std::to_string(s));
            }
            loaded = got;
            return Status::OK();
          } catch (py::error_already_set& e) {
            if (!IsCheckpointFailure(e.value().ptr())) {  // a bug or an interrupt: raised
              fatal = e.value();
              return Status::Aborted(py::str(e.value()).cast<std::string>());
            }
            return Status(StatusCodeOfException(e.value().ptr()),
                          py::str(e.value()).cast<std::string>());
          }
        };
        tier::Gather gather_fn = [&](const std::string& mine) -> Result<std::vector<std::string>> {
          py::gil_scoped_acquire g;
          try {  // JSON over the process group (the Comm's gather)
            py::str text = py::reinterpret_steal<py::str>(
                PyUnicode_DecodeUTF8(mine.data(), static_cast<Py_ssize_t>(mine.size()), "replace"));
            return gather(text).cast<std::vector<std::string>>();
          } catch (py::error_already_set& e) {  // the group failed: raised as it is
            fatal = e.value();
            return Status::Aborted(py::str(e.value()).cast<std::string>());
          }
        };
        tier::RemoteRestoreResult out;
        Status s;
        t.Forget();
        {
          py::gil_scoped_release r;
          s = gather.is_none()
                  ? tier::RestoreFromRemote(DefaultEnv(), &t.tier(), req, read_fn, &out)
                  : tier::RestoreFromRemoteDist(DefaultEnv(), &t.tier(), req, gather_fn, read_fn,
                                                &out);
        }
        for (const std::string& w : out.warnings) Warn(w);
        if (!fatal.is_none()) {
          PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(fatal.ptr())), fatal.ptr());
          throw py::error_already_set();
        }
        if (!s.ok()) t.Raise(s);
        return out.read ? loaded : py::none();
      },
      py::arg("tier"), py::arg("job_dir"), py::arg("rank"), py::arg("step"), py::arg("extra"),
      py::arg("fetch_dir"), py::arg("read"), py::arg("world") = py::none(),
      py::arg("load") = false, py::arg("gather") = py::none(),
      "One rank's restore with a remote tier (tier/remote_restore.h RestoreFromRemote; with "
      "gather(text) -> every rank's text, rank 0 first: RestoreFromRemoteDist): read(dir) is "
      "called on each remote candidate fetched (verified) into fetch_dir, in the plan's order, "
      "until one returns the LoadedCheckpoint of its step (returned); None: the local path "
      "reads. Failures are warnings; errors as RestoreFromRemote's.");
}

}  // namespace

void InitRemote(py::module_& m) {
  InitPathStore(m);
  InitStoreRequests(m);
  InitRemoteLayout(m);
  InitRemoteTier(m);
  InitRemoteRestore(m);
  InitRemoteUploader(m);
}

}  // namespace nonstop::py_bindings
