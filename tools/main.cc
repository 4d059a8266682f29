// The `nonstop` command line.
#include <CLI/CLI.hpp>

#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"nonstop: checkpoint store tools (inspect, verify, export, bench, tune, simulate)"};
  app.require_subcommand(1);
  nonstop::cli::AddStoreCommands(app);
  nonstop::cli::AddBenchCommands(app);
  nonstop::cli::AddSimulateCommand(app);
  nonstop::cli::AddTuneCommand(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
