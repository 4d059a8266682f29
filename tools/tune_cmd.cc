#include "tools/commands.h"

namespace nonstop::cli {
void AddTuneCommand(CLI::App& /*app*/) {}
}  // namespace nonstop::cli
