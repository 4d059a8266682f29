// `nonstop ls` and `nonstop rm`: checkpoint management through the job
// directory's owner (include/nonstop/jobdir.h). `ls` takes no lock and
// changes nothing; `rm` takes every rank's lock (refused, naming the holder,
// while a job writes to the directory) and deletes one kept copy
// (JobDir::DeleteKept: renamed away first, so a reader sees it whole or not
// at all). Every error is one line on stderr and a non-zero exit.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <ctime>
#include <exception>
#include <iostream>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <vector>

#include "engine/job_view.h"
#include "jobdir/remote_layout.h"
#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "store/format.h"
#include "tools/commands.h"
#include "tools/remote_cli.h"
#include "tools/store_json.h"

namespace nonstop::cli {
namespace {

using nlohmann::json;

constexpr int kExitNotFound = 1;
constexpr int kExitRefused = 3;

[[noreturn]] void Fail(const std::string& cmd, const Status& s) {
  std::cerr << "nonstop " << cmd << ": " << OneLine(s.message()) << "\n";
  throw CLI::RuntimeError(s.code() == StatusCode::kNotFound || s.code() == StatusCode::kCorruption
                              ? kExitNotFound
                              : kExitRefused);
}

// `nonstop ls DIR`: the job view (engine/job_view.h) of one rank: every
// checkpoint with the tiers that hold it (disk, memory; remote and peer as
// the job manifest recorded them), newest first.
void RunLs(const std::string& dir, int rank, bool as_json) {
  Result<JobView> view = ViewJob(dir, rank);
  if (!view.ok()) Fail("ls", view.status());
  const std::vector<ViewRow>& rows = view.value().rows;
  // A file that cannot be read (the slot file, the manifest) is damage:
  // listed, then one line on stderr and exit 1, never "no checkpoint" and 0.
  std::string unreadable;
  for (const ViewRow& r : rows) {
    if (r.unreadable && unreadable.empty()) unreadable = r.reason;
  }
  for (const std::string& n : view.value().notes) {
    std::cerr << "nonstop ls: " << OneLine(n) << "\n";
  }
  const auto done = [&] {
    if (!unreadable.empty()) Fail("ls", Status::Corruption(unreadable));
  };
  if (as_json) {
    json out = json::array();
    for (const ViewRow& r : rows) {
      json m = json::object();
      for (const auto& [k, v] : r.metrics) m[format::Printable(k)] = v;
      json tiers = json::array();
      for (const ViewHolder& h : r.tiers) {
        tiers.push_back({{"tier", h.tier}, {"where", h.where}, {"recorded", h.recorded}});
      }
      out.push_back({{"step", r.step},
                     {"counter", r.counter},
                     {"where", r.where},
                     // whole (JSON escapes what it must): nonstop.list's values
                     {"path", r.path},
                     {"state", r.state},
                     {"reason", r.reason},
                     {"commit_unix_ns", r.commit_unix_ns},
                     {"bytes", r.bytes},
                     {"metrics", m},
                     {"tiers", tiers},
                     {"job", view.value().job}});
    }
    std::cout << DumpJson(out, 2) << "\n";
    done();
    return;
  }
  std::cout << LsText(view.value(), rank, dir);
  done();
}

// A training step as the command line gives it: a signed 64-bit decimal,
// the whole argument, never clamped (CLI11 would saturate 99999999999999999999).
int64_t ParseStep(const std::string& cmd, const std::string& text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc::result_out_of_range) {
    std::cerr << "nonstop " << cmd << ": step " << OneLine(text)
              << " is out of range (a step is a signed 64-bit integer)\n";
    throw CLI::RuntimeError(2);
  }
  if (ec != std::errc() || p != end || text.empty()) {
    std::cerr << "nonstop " << cmd << ": step must be an integer, got '" << OneLine(text) << "'\n";
    throw CLI::RuntimeError(2);
  }
  return v;
}

void RunRm(const std::string& dir, int64_t step) {
  Result<std::unique_ptr<JobDir>> jd = JobDir::OpenForMaintenance(dir);
  if (!jd.ok()) Fail("rm", jd.status());
  Status s = jd.value()->DeleteKept(step);
  if (!s.ok()) Fail("rm", s);
  std::cout << "deleted the kept copy of step " << step << " in " << dir << "\n";
}

template <typename F>
std::function<void()> Guarded(const char* cmd, F run) {
  return [cmd, run] {
    try {
      run();
    } catch (const CLI::Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      Fail(cmd, Status::Internal("out of memory"));
    } catch (const std::exception& e) {
      Fail(cmd, Status::Internal(std::string("internal error: ") + e.what()));
    }
  };
}

}  // namespace

void AddManageCommands(CLI::App& app) {
  struct Args {
    std::string dir;
    int rank = 0;
    bool json = false;
    std::string step;
  };
  auto args = std::make_shared<Args>();
  CLI::App* ls = app.add_subcommand(
      "ls", "List the checkpoints of a directory, newest first: the ring, the kept copies (keep/), "
            "the memory segment, and what the remote and peer tiers hold (the job manifest)");
  ls->add_option("dir", args->dir, "checkpoint directory")->required();
  ls->add_option("--rank", args->rank, "rank whose files to list (default 0)");
  ls->add_flag("--json", args->json, "print JSON instead of a table");
  ls->callback(Guarded("ls", [args] {
    // a remote (a URL, or a directory used as one): python -m nonstop._remote_cli ls
    if (IsRemoteUrl(args->dir) || remote::LooksLikeRemoteRoot(DefaultEnv(), args->dir)) {
      RunRemote(RemoteCall("ls", args->dir, "", args->rank, args->json));
    }
    RunLs(args->dir, args->rank, args->json);
  }));

  CLI::App* rm = app.add_subcommand(
      "rm", "Delete the kept copy of one step (keep/step-N/) while no job writes to the directory");
  rm->add_option("dir", args->dir, "checkpoint directory")->required();
  rm->add_option("step", args->step, "training step whose kept copy to delete")->required();
  rm->callback(Guarded("rm", [args] { RunRm(args->dir, ParseStep("rm", args->step)); }));
}

}  // namespace nonstop::cli
