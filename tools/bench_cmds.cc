#include "tools/commands.h"

namespace nonstop::cli {
void AddBenchCommands(CLI::App& /*app*/) {}
}  // namespace nonstop::cli
