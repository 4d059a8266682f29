#include "tier/uploader.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <utility>

#include "jobdir/manifest.h"
#include "tier/staging.h"

namespace nonstop::tier {

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::chrono::nanoseconds Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(std::max(0.0, s)));
}

// A store's messages can run to many lines (obstore's debug dump): the
// first says it.
std::string FirstLine(const Status& s) {
  std::string m = s.message();
  m = m.substr(0, m.find('\n'));
  while (!m.empty() && (m.back() == ' ' || m.back() == '\r')) m.pop_back();
  return m.empty() ? StatusCodeName(s.code()) : m;
}

constexpr double kFirstBackoffS = 0.2;

}  // namespace

void LowerThreadPriority(int nice) {
  if (nice <= 0) return;
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  errno = 0;
  const int now = getpriority(PRIO_PROCESS, tid);
  if (errno == 0) (void)setpriority(PRIO_PROCESS, tid, std::min(19, now + nice));
  if (nice >= kIdleNice) {
    sched_param sp{};
    sp.sched_priority = 0;
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
  }
#ifdef SYS_ioprio_set
  // ioprio_set(IOPRIO_WHO_PROCESS, tid, best-effort class, its lowest level 7)
  (void)syscall(SYS_ioprio_set, 1, static_cast<int>(tid), (2 << 13) | 7);
#endif
}

RemoteUploader::RemoteUploader(RemoteTier* tier, Env* env, UploaderOptions o, Newest newest)
    : tier_(tier), env_(env), o_(std::move(o)), newest_(std::move(newest)) {}

Result<std::unique_ptr<RemoteUploader>> RemoteUploader::Start(RemoteTier* tier, Env* env,
                                                              UploaderOptions o, Newest newest) {
  if (o.retention.max_to_keep < 1) {
    return Status::InvalidArgument("remote_options max_to_keep must be at least 1");
  }
  if (o.every > 0 && o.world_size > 1) {
    return Status::InvalidArgument(
        "remote_every is for one process: with several ranks the newest checkpoint every rank "
        "holds is uploaded (leave remote_every out)");
  }
  std::unique_ptr<RemoteUploader> u(new RemoteUploader(tier, env, std::move(o), std::move(newest)));
  RemoteUploader* self = u.get();
  u->thread_ = std::thread([self] { self->Loop(); });
  return u;
}

RemoteUploader::~RemoteUploader() {
  (void)Close(false);
  if (thread_.joinable()) thread_.join();
}

void RemoteUploader::Started(uint64_t counter, int64_t step) {
  MutexLock l(&mu_);
  if (o_.every > 0 && counter % o_.every == 0) queue_.push_back({counter, step});
  wake_ = true;
  cv_.SignalAll();
}

void RemoteUploader::BeforeSave() {
  if (o_.every == 0) return;
  const double deadline = Now() + o_.commit_timeout_s;
  MutexLock l(&mu_);
  while (!queue_.empty() && !done_) {
    const double left = deadline - Now();
    if (left <= 0) {
      const UploadTarget gone = queue_.front();
      queue_.pop_front();
      ++stats_.given_up;
      stats_.last_error = "step " + std::to_string(gone.step) +
                          ": not copied for upload within commit_timeout_s";
      continue;
    }
    cv_.WaitFor(&mu_, Seconds(std::min(left, 0.5)));
  }
}

UploaderStats RemoteUploader::Stats() const {
  MutexLock l(&mu_);
  UploaderStats s = stats_;
  s.skipped_gone = tier_->skipped_gone();
  return s;
}

bool RemoteUploader::Running() const {
  MutexLock l(&mu_);
  return !done_;
}

