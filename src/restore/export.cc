// A checkpoint as one safetensors file (include/nonstop/export.h): the
// single-rank export of the CLI and of nonstop.export, and the writer of
// every safetensors export.
#include "nonstop/export.h"

#include <fnmatch.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "jobdir/records.h"
#include "nonstop/jobdir.h"
#include "nonstop/restore.h"
#include "nonstop/store.h"
#include "store/format.h"

namespace nonstop {
namespace {

using jobdir_internal::Json;

// Deeper state trees are not walked for tied-weight names (as
// python/nonstop/_state.py's MAX_DEPTH).
constexpr int kMaxTreeDepth = 200;

// (path, stored name) for each tensor of the metadata's state tree referred
// to under a path other than its stored name: a tied weight's second name
// ("model/lm_head.weight" -> "model/tok.weight"). Paths through plain
// string-keyed objects and arrays only, as the Python front end forms tensor
// names (python/nonstop/_state.py); a tagged value ("__..." keys) is not
// walked.
void TreeAliases(const Json& node, const std::string& path, int depth,
                 std::vector<std::pair<std::string, std::string>>* out) {
  if (depth > kMaxTreeDepth) return;
  if (node.type == Json::Type::kObject) {
    const Json* ref = node.Get("__tensor__");
    if (node.keys.size() == 1 && ref != nullptr && ref->type == Json::Type::kString) {
      if (path != ref->text) out->emplace_back(path, ref->text);
      return;
    }
    for (const std::string& k : node.keys) {
      if (k.rfind("__", 0) == 0) return;
    }
    for (size_t i = 0; i < node.keys.size(); ++i) {
      TreeAliases(node.items[i], path.empty() ? node.keys[i] : path + "/" + node.keys[i],
                  depth + 1, out);
    }
  } else if (node.type == Json::Type::kArray) {
    for (size_t i = 0; i < node.items.size(); ++i) {
      TreeAliases(node.items[i], path + "/" + std::to_string(i), depth + 1, out);
    }
  }
}

// The aliases of `meta_json`'s "state" tree; none when it does not parse.
std::vector<std::pair<std::string, std::string>> MetaAliases(std::string_view meta_json) {
  std::vector<std::pair<std::string, std::string>> out;
  const std::string_view state = jobdir_internal::TopLevelValue(meta_json, "state");
  if (state.empty()) return out;
  jobdir_internal::JsonLimits limits;
  limits.max_bytes = state.size();
  limits.max_elements = state.size();
  limits.max_depth = kMaxTreeDepth + 2;
  Result<Json> tree = jobdir_internal::ParseJson(state, "state", limits);
  if (tree.ok()) TreeAliases(tree.value(), "", 0, &out);
  return out;
}

bool Included(const std::string& name, const std::vector<std::string>& include) {
  if (include.empty()) return true;
  for (const std::string& pattern : include) {
    if (::fnmatch(pattern.c_str(), name.c_str(), 0) == 0) return true;
  }
  return false;
}

void ReplaceAll(std::string* s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  for (size_t at = s->find(from); at != std::string::npos; at = s->find(from, at + to.size())) {
    s->replace(at, from.size(), to);
  }
}

}  // namespace

Status CheckExportNames(std::string_view names_json) {
  const jobdir_internal::JsonLimits limits = jobdir_internal::MetaJsonLimits(format::kMaxMetaBytes);
  Result<Json> parsed = jobdir_internal::ParseJson(names_json, "names", limits);
  auto bad = [](const std::string& why) {
    return Status::Corruption("checkpoint metadata 'names' is malformed: " + why);
  };
  if (!parsed.ok()) return bad(parsed.status().message());
  const Json& names = *parsed;
  if (names.type == Json::Type::kNull) return Status::OK();
  if (names.type != Json::Type::kObject) return bad("not an object");
  if (const Json* mods = names.Get("modules")) {
    const bool ok = mods->type == Json::Type::kObject &&
                    std::all_of(mods->items.begin(), mods->items.end(),
                                [](const Json& v) { return v.type == Json::Type::kString; });
    if (!ok) return bad("'modules' is not a map of names to prefixes");
  }
  const Json* opts = names.Get("optimizers");
  if (opts == nullptr) return Status::OK();
  if (opts->type != Json::Type::kObject) return bad("'optimizers' is not an object");
  for (size_t i = 0; i < opts->items.size(); ++i) {
    const Json& o = opts->items[i];
    const Json* module = o.type == Json::Type::kObject ? o.Get("module") : nullptr;
    const Json* params = o.type == Json::Type::kObject ? o.Get("params") : nullptr;
    const bool ok = module != nullptr && module->type == Json::Type::kString &&
                    params != nullptr && params->type == Json::Type::kArray &&
                    std::all_of(params->items.begin(), params->items.end(),
                                [](const Json& p) { return p.type == Json::Type::kString; });
    if (!ok) {
      return bad("optimizer " + jobdir_internal::JsonString(opts->keys[i]) +
                 " has no module name and list of parameter names");
    }
  }
  return Status::OK();
}

namespace {

// The fixed lists a state tree's tags are decoded from (python/nonstop/_state.py).
constexpr std::string_view kTorchDtypes[] = {
    "bool",          "uint8",          "int8",           "int16",         "int32",
    "int64",         "uint16",         "uint32",         "uint64",        "float16",
    "bfloat16",      "float32",        "float64",        "complex32",     "complex64",
    "complex128",    "float8_e4m3fn",  "float8_e5m2",    "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "qint8",         "quint8",         "qint32",        "quint4x2",
    "quint2x4"};
constexpr std::string_view kDeviceTypes[] = {"cpu", "cuda", "meta", "mps",
                                             "xpu", "hpu",  "mtia", "privateuseone"};
// numpy's scalar types (dtype.str) of the on-disk dtypes numpy has.
constexpr std::string_view kNumpyScalars[] = {"|u1", "|i1", "<i2", "<i4", "<i8", "<f2", "<f4",
                                              "<f8", "|b1", "<c8", "<c16", "<u2", "<u4", "<u8"};

// A "__...__" key: a tagged value's, when an object's only key.
bool IsTag(const std::string& k) {
  return k.size() >= 2 && k.rfind("__", 0) == 0 && k.compare(k.size() - 2, 2, "__") == 0;
}

template <size_t N>
bool OneOf(const std::string_view (&list)[N], std::string_view s) {
  return std::find(std::begin(list), std::end(list), s) != std::end(list);
}

// A value as a one-line message shows it.
std::string Shown(const Json& v) {
  switch (v.type) {
    case Json::Type::kString: return "'" + format::Printable(v.text) + "'";
    case Json::Type::kNumber: return format::Printable(v.text);
    case Json::Type::kBool: return v.b ? "true" : "false";
    case Json::Type::kNull: return "null";
    case Json::Type::kArray: return "a list";
    case Json::Type::kObject: return "an object";
  }
  return "";
}

// Whether the value `n` rebuilds to is hashable in Python (a dict's key):
// not a list, dict or numpy array, nor a tuple holding one.
bool Hashable(const Json& n) {
  if (n.type == Json::Type::kArray) return false;
  if (n.type != Json::Type::kObject) return true;
  if (n.keys.size() != 1) return false;
  const std::string& tag = n.keys[0];
  if (tag == "__tuple__") {
    const std::vector<Json>& items = n.items[0].items;
    return n.items[0].type == Json::Type::kArray && std::all_of(items.begin(), items.end(), Hashable);
  }
  return tag == "__tensor__" || tag == "__float__" || tag == "__npscalar__" || tag == "__dtype__" ||
         tag == "__device__";
}

class TreeCheck {
 public:
  explicit TreeCheck(const std::vector<std::string>& tensors)
      : tensors_(tensors.begin(), tensors.end()) {}
  // An empty string when `n` (at `where`) is well formed, else WHERE: WHY.
  std::string Check(const Json& n, const std::string& where) const {
    if (n.type == Json::Type::kArray) {
      for (size_t i = 0; i < n.items.size(); ++i) {
        std::string why = Check(n.items[i], where + "[" + std::to_string(i) + "]");
        if (!why.empty()) return why;
      }
      return "";
    }
    if (n.type != Json::Type::kObject) return "";
    if (n.keys.size() == 1) {
      std::string why = Tag(n.keys[0], n.items[0], where);
      if (why != "-") return why;  // "-": no tag, a plain one-key dict
    }
    for (size_t i = 0; i < n.keys.size(); ++i) {
      std::string why = Check(n.items[i], where + "['" + format::Printable(n.keys[i]) + "']");
      if (!why.empty()) return why;
    }
    return "";
  }

