// Subcommands of the `nonstop` command line. Each Add* function registers one
// subcommand (and its callback) on the app; main.cc calls them all.
#pragma once

#include <CLI/CLI.hpp>

namespace nonstop::cli {
void AddStoreCommands(CLI::App& app);  // inspect, verify, export
void AddManageCommands(CLI::App& app);  // ls, rm (manage_cmds.cc)
void AddBenchCommands(CLI::App& app);  // bench storage, bench overhead, ...
void AddSimulateCommand(CLI::App& app);
void AddTuneCommand(CLI::App& app);
}  // namespace nonstop::cli
