#include "tools/commands.h"

namespace nonstop::cli {
void AddStoreCommands(CLI::App& /*app*/) {}
}  // namespace nonstop::cli
