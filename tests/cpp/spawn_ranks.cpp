#include "spawn_ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace zeroshard::testing {
namespace {

// A port the kernel just handed out; TCPStore binds it a moment later.
int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error("spawnRanks: cannot find a free port");
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

} // namespace

std::vector<RankOutcome> spawnRanks(
    const std::string& program,
    const std::string& scenario,
    int worldSize,
    const SpawnOptions& options) {
  return spawnRanks(program, std::vector<std::string>{scenario}, worldSize, options);
}

std::vector<RankOutcome> spawnRanks(
    const std::string& program,
    const std::vector<std::string>& args,
    int worldSize,
    const SpawnOptions& options) {
  const int port = freePort();
  std::vector<pid_t> pids(worldSize, -1);
  std::vector<std::string> logs(worldSize);
  std::vector<RankOutcome> outcomes(worldSize);

  for (int rank = 0; rank < worldSize; ++rank) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      const std::string key = kv.substr(0, kv.find('='));
      // Replaced below; a duplicate would win, since getenv returns the first match.
      if (key != "RANK" && key != "WORLD_SIZE" && key != "LOCAL_RANK" && key != "MASTER_ADDR" &&
          key != "MASTER_PORT" && key != "OMP_NUM_THREADS") {
        env.push_back(kv);
      }
    }
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(worldSize));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back("OMP_NUM_THREADS=1");
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);

    char logTemplate[] = "/tmp/zeroshard-rank-XXXXXX";
    const int logFd = ::mkstemp(logTemplate);
    if (logFd < 0) throw std::runtime_error("spawnRanks: cannot create a log file");
    logs[rank] = logTemplate;

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, logFd, STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, logFd, STDERR_FILENO);
    std::vector<std::string> argStrings{program};
    argStrings.insert(argStrings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& arg : argStrings) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pids[rank], program.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(logFd);
    if (rc != 0) {
      // The ranks already started would wait for this one until their timeout.
      for (int started = 0; started < rank; ++started) {
        ::kill(pids[started], SIGKILL);
        ::waitpid(pids[started], nullptr, 0);
      }
      for (int started = 0; started <= rank; ++started) std::remove(logs[started].c_str());
      throw std::runtime_error("spawnRanks: cannot start " + program + ": " + std::strerror(rc));
    }
  }

  // Poll for exits (no sleep decides an outcome: the deadline only bounds a hang).
  const auto deadline = std::chrono::steady_clock::now() + options.deadline;
  int running = worldSize;
  while (running > 0) {
    for (int rank = 0; rank < worldSize; ++rank) {
      if (pids[rank] < 0) continue;
      int status = 0;
      if (::waitpid(pids[rank], &status, WNOHANG) == pids[rank]) {
        outcomes[rank].exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        outcomes[rank].killed = WIFSIGNALED(status);
        pids[rank] = -1;
        --running;
      }
    }
    const bool onlyLingererLeft = running == 1 && options.lingeringRank >= 0 && pids[options.lingeringRank] >= 0;
    if (running > 0 && (onlyLingererLeft || std::chrono::steady_clock::now() > deadline)) {
      for (int rank = 0; rank < worldSize; ++rank) {
        if (pids[rank] < 0) continue;
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], nullptr, 0);
        outcomes[rank].killed = true;
        pids[rank] = -1;
        --running;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  for (int rank = 0; rank < worldSize; ++rank) {
    outcomes[rank].output = readFile(logs[rank]);
    std::remove(logs[rank].c_str());
  }
  return outcomes;
}

std::string describeFailures(const std::vector<RankOutcome>& outcomes, int lingeringRank) {
  std::ostringstream out;
  for (size_t rank = 0; rank < outcomes.size(); ++rank) {
    if (static_cast<int>(rank) == lingeringRank) continue;
    const auto& o = outcomes[rank];
    if (o.exitCode != 0 || o.killed) {
      out << "rank " << rank << (o.killed ? " was killed at the deadline" : " exited ") << o.exitCode << ":\n"
          << o.output << "\n";
    }
  }
  return out.str();
}

} // namespace zeroshard::testing