Status RemoteUploader::Close(bool wait) {
  const double wait_s = wait ? o_.close_timeout_s : 0.0;
  {
    MutexLock l(&mu_);
    if (!stop_) {
      stop_at_ = Now();
      deadline_ = stop_at_ + wait_s;
      stop_ = true;
    }
    wake_ = true;
    cv_.SignalAll();
  }
  tier_->Stop(wait_s);  // a commit wait ends by then
  MutexLock l(&mu_);
  bool finished = cv_.WaitFor(&mu_, Seconds(deadline_ - Now()), [&]() REQUIRES(mu_) {
    return done_;
  });
  if (!finished) {  // past the deadline: a throttled transfer stops now
    l.Unlock();
    tier_->Abort();
    l.Lock();
    finished = cv_.WaitFor(&mu_, Seconds(o_.abort_grace_s), [&]() REQUIRES(mu_) {
      return done_;
    });
  }
  if (!finished) {
    return Status::IOError("rank " + std::to_string(o_.rank) +
                           ": a remote transfer is still running after close_timeout_s; left to "
                           "finish in the background");
  }
  const bool failed = stats_.failures > 0 && !stats_.last_error.empty();
  const std::string err = stats_.last_error;
  l.Unlock();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  if (wait && failed) {
    return Status::IOError("rank " + std::to_string(o_.rank) + ": remote upload: " + err);
  }
  return Status::OK();
}

bool RemoteUploader::DeadlinePassed(double extra_s) const {
  return stop_ && Now() > std::min(deadline_, stop_at_ + extra_s);
}

void RemoteUploader::Pause(double s) {
  MutexLock l(&mu_);
  const bool stopping = stop_;  // stopping: the whole pause (it does not end it)
  cv_.WaitFor(&mu_, Seconds(s), [&]() REQUIRES(mu_) { return stop_ && !stopping; });
}

std::optional<UploadTarget> RemoteUploader::Target() {
  std::optional<UploadTarget> head;
  if (o_.every > 0) {  // the oldest selected one, once committed
    MutexLock l(&mu_);
    if (retry_) {
      head = retry_;
    } else if (!queue_.empty()) {
      head = queue_.front();
    } else {
      return std::nullopt;
    }
  }
  Result<std::optional<UploadTarget>> got = newest_();
  if (!got.ok()) {  // the engine closed meanwhile, say
    MutexLock l(&mu_);
    stats_.last_error = "target: " + FirstLine(got.status());
    return std::nullopt;
  }
  if (!head) return got.value();
  if (got.value() && got.value()->counter >= head->counter) return head;
  return std::nullopt;
}

Result<std::optional<UploadTarget>> RemoteUploader::Pick(const UploadTarget& t) {
  if (o_.world_size == 1 || o_.rank == 0) return std::optional<UploadTarget>(t);
  std::optional<int64_t> done;
  {
    MutexLock l(&mu_);
    done = stats_.uploaded_step;
  }
  NONSTOP_ASSIGN_OR_RETURN(auto got,
                           tier_->Follow(o_.job_dir, o_.rank, o_.world_size, t.step, done));
  if (!got) return std::optional<UploadTarget>();
  return std::optional<UploadTarget>(UploadTarget{got->first, got->second});
}

Status RemoteUploader::Upload(const UploadTarget& t) {
  {
    MutexLock l(&mu_);
    stats_.uploading_step = t.step;
  }
  // The staged one-slot copy (every chunk verified; one of this counter
  // staged before a restart is kept) and the checkpoint's own lineage.
  const double t_stage = Now();
  Result<StagedCopy> staged = StageCopy(env_, o_.job_dir, o_.rank, t.counter, t.step);
  {
    MutexLock l(&mu_);
    stats_.stage_s += Now() - t_stage;
    if (staged.ok() && o_.every > 0) {  // its ring slot may be reused now
      while (!queue_.empty() && queue_.front().counter <= t.counter) queue_.pop_front();
      retry_ = t;  // retried until it is uploaded, never skipped
      cv_.SignalAll();
    }
  }
  NONSTOP_RETURN_IF_ERROR(staged.status());
  // The upload and rank 0's commit (RemoteTier::Publish).
  PublishRequest req{t.step, t.counter, staged.value().lineage, o_.rank, o_.world_size,
                     staged.value().dir, staged.value().name};
  PublishOptions po;
  po.bps = o_.bps;
  po.commit_timeout_s = o_.commit_timeout_s;
  po.poll_s = o_.poll_s;
  NONSTOP_ASSIGN_OR_RETURN(PublishReport rep, tier_->Publish(req, po));
  using O = PublishReport::Outcome;
  {
    MutexLock l(&mu_);
    UploaderStats& s = stats_;
    if (rep.outcome == O::kSkippedExisting) {
      ++s.skipped_existing;  // already there (a restart of the same run)
    } else {
      ++s.uploads;
      s.bytes += rep.bytes;
      s.upload_s += rep.upload_s;
      s.crc_s += rep.crc_s;
      s.put_s += rep.put_s;
      s.last_GBps = rep.upload_s > 0 ? static_cast<double>(rep.bytes) / rep.upload_s / 1e9 : 0.0;
    }
    if (rep.outcome == O::kCommitted) {
      ++s.committed;
    } else if (rep.outcome == O::kGivenUp) {  // a rank no longer holds the step: not an error
      ++s.given_up;
    } else if (rep.outcome == O::kNotCommitted) {
      ++s.failures;
      s.last_error = rep.error;
    }
  }
  if (rep.outcome == O::kCommitted) {
    NONSTOP_ASSIGN_OR_RETURN(int deleted, tier_->Retain(o_.retention));
    MutexLock l(&mu_);
    stats_.deleted_steps += static_cast<uint64_t>(deleted);
  }
  if (rep.outcome != O::kNotCommitted && rep.outcome != O::kGivenUp) NoteManifest();
  std::vector<std::string> left = DropStaged(env_, o_.job_dir, t.step);
  MutexLock l(&mu_);
  stats_.uploaded_step = t.step;
  if (retry_ && retry_->counter == t.counter) retry_.reset();
  if (!left.empty()) stats_.last_error = left.back();
  return Status::OK();
}

