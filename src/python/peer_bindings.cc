// The peer tier (tier/peer.h) for Python: PeerServer, PeerReplicator and the
// client calls. Thin: every blocking call runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <iterator>

#include "python/bindings.h"
#include "engine/memory_tier.h"
#include "tier/peer.h"
#include "tier/peer_gather.h"
#include "tier/peer_options.h"
#include "tier/peer_setup.h"
#include "tier/peer_wire.h"
#include "tier/uploader.h"

namespace nonstop::py_bindings {

bool IsCheckpointFailure(PyObject* exc);  // bindings.cc: a nonstop error or an OSError

namespace {

namespace py = pybind11;

py::list HeldList(const std::vector<peer::HeldReplica>& held) {
  py::list out;
  for (const peer::HeldReplica& h : held) {
    py::dict d;
    d["source_rank"] = h.source_rank;
    d["world_size"] = h.world_size;
    d["step"] = h.step;
    d["counter"] = h.counter;
    d["bytes"] = h.bytes;
    out.append(d);
  }
  return out;
}

peer::Source SourceOf(const std::string& name) {
  if (name == "replica") return peer::Source::kReplica;
  if (name == "segment") return peer::Source::kSegment;
  if (name == "disk") return peer::Source::kDisk;
  throw py::value_error("peer source must be 'replica', 'segment' or 'disk', got '" + name + "'");
}

const char* OutcomeName(peer::PushOutcome o) {
  switch (o) {
    case peer::PushOutcome::kStored: return "stored";
    case peer::PushOutcome::kAlreadyHeld: return "already_held";
    case peer::PushOutcome::kSkippedBudget: return "skipped_budget";
  }
  return "stored";
}

// Runs `fn` with the GIL released and returns its value (raises its error).
template <typename Fn>
auto Released(Fn&& fn) {
  decltype(fn()) r = Status::Internal("unset");
  {
    py::gil_scoped_release release;
    r = fn();
  }
  return Take(std::move(r));
}

// A Python value of a peer option (an int is a plain int: never a bool).
peer::OptionValue OptionOf(py::handle v) {
  peer::OptionValue o;
  if (v.is_none()) return o;
  o.kind = peer::OptionValue::kOther;
  if (py::isinstance<py::str>(v)) {
    o.kind = peer::OptionValue::kWord;
    o.word = v.cast<std::string>();
  } else if (PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr())) {
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow == 0) {
      o.kind = peer::OptionValue::kInt;
      o.n = n;
    }
  }
  return o;
}

// The peer tier's stats under their Checkpointer.stats() names (docs/TIERS.md "Stats").
py::dict TierStats(peer::Replicator* rep, peer::PeerServer* srv) {
  py::dict d;
  auto none_if_negative = [](auto v) { return v < 0 ? py::object(py::none()) : py::cast(v); };
  if (rep != nullptr) {
    const peer::ReplicatorStats r = rep->stats();
    d["peer_replicated"] = r.replicated;
    d["peer_bytes"] = r.bytes;
    d["peer_failures"] = r.failures;
    d["peer_skipped"] = r.skipped;
    d["peer_skipped_cadence"] = r.skipped_cadence;
    d["peer_skipped_budget"] = r.skipped_budget;
    d["peer_last_step"] = none_if_negative(r.last_step);
    d["peer_error"] = r.last_error;
    d["peer_lag_s"] = none_if_negative(r.lag_s_last);
    d["peer_lag_s_max"] = none_if_negative(r.lag_s_max);
  }
  if (srv != nullptr) {
    peer::PeerServerStats v;
    {
      py::gil_scoped_release r;  // lists the replicas: file reads
      v = srv->stats();
    }
    d["peer_held"] = v.held;
    d["peer_held_bytes"] = v.held_bytes;
    d["peer_received"] = v.replicas_received;
    d["peer_served"] = v.fetches_served;
    d["peer_auth_failures"] = v.auth_failures;
    d["peer_handshake_timeouts"] = v.handshake_timeouts;
    d["peer_budget_bytes"] = v.budget_bytes;
    d["peer_old_world_removed"] = v.old_world_removed;
  }
  return d;
}

