// OpenMedium(path): a path opened through the Env like every other file
// (media, below the Env, only turns an open fd into a Medium).
#include <string>

#include "nonstop/env.h"

namespace nonstop {

// Through the Env, like every other file nonstop opens: the parent directory,
// then the file relative to it (O_NOFOLLOW; O_CREAT|O_EXCL with create).
Result<std::unique_ptr<Medium>> OpenMedium(const std::string& path, MediumKind kind,
                                           const MediumOptions& opts) {
  if (opts.read_only && opts.create) {
    return Status::InvalidArgument("open " + path + ": read_only and create together");
  }
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("open " + path));
  Result<std::unique_ptr<Directory>> d = DefaultEnv()->OpenDirectory(dir, /*create=*/false);
  if (!d.ok()) return d.status().Annotate("open " + path);
  if (opts.create) {
    MediumOptions o = opts;
    o.create = false;
    return (*d)->CreateFile(name, kind, o);
  }
  return (*d)->OpenFile(name, kind, opts);
}

}  // namespace nonstop
