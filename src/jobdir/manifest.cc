// The job manifest (manifest.h): encoding, validation, and the notes of the
// tiers' background threads.
#include "jobdir/manifest.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <mutex>

#include "jobdir/records.h"
#include "nonstop/crc32c.h"
#include "nonstop/jobdir.h"

namespace nonstop {
namespace {

using jobdir_internal::Json;
using jobdir_internal::JsonString;
using jobdir_internal::ParseJson;

constexpr std::string_view kFormat = "nonstop.manifest/1";
constexpr std::string_view kCrcPrefix = "crc32c=";

std::string Crc8(uint32_t c) {
  char b[16];
  std::snprintf(b, sizeof(b), "%08x", c);
  return b;
}

std::string Num(double v) {
  if (!std::isfinite(v)) return "0";
  char b[64];
  std::snprintf(b, sizeof(b), "%.6f", v);
  return b;
}

bool ValidText(const std::string& s) { return s.size() <= kMaxManifestText; }

}  // namespace

std::string EncodeJobManifest(const JobManifest& m) {
  std::string body = "{\"format\": " + JsonString(kFormat) + ", \"rank\": " +
                     std::to_string(m.rank) + ", \"job\": " + JsonString(m.job) +
                     ", \"holders\": [";
  for (size_t h = 0; h < m.holders.size(); ++h) {
    const ManifestHolder& x = m.holders[h];
    if (h) body += ", ";
    body += "{\"tier\": " + JsonString(x.tier) + ", \"where\": " + JsonString(x.where) +
            ", \"unix_s\": " + Num(x.unix_s) + ", \"held\": [";
    for (size_t k = 0; k < x.held.size(); ++k) {
      if (k) body += ", ";
      body += "[" + std::to_string(x.held[k].step) + ", " + std::to_string(x.held[k].counter) + "]";
    }
    body += "]}";
  }
  body += "]}\n";
  return body + std::string(kCrcPrefix) + Crc8(Crc32c(body.data(), body.size())) + "\n";
}

Result<JobManifest> DecodeJobManifest(std::string_view text, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Status::Corruption(what + ": not a job manifest (" + why + ")");
  };
  if (text.size() > kMaxManifestBytes) {
    return bad(std::to_string(text.size()) + " bytes, more than " +
               std::to_string(kMaxManifestBytes));
  }
  // body "\n" "crc32c=xxxxxxxx" "\n": the crc covers the body and its newline.
  const size_t tail = kCrcPrefix.size() + 8 + 1;
  if (text.size() < tail + 2 || text.back() != '\n' ||
      text.substr(text.size() - tail, kCrcPrefix.size()) != kCrcPrefix) {
    return bad("no crc32c line at its end: cut short or not written by nonstop");
  }
  const std::string_view body = text.substr(0, text.size() - tail);
  const std::string_view crc = text.substr(text.size() - tail + kCrcPrefix.size(), 8);
  if (body.empty() || body.back() != '\n') return bad("no newline before its crc32c line");
  if (Crc8(Crc32c(body.data(), body.size())) != crc) {
    return bad("crc32c mismatch: stored " + std::string(crc) + ", computed " +
               Crc8(Crc32c(body.data(), body.size())));
  }
  NONSTOP_ASSIGN_OR_RETURN(Json j, ParseJson(body, what));
  if (j.type != Json::Type::kObject) return bad("not an object");
  const Json* f = j.Get("format");
  if (f == nullptr || f->type != Json::Type::kString || f->text != kFormat) {
    return bad("\"format\" is not \"" + std::string(kFormat) + "\"");
  }
  JobManifest m;
  int64_t v = 0;
  f = j.Get("rank");
  if (f == nullptr || !f->AsInt64(&v) || v < 0 || v > 99999) return bad("\"rank\" is not a rank");
  m.rank = static_cast<int>(v);
  f = j.Get("job");
  if (f == nullptr || f->type != Json::Type::kString || !ValidText(f->text)) {
    return bad("\"job\" is not a job name");
  }
  m.job = f->text;
  f = j.Get("holders");
  if (f == nullptr || f->type != Json::Type::kArray || f->items.size() > kMaxManifestHolders) {
    return bad("\"holders\" is not a list of at most " + std::to_string(kMaxManifestHolders));
  }
  for (const Json& h : f->items) {
    if (h.type != Json::Type::kObject) return bad("a holder is not an object");
    ManifestHolder x;
    const Json* t = h.Get("tier");
    if (t == nullptr || t->type != Json::Type::kString || (t->text != "remote" && t->text != "peer")) {
      return bad("a holder's \"tier\" is not \"remote\" or \"peer\"");
    }
    x.tier = t->text;
    t = h.Get("where");
    if (t == nullptr || t->type != Json::Type::kString || t->text.empty() || !ValidText(t->text)) {
      return bad("a holder's \"where\" is not a place");
    }
    x.where = t->text;
    t = h.Get("unix_s");
    if (t == nullptr || !t->AsDouble(&x.unix_s)) return bad("a holder's \"unix_s\" is not a number");
    t = h.Get("held");
    if (t == nullptr || t->type != Json::Type::kArray || t->items.size() > kMaxManifestHeld) {
      return bad("a holder's \"held\" is not a list of at most " + std::to_string(kMaxManifestHeld));
    }
    for (const Json& e : t->items) {
      ManifestHeld held;
      if (e.type != Json::Type::kArray || e.items.size() != 2 || !e.items[0].AsInt64(&held.step) ||
          !e.items[1].AsUint64(&held.counter) || held.counter == 0) {
        return bad("a held checkpoint is not [step, counter]");
      }
      x.held.push_back(held);
    }
    m.holders.push_back(std::move(x));
  }
  return m;
}