void RemoteUploader::Loop() {
  LowerThreadPriority(o_.nice);
  double backoff = kFirstBackoffS;
  for (;;) {
    const std::optional<UploadTarget> t = Target();
    bool go = false;
    if (t) {
      MutexLock l(&mu_);
      go = o_.every > 0 || !stats_.uploaded_step || t->step > *stats_.uploaded_step;
    }
    if (go) {
      UploadTarget tried = *t;
      Result<std::optional<UploadTarget>> picked = Pick(*t);
      Status s = picked.status();
      if (s.ok() && !picked.value()) {  // a follower with no step led yet
        {
          MutexLock l(&mu_);
          if (DeadlinePassed(o_.commit_timeout_s)) break;
        }
        Pause(std::max(o_.poll_s, 0.2));
        continue;
      }
      if (s.ok()) {
        tried = *picked.value();
        s = Upload(tried);
      }
      MutexLock l(&mu_);
      stats_.uploading_step.reset();
      if (s.ok()) {
        backoff = kFirstBackoffS;
        continue;
      }
      ++stats_.retries;
      stats_.last_error = "step " + std::to_string(tried.step) + ": " + FirstLine(s);
      if (DeadlinePassed(o_.close_timeout_s)) {
        ++stats_.failures;
        break;
      }
      l.Unlock();
      Pause(backoff);
      backoff = std::min(backoff * 2, o_.retry_max_s);
      continue;
    }
    MutexLock l(&mu_);
    if (stop_) break;
    cv_.WaitFor(&mu_, Seconds(o_.poll_s), [&]() REQUIRES(mu_) { return wake_ || stop_; });
    wake_ = false;
  }
  MutexLock l(&mu_);
  done_ = true;
  cv_.SignalAll();
}

void RemoteUploader::NoteManifest() {
  if (!o_.note_manifest || o_.job_dir.empty()) return;
  ManifestHolder h;
  h.tier = "remote";
  h.where = tier_->where();
  h.unix_s = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  Status st;
  Result<std::vector<HeldStep>> list = tier_->List(o_.rank);
  if (list.ok()) {
    for (const HeldStep& s : list.value()) {
      // Committed, with this rank's part and its counter: durable for this rank.
      if (s.state != StepState::kCommitted || !s.marker || !s.marker->counter || s.bytes == 0) continue;
      if (o_.rank >= s.marker->world_size) continue;
      h.held.push_back(ManifestHeld{s.step, *s.marker->counter});
    }
    st = NoteHeld(env_, o_.job_dir, static_cast<int>(o_.rank), o_.job, std::move(h));
  } else {
    st = list.status();
  }
  MutexLock l(&mu_);
  if (st.ok()) {
    ++stats_.manifest_notes;
  } else {
    stats_.manifest_error = "noting the remote's steps in the job manifest: " + st.message();
  }
}

}  // namespace nonstop::tier