 private:
  std::string Tag(const std::string& tag, const Json& v, const std::string& where) const {
    const bool str = v.type == Json::Type::kString;
    if (tag == "__tensor__" || tag == "__ndarray__") {
      if (str && tensors_.count(v.text)) return "";
      return where + " refers to tensor " + Shown(v) + ", which the checkpoint does not hold";
    }
    if (tag == "__float__") {
      if (str && v.text.size() == 16 &&
          std::all_of(v.text.begin(), v.text.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
        return "";
      }
      return where + ": " + Shown(v) + " is not a float's 8 bytes in hex";
    }
    if (tag == "__tuple__") {
      if (v.type != Json::Type::kArray) return where + ": a tuple must be a list";
      return Check(v, where);
    }
    if (tag == "__dict__") {
      const bool pairs = v.type == Json::Type::kArray &&
                         std::all_of(v.items.begin(), v.items.end(), [](const Json& kv) {
                           return kv.type == Json::Type::kArray && kv.items.size() == 2;
                         });
      if (!pairs) return where + ": a dict must be a list of [key, value] pairs";
      for (size_t i = 0; i < v.items.size(); ++i) {
        const std::string key = std::to_string(i);
        std::string why = Check(v.items[i].items[0], where + ".key" + key);
        if (why.empty() && !Hashable(v.items[i].items[0])) {
          why = where + ": key " + key + " is of an unhashable type (a list, dict or array)";
        }
        if (why.empty()) why = Check(v.items[i].items[1], where + "[key " + key + "]");
        if (!why.empty()) return why;
      }
      return "";
    }
    if (tag == "__npscalar__") {
      const bool pair = v.type == Json::Type::kArray && v.items.size() == 2;
      const Json::Type value = pair ? v.items[1].type : Json::Type::kNull;
      const bool ok = pair && v.items[0].type == Json::Type::kString &&
                      OneOf(kNumpyScalars, v.items[0].text) &&
                      (value == Json::Type::kBool || value == Json::Type::kNumber ||
                       value == Json::Type::kObject);
      if (!ok) {
        return where + ": numpy scalar " +
               (v.type == Json::Type::kArray && !v.items.empty() ? Shown(v.items[0]) : Shown(v)) +
               " is not of a numeric dtype";
      }
      return Check(v.items[1], where);
    }
    if (tag == "__dtype__") {
      if (str && OneOf(kTorchDtypes, v.text)) return "";
      return where + ": dtype " + Shown(v) + " is not one of torch's tensor dtypes";
    }
    if (tag == "__device__") {
      const size_t colon = str ? v.text.find(':') : std::string::npos;
      const std::string_view kind = std::string_view(v.text).substr(0, colon);
      const std::string_view index =
          colon == std::string::npos ? "" : std::string_view(v.text).substr(colon + 1);
      const bool ok = str && v.text.size() <= 32 && OneOf(kDeviceTypes, kind) &&
                      (colon == std::string::npos ||
                       (!index.empty() && index.size() <= 5 &&
                        std::all_of(index.begin(), index.end(),
                                    [](char c) { return c >= '0' && c <= '9'; })));
      if (ok) return "";
      std::string kinds;
      for (std::string_view k : kDeviceTypes) kinds += (kinds.empty() ? "" : ", ") + std::string(k);
      return where + ": device " + Shown(v) + " is not one of " + kinds + " (with an index)";
    }
    if (IsTag(tag)) {
      return where + ": unknown tag '" + format::Printable(tag) + "'";
    }
    return "-";
  }

  std::set<std::string> tensors_;
};

}  // namespace

Status CheckStateTree(std::string_view tree_json, const std::vector<std::string>& tensors) {
  const jobdir_internal::JsonLimits limits =
      jobdir_internal::MetaJsonLimits(std::max<uint64_t>(tree_json.size(), 1));
  Result<Json> tree = jobdir_internal::ParseJson(tree_json, "the state tree", limits);
  std::string why = tree.ok() ? TreeCheck(tensors).Check(*tree, "state")
                              : std::string(tree.status().message());
  if (why.empty()) return Status::OK();
  return Status::Corruption("malformed checkpoint metadata: " + why);
}

std::vector<std::string> StateTreeDtypes() {
  return {std::begin(kTorchDtypes), std::end(kTorchDtypes)};
}

std::vector<std::string> StateTreeDevices() {
  return {std::begin(kDeviceTypes), std::end(kDeviceTypes)};
}

namespace {

// Whether a checked tree's value `n` rebuilds to a dict: an object that is
// no tagged value, or a "__dict__" one.
bool IsDict(const Json& n) {
  return n.type == Json::Type::kObject &&
         (n.keys.size() != 1 || !IsTag(n.keys[0]) || n.keys[0] == "__dict__");
}

// The value of string key `key` of a dict IsDict accepts; null when none.
const Json* DictGet(const Json& d, std::string_view key) {
  if (d.keys.size() != 1 || d.keys[0] != "__dict__") return d.Get(key);
  for (const Json& kv : d.items[0].items) {
    if (kv.items[0].type == Json::Type::kString && kv.items[0].text == key) return &kv.items[1];
  }
  return nullptr;
}

// The Python type a checked tree's value `n` rebuilds to, as its messages name it.
std::string PyType(const Json& n) {
  switch (n.type) {
    case Json::Type::kNull: return "NoneType";
    case Json::Type::kBool: return "bool";
    case Json::Type::kString: return "str";
    case Json::Type::kNumber:
      return n.text.find_first_of(".eE") == std::string::npos ? "int" : "float";
    case Json::Type::kArray: return "list";
    case Json::Type::kObject: break;
  }
  if (IsDict(n)) return "dict";
  const std::string& tag = n.keys[0];
  if (tag == "__tensor__") return "Tensor";
  if (tag == "__ndarray__") return "ndarray";
  if (tag == "__npscalar__") return "numpy scalar";
  return tag.substr(2, tag.size() - 4);  // float, tuple, dtype, device
}

// The parameter group sizes of optimizer state dict `v`; nullopt when it
// is not one.
std::optional<std::vector<int64_t>> GroupSizes(const Json& v) {
  const Json* groups = DictGet(v, "param_groups");
  const Json* state = DictGet(v, "state");
  if (groups == nullptr || groups->type != Json::Type::kArray || state == nullptr ||
      !IsDict(*state)) {
    return std::nullopt;
  }
  std::vector<int64_t> sizes;
  for (const Json& g : groups->items) {
    const Json* params = IsDict(g) ? DictGet(g, "params") : nullptr;
    if (params == nullptr || params->type != Json::Type::kArray) return std::nullopt;
    sizes.push_back(static_cast<int64_t>(params->items.size()));
  }
  return sizes;
}

}  // namespace

Result<std::vector<std::optional<std::vector<int64_t>>>> CheckSavedState(
    const std::string& where, std::string_view state_json, const std::vector<StateKey>& keys,
    const std::vector<std::string>& tensors) {
  const jobdir_internal::JsonLimits limits =
      jobdir_internal::MetaJsonLimits(std::max<uint64_t>(state_json.size(), 1));
  Result<Json> tree = jobdir_internal::ParseJson(state_json, "the state tree", limits);
  if (!tree.ok()) {
    return Status::Corruption(where + ": malformed checkpoint metadata: " +
                              std::string(tree.status().message()));
  }
  if (tree->type != Json::Type::kObject) {
    return Status::Corruption(where + ": its metadata holds no state tree");
  }
  const TreeCheck check(tensors);
  for (const StateKey& k : keys) {
    const Json* v = tree->Get(k.key);
    std::string why = v == nullptr ? "" : check.Check(*v, "state[" + k.key_repr + "]");
    if (!why.empty()) return Status::Corruption(where + ": malformed checkpoint metadata: " + why);
  }
  std::vector<std::optional<std::vector<int64_t>>> out;
  for (const StateKey& k : keys) {
    out.emplace_back();
    const Json* v = tree->Get(k.key);
    if (v == nullptr || k.kind == StateKind::kAny) continue;
    const std::string state = where + ": state " + k.key_repr;
    if (k.kind == StateKind::kTensor) {
      if (v->type != Json::Type::kObject || v->keys.size() != 1 || v->keys[0] != "__tensor__") {
        return Status::Corruption(state + " is not a tensor");
      }
      continue;
    }
    if (!IsDict(*v)) return Status::Corruption(state + " is a " + PyType(*v) + ", not a state dict");
    const Json* zero = DictGet(*v, "nonstop_consolidated_zero");  // _objects.CONSOLIDATED
    if (k.kind != StateKind::kOptimizer || (zero != nullptr && zero->type != Json::Type::kNull)) {
      continue;
    }
    out.back() = GroupSizes(*v);
    if (!out.back()) return Status::Corruption(state + " is not an optimizer state dict");
  }
  return out;
}

namespace {

// The Python type name of a JSON value, as a record's reader sees it.
const char* PyTypeName(const Json& j) {
  switch (j.type) {
    case Json::Type::kNull: return "NoneType";
    case Json::Type::kBool: return "bool";
    case Json::Type::kNumber: return "number";
    case Json::Type::kString: return "str";
    case Json::Type::kArray: return "list";
    case Json::Type::kObject: break;
  }
  return "dict";
}

// Whether every item is an integer in [0, 2^32).
bool Uint32s(const std::vector<Json>& items) {
  uint64_t v = 0;
  return std::all_of(items.begin(), items.end(),
                     [&](const Json& x) { return x.AsUint64(&v) && v <= 0xffffffffu; });
}

bool HexString(const Json& j) {
  return j.type == Json::Type::kString && !j.text.empty() && j.text.size() % 2 == 0 &&
         j.text.size() <= (1u << 20) &&
         std::all_of(j.text.begin(), j.text.end(), [](char c) { return std::isxdigit(c) != 0; });
}

// The tuple {"t": [...]} of `n` items as its items, or null.
const std::vector<Json>* Tuple(const Json& j, size_t n) {
  const Json* t = j.type == Json::Type::kObject && j.keys.size() == 1 ? j.Get("t") : nullptr;
  return t != nullptr && t->type == Json::Type::kArray && t->items.size() == n ? &t->items
                                                                               : nullptr;
}

// Why one part of an RNG record is malformed; empty when it is well formed.
std::string RngPartCheck(const std::string& part, const Json& j) {
  double d = 0;
  uint64_t u = 0;
  if (part == "random") {
    const std::vector<Json>* t = Tuple(j, 3);
    const std::vector<Json>* mt = t != nullptr ? Tuple((*t)[1], 625) : nullptr;
    if (mt == nullptr) return "not a tuple (3, (625 integers), gauss)";
    if (!(*t)[0].AsUint64(&u) || u != 3) return "version is not 3";
    if (!Uint32s(*mt) || !mt->back().AsUint64(&u) || u > 624) {
      return "the Mersenne Twister state is not 625 integers < 2^32 ending at a position <= 624";
    }
    if ((*t)[2].type != Json::Type::kNull && !(*t)[2].AsDouble(&d)) {
      return "gauss is neither null nor a number";
    }
  } else if (part == "numpy") {
    if (j.type != Json::Type::kArray || j.items.size() != 5) {
      return "not a list [kind, keys, pos, has_gauss, cached]";
    }
    const std::vector<Json>& v = j.items;
    if (v[0].type != Json::Type::kString || v[0].text != "MT19937" ||
        v[1].type != Json::Type::kArray || v[1].items.size() != 624 || !Uint32s(v[1].items)) {
      return "not MT19937's 624 keys (integers < 2^32)";
    }
    if (!v[2].AsUint64(&u) || u > 624) return "pos is not an integer in 0..624";
    if (!v[3].AsUint64(&u) || u > 1) return "has_gauss is not 0 or 1";
    if (!v[4].AsDouble(&d)) return "cached is not a number";
  } else if (part == "torch") {
    if (!HexString(j)) return "not a hex string";
  } else if (part == "cuda") {
    if (j.type != Json::Type::kArray) return "not a list";
    if (!std::all_of(j.items.begin(), j.items.end(), HexString)) return "not hex strings";
  }
  return "";
}

}  // namespace

Status CheckRngRecord(std::string_view record_json) {
  const jobdir_internal::JsonLimits limits =
      jobdir_internal::MetaJsonLimits(std::max<uint64_t>(record_json.size(), 1));
  NONSTOP_ASSIGN_OR_RETURN(Json record,
                           jobdir_internal::ParseJson(record_json, "RNG record", limits));
  if (record.type != Json::Type::kObject) {
    return Status::Corruption(std::string("RNG record is a ") + PyTypeName(record) +
                              ", not a dict");
  }
  for (const char* part : {"random", "numpy", "torch", "cuda"}) {
    const Json* j = record.Get(part);
    const std::string why = j != nullptr ? RngPartCheck(part, *j) : "";
    if (!why.empty()) {
      return Status::Corruption(std::string("RNG record '") + part + "' is malformed: " + why);
    }
  }
  return Status::OK();
}

namespace {

// Whether `node` refers to a tensor (a {"__tensor__"/"__ndarray__": name}
// object) whose name is not in `shared`.
bool RefersToLocal(const Json& node, const std::set<std::string>& shared) {
  std::vector<const Json*> stack = {&node};
  while (!stack.empty()) {
    const Json* n = stack.back();
    stack.pop_back();
    if (n->type == Json::Type::kObject && n->keys.size() == 1 &&
        (n->keys[0] == "__tensor__" || n->keys[0] == "__ndarray__") &&
        n->items[0].type == Json::Type::kString) {
      if (shared.count(n->items[0].text) == 0) return true;
      continue;
    }
    for (const Json& child : n->items) stack.push_back(&child);
  }
  return false;
}

}  // namespace

Result<DcpGather> DcpGatherLayout(std::string_view dist_json,
                                  const std::vector<dist::Piece>& pieces,
                                  const std::string& where, int64_t step) {
  const jobdir_internal::JsonLimits limits =
      jobdir_internal::MetaJsonLimits(std::max<uint64_t>(dist_json.size(), 1));
  Result<Json> doc = jobdir_internal::ParseJson(dist_json, "the metadata's \"dist\"", limits);
  if (!doc.ok()) return Status::Corruption(where + ": " + std::string(doc.status().message()));
  if (doc->type != Json::Type::kObject) {
    return Status::Corruption(where + ": the metadata's \"dist\" is not an object");
  }
  std::vector<dist::SharedTensor> shared;
  std::map<std::string, DType> dtypes;
  for (const std::string table : {"shared", "dtensor"}) {
    const Json* t = doc->Get(table);
    if (t == nullptr) continue;
    if (t->type != Json::Type::kObject) {
      return Status::Corruption(where + ": the metadata's \"" + table + "\" table is not an object");
    }
    const size_t fields = table == "shared" ? 2 : 3;
    for (size_t i = 0; i < t->keys.size(); ++i) {
      const Json& e = t->items[i];
      const std::string tensor = "the metadata of tensor '" + format::Printable(t->keys[i]) + "'";
      bool ok = e.type == Json::Type::kArray && e.items.size() == fields &&
                e.items[0].type == Json::Type::kArray;
      std::vector<int64_t> shape(ok ? e.items[0].items.size() : 0);
      for (size_t d = 0; ok && d < shape.size(); ++d) ok = e.items[0].items[d].AsInt64(&shape[d]);
      if (!ok) {
        return Status::Corruption(where + ": " + tensor + " in \"" + table + "\" is not [shape, " +
                                  (fields == 2 ? "dtype]" : "dtype, placement]"));
      }
      const Json& dtype = e.items[1];
      DType dt;
      if (dtype.type != Json::Type::kString || !ParseDType(dtype.text, &dt)) {
        const std::string shown = dtype.type == Json::Type::kString
                                      ? "'" + format::Printable(dtype.text.substr(0, 40)) + "'"
                                      : Shown(dtype);
        return Status::Corruption(where + ": " + tensor + " names dtype " + shown +
                                  ", which is not one nonstop writes");
      }
      if (dtypes.emplace(t->keys[i], dt).second) {
        shared.push_back({t->keys[i], std::move(shape), dtype.text});
      }
    }
  }
  NONSTOP_ASSIGN_OR_RETURN(dist::SharedLayout layout,
                           dist::LayOutShared(shared, pieces, true, where, step));
  DcpGather out;
  std::map<std::string, uint64_t> base;
  for (const dist::SharedLayout::Tensor& t : layout.tensors) {
    base[t.name] = t.offset;
    const auto s = std::find_if(shared.begin(), shared.end(),
                                [&](const dist::SharedTensor& x) { return x.name == t.name; });
    out.tensors.push_back({t.name, s->shape, dtypes[t.name]});
  }
  std::map<std::pair<int, size_t>, const std::string*> names;
  for (const dist::Piece& p : pieces) names[{p.rank, p.handle}] = &p.name;
  for (dist::PieceCopy c : layout.copies) {
    c.offset -= base[*names[{c.rank, c.handle}]];
    out.copies.push_back(c);
  }
  return out;
}

Result<std::vector<DcpValue>> DcpLayout(const std::vector<std::string>& states,
                                        const std::vector<std::string>& shared_names,
                                        std::string_view names_json, std::string_view dist_json) {
  NONSTOP_RETURN_IF_ERROR(CheckExportNames(names_json));
  const jobdir_internal::JsonLimits limits = jobdir_internal::MetaJsonLimits(format::kMaxMetaBytes);
  NONSTOP_ASSIGN_OR_RETURN(Json names, jobdir_internal::ParseJson(names_json, "names", limits));
  NONSTOP_ASSIGN_OR_RETURN(Json dist, jobdir_internal::ParseJson(dist_json, "dist", limits));
  const Json* modules = names.type == Json::Type::kObject ? names.Get("modules") : nullptr;
  const Json* zero = dist.type == Json::Type::kObject ? dist.Get("zero") : nullptr;
  const std::set<std::string> module_keys =
      modules != nullptr ? std::set<std::string>(modules->keys.begin(), modules->keys.end())
                         : std::set<std::string>();
  const std::set<std::string> zero_keys =
      zero != nullptr && zero->type == Json::Type::kObject
          ? std::set<std::string>(zero->keys.begin(), zero->keys.end())
          : std::set<std::string>();
  std::vector<Json> trees;
  for (size_t r = 0; r < states.size(); ++r) {
    const std::string what = "the state tree of rank " + std::to_string(r);
    NONSTOP_ASSIGN_OR_RETURN(Json tree, jobdir_internal::ParseJson(states[r], what, limits));
    if (tree.type != Json::Type::kObject) return Status::Corruption(what + " is not an object");
    trees.push_back(std::move(tree));
  }
  if (trees.empty()) return std::vector<DcpValue>{};
  const int world = static_cast<int>(trees.size());
  const std::set<std::string> shared(shared_names.begin(), shared_names.end());
  std::vector<DcpValue> out;
  const Json& first = trees[0];
  for (size_t k = 0; k < first.keys.size(); ++k) {
    const std::string& key = first.keys[k];
    const Json& tree = first.items[k];
    if (world > 1 && zero_keys.count(key)) {
      out.push_back(DcpValue{key, -1, true, {}, true});
      continue;
    }
    if (world == 1 || !RefersToLocal(tree, shared)) {
      out.push_back(DcpValue{key, -1, true, {}, false});
      continue;
    }
    if (module_keys.count(key) && tree.type == Json::Type::kObject) {
      // A state_dict: split entry by entry.
      DcpValue global{key, -1, false, {}, false};
      std::set<std::string> in_global;
      for (size_t e = 0; e < tree.keys.size(); ++e) {
        if (!RefersToLocal(tree.items[e], shared)) {
          global.entries.push_back(tree.keys[e]);
          in_global.insert(tree.keys[e]);
        }
      }
      if (!global.entries.empty()) out.push_back(std::move(global));
      for (int r = 0; r < world; ++r) {
        const Json* theirs = trees[r].Get(key);
        DcpValue part{key, r, false, {}, false};
        for (size_t e = 0; theirs != nullptr && e < theirs->keys.size(); ++e) {
          if (in_global.count(theirs->keys[e]) == 0) part.entries.push_back(theirs->keys[e]);
        }
        if (!part.entries.empty()) out.push_back(std::move(part));
      }
      continue;
    }
    for (int r = 0; r < world; ++r) out.push_back(DcpValue{key, r, true, {}, false});
  }
  return out;
}

namespace {

Json JsonOf(Json::Type type, std::string text = "") {
  Json j;
  j.type = type;
  j.text = std::move(text);
  return j;
}

using DictItems = std::vector<std::pair<Json, Json>>;

// The (key, value) pairs of a state tree's dict: a plain object, or a
// {"__dict__": [[key, value], ...]}; nullopt for any other value.
std::optional<DictItems> AsDict(const Json& n) {
  if (n.type != Json::Type::kObject) return std::nullopt;
  DictItems out;
  const Json* pairs = n.keys.size() == 1 ? n.Get("__dict__") : nullptr;
  if (pairs == nullptr) {
    if (n.keys.size() == 1 && IsTag(n.keys[0])) return std::nullopt;  // a tensor, a tuple, ...
    for (size_t i = 0; i < n.keys.size(); ++i) {
      out.emplace_back(JsonOf(Json::Type::kString, n.keys[i]), n.items[i]);
    }
    return out;
  }
  if (pairs->type != Json::Type::kArray) return std::nullopt;
  for (const Json& kv : pairs->items) {
    if (kv.type != Json::Type::kArray || kv.items.size() != 2) return std::nullopt;
    out.emplace_back(kv.items[0], kv.items[1]);
  }
  return out;
}

// A dict of `items` as the state tree writes it (python/nonstop/_state.py).
Json MakeDict(DictItems items) {
  const bool plain = std::all_of(items.begin(), items.end(), [](const auto& kv) {
    return kv.first.type == Json::Type::kString && kv.first.text.rfind("__", 0) != 0;
  });
  Json out = JsonOf(Json::Type::kObject);
  if (plain) {
    for (auto& [k, v] : items) {
      out.keys.push_back(k.text);
      out.items.push_back(std::move(v));
    }
    return out;
  }
  Json pairs = JsonOf(Json::Type::kArray);
  for (auto& [k, v] : items) {
    Json kv = JsonOf(Json::Type::kArray);
    kv.items = {std::move(k), std::move(v)};
    pairs.items.push_back(std::move(kv));
  }
  out.keys = {"__dict__"};
  out.items = {std::move(pairs)};
  return out;
}

Json* Find(DictItems& items, std::string_view key) {
  for (auto& [k, v] : items) {
    if (k.type == Json::Type::kString && k.text == key) return &v;
  }
  return nullptr;
}

// A parameter index: a JSON integer in [0, n).
std::optional<size_t> Index(const Json& j, size_t n) {
  int64_t i = 0;
  const bool integer = j.type == Json::Type::kNumber &&
                       j.text.find_first_of(".eE") == std::string::npos && j.AsInt64(&i);
  if (!integer || i < 0 || static_cast<uint64_t>(i) >= n) return std::nullopt;
  return static_cast<size_t>(i);
}

// An optimizer's state_dict `tree` by the parameter names `fqn`; nullopt
// when its indices are not exactly 0..fqn.size()-1.
std::optional<Json> RenameOptimizer(const Json& tree, const std::vector<std::string>& fqn) {
  std::optional<DictItems> top = AsDict(tree);
  Json* state = top ? Find(*top, "state") : nullptr;
  Json* groups = top ? Find(*top, "param_groups") : nullptr;
  std::optional<DictItems> entries = state ? AsDict(*state) : std::nullopt;
  if (!entries || groups == nullptr || groups->type != Json::Type::kArray) return std::nullopt;
  const size_t n = fqn.size();
  std::vector<bool> seen(n, false);
  size_t count = 0;
  for (Json& g : groups->items) {
    std::optional<DictItems> group = AsDict(g);
    Json* params = group ? Find(*group, "params") : nullptr;
    if (params == nullptr || params->type != Json::Type::kArray) return std::nullopt;
    for (Json& p : params->items) {
      std::optional<size_t> i = Index(p, n);
      if (!i || seen[*i]) return std::nullopt;
      seen[*i] = true;
      ++count;
      p = JsonOf(Json::Type::kString, fqn[*i]);
    }
    g = MakeDict(std::move(*group));
  }
  if (count != n) return std::nullopt;
  for (auto& [k, v] : *entries) {
    std::optional<size_t> i = Index(k, n);
    if (!i) return std::nullopt;
    k = JsonOf(Json::Type::kString, fqn[*i]);
  }
  *state = MakeDict(std::move(*entries));
  return MakeDict(std::move(*top));
}

}  // namespace

Result<std::string> DcpRename(const std::string& key, std::string_view tree_json,
                              std::string_view names_json) {
  NONSTOP_RETURN_IF_ERROR(CheckExportNames(names_json));
  const jobdir_internal::JsonLimits limits =
      jobdir_internal::MetaJsonLimits(std::max<uint64_t>({tree_json.size(), names_json.size(), 1}));
  NONSTOP_ASSIGN_OR_RETURN(Json tree, jobdir_internal::ParseJson(tree_json, "the state tree", limits));
  NONSTOP_ASSIGN_OR_RETURN(Json names, jobdir_internal::ParseJson(names_json, "names", limits));
  const Json* modules = names.type == Json::Type::kObject ? names.Get("modules") : nullptr;
  const Json* prefix = modules != nullptr ? modules->Get(key) : nullptr;
  std::optional<DictItems> dict = AsDict(tree);
  std::string out;
  if (prefix != nullptr && dict) {
    for (auto& [k, v] : *dict) {
      if (!prefix->text.empty() && k.type == Json::Type::kString && k.text.rfind(prefix->text, 0) == 0) {
        k.text = k.text.substr(prefix->text.size());
      }
    }
    jobdir_internal::AppendJson(MakeDict(std::move(*dict)), &out);
    return out;
  }
  const Json* opts = names.type == Json::Type::kObject ? names.Get("optimizers") : nullptr;
  const Json* opt = opts != nullptr ? opts->Get(key) : nullptr;
  if (opt != nullptr) {
    std::vector<std::string> fqn;
    for (const Json& p : opt->Get("params")->items) fqn.push_back(p.text);
    if (std::optional<Json> renamed = RenameOptimizer(tree, fqn)) {
      jobdir_internal::AppendJson(*renamed, &out);
      return out;
    }
  }
  jobdir_internal::AppendJson(tree, &out);
  return out;
}

Result<std::vector<std::pair<std::string, size_t>>> ExportNames(
    const std::vector<std::string>& names, const std::vector<std::string>& include,
    const std::string& include_text, const std::string& strip, const std::string& what) {
  std::vector<std::pair<std::string, size_t>> out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (Included(names[i], include)) out.emplace_back(names[i], i);
  }
  if (out.empty() && !include.empty()) {
    return Status::InvalidArgument("no tensor of " + what + " matches " + include_text +
                                   " (globs over the stored names, e.g. 'model/*'; `nonstop "
                                   "inspect` lists them)");
  }
  if (!strip.empty()) {
    for (auto& n : out) {
      if (n.first.rfind(strip, 0) == 0) n.first = n.first.substr(strip.size());
    }
  }
  return out;
}

Result<uint64_t> WriteSafetensors(const SafetensorsTarget& target,
                                  const std::vector<SafetensorsEntry>& entries,
                                  const std::vector<std::pair<std::string, std::string>>& meta,
                                  const SafetensorsSource& source) {
  const std::string& out = target.path;
  std::string header = "{";
  std::set<std::string_view> seen;
  uint64_t total = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.name == "__metadata__") {
      return Status::InvalidArgument("a tensor would be written as '__metadata__', a name "
                                     "safetensors reserves");
    }
    if (!seen.insert(e.name).second) {
      return Status::InvalidArgument("two tensors would be written as '" + e.name +
                                     "' (strip made their names collide?)");
    }
    if (e.dtype == DType::kComplex128 || static_cast<int>(e.dtype) >= kNumDTypes) {
      return Status::InvalidArgument("tensor '" + e.name + "' has dtype " +
                                     std::string(DTypeName(e.dtype)) +
                                     ", which safetensors cannot hold");
    }
    // The header must describe the bytes: a shape that does not make
    // nbytes would write a file that no reader takes.
    uint64_t want = DTypeSize(e.dtype);
    for (int64_t d : e.shape) {
      if (d < 0 || (d > 0 && want > UINT64_MAX / static_cast<uint64_t>(d))) {
        want = UINT64_MAX;
        break;
      }
      want *= static_cast<uint64_t>(d);
    }
    if (want != e.nbytes) {
      return Status::InvalidArgument("tensor '" + e.name + "': its shape makes " +
                                     (want == UINT64_MAX ? std::string("no valid size")
                                                         : std::to_string(want) + " bytes") +
                                     ", not " + std::to_string(e.nbytes));
    }
    header += jobdir_internal::JsonString(e.name) + ":{\"dtype\":\"" +
              std::string(DTypeSafetensorsName(e.dtype)) + "\",\"shape\":[";
    for (size_t d = 0; d < e.shape.size(); ++d) {
      header += (d ? "," : "") + std::to_string(e.shape[d]);
    }
    header += "],\"data_offsets\":[" + std::to_string(total) + "," +
              std::to_string(total + e.nbytes) + "]},";
    total += e.nbytes;
  }
  header += "\"__metadata__\":{";
  for (size_t i = 0; i < meta.size(); ++i) {
    header += (i ? "," : "") + jobdir_internal::JsonString(meta[i].first) + ":" +
              jobdir_internal::JsonString(meta[i].second);
  }
  header += "}}";
  header.append((8 - header.size() % 8) % 8, ' ');

  // OUT's directory and OUT.tmp in it, through the Env. Errors about the
  // output name OUT, never OUT.tmp (the name the user gave).
  const size_t cut = out.rfind('/');
  const std::string name = cut == std::string::npos ? out : out.substr(cut + 1);
  const std::string dir = cut == std::string::npos ? "." : cut == 0 ? "/" : out.substr(0, cut);
  const std::string tmp_name = name + ".tmp";
  const std::string tmp = out + ".tmp";
  auto failed = [&](const Status& st) {
    std::string why = st.message();
    ReplaceAll(&why, tmp, out);
    ReplaceAll(&why, tmp_name, name);
    return Status::IOError("cannot export to " + out + ": " + why);
  };
  if (Status st = CheckEntryName(name); !st.ok()) {
    return Status::InvalidArgument("cannot export to " + out + ": it does not name a file: " +
                                   st.message());
  }
  if (Status st = CheckEntryName(tmp_name); !st.ok()) {
    return Status::InvalidArgument("cannot export to " + out + ": " + st.message());
  }
  Env* env = target.env != nullptr ? target.env : DefaultEnv();
  Result<std::unique_ptr<Directory>> od = env->OpenDirectory(dir, /*create=*/false);
  if (!od.ok()) return failed(od.status());
  Directory& odir = *od.value();
  // A leftover OUT.tmp (an interrupted export, or something planted) is
  // removed; unlink never follows a link. Without remove_temp_link only a
  // regular file is.
  if (Result<FileStat> st = odir.Stat(tmp_name); st.ok()) {
    if (st->type != EntryType::kFile && !target.remove_temp_link) {
      return Status::InvalidArgument(tmp + " already exists and is not a regular file (a "
                                     "symlink?); refusing to write through it: remove it");
    }
    if (Status u = odir.Unlink(tmp_name); !u.ok()) return failed(u);
  } else if (st.status().code() != StatusCode::kNotFound) {
    return failed(st.status());
  }
  Result<std::unique_ptr<Medium>> created =
      odir.CreateFile(tmp_name, MediumKind::kBuffered, MediumOptions{});
  if (!created.ok()) return failed(created.status());
  std::unique_ptr<Medium> f = std::move(created).value();
  Status st = [&]() -> Status {
    uint64_t pos = 0;
    auto put = [&](const void* p, size_t n) -> Status {
      Status w = f->Write(pos, p, n);
      pos += n;
      return w.ok() ? w : failed(w);
    };
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(header.size() >> (8 * i));
    NONSTOP_RETURN_IF_ERROR(put(le, 8));
    NONSTOP_RETURN_IF_ERROR(put(header.data(), header.size()));
    using Clock = std::chrono::steady_clock;
    Clock::time_point shown = Clock::now();
    uint64_t done = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].nbytes == 0) continue;
      NONSTOP_ASSIGN_OR_RETURN(std::string_view bytes, source(i));
      if (bytes.size() != entries[i].nbytes) {
        return Status::Internal("export: " + std::to_string(bytes.size()) + " bytes for tensor '" +
                                entries[i].name + "' of " + std::to_string(entries[i].nbytes));
      }
      NONSTOP_RETURN_IF_ERROR(put(bytes.data(), bytes.size()));
      done += bytes.size();
      if (target.progress && Clock::now() - shown >= std::chrono::milliseconds(100)) {
        shown = Clock::now();
        if (!target.progress(done, total)) return Status::Aborted("export cancelled");
      }
    }
    if (target.progress && !target.progress(done, total)) {
      return Status::Aborted("export cancelled");
    }
    if (Status s = f->Sync(); !s.ok()) return failed(s);
    f.reset();
    if (Status s = odir.Rename(tmp_name, name); !s.ok()) return failed(s);
    if (Status s = odir.SyncDir(); !s.ok()) return failed(s);
    return Status::OK();
  }();
  if (!st.ok()) {
    f.reset();
    (void)odir.Unlink(tmp_name);
    return st;
  }
  return total;
}

