// The engine's staging pool: its default size, growing it to the registered
// state, and the background allocation of PrepareStaging.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

// Default staging (no staging_bytes): grows the pool to DefaultStagingSize
// for the state about to be registered. The pool is replaced only with
// nothing in flight (writers release chunks into staging_), so a state that
// outgrows the pool waits for the checkpoints in flight once; it never
// shrinks (but see ShrinkStaging). If the larger pool cannot be allocated
// the old one is kept. `state_bytes` counts only what goes through staging
// (staged tensors do not: Register).
Status EngineImpl::GrowStaging(uint64_t state_bytes) {
  const bool pinned = copy_->PinsHostMemory();
  const StagingSize want =
      DefaultStagingSize(state_bytes, chunk_bytes_, min_chunks_, PhysicalMemoryBytes(), pinned);
  if (want.capped && want.note != staging_note_) {
    std::fprintf(stderr, "nonstop: %s\n", want.note.c_str());
    staging_note_ = want.note;
  }
  if (want.bytes <= staging_->total_bytes()) return Status::OK();
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
  // A pool PrepareStaging allocated in the background, when large enough;
  // otherwise allocated here, on the training thread (counted either way).
  double waited_s = 0;
  const auto t0 = Clock::now();
  Result<std::unique_ptr<StagingPool>> grown = TakePrepared(&waited_s);
  if (grown.ok() && grown.value()->total_bytes() < want.bytes) {
    grown = Status::Aborted("prepared staging is smaller than the state");
  }
  if (!grown.ok()) {
    grown = StagingPool::Create(copy_.get(), want.bytes, chunk_bytes_, min_chunks_);
    waited_s = Seconds(t0, Clock::now());
  }
  if (waited_s > 0) {
    stats_.staging_alloc_waits += 1;
    stats_.staging_alloc_wait_s += waited_s;
  }
  if (!grown.ok()) {
    std::fprintf(stderr, "nonstop: keeping %llu MiB of staging: %s\n",
                 static_cast<unsigned long long>(staging_->total_bytes() >> 20),
                 grown.status().ToString().c_str());
    return Status::OK();
  }
  return ReplaceStaging(std::move(grown).value());
}

// Staged tensors (TensorRef::staged) are written from their own memory; a
// registration of nothing else needs only the pool's smallest size (the
// dispatcher and writers hold no chunk of it for these checkpoints).
Status EngineImpl::ShrinkStaging() {
  const uint64_t want = uint64_t{min_chunks_} * chunk_bytes_;
  if (staging_->total_bytes() <= want) return Status::OK();
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
  Result<std::unique_ptr<StagingPool>> small =
      StagingPool::Create(copy_.get(), want, chunk_bytes_, min_chunks_);
  if (!small.ok()) return Status::OK();  // keep the larger pool
  return ReplaceStaging(std::move(small).value());
}

// GrowStaging and ShrinkStaging: `pool` becomes the staging pool. Called
// with nothing in flight, so nothing refers to the old pool: it is freed in
// the background (see retire_thread_).
Status EngineImpl::ReplaceStaging(std::unique_ptr<StagingPool> pool) {
  staging_wait_s_before_ += staging_->wait_s_total();
  std::unique_ptr<StagingPool> old = std::move(staging_);
  staging_ = std::move(pool);
  stats_.staging_bytes = staging_->total_bytes();
  if (retire_thread_.joinable()) retire_thread_.join();
  retire_thread_ = std::thread([old = std::move(old)]() mutable { old.reset(); });
  return Status::OK();
}

Result<std::unique_ptr<StagingPool>> EngineImpl::TakePrepared(double* waited_s) {
  *waited_s = 0;
  if (!prep_) return Status::NotFound("no staging prepared");
  std::shared_ptr<PreparedStaging> prep = std::move(prep_);
  prep_.reset();
  Result<std::unique_ptr<StagingPool>> pool = TakeBackground(*prep, prep_thread_, waited_s);
  if (pool.ok()) stats_.staging_prepared_bytes = pool.value()->total_bytes();
  return pool;
}

