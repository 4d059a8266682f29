#include "tier/path_transport.h"

#include <algorithm>
#include <utility>

#include "tier/pacer.h"

namespace nonstop::tier {

namespace {

std::vector<std::string> Split(const std::string& key) {
  std::vector<std::string> out;
  size_t at = 0;
  while (true) {
    const size_t slash = key.find('/', at);
    out.push_back(key.substr(at, slash == std::string::npos ? std::string::npos : slash - at));
    if (slash == std::string::npos) return out;
    at = slash + 1;
  }
}

bool EndsWith(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// A link (or anything not ours) where an object's file or directory must be.
Status AsCorruption(const Status& s) {
  return s.code() == StatusCode::kFailedPrecondition ? Status::Corruption(s.message()) : s;
}

}  // namespace

PathTransport::PathTransport(Env* env, std::string root, uint64_t part_bytes)
    : env_(env), root_(std::move(root)), part_(std::max<uint64_t>(part_bytes, 4096)) {}

Result<std::unique_ptr<Directory>> PathTransport::Parent(const std::string& key, bool create,
                                                         std::string* name) {
  std::vector<std::string> names = Split(key);
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, env_->OpenDirectory(root_, create));
  for (size_t i = 0; i + 1 < names.size(); ++i) {
    NONSTOP_ASSIGN_OR_RETURN(d, d->OpenDir(names[i], create));
  }
  *name = names.back();
  return d;
}

Status PathTransport::PutFile(const std::string& key, const std::string& dir,
                              const std::string& name, double bps) {
  if (aborted_.load()) return Status::Aborted(key + ": upload aborted (close_timeout_s passed)");
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> src_dir, env_->OpenDirectory(dir, false));
  MediumOptions ro;
  ro.read_only = true;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> src,
                           src_dir->OpenFile(name, MediumKind::kBuffered, ro));
  std::string dest;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, Parent(key, true, &dest));
  const std::string tmp = dest + ".tmp";
  if (Status s = d->Unlink(tmp); !s.ok() && s.code() != StatusCode::kNotFound) return s;
  Status s = [&]() -> Status {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> out,
                             d->CreateFile(tmp, MediumKind::kBuffered, MediumOptions{}));
    Pacer pace(bps);  // the bandwidth limit; Abort stops it
    std::string buf(part_, '\0');
    const uint64_t size = src->Size();
    for (uint64_t at = 0; at < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(part_, size - at));
      NONSTOP_RETURN_IF_ERROR(src->Read(at, buf.data(), n));
      NONSTOP_RETURN_IF_ERROR(out->Write(at, buf.data(), n));
      at += n;
      NONSTOP_RETURN_IF_ERROR(
          pace.Wait(at, [this] { return aborted_.load(); }).Annotate(key));
    }
    return out->Sync();  // sticky: a failed fsync is never renamed into place
  }();
  if (s.ok()) s = d->Rename(tmp, dest);
  if (s.ok()) return d->SyncDir();
  (void)d->Unlink(tmp);  // best effort: a later put removes a stale temp
  return s;
}

Status PathTransport::PutBytes(const std::string& key, std::string_view data) {
  std::string name;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, Parent(key, true, &name));
  return WriteFileAtomic(*d, name, data);
}

Result<std::unique_ptr<Medium>> PathTransport::OpenObject(const std::string& key) {
  std::string name;
  Result<std::unique_ptr<Directory>> d = Parent(key, false, &name);
  if (!d.ok()) return AsCorruption(d.status());
  MediumOptions ro;
  ro.read_only = true;
  Result<std::unique_ptr<Medium>> m = d.value()->OpenFile(name, MediumKind::kBuffered, ro);
  if (!m.ok()) return AsCorruption(m.status());
  return m;
}

Result<std::string> PathTransport::GetBytes(const std::string& key, uint64_t limit) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, OpenObject(key));
  if (m->Size() > limit) {
    return Status::Corruption(root_ + "/" + key + " is more than a nonstop document (" +
                              std::to_string(limit) + " bytes)");
  }
  std::string out(m->Size(), '\0');
  NONSTOP_RETURN_IF_ERROR(m->Read(0, out.data(), out.size()));
  return out;
}