Result<ExportResult> ExportSafetensors(const ExportRequest& req, const SafetensorsTarget& target) {
  Env* env = target.env != nullptr ? target.env : DefaultEnv();
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> jd, JobDir::OpenForRead(req.dir, env));
  ExportResult res;
  {  // A multi-rank job is exported consolidated: its header says so before any data is read.
    Result<std::unique_ptr<Medium>> m = jd->OpenSlot(req.rank, MediumKind::kBuffered, true);
    Result<std::unique_ptr<SlotFile>> sf =
        m.ok() ? SlotFile::Open(std::move(m).value()) : Result<std::unique_ptr<SlotFile>>(m.status());
    if (!sf.ok()) return sf.status().Annotate(jd->SlotPath(req.rank));
    res.world_size = static_cast<int>(sf.value()->geometry().world_size);
    res.notes = sf.value()->salvaged();
    for (std::string& n : res.notes) n = jd->SlotPath(req.rank) + ": " + n;
    if (res.world_size > 1) return res;
  }
  // What recovery would load (of req.step when given): the planner's choice.
  SelectOptions so;
  so.step = req.step;
  Result<Selection> picked = jd->Select(req.rank, so);
  if (!picked.ok() && req.step && picked.status().code() == StatusCode::kNotFound) {
    // A step that is not there: the steps that are.
    Result<std::vector<ListedCheckpoint>> listed = jd->List(req.rank);
    std::set<int64_t> steps;
    for (const ListedCheckpoint& c : listed.ok() ? listed.value() : std::vector<ListedCheckpoint>{}) {
      if (c.state == ListedCheckpoint::State::kCommitted) steps.insert(c.step);
    }
    std::string there;
    for (int64_t st : steps) there += (there.empty() ? "" : ", ") + std::to_string(st);
    return Status::NotFound(picked.status().message() + " (steps here: " +
                            (there.empty() ? "none" : there) + ")");
  }
  NONSTOP_ASSIGN_OR_RETURN(Selection sel, std::move(picked));
  if (!sel.chosen) {
    return Status::NotFound("no committed checkpoint in " + req.dir);
  }
  Selected& chosen = *sel.chosen;
  const CheckpointInfo& info = chosen.info;
  const std::string what = "step " + std::to_string(info.step) + " of " + req.dir;
  if (!jobdir_internal::TopLevelValue(info.meta_json, "multistep_plan").empty()) {
    return Status::InvalidArgument(
        what + " was written by mode='multistep' with replay='torch': its optimizer's tensors "
               "reach that step only when restore() replays them; restore it and save with "
               "mode='concurrent' to export");
  }
  // Each stored tensor, then each tied weight's other names (table index of each).
  std::vector<std::string> all;
  std::vector<size_t> index;
  std::map<std::string, size_t> stored;
  for (size_t i = 0; i < info.tensors.size(); ++i) {
    stored.emplace(info.tensors[i].spec.name, i);
    all.push_back(info.tensors[i].spec.name);
    index.push_back(i);
  }
  for (const auto& [path, ref] : MetaAliases(info.meta_json)) {
    auto it = stored.find(ref);
    if (it != stored.end() && !stored.contains(path)) {
      all.push_back(path);
      index.push_back(it->second);
    }
  }
  NONSTOP_ASSIGN_OR_RETURN(auto names,
                           ExportNames(all, req.include, req.include_text, req.strip, what));
  for (auto& n : names) n.second = index[n.second];
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, i] : names) {
    const TensorSpec& sp = info.tensors[i].spec;
    entries.push_back(SafetensorsEntry{name, sp.dtype, sp.shape, sp.nbytes});
  }

  // The data through the one restore path: a window of entries (in output
  // order, about window_bytes of distinct stored tensors, at least one) read
  // in one ReadCheckpointInto over their byte range; a tied weight's second
  // name in the window reuses the bytes read once.
  std::vector<char> buf;
  std::vector<uint64_t> at(info.tensors.size(), 0);  // offset of each stored tensor in buf
  std::vector<char> in_window(info.tensors.size(), 0);
  size_t window_end = 0;
  auto read_window = [&](size_t first) -> Status {
    std::fill(in_window.begin(), in_window.end(), 0);
    uint64_t bytes = 0, lo = UINT64_MAX, hi = 0;
    std::vector<size_t> kept;
    size_t last = first;
    for (; last < names.size(); ++last) {
      const size_t i = names[last].second;
      const TensorEntry& te = info.tensors[i];
      const bool fresh = te.spec.nbytes != 0 && !in_window[i];
      if (fresh && !kept.empty() && bytes + te.spec.nbytes > req.window_bytes) break;
      if (fresh) {
        in_window[i] = 1;
        kept.push_back(i);
        at[i] = bytes;
        bytes += te.spec.nbytes;
        lo = std::min(lo, te.data_offset);
        hi = std::max(hi, te.data_offset + te.spec.nbytes);
      }
    }
    window_end = last;
    buf.resize(bytes);
    std::vector<void*> dst(info.tensors.size(), nullptr);
    for (size_t i : kept) dst[i] = buf.data() + at[i];
    RestoreOptions ro;
    ro.threads = std::max(1, req.threads);
    ro.data_begin = lo;
    ro.data_end = hi;
    return ReadCheckpointInto(*chosen.file, info, dst, ro);
  };
  SafetensorsSource source = [&](size_t k) -> Result<std::string_view> {
    if (k >= window_end) NONSTOP_RETURN_IF_ERROR(read_window(k));
    const size_t i = names[k].second;
    return std::string_view(buf.data() + at[i], info.tensors[i].spec.nbytes);
  };
  NONSTOP_ASSIGN_OR_RETURN(
      res.bytes, WriteSafetensors(target, entries,
                                  {{"nonstop.step", std::to_string(info.step)},
                                   {"nonstop.counter", std::to_string(info.counter)},
                                   {"nonstop.meta", info.meta_json}},
                                  source));
  res.step = info.step;
  res.counter = info.counter;
  res.tensors = entries.size();
  return res;
}

}  // namespace nonstop
