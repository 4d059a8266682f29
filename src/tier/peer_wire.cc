// The peer tier's sockets and frames (peer_wire.h).
#include "tier/peer_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include "nonstop/crc32c.h"
#include "store/format.h"

namespace nonstop::peer::wire {

static_assert(std::endian::native == std::endian::little, "the peer wire is little endian");

uint64_t MaxPayload(uint16_t t) {
  switch (static_cast<Type>(t)) {
    case Type::kPush: return 2 + kMaxJobBytes + kMaxTableFrame;
    case Type::kTable: return kMaxTableFrame;
    case Type::kData: return kMaxDataFrame;
    case Type::kEnd: return 0;
    case Type::kList:
    case Type::kFetch:
    case Type::kReply: return kMaxSmallFrame;
    case Type::kListing: return 4 + kMaxListed * 32;
  }
  return 0;
}

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

timeval Tv(double seconds) {
  if (!(seconds > 0)) seconds = 1e-3;
  if (seconds > 1e6) seconds = 1e6;
  timeval tv;
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - std::floor(seconds)) * 1e6);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  return tv;
}

Status Resolve(const std::string& host, uint16_t port, bool passive, addrinfo** out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string p = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), p.c_str(), &hints, out);
  if (rc != 0) {
    return Status::IOError("peer address " + host + ":" + p + ": " + ::gai_strerror(rc));
  }
  return Status::OK();
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    Close();
    fd_.store(o.fd_.exchange(-1));
    peer_ = std::move(o.peer_);
  }
  return *this;
}

Status Socket::SetTimeout(double seconds) {
  const timeval tv = Tv(seconds);
  if (::setsockopt(fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return Status::FromErrno("peer socket timeout", errno);
  }
  return Status::OK();
}

Status Socket::SendAll(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd(), c, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return Status::IOError("peer " + peer_ + ": send timed out");
      }
      return Status::FromErrno("peer " + peer_ + ": send", errno);
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

Status Socket::RecvAll(void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd(), c, n, 0);
    if (r == 0) return Status::IOError("peer " + peer_ + " closed the connection");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return Status::IOError("peer " + peer_ + ": receive timed out");
      }
      return Status::FromErrno("peer " + peer_ + ": receive", errno);
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return Status::OK();
}

bool Socket::WaitReadable(double seconds) {
  pollfd pfd{fd(), POLLIN, 0};
  const int rc = ::poll(&pfd, 1, static_cast<int>(std::max(0.0, seconds) * 1000));
  return rc > 0;
}

void Socket::Shutdown() {
  const int f = fd_.load();
  if (f >= 0) ::shutdown(f, SHUT_RDWR);
}

void Socket::Close() {
  const int f = fd_.exchange(-1);
  if (f >= 0) ::close(f);
}

Result<Socket> Connect(const std::string& endpoint, double connect_timeout_s, double io_timeout_s) {
  NONSTOP_ASSIGN_OR_RETURN(Endpoint ep, ParseEndpoint(endpoint));
  addrinfo* ai = nullptr;
  NONSTOP_RETURN_IF_ERROR(Resolve(ep.host, ep.port, false, &ai));
  Status last = Status::IOError("peer " + endpoint + ": no address");
  const int64_t deadline = NowMs() + static_cast<int64_t>(std::max(0.001, connect_timeout_s) * 1000);
  for (addrinfo* a = ai; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last = Status::FromErrno("peer " + endpoint + ": socket", errno);
      continue;
    }
    Socket s(fd, endpoint);
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS) {
      last = Status::FromErrno("peer " + endpoint + ": connect", errno);
      continue;
    }
    if (rc != 0) {
      pollfd pfd{fd, POLLOUT, 0};
      const int64_t left = std::max<int64_t>(0, deadline - NowMs());
      rc = ::poll(&pfd, 1, static_cast<int>(left));
      if (rc == 0) {
        last = Status::IOError("peer " + endpoint + ": connect timed out after " +
                               std::to_string(connect_timeout_s) + " s");
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      if (rc < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
        last = Status::FromErrno("peer " + endpoint + ": connect", err != 0 ? err : errno);
        continue;
      }
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      last = Status::FromErrno("peer " + endpoint + ": fcntl", errno);
      continue;
    }
    const int one = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    last = s.SetTimeout(io_timeout_s);
    if (!last.ok()) continue;
    ::freeaddrinfo(ai);
    return s;
  }
  ::freeaddrinfo(ai);
  return last;
}

Result<Socket> Listen(const std::string& host, uint16_t port, uint16_t* bound) {
  addrinfo* ai = nullptr;
  NONSTOP_RETURN_IF_ERROR(Resolve(host, port, true, &ai));
  const std::string where = host + ":" + std::to_string(port);
  Status last = Status::IOError("peer listen " + where + ": no address");
  for (addrinfo* a = ai; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last = Status::FromErrno("peer listen " + where + ": socket", errno);
      continue;
    }
    Socket s(fd, where);
    const int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
      last = Status::FromErrno("peer listen " + where, errno);
      continue;
    }
    sockaddr_storage sa{};
    socklen_t len = sizeof(sa);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      last = Status::FromErrno("peer listen " + where + ": getsockname", errno);
      continue;
    }
    *bound = ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
    ::freeaddrinfo(ai);
    return s;
  }
  ::freeaddrinfo(ai);
  return last;
}