Status PathTransport::GetChunks(const std::string& key,
                                const std::function<Status(uint64_t size)>& on_size,
                                const std::function<Status(std::string_view chunk)>& on_chunk) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, OpenObject(key));
  const uint64_t size = m->Size();
  NONSTOP_RETURN_IF_ERROR(on_size(size));
  std::string buf(part_, '\0');
  for (uint64_t at = 0; at < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(part_, size - at));
    NONSTOP_RETURN_IF_ERROR(m->Read(at, buf.data(), n));
    NONSTOP_RETURN_IF_ERROR(on_chunk(std::string_view(buf.data(), n)));
    at += n;
  }
  return Status::OK();
}

Status PathTransport::Walk(Directory& d, const std::string& rel, int depth,
                           std::vector<StoredObject>* out) {
  if (depth > 8) return Status::OK();  // the layout nests two levels: deeper is not ours
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, d.List());
  for (const DirEntry& e : entries) {
    const std::string key = rel.empty() ? e.name : rel + "/" + e.name;
    if (e.type == EntryType::kDirectory) {
      Result<std::unique_ptr<Directory>> sub = d.OpenDir(e.name, false);
      if (sub.ok()) {
        NONSTOP_RETURN_IF_ERROR(Walk(*sub.value(), key, depth + 1, out));
      } else if (sub.status().code() != StatusCode::kNotFound &&
                 sub.status().code() != StatusCode::kFailedPrecondition) {
        return sub.status();  // removed meanwhile, or replaced by a link: skipped
      }
    } else if (e.type == EntryType::kFile && !EndsWith(e.name, ".tmp")) {
      // A failed stat fails the listing: an object left out (a step's
      // COMMITTED) would make retention delete a committed step's parts.
      Result<FileStat> st = d.Stat(e.name);
      if (!st.ok() && st.status().code() != StatusCode::kNotFound) return st.status();
      if (st.ok() && st.value().type == EntryType::kFile) out->push_back({key, st.value().size});
    }
  }
  return Status::OK();
}

Result<std::vector<StoredObject>> PathTransport::List(const std::string& prefix) {
  std::string rel = prefix;
  while (!rel.empty() && rel.back() == '/') rel.pop_back();
  while (!rel.empty() && rel.front() == '/') rel.erase(0, 1);
  std::vector<StoredObject> out;
  std::string unused;
  Result<std::unique_ptr<Directory>> d =
      rel.empty() ? env_->OpenDirectory(root_, false) : Parent(rel + "/x", false, &unused);
  if (!d.ok()) {
    if (d.status().code() == StatusCode::kNotFound) return out;
    return AsCorruption(d.status());
  }
  NONSTOP_RETURN_IF_ERROR(Walk(*d.value(), rel, 0, &out));
  return out;
}

Status PathTransport::Delete(const std::vector<std::string>& keys) {
  std::vector<std::string> emptied;  // the step directories to remove when empty
  for (const std::string& k : keys) {
    std::string name;
    Result<std::unique_ptr<Directory>> d = Parent(k, false, &name);
    if (!d.ok()) {
      const StatusCode c = d.status().code();
      if (c == StatusCode::kNotFound || c == StatusCode::kFailedPrecondition) continue;
      return d.status();  // gone, or a link: not ours
    }
    if (Status s = d.value()->Unlink(name); !s.ok() && s.code() != StatusCode::kNotFound) return s;
    NONSTOP_RETURN_IF_ERROR(d.value()->SyncDir());
    const size_t slash = k.rfind('/');
    if (slash != std::string::npos &&
        std::find(emptied.begin(), emptied.end(), k.substr(0, slash)) == emptied.end()) {
      emptied.push_back(k.substr(0, slash));
    }
  }
  for (const std::string& rel : emptied) {  // not empty (or gone): left for a later round
    std::string name;
    Result<std::unique_ptr<Directory>> parent = Parent(rel, false, &name);
    if (parent.ok() && parent.value()->RemoveDir(name).ok()) (void)parent.value()->SyncDir();
  }
  return Status::OK();
}

}  // namespace nonstop::tier
