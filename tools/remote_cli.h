// A checkpoint URL where the command line expects a directory:
// `nonstop verify|inspect|export s3://bucket/prefix` (any `scheme://`,
// file:// included, as `remote=` of the Checkpointer takes). The executable
// has no network code: it replaces itself with
// `PY -m nonstop._remote_cli CMD URL ...` (python/nonstop/_remote_cli.py;
// the arguments: RemoteCall),
// which downloads through the remote tier's own validated path and runs this
// executable (NONSTOP_CLI) on the downloaded directory. PY is
// $NONSTOP_PYTHON, else the `python` next to this executable (a virtual
// environment's bin/), else python3. docs/TIERS.md.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace nonstop::cli {

inline bool IsRemoteUrl(const std::string& s) {
  const auto colon = s.find("://");
  if (colon == std::string::npos || colon == 0) return false;
  for (size_t i = 0; i < colon; ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (i > 0 && ((c >= '0' && c <= '9') || c == '+' ||
                                                        c == '.' || c == '-'));
    if (!ok) return false;
  }
  return true;
}

// The interpreter of the package this executable belongs to, for every
// command that runs Python (a remote URL, export --format dcp, a multi-rank
// export, bench, simulate --plot): $NONSTOP_PYTHON, else the `python` next
// to this executable (a virtual environment's bin/, where pip puts both),
// else python3 from PATH.
inline std::string PackagePython() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("NONSTOP_PYTHON"); env != nullptr && *env != '\0') {
    return env;
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && ::access((self.parent_path() / "python").c_str(), X_OK) == 0) {
    return (self.parent_path() / "python").string();
  }
  return "python3";
}

// The arguments of python -m nonstop._remote_cli, as this executable parsed
// and checked them: CMD URL STEP RANK JSON ("" for no step, "" or "1"),
// then export's own (-o, --format, --include, --strip) after them.
inline std::vector<std::string> RemoteCall(const std::string& cmd, const std::string& url,
                                           const std::string& step, int rank, bool json) {
  return {cmd, url, step, std::to_string(rank), json ? "1" : ""};
}

// Replaces this process with `argv`; returns only when that failed (errno).
inline void ExecArgv(std::vector<std::string> argv) {
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  ::execvp(cargv[0], cargv.data());
}

[[noreturn]] inline void RunRemote(std::vector<std::string> args) {
  namespace fs = std::filesystem;
  const std::string python = PackagePython();
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) ::setenv("NONSTOP_CLI", self.c_str(), 1);
  std::vector<std::string> argv = {python, "-m", "nonstop._remote_cli"};
  argv.insert(argv.end(), args.begin(), args.end());
  ExecArgv(argv);
  std::fprintf(stderr,
               "nonstop %s: cannot run %s for a remote URL: %s (set NONSTOP_PYTHON to a python "
               "with nonstop and obstore)\n",
               args.empty() ? "" : args[0].c_str(), python.c_str(), std::strerror(errno));
  std::exit(2);
}

}  // namespace nonstop::cli