Status EngineImpl::PrepareStaging(uint64_t state_bytes) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  // No slot file yet (Init found none, nothing registered): create one in
  // the background too, published empty under the slot file's name (it holds
  // no checkpoint, so a crash from here on recovers as with no file). Never
  // while one exists: file_ is set by Init for an existing file, and the
  // single-writer lock keeps others from creating one meanwhile
  // (CreateSlotFile also refuses to publish over one).
  if (!file_ && !file_prep_ && !file_prep_thread_.joinable() && state_bytes > 0 &&
      state_bytes < (uint64_t{1} << 52)) {
    auto fp = std::make_shared<PreparedFile>();
    file_prep_ = fp;
    StoreGeometry g;
    g.slots = WantedSlots();
    g.slot_bytes = PreparedSlotBytes(state_bytes);
    g.rank = opts_.rank;
    g.world_size = opts_.world_size;
    file_prep_thread_ = std::thread([this, fp, g] {
      fp->Set(CreateSlotFile(g, /*publish=*/true, /*never_replace=*/true));
    });
  }
  if (opts_.staging_bytes != 0 || prep_) return Status::OK();
  const bool pinned = copy_->PinsHostMemory();
  const uint64_t want =
      DefaultStagingSize(state_bytes, chunk_bytes_, min_chunks_, PhysicalMemoryBytes(), pinned).bytes;
  if (want <= staging_->total_bytes()) return Status::OK();
  if (prep_thread_.joinable()) prep_thread_.join();  // an earlier one, already taken
  // Nothing registered or in flight yet: until the first Register takes the
  // prepared pool, the smallest one will do. The default pool (256 MiB) is
  // freed now, in the background (retire_thread_), rather than during the
  // first save(), where unlocking and unmapping it competed with the save
  // for the CPU.
  const uint64_t smallest = uint64_t{min_chunks_} * chunk_bytes_;
  if (!reg_ && in_flight_ == 0 && open_ == 0 && staging_->total_bytes() > smallest) {
    Result<std::unique_ptr<StagingPool>> small =
        StagingPool::Create(copy_.get(), smallest, chunk_bytes_, min_chunks_);
    if (small.ok()) NONSTOP_RETURN_IF_ERROR(ReplaceStaging(std::move(small).value()));
  }
  auto prep = std::make_shared<PreparedStaging>();
  prep_ = prep;
  CopyEngine* copy = copy_.get();
  const uint64_t chunk = chunk_bytes_;
  const uint32_t min_chunks = min_chunks_;
  prep_thread_ = std::thread([prep, copy, want, chunk, min_chunks] {
    prep->Set(StagingPool::Create(copy, want, chunk, min_chunks));
  });
  return Status::OK();
}

}  // namespace nonstop::engine_detail

namespace nonstop {

uint64_t PreparedSlotBytes(uint64_t state_bytes) {
  const uint64_t room = state_bytes / 128 + (uint64_t{4} << 20);
  return (state_bytes + room + kStoreAlign - 1) / kStoreAlign * kStoreAlign;
}

bool PreparedSlotFits(uint64_t prepared_slot_bytes, uint64_t needed_slot_bytes) {
  return prepared_slot_bytes >= needed_slot_bytes &&
         prepared_slot_bytes - needed_slot_bytes <= needed_slot_bytes / 8 + (uint64_t{8} << 20);
}

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

StagingSize DefaultStagingSize(uint64_t state_bytes, uint64_t chunk_bytes, uint32_t min_chunks,
                               uint64_t ram_bytes, bool pinned) {
  const uint64_t b = std::max<uint64_t>(chunk_bytes, 1);
  auto up = [b](uint64_t x) { return (x + b - 1) / b * b; };
  const uint64_t floor_bytes = std::max<uint64_t>(uint64_t{min_chunks} * b, 1);
  StagingSize r;
  r.bytes = std::max({up(kStagingFloorBytes), up(state_bytes), floor_bytes});
  uint64_t cap = ram_bytes > 0 ? ram_bytes / 4 : UINT64_MAX;
  const char* why = "a quarter of physical memory";
  if (pinned && cap > kPinnedStagingCapBytes) {
    cap = kPinnedStagingCapBytes;
    why = "the pinned-memory cap";
  }
  cap = std::max(cap / b * b, floor_bytes);
  if (r.bytes > cap) {
    r.capped = state_bytes > cap;
    r.bytes = cap;
  }
  if (r.capped) {
    char buf[320];
    std::snprintf(buf, sizeof(buf),
                  "staging capped at %.2f GiB (%s) for a %.2f GiB state: each checkpoint's copy "
                  "waits for the medium to write the other %.2f GiB; set staging_bytes to "
                  "override",
                  static_cast<double>(r.bytes) / (1 << 30), why,
                  static_cast<double>(state_bytes) / (1 << 30),
                  static_cast<double>(state_bytes - r.bytes) / (1 << 30));
    r.note = buf;
  }
  return r;
}

}  // namespace nonstop