Result<std::optional<JobManifest>> ReadJobManifest(Directory& dir, int rank) {
  const std::string name = JobDirNames::Manifest(rank);
  const std::string what = dir.path() + "/" + name;
  // Bounded before it is read: ReadSmallFile refuses a larger file.
  Result<std::string> text = ReadSmallFile(dir, name, kMaxManifestBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return std::optional<JobManifest>();
    if (text.status().code() == StatusCode::kCorruption) {
      return Status::Corruption(what + ": not a job manifest (" + text.status().message() + ")");
    }
    return text.status().Annotate(what);
  }
  NONSTOP_ASSIGN_OR_RETURN(JobManifest m, DecodeJobManifest(text.value(), what));
  if (m.rank != rank) {
    return Status::Corruption(what + ": not a job manifest (it names rank " +
                              std::to_string(m.rank) + ")");
  }
  return std::optional<JobManifest>(std::move(m));
}

Status NoteHeld(Env* env, const std::string& job_dir, int rank, const std::string& job,
                ManifestHolder holder) {
  static std::mutex mu;  // the uploader's and the replicator's threads note into one file
  std::lock_guard<std::mutex> lock(mu);
  if (env == nullptr) env = DefaultEnv();
  if (holder.tier != "remote" && holder.tier != "peer") {
    return Status::InvalidArgument("NoteHeld: tier must be \"remote\" or \"peer\", got \"" +
                                   holder.tier + "\"");
  }
  if (holder.where.empty() || !ValidText(holder.where) || !ValidText(job)) {
    return Status::InvalidArgument("NoteHeld: a place of 1 to " +
                                   std::to_string(kMaxManifestText) + " bytes and a job name of "
                                   "at most that");
  }
  std::sort(holder.held.begin(), holder.held.end(),
            [](const ManifestHeld& a, const ManifestHeld& b) { return a.counter > b.counter; });
  if (holder.held.size() > kMaxManifestHeld) holder.held.resize(kMaxManifestHeld);
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> dir, env->OpenDirectory(job_dir, false));
  JobManifest m;
  m.rank = rank;
  Result<std::optional<JobManifest>> old = ReadJobManifest(*dir, rank);
  if (old.ok() && old.value()) {
    m = std::move(*old.value());
  } else if (!old.ok() && old.status().code() != StatusCode::kCorruption) {
    return old.status();  // an I/O error: leave the file as it is
  }  // damaged: replaced by this note alone
  if (!job.empty()) m.job = job;
  std::erase_if(m.holders, [&](const ManifestHolder& h) {
    return h.tier == holder.tier && h.where == holder.where;
  });
  m.holders.insert(m.holders.begin(), std::move(holder));
  if (m.holders.size() > kMaxManifestHolders) m.holders.resize(kMaxManifestHolders);
  return WriteFileAtomic(*dir, JobDirNames::Manifest(rank), EncodeJobManifest(m));
}

}  // namespace nonstop
