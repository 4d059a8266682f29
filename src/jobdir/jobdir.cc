// JobDir (include/nonstop/jobdir.h). First merge: the API only; the
// implementation follows.
#include "nonstop/jobdir.h"

#include <cstdlib>

namespace nonstop {

namespace {
Status NotYet() { return Status::Unavailable("JobDir: not implemented yet"); }
}  // namespace

struct JobDir::Impl {
  std::string path;
};

bool LineageRecord::IsAbandoned(uint64_t counter) const {
  for (const auto& [lo, hi] : abandoned) {
    if (counter >= lo && counter <= hi) return true;
  }
  return false;
}

JobDir::JobDir(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JobDir::~JobDir() = default;

Result<std::unique_ptr<JobDir>> JobDir::OpenForWrite(const std::string&, int, int, Env*) {
  return NotYet();
}
Result<std::unique_ptr<JobDir>> JobDir::OpenForRead(const std::string&, Env*) { return NotYet(); }
const std::string& JobDir::path() const { return impl_->path; }
bool JobDir::writable() const { return false; }
int JobDir::rank() const { return 0; }
Directory& JobDir::dir() { std::abort(); }
std::string JobDir::SlotPath(int rank) const { return impl_->path + "/" + JobDirNames::Slot(rank); }
Result<std::vector<std::string>> JobDir::ForeignEntries() { return NotYet(); }
Result<std::unique_ptr<Medium>> JobDir::OpenSlot(int, MediumKind, bool) { return NotYet(); }
Result<std::unique_ptr<Medium>> JobDir::CreateTempSlot(MediumKind) { return NotYet(); }
Status JobDir::PublishTempSlot() { return NotYet(); }
Status JobDir::DiscardTempSlot() { return NotYet(); }
Result<Selection> JobDir::Select(int, const SelectOptions&) { return NotYet(); }
Result<CommonSelection> JobDir::SelectCommon(int, const SelectOptions&, std::optional<int>) {
  return NotYet();
}
Result<std::vector<ListedCheckpoint>> JobDir::List(int) { return NotYet(); }
Status JobDir::RecordRestore(int, uint64_t) { return NotYet(); }
Result<LineageRecord> JobDir::ReadLineage(int) { return NotYet(); }
Result<uint64_t> JobDir::NextCounter(int) { return NotYet(); }
Result<std::optional<uint64_t>> JobDir::ProtectedCounter(int) { return NotYet(); }
Status JobDir::Keep(SlotFile&, const CheckpointInfo&) { return NotYet(); }
Result<bool> JobDir::NeedsSetAside(int) { return NotYet(); }
Result<std::vector<int>> JobDir::SetAside(int) { return NotYet(); }
Result<std::vector<int>> JobDir::SetAsideWorlds() { return NotYet(); }
Status JobDir::WriteAgreed(const AgreedRecord&) { return NotYet(); }
Result<std::optional<AgreedRecord>> JobDir::ReadAgreed(int) { return NotYet(); }

}  // namespace nonstop