// A copy's dict: HeldList's keys, its kind, and (this host's) its path.
py::dict CopyDict(const peer::GatherCopy& c) {
  static constexpr const char* kKinds[] = {"replica", "segment", "disk"};
  py::dict d = HeldList({c.held})[0].cast<py::dict>();
  d["kind"] = kKinds[static_cast<int>(c.kind)];
  if (c.holder < 0) d["path"] = c.path;
  return d;
}

}  // namespace

void InitPeer(py::module_& m) {
  py::tuple names(std::size(peer::kOptionNames));
  for (size_t i = 0; i < std::size(peer::kOptionNames); ++i) {
    names[i] = py::str(std::string(peer::kOptionNames[i]));
  }
  m.attr("PEER_OPTIONS") = names;  // DistOptions' order
  m.def(
      "check_peer_option",
      [](const std::string& name, py::object value) -> py::object {
        const peer::OptionValue v =
            Take(peer::CheckOption(name, OptionOf(value), py::repr(value).cast<std::string>()));
        if (v.kind == peer::OptionValue::kInt) return py::int_(v.n);
        return v.kind == peer::OptionValue::kWord ? py::object(py::str(v.word)) : py::none();
      },
      py::arg("name"), py::arg("value"),
      "Peer option name's value checked (tier/peer_options.h): peer_nice 'idle' as "
      "PEER_IDLE_NICE; else CheckpointMismatchError in one line.");
  m.def(
      "peer_env_secret",
      []() -> py::object {
        const std::string s = Take(peer::EnvSecret());
        return s.empty() ? py::object(py::none()) : py::object(py::bytes(s));
      },
      "$NONSTOP_PEER_SECRET as bytes (hex, 16 to 64 bytes), or None when unset.");
  m.def(
      "peer_secret_fingerprint",
      [](const py::bytes& secret) { return peer::SecretFingerprint(std::string(secret)); },
      py::arg("secret"), "Names a secret without telling it: every rank's must match.");
  m.def(
      "peer_agree_secret",
      [](const std::vector<std::string>& fingerprints, const std::string& made_hex,
         const py::bytes& mine) {
        return py::bytes(Take(peer::AgreeSecret(fingerprints, made_hex, std::string(mine))));
      },
      py::arg("fingerprints"), py::arg("made_hex"), py::arg("mine"),
      "The job's peer secret from the ranks' fingerprints of $NONSTOP_PEER_SECRET ('' where "
      "unset) and rank 0's made secret (hex): tier/peer_options.h AgreeSecret.");
  m.def(
      "start_peers",
      [](py::object gather, uint32_t rank, uint32_t world, int replicas,
         const std::string& segment, const std::string& job_dir,
         std::optional<uint64_t> budget_bytes, uint32_t every, int nice, py::object bps) {
        peer::SetupRequest r;
        r.rank = rank;
        r.world = world;
        r.replicas = replicas;
        r.segment = segment;
        r.job_dir = job_dir;
        r.budget_bytes = budget_bytes;
        r.every = every;
        r.nice = nice;
        const bool spread = py::isinstance<py::str>(bps);  // peer_bps="spread"
        r.bps = spread ? 0 : bps.cast<uint64_t>();
        r.spread_s = spread ? peer::kSpreadS : 0.0;
        r.env_secret = Take(peer::EnvSecret());
        py::object fatal = py::none();
        peer::SetupGather gather_fn = [&](const std::string& mine) -> Result<std::vector<std::string>> {
          py::gil_scoped_acquire g;
          try {  // JSON over the process group (the Comm's gather); any byte through a str
            py::object text = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(
                mine.data(), static_cast<Py_ssize_t>(mine.size()), "surrogateescape"));
            if (!text) throw py::error_already_set();
            std::vector<std::string> out;
            for (py::handle t : gather(text)) {
              py::object b = py::reinterpret_steal<py::object>(
                  PyUnicode_AsEncodedString(t.ptr(), "utf-8", "surrogateescape"));
              if (!b) throw py::error_already_set();
              out.push_back(b.cast<std::string>());
            }
            return out;
          } catch (py::error_already_set& e) {  // the group failed: raised as it is
            fatal = e.value();
            return Status::Aborted(py::str(e.value()).cast<std::string>());
          }
        };
        Result<peer::PeerStart> got = Status::Internal("unset");
        {
          py::gil_scoped_release release;
          r.addr = peer::LocalAddress();  // $NONSTOP_PEER_ADDR, else the route to MASTER_ADDR
          r.host = peer::HostId(r.addr);
          if (replicas > 0 && !segment.empty()) {  // this host's own segments (any world size)
            for (auto& [rk, name] : RecordedMemorySegments(job_dir, "", nullptr)) {
              r.segments.push_back(name);
            }
          }
          got = peer::StartPeers(r, gather_fn);
        }
        if (!fatal.is_none()) {
          PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(fatal.ptr())), fatal.ptr());
          throw py::error_already_set();
        }
        peer::PeerStart s = Take(std::move(got));
        py::list held, other, local;
        for (const auto& [step, counter, holder] : s.held) held.append(py::make_tuple(step, counter, holder));
        for (const peer::GatherCopy& c : s.other) other.append(py::make_tuple(c.holder, CopyDict(c)));
        for (const peer::GatherCopy& c : s.local) local.append(CopyDict(c));
        py::dict d;
        d["note"] = s.note;
        d["replicas"] = s.replicas;
        d["hosts"] = s.hosts;
        d["job"] = s.job;
        d["_secret"] = py::bytes(s.secret);
        d["endpoints"] = s.endpoints;
        d["partners"] = s.partners;
        d["held"] = held;
        d["other"] = other;
        d["local"] = local;
        d["reshard_any"] = s.reshard_any;
        d["server"] = s.server == nullptr ? py::none() : py::cast(std::move(s.server));
        d["replicator"] = s.replicator == nullptr ? py::none() : py::cast(std::move(s.replicator));
        return d;
      },
      py::arg("gather"), py::arg("rank"), py::arg("world"), py::arg("replicas"),
      py::arg("segment"), py::arg("job_dir"), py::arg("budget_bytes"), py::arg("every"),
      py::arg("nice"), py::arg("bps"),
      "Collective: the peer tier's start on this rank (tier/peer_setup.h StartPeers), gather(text) "
      "-> every rank's text: {note, replicas, hosts, job, _secret, endpoints, partners, held "
      "[(step, counter, holder)], other [(holder, copy)], local [copy], reshard_any, server, "
      "replicator} (the attributes of _peer.Peers).");
  m.def("peer_tier_stats", &TierStats, py::arg("replicator"), py::arg("server"),
        "The replicator's and the server's stats (either may be None) under their "
        "Checkpointer.stats() names.");
  m.attr("PEER_WIRE_VERSION") = peer::wire::kVersion;  // docs/FORMAT.md "Peer wire format"
  m.attr("PEER_IDLE_NICE") = tier::kIdleNice;  // nice= that means SCHED_IDLE (peer_nice="idle")
  py::class_<peer::PeerServer>(m, "PeerServer",
                               "The peer tier's server (tier/peer.h): holds partners' replicas "
                               "in the memory directory and serves lists and fetches.")
      .def(py::init([](const std::string& job, const py::bytes& secret,
                       const std::string& bind_host, uint16_t port, const std::string& dir,
                       uint64_t budget_bytes, uint32_t budget_share, double io_timeout_s,
                       const std::vector<std::string>& segments, double handshake_timeout_s,
                       int max_pending_handshakes, int nice, const std::string& job_dir,
                       uint32_t world_size) {
             peer::PeerServerOptions o;
             o.world_size = world_size;
             o.segments = segments;
             o.job_dir = job_dir;
             o.job = job;
             o.secret = secret;
             o.bind_host = bind_host;
             o.port = port;
             o.dir = dir;
             o.budget_bytes = budget_bytes;
             o.budget_share = budget_share;
             o.io_timeout_s = io_timeout_s;
             o.handshake_timeout_s = handshake_timeout_s;
             o.max_pending_handshakes = max_pending_handshakes;
             o.nice = nice;
             return Released([&] { return peer::PeerServer::Start(o); });
           }),
           py::arg("job"), py::arg("secret"), py::arg("bind_host") = "0.0.0.0", py::arg("port") = 0,
           py::arg("dir") = "", py::arg("budget_bytes") = 0, py::arg("budget_share") = 0,
           py::arg("io_timeout_s") = 30.0, py::arg("segments") = std::vector<std::string>{},
           py::arg("handshake_timeout_s") = 0.0, py::arg("max_pending_handshakes") = 8,
           py::arg("nice") = 10, py::arg("job_dir") = "", py::arg("world_size") = 0)
      .def_property_readonly("port", &peer::PeerServer::port)
      .def_property_readonly("endpoint", &peer::PeerServer::endpoint)
      .def(
          "list",
          [](peer::PeerServer& s) { return HeldList(Released([&] { return s.List(); })); },
          "The complete replicas of this job held here: [{source_rank, world_size, step, "
          "counter, bytes}].")
      .def(
          "list_own",
          [](peer::PeerServer& s) { return HeldList(Released([&] { return s.ListOwn(); })); },
          "The newest committed checkpoint of each own segment served (segments=): "
          "[{source_rank, world_size, step, counter, bytes}].")
      .def(
          "list_disk",
          [](peer::PeerServer& s) { return HeldList(Released([&] { return s.ListDisk(); })); },
          "The newest committed checkpoint of each rank file of the job directory served "
          "(job_dir=): [{source_rank, world_size, step, counter, bytes}].")
      .def(
          "stats",
          [](peer::PeerServer& s) {
            peer::PeerServerStats st;
            {
              py::gil_scoped_release r;  // lists the replicas: file reads
              st = s.stats();
            }
            py::dict d;
            d["replicas_received"] = st.replicas_received;
            d["bytes_received"] = st.bytes_received;
            d["replica_skipped_budget"] = st.replica_skipped_budget;
            d["replicas_already_held"] = st.replicas_already_held;
            d["old_world_removed"] = st.old_world_removed;
            d["push_failures"] = st.push_failures;
            d["refused_frames"] = st.refused_frames;
            d["auth_failures"] = st.auth_failures;
            d["handshake_timeouts"] = st.handshake_timeouts;
            d["handshakes_refused"] = st.handshakes_refused;
            d["fetches_served"] = st.fetches_served;
            d["bytes_served"] = st.bytes_served;
            d["held"] = st.held;
            d["held_bytes"] = st.held_bytes;
            d["budget_bytes"] = st.budget_bytes;
            d["last_error"] = st.last_error;
            return d;
          })
      .def(
          "close",
          [](peer::PeerServer& s) {
            py::gil_scoped_release r;
            s.Close();
          },
          "Stops listening and ends every connection; the replicas stay.");

  py::class_<peer::Replicator>(m, "PeerReplicator",
                               "Sends this rank's newest committed memory checkpoint (its "
                               "segment) to its partners in the background (tier/peer.h).")
      .def(py::init([](const std::string& job, const py::bytes& secret, uint32_t rank,
                       const std::string& segment, const std::vector<std::string>& partners,
                       double poll_s, double retry_s, double connect_timeout_s,
                       double io_timeout_s, const std::string& job_dir, int nice,
                       uint32_t every, uint64_t bps, double spread_s) {
             peer::ReplicatorOptions o;
             o.job_dir = job_dir;
             o.job = job;
             o.secret = secret;
             o.rank = rank;
             o.segment = segment;
             o.partners = partners;
             o.poll_s = poll_s;
             o.retry_s = retry_s;
             o.push.connect_timeout_s = connect_timeout_s;
             o.push.io_timeout_s = io_timeout_s;
             o.nice = nice;
             o.every = every;
             o.bps = bps;
             o.spread_s = spread_s;
             return Released([&] { return peer::Replicator::Start(o); });
           }),
           py::arg("job"), py::arg("secret"), py::arg("rank"), py::arg("segment"),
           py::arg("partners"),
           py::arg("poll_s") = 0.2, py::arg("retry_s") = 1.0, py::arg("connect_timeout_s") = 5.0,
           py::arg("io_timeout_s") = 30.0, py::arg("job_dir") = "", py::arg("nice") = 10,
           py::arg("every") = 1, py::arg("bps") = 0, py::arg("spread_s") = 0.0)
      .def("notify", &peer::Replicator::Notify, "A checkpoint may have been committed: look now.")
      .def(
          "drain",
          [](peer::Replicator& r, double timeout_s) {
            py::gil_scoped_release rel;
            return r.Drain(timeout_s);
          },
          py::arg("timeout_s"),
          "Waits until the segment's newest committed checkpoint went to every partner (or "
          "failed); False when timeout_s passed first.")
      .def(
          "stats",
          [](peer::Replicator& r) {
            peer::ReplicatorStats st = r.stats();
            py::dict d;
            d["replicated"] = st.replicated;
            d["bytes"] = st.bytes;
            d["failures"] = st.failures;
            d["skipped"] = st.skipped;
            d["skipped_cadence"] = st.skipped_cadence;
            d["skipped_budget"] = st.skipped_budget;
            d["last_step"] = st.last_step < 0 ? py::object(py::none()) : py::cast(st.last_step);
            d["last_counter"] = st.last_counter;
            d["send_s_total"] = st.send_s_total;
            d["lag_s_last"] = st.lag_s_last < 0 ? py::object(py::none()) : py::cast(st.lag_s_last);
            d["lag_s_max"] = st.lag_s_max < 0 ? py::object(py::none()) : py::cast(st.lag_s_max);
            d["last_error"] = st.last_error;
            return d;
          })
      .def(
          "close",
          [](peer::Replicator& r) {
            py::gil_scoped_release rel;
            r.Close();
          },
          "Stops the thread (a push in progress is cut).");

  m.def(
      "peer_list",
      [](const std::string& endpoint, const std::string& job, const py::bytes& secret,
         double timeout_s) {
        const std::string key = secret;
        return HeldList(
            Released([&] { return peer::ListReplicas(endpoint, job, key, timeout_s); }));
      },
      py::arg("endpoint"), py::arg("job"), py::arg("secret"), py::arg("timeout_s") = 10.0,
      "What the peer server at endpoint holds of job: [{source_rank, world_size, step, counter, "
      "bytes}].");
  m.def(
      "peer_fetch",
      [](const std::string& endpoint, const std::string& job, const py::bytes& secret,
         uint32_t source_rank, uint32_t world_size, const std::string& local_dir,
         std::optional<int64_t> step, double timeout_s) {
        const std::string key = secret;
        return Released([&] {
          return peer::FetchReplica(endpoint, job, key, world_size, source_rank, step, local_dir,
                                    nullptr, timeout_s);
        });
      },
      py::arg("endpoint"), py::arg("job"), py::arg("secret"), py::arg("source_rank"),
      py::arg("world_size"), py::arg("local_dir"),
      py::arg("step") = py::none(), py::arg("timeout_s") = 60.0,
      "source_rank's replica of world_size (of step, or the newest) fetched and verified into the one-slot "
      "job directory local_dir/peer/step-N (rank-RRRRR.nsck); returns that directory.");
  m.def(
      "peer_list_own",
      [](const std::string& endpoint, const std::string& job, const py::bytes& secret,
         double timeout_s) {
        const std::string key = secret;
        return HeldList(
            Released([&] { return peer::ListOwnSegments(endpoint, job, key, timeout_s); }));
      },
      py::arg("endpoint"), py::arg("job"), py::arg("secret"), py::arg("timeout_s") = 10.0,
      "What the peer server at endpoint serves of its host's own memory segments of job: "
      "[{source_rank, world_size, step, counter, bytes}].");
  m.def(
      "peer_fetch_into",
      [](const std::string& endpoint, const std::string& job, const py::bytes& secret,
         uint32_t source_rank, uint32_t world_size, const std::string& local_dir,
         const std::string& sub, std::optional<int64_t> step, const std::string& source,
         double timeout_s) {
        const std::string key = secret;
        const peer::Source from = SourceOf(source);
        return Released([&] {
          return peer::FetchInto(endpoint, job, key, world_size, source_rank, step, from,
                                 local_dir, sub, nullptr, timeout_s);
        });
      },
      py::arg("endpoint"), py::arg("job"), py::arg("secret"), py::arg("source_rank"),
      py::arg("world_size"), py::arg("local_dir"), py::arg("sub"), py::arg("step") = py::none(),
      py::arg("source") = "replica", py::arg("timeout_s") = 60.0,
      "source_rank's checkpoint of world_size (of step, or the newest) as the server at "
      "endpoint holds it (source: 'replica', its host's own 'segment' or its host's job "
      "directory's rank file 'disk'), fetched and verified into the one-slot file "
      "local_dir/sub/rank-RRRRR.nsck; returns its path.");
  m.def(
      "peer_list_disk",
      [](const std::string& endpoint, const std::string& job, const py::bytes& secret,
         double timeout_s) {
        const std::string key = secret;
        return HeldList(
            Released([&] { return peer::ListDiskFiles(endpoint, job, key, timeout_s); }));
      },
      py::arg("endpoint"), py::arg("job"), py::arg("secret"), py::arg("timeout_s") = 10.0,
      "What the peer server at endpoint serves of its host's job directory's rank files: "
      "[{source_rank, world_size, step, counter, bytes}].");
  m.def(
      "peer_verify_local",
      [](const std::string& path, uint32_t source_rank, int64_t step) {
        Status st;
        {
          py::gil_scoped_release r;
          st = peer::VerifyLocal(path, source_rank, step);
        }
        Check(st);
      },
      py::arg("path"), py::arg("source_rank"), py::arg("step"),
      "Raises unless the newest checkpoint of the slot file at path is source_rank's of step "
      "and every chunk of its data verifies.");
  m.def(
      "memory_segments",
      [](const std::string& job_dir, const std::string& shm_dir) {
        std::vector<std::pair<int, std::string>> got;
        {
          py::gil_scoped_release r;
          got = RecordedMemorySegments(job_dir, shm_dir, nullptr);
        }
        return got;
      },
      py::arg("job_dir"), py::arg("shm_dir") = "",
      "[(rank, segment name)]: the memory segments job_dir's records name that exist in the "
      "segment directory (any world size).");
  m.def(
      "peer_push",
      [](const std::string& endpoint, const std::string& job, const py::bytes& secret,
         const std::string& slot_path, double connect_timeout_s, double io_timeout_s) {
        peer::PushOptions o;
        o.connect_timeout_s = connect_timeout_s;
        o.io_timeout_s = io_timeout_s;
        const std::string key = secret;
        return OutcomeName(
            Released([&] { return peer::PushNewest(endpoint, job, key, slot_path, o); }));
      },
      py::arg("endpoint"), py::arg("job"), py::arg("secret"), py::arg("slot_path"),
      py::arg("connect_timeout_s") = 5.0, py::arg("io_timeout_s") = 30.0,
      "Pushes the newest committed checkpoint of the slot file at slot_path now; returns "
      "'stored', 'already_held' or 'skipped_budget'.");
  py::class_<peer::ReshardLease, std::shared_ptr<peer::ReshardLease>>(
      m, "PeerReshardLease",
      "A rank's hold on its host's reshard copies fetched once per host (tier/peer_gather.h "
      "ReshardLease), from peer_gather_old_shards.")
      .def(
          "release",
          [](peer::ReshardLease& l) {
            py::gil_scoped_release r;
            Result<bool> done = l.Release();
            return done.ok() && *done;  // a failure leaves the copies to the host's last holder
          },
          "Gives the hold up; the last holder of the host removes the copies (True: this one "
          "did; never raises).");
  m.def(
      "peer_gather_old_shards",
      [](const std::string& job_dir, const std::string& job, const py::bytes& secret,
         const std::vector<std::string>& endpoints, const py::list& local, const py::list& other,
         const std::vector<std::string>& hosts, uint32_t rank, const py::object& remote,
         const std::string& holder) {
        peer::GatherRequest r;
        r.job_dir = job_dir;
        r.job = job;
        r.secret = secret;
        r.endpoints = endpoints;
        auto add = [&](py::handle h, int at) {
          const py::dict d = h.cast<py::dict>();
          peer::GatherCopy c;
          c.held.source_rank = d["source_rank"].cast<uint32_t>();
          c.held.world_size = d["world_size"].cast<uint32_t>();
          c.held.step = d["step"].cast<int64_t>();
          c.held.counter = d["counter"].cast<uint64_t>();
          c.kind = SourceOf(d["kind"].cast<std::string>());
          c.holder = at;
          c.path = d.contains("path") ? d["path"].cast<std::string>() : "";
          r.copies.push_back(std::move(c));
        };
        // This host's memory directory is read in place; a server on this
        // host lists the same files: only other hosts' servers are asked.
        for (const py::handle& h : local) add(h, -1);
        for (const py::handle& h : other) {
          const py::tuple t = h.cast<py::tuple>();
          const int at = t[0].cast<int>();
          if (hosts.at(static_cast<size_t>(at)) != hosts.at(rank)) add(t[1], at);
        }
        if (!remote.is_none() && !r.copies.empty()) {  // a _core.RemoteTier: its steps, its fetch
          r.remote_url = remote.attr("url").cast<std::string>();
          try {
            for (const py::handle& h : remote.attr("committed_steps")()) {
              const py::tuple t = h.cast<py::tuple>();
              const py::dict m = t[1].cast<py::dict>();
              r.remote_steps.push_back({DictGet<uint32_t>(m, "world_size", 0),
                                        t[0].cast<int64_t>(), DictGet<uint64_t>(m, "counter", 0)});
            }
          } catch (py::error_already_set& e) {
            if (!IsCheckpointFailure(e.value().ptr())) throw;
            r.remote_steps.clear();
            r.remote_error = "the remote tier " + r.remote_url +
                             " cannot be listed: " + py::str(e.value()).cast<std::string>();
          }
          // The remote tier's fetch is Python's (its transport): called with the GIL held.
          // By pointer: the function is copied with the GIL released; `remote` outlives it.
          r.remote_fetch = [rm = &remote](int64_t step, uint32_t rank,
                                          const std::string& dir) -> Result<std::string> {
            py::gil_scoped_acquire gil;
            try {
              return rm->attr("fetch")(step, rank, dir).cast<std::string>();
            } catch (py::error_already_set& e) {
              return Status::IOError(py::str(e.value()).cast<std::string>());
            }
          };
        }
        r.mem_dir = peer::PeerMemoryDir("");
        r.fallback_dir = peer::RankDir(job, "reshard", rank);
        r.holder = holder;
        peer::GatherResult got;
        const auto t0 = std::chrono::steady_clock::now();
        {
          py::gil_scoped_release release;
          got = peer::GatherOldShards(r);
        }
        py::list files;
        for (const auto& [w, rk, path] : got.files) files.append(py::make_tuple(w, rk, path));
        py::dict out, stats;  // stats: Checkpointer.stats()'s peer_reshard_* (none: nothing gathered)
        if (!got.from.empty() || !got.missing.empty()) {
          stats["peer_reshard_from"] = got.from;
          stats["peer_reshard_missing"] = got.missing;
          stats["peer_reshard_bytes"] = got.bytes;
          stats["peer_reshard_shared"] = got.shared;
          stats["peer_reshard_s"] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          stats["peer_reshard_dir"] = got.dir;
        }
        out["files"] = files;
        out["missing"] = got.missing;
        out["stats"] = stats;
        out["lease"] = got.lease == nullptr ? py::none() : py::cast(got.lease);
        return out;
      },
      py::arg("job_dir"), py::arg("job"), py::arg("secret"), py::arg("endpoints"),
      py::arg("local"), py::arg("other"), py::arg("hosts"), py::arg("rank"), py::arg("remote"),
      py::arg("holder"),
      "A copy of every old rank the job directory's world-W/ lacks (tier/peer_gather.h), for "
      "rank `rank`: from this host's memory directory (local [{source_rank, world_size, step, "
      "counter, kind, path}]), another host's server (other [(holder rank, {...})], hosts: "
      "every rank's host) or the remote tier (remote: a RemoteTier or None); fetched alone "
      "into peer_rank_dir(job, 'reshard', rank): {files [(world, rank, path)], missing, stats "
      "(peer_reshard_from {'W/r': line}, _missing, _bytes, _shared, _s, _dir; {} when nothing "
      "was gathered), lease (a PeerReshardLease or None: release it once the reshard read the "
      "files)}.");
  m.def(
      "peer_prefetch",
      [](const std::vector<std::tuple<int64_t, uint64_t, uint32_t>>& held,
         const std::vector<std::string>& endpoints, const std::string& job,
         const py::bytes& secret, uint32_t rank, uint32_t world,
         const std::vector<int64_t>& own_steps) {
        const std::string key = secret;
        peer::Prefetched p;
        {
          py::gil_scoped_release r;
          p = peer::PrefetchOwnReplica(held, endpoints, job, key, rank, world, own_steps);
        }
        py::object got = py::none();
        if (!p.dir.empty()) {
          got = py::dict(py::arg("step") = p.step, py::arg("counter") = p.counter,
                         py::arg("dir") = p.dir, py::arg("holder") = p.holder);
        }
        return py::make_tuple(got, LossyStr(p.why));
      },
      py::arg("held"), py::arg("endpoints"), py::arg("job"), py::arg("secret"), py::arg("rank"),
      py::arg("world"), py::arg("own_steps"),
      "({step, counter, dir, holder} or None, why not): the newest replica of this rank held "
      "at the start, fetched and verified unless own_steps has its step "
      "(tier/peer_setup.h PrefetchOwnReplica).");
  m.def(
      "peer_rank_dir",
      [](const std::string& job, const std::string& what, uint32_t rank, bool fresh) {
        py::gil_scoped_release r;
        return peer::RankDir(job, what, rank, fresh);
      },
      py::arg("job"), py::arg("what"), py::arg("rank"), py::arg("fresh") = false,
      "This rank's own directory in the memory directory (tier/peer_setup.h RankDir; fresh: "
      "what a run before left there removed first).");
  m.def(
      "peer_remove_rank_dir",
      [](const std::string& job, const std::string& what, uint32_t rank) {
        py::gil_scoped_release r;
        return peer::RemoveRankDir(job, what, rank);
      },
      py::arg("job"), py::arg("what"), py::arg("rank"),
      "Removes peer_rank_dir(job, what, rank) through the seam; best effort (False: not there "
      "or not removed).");
  m.def("peer_step_dir", &peer::PeerStepDir, py::arg("local_dir"), py::arg("step"));
  m.def("peer_replica_name", &peer::ReplicaName, py::arg("job"), py::arg("world_size"),
        py::arg("source_rank"));
  m.def("peer_shared_reshard_dir", &peer::SharedReshardDir, py::arg("job"));
  m.def("choose_partners", &peer::ChoosePartners, py::arg("hosts"), py::arg("replicas"),
        "partners[r]: the ranks that hold rank r's replicas (never on r's host).");
}

}  // namespace nonstop::py_bindings
