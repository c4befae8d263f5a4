// A Gloo group of one rank in the test process, for tests that drive the core's collectives
// directly (grad/, stage3/).
#pragma once

#include <c10/util/intrusive_ptr.h>
// Complete type for the intrusive_ptr that initProcessGroupFromEnv() returns.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/comm/process_group.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroshard::testing {

// Every collective of these tests is bounded by this.
inline constexpr std::chrono::seconds kTimeout{30};

// A port the kernel just handed out; the group's TCPStore binds it a moment later.
inline int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error("single_rank_group.h: cannot find a free port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The Gloo group of one rank these tests share, made as a C++ program makes its group
// (initProcessGroupFromEnv, with the torchrun variables set for that call only). It lives until
// the process exits; each test makes its own Communicator over it, so counts start at zero.
inline const c10::intrusive_ptr<c10d::ProcessGroup>& singleRankGroup() {
  static const auto* group = [] {
    const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
    std::vector<std::optional<std::string>> saved;
    for (const char* name : names) {
      const char* value = std::getenv(name);
      saved.push_back(value ? std::optional<std::string>(value) : std::nullopt);
      ::unsetenv(name);
    }
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "1", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(freePort()).c_str(), 1);
    auto* made = new c10::intrusive_ptr<c10d::ProcessGroup>(zeroshard::initProcessGroupFromEnv(kTimeout));
    for (size_t i = 0; i < saved.size(); ++i) {
      if (saved[i]) ::setenv(names[i], saved[i]->c_str(), 1); else ::unsetenv(names[i]);
    }
    return made;
  }();
  return *group;
}

}  // namespace zeroshard::testing
