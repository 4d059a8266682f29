// The peer wire's socket (tier/peer_wire.h): SendAllV's partial sends. A
// blocking sendmsg returns fewer bytes than asked when a signal arrives
// after some were queued (or a send timeout expires then); SendAllV must go
// on from the exact byte where the kernel stopped, across the parts of the
// iovec, so that the receiver gets every byte once and in order.
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tier/peer_wire.h"

namespace nonstop::peer::wire {
namespace {

std::atomic<int> g_signals{0};
void OnSignal(int) { g_signals.fetch_add(1, std::memory_order_relaxed); }

// Parts of odd sizes (a header, a payload, a tag, an empty part, a tail),
// every byte a function of its position in the whole, so that a byte lost,
// sent twice or out of order shows.
std::vector<std::string> Parts() {
  const size_t sizes[] = {24, (1u << 20) + 4093, 16, 0, 70001};
  std::vector<std::string> parts;
  uint64_t at = 0;
  for (size_t n : sizes) {
    std::string p(n, '\0');
    for (size_t i = 0; i < n; ++i, ++at) p[i] = static_cast<char>((at * 2654435761u) >> 13);
    parts.push_back(std::move(p));
  }
  return parts;
}

TEST(PeerWireSocket, SendAllVResumesPartialSendsAcrossParts) {
  // A handler without SA_RESTART: a blocked sendmsg that already queued
  // bytes returns that count (a partial send), one that queued none EINTR.
  struct sigaction sa {}, old {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);

  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const int small = 4096;  // the kernel's minimum: the sender blocks at once
  ASSERT_EQ(::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  ASSERT_EQ(::setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  Socket sender(sv[0], "pair"), receiver(sv[1], "pair");
  ASSERT_TRUE(sender.SetTimeout(20).ok());  // a hung test ends; no timeout on a live reader
  ASSERT_TRUE(receiver.SetTimeout(20).ok());

  const std::vector<std::string> parts = Parts();
  std::string want;
  for (const std::string& p : parts) want += p;

  // The reader: small pieces, slowly, so the sender sits blocked in sendmsg.
  std::string got;
  std::thread reader([&] {
    char piece[1500];
    for (;;) {  // up to the sender's end (a byte too many shows too)
      const ssize_t r = ::recv(receiver.fd(), piece, sizeof(piece), 0);
      if (r <= 0) return;
      got.append(piece, static_cast<size_t>(r));
      if (got.size() > want.size()) {  // bytes sent twice: end the sender's loop too
        ::shutdown(receiver.fd(), SHUT_RDWR);
        return;
      }
      if (got.size() % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });

  std::atomic<bool> sending{true};
  Status st;
  std::thread send_thread([&] {
    std::vector<::iovec> iov;
    for (const std::string& p : parts) iov.push_back({const_cast<char*>(p.data()), p.size()});
    st = sender.SendAllV(iov.data(), static_cast<int>(iov.size()));
    sending = false;
    ::shutdown(sender.fd(), SHUT_WR);
  });
  // Interrupt the blocked sender over and over.
  const pthread_t target = send_thread.native_handle();
  while (sending.load()) {
    (void)pthread_kill(target, SIGUSR1);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  send_thread.join();
  reader.join();
  ASSERT_EQ(sigaction(SIGUSR1, &old, nullptr), 0);

  EXPECT_EQ(got.size(), want.size());
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_GT(g_signals.load(), 10) << "the sender was hardly interrupted: no partial sends tested";
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want) << "bytes lost, repeated or reordered at a partial send";
}

}  // namespace
}  // namespace nonstop::peer::wire