Status SendFrame(Socket& s, Type type, std::string_view a, std::string_view b) {
  const uint64_t len = a.size() + b.size();
  if (len > MaxPayload(static_cast<uint16_t>(type))) {
    return Status::InvalidArgument("peer frame of " + std::to_string(len) + " bytes is over its limit");
  }
  uint8_t h[kHeaderBytes];
  const uint32_t magic = kMagic;
  const uint16_t version = kVersion, t = static_cast<uint16_t>(type);
  const uint32_t pcrc = Crc32c(b.data(), b.size(), Crc32c(a.data(), a.size()));
  std::memcpy(h, &magic, 4);
  std::memcpy(h + 4, &version, 2);
  std::memcpy(h + 6, &t, 2);
  std::memcpy(h + 8, &len, 8);
  std::memcpy(h + 16, &pcrc, 4);
  const uint32_t hcrc = Crc32c(h, 20);
  std::memcpy(h + 20, &hcrc, 4);
  NONSTOP_RETURN_IF_ERROR(s.SendAll(h, sizeof(h)));
  if (!a.empty()) NONSTOP_RETURN_IF_ERROR(s.SendAll(a.data(), a.size()));
  if (!b.empty()) NONSTOP_RETURN_IF_ERROR(s.SendAll(b.data(), b.size()));
  return Status::OK();
}

Status RecvFrame(Socket& s, Frame* f) {
  uint8_t h[kHeaderBytes];
  NONSTOP_RETURN_IF_ERROR(s.RecvAll(h, sizeof(h)));
  uint32_t magic, pcrc, hcrc;
  uint16_t version, type;
  uint64_t len;
  std::memcpy(&magic, h, 4);
  std::memcpy(&version, h + 4, 2);
  std::memcpy(&type, h + 6, 2);
  std::memcpy(&len, h + 8, 8);
  std::memcpy(&pcrc, h + 16, 4);
  std::memcpy(&hcrc, h + 20, 4);
  const std::string from = "peer " + s.peer() + ": ";
  if (magic != kMagic) return Status::Corruption(from + "not a nonstop peer frame (bad magic)");
  if (version != kVersion) {
    return Status::Corruption(from + "peer wire version " + std::to_string(version) +
                              ", this build speaks " + std::to_string(kVersion));
  }
  if (Crc32c(h, 20) != hcrc) return Status::Corruption(from + "frame header checksum mismatch");
  const uint64_t max = MaxPayload(type);
  if (max == 0 && type != static_cast<uint16_t>(Type::kEnd)) {
    return Status::Corruption(from + "unknown frame type " + std::to_string(type));
  }
  if (len > max) {
    return Status::Corruption(from + "frame of type " + std::to_string(type) + " claims " +
                              std::to_string(len) + " bytes, over its limit of " +
                              std::to_string(max));
  }
  f->type = type;
  f->payload.resize(len);
  if (len > 0) NONSTOP_RETURN_IF_ERROR(s.RecvAll(f->payload.data(), len));
  if (Crc32c(f->payload.data(), f->payload.size()) != pcrc) {
    return Status::Corruption(from + "frame payload checksum mismatch");
  }
  return Status::OK();
}

Out& Out::Raw(const void* p, size_t n) {
  s_.append(static_cast<const char*>(p), n);
  return *this;
}

Out& Out::Str16(std::string_view v) {
  U16(static_cast<uint16_t>(v.size()));
  return Bytes(v.substr(0, 0xffff));
}

std::string In::Str16(size_t max) {
  const uint16_t n = U16();
  if (!ok_ || n > max || s_.size() - pos_ < n) {
    ok_ = false;
    return {};
  }
  std::string v(s_.substr(pos_, n));
  pos_ += n;
  return v;
}

std::vector<uint8_t> EncodeCheckpointTable(const CheckpointInfo& info) {
  format::Table t;
  t.counter = info.counter;
  t.step = info.step;
  t.rank = info.rank;
  t.world_size = info.world_size;
  t.crc_chunk_bytes = info.crc_chunk_bytes;
  t.data_bytes = info.data_bytes;
  t.tensors = info.tensors;
  t.chunk_crcs = info.chunk_crcs;
  t.meta_json = info.meta_json;
  return format::EncodeTable(t);
}

std::string EncodeReply(const Status& s, uint32_t outcome) {
  Out o;
  o.U32(static_cast<uint32_t>(s.code())).U32(outcome);
  o.Bytes(std::string_view(s.message()).substr(0, 4000));
  return o.str();
}

Status DecodeReply(std::string_view payload, uint32_t* outcome, const std::string& from) {
  In in(payload);
  const uint32_t code = in.U32();
  *outcome = in.U32();
  std::string_view msg = in.Rest();
  if (!in.ok() || code > static_cast<uint32_t>(StatusCode::kInternal)) {
    return Status::Corruption("peer " + from + ": malformed reply");
  }
  if (code == 0) return Status::OK();
  std::string line(msg);
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return Status(static_cast<StatusCode>(code), "peer " + from + ": " + line);
}

}  // namespace nonstop::peer::wire
