// The peer tier (peer.h): stubs of the first commit; the implementation follows.
#include "tier/peer.h"

namespace nonstop::peer {
namespace {
Status NotYet() { return Status::Unavailable("the peer tier is not implemented yet"); }
}  // namespace

std::string Endpoint::ToString() const { return host + ":" + std::to_string(port); }
Result<Endpoint> ParseEndpoint(const std::string&) { return NotYet(); }
std::string JobKey(const std::string&) { return "0000000000000000"; }
std::string ReplicaName(const std::string& job, uint32_t source_rank) {
  char b[32];
  std::snprintf(b, sizeof(b), "-replica-rank-%05u.nsck", source_rank);
  return JobKey(job) + b;
}
std::string PeerMemoryDir(const std::string& configured) { return configured; }

struct PeerServer::Impl {};
Result<std::unique_ptr<PeerServer>> PeerServer::Start(const PeerServerOptions&) { return NotYet(); }
PeerServer::~PeerServer() = default;
uint16_t PeerServer::port() const { return 0; }
std::string PeerServer::endpoint() const { return ""; }
Result<std::vector<HeldReplica>> PeerServer::List() { return NotYet(); }
PeerServerStats PeerServer::stats() const { return {}; }
void PeerServer::Close() {}

Result<PushOutcome> PushCheckpoint(const std::string&, const std::string&, SlotFile&,
                                   const CheckpointInfo&, const PushOptions&) {
  return NotYet();
}

Result<PushOutcome> PushNewest(const std::string&, const std::string&, const std::string&,
                               const PushOptions&, Env*, CheckpointInfo*) {
  return NotYet();
}

struct Replicator::Impl {};
Result<std::unique_ptr<Replicator>> Replicator::Start(const ReplicatorOptions&) { return NotYet(); }
Replicator::~Replicator() = default;
void Replicator::Notify() {}
bool Replicator::Drain(double) { return true; }
ReplicatorStats Replicator::stats() const { return {}; }
void Replicator::Close() {}

Result<std::vector<HeldReplica>> ListReplicas(const std::string&, const std::string&, double) {
  return NotYet();
}
std::string PeerStepDir(const std::string& local_dir, int64_t step) {
  return local_dir + "/peer/step-" + std::to_string(step);
}
Result<std::string> FetchReplica(const std::string&, const std::string&, uint32_t,
                                 std::optional<int64_t>, const std::string&, Env*, double) {
  return NotYet();
}
std::vector<std::vector<uint32_t>> ChoosePartners(const std::vector<std::string>& hosts, int) {
  return std::vector<std::vector<uint32_t>>(hosts.size());
}

}  // namespace nonstop::peer
