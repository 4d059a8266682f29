#include "tools/commands.h"

namespace nonstop::cli {
void AddSimulateCommand(CLI::App& /*app*/) {}
}  // namespace nonstop::cli
