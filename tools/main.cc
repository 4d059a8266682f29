// The `nonstop` command line. Whatever a subcommand meets (a hostile file, a
// bug, memory running out), the process ends with one line on stderr and a
// non-zero exit code, never an uncaught exception.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <new>

#include "tools/commands.h"

int main(int argc, char** argv) {
  try {
    CLI::App app{"nonstop: checkpoint store tools (inspect, ls, rm, verify, export, bench, tune, simulate)"};
    app.require_subcommand(1);
    nonstop::cli::AddStoreCommands(app);
    nonstop::cli::AddManageCommands(app);
    nonstop::cli::AddBenchCommands(app);
    nonstop::cli::AddSimulateCommand(app);
    nonstop::cli::AddTuneCommand(app);
    CLI11_PARSE(app, argc, argv);
  } catch (const std::bad_alloc&) {
    std::cerr << "nonstop: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "nonstop: internal error: " << e.what() << "\n";
    return 1;
  } catch (...) {
    std::cerr << "nonstop: internal error\n";
    return 1;
  }
  return 0;
}
