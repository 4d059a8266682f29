// Rewrites of state trees (state_tree.h), on the job directory's bounded JSON.
#include "restore/state_tree.h"

#include <cstdint>
#include <map>
#include <set>
#include <utility>

#include "jobdir/records.h"
#include "nonstop/dist.h"
#include "store/format.h"

namespace nonstop {
namespace {

using jobdir_internal::Json;

Result<Json> Parse(const std::string& text, const std::string& what) {
  return jobdir_internal::ParseJson(text, what,
                                    jobdir_internal::MetaJsonLimits(format::kMaxMetaBytes));
}

// The tensor a {"__tensor__"/"__ndarray__": name} leaf names, else nullptr.
Json* TensorName(Json& j) {
  if (j.type == Json::Type::kObject && j.keys.size() == 1 &&
      (j.keys[0] == "__tensor__" || j.keys[0] == "__ndarray__") &&
      j.items[0].type == Json::Type::kString) {
    return &j.items[0];
  }
  return nullptr;
}

Json Number(int64_t v) {
  Json j;
  j.type = Json::Type::kNumber;
  j.text = std::to_string(v);
  return j;
}

Json* Field(Json& j, const std::string& key) {
  for (size_t k = 0; j.type == Json::Type::kObject && k < j.keys.size(); ++k) {
    if (j.keys[k] == key) return &j.items[k];
  }
  return nullptr;
}

// Each tensor leaf of `j` (old rank `rank`, `where`) renamed "{prefix}{old}".
Status RenameLeaves(Json& j, int rank, const std::string& prefix, const std::string& where,
                    const std::set<std::string>& held, std::set<std::string>* done,
                    TreeRewrite* out) {
  if (Json* name = TensorName(j)) {
    if (held.count(name->text) == 0) {
      return Status::Corruption(where + " refers to tensor " +
                                jobdir_internal::JsonString(name->text.substr(0, 80)) +
                                ", which its checkpoint does not hold");
    }
    if (done->insert(name->text).second) out->renames.emplace_back(rank, name->text, prefix + name->text);
    name->text = prefix + name->text;
    return Status::OK();
  }
  for (Json& c : j.items) {
    NONSTOP_RETURN_IF_ERROR(RenameLeaves(c, rank, prefix, where, held, done, out));
  }
  return Status::OK();
}

bool Ints(const Json* j, std::vector<int64_t>* out) {
  if (j == nullptr || j->type != Json::Type::kArray) return false;
  for (const Json& v : j->items) {
    int64_t x;
    if (!v.AsInt64(&x)) return false;
    out->push_back(x);
  }
  return true;
}

}  // namespace

Result<TreeRewrite> ConsolidateZero(const std::string& key, const std::vector<std::string>& trees,
                                    const std::vector<std::string>& layouts,
                                    const std::vector<std::vector<std::string>>& names) {
  if (trees.empty() || layouts.size() != trees.size() || names.size() != trees.size()) {
    return Status::InvalidArgument("ConsolidateZero: one tree, layout and name list per rank");
  }
  TreeRewrite out;
  std::map<int64_t, Json> state;
  Json groups;
  groups.type = Json::Type::kArray;
  for (size_t r = 0; r < trees.size(); ++r) {
    const std::string where = "the ZeRO optimizer state '" + key + "' of rank " + std::to_string(r);
    auto bad = [&](const std::string& why) { return Status::Corruption(where + ": " + why); };
    NONSTOP_ASSIGN_OR_RETURN(Json layout, Parse(layouts[r], where));
    NONSTOP_ASSIGN_OR_RETURN(Json tree, Parse(trees[r], where));
    std::vector<int64_t> index, sizes, params, ids;
    if (!Ints(layout.Get("index"), &index) || !Ints(layout.Get("groups"), &sizes)) {
      return bad("its layout is not {\"index\": [...], \"groups\": [...]}");
    }
    Json* st = Field(tree, "state");
    Json* pg = Field(tree, "param_groups");
    if (st == nullptr || pg == nullptr || pg->type != Json::Type::kArray) {
      return bad("not an optimizer state_dict (state, param_groups)");
    }
    for (const Json& g : pg->items) {
      if (!Ints(g.Get("params"), &params)) return bad("a param_group has no list of parameter ids");
    }
    // Integer keys: flattened as {"__dict__": [[id, value], ...]} ({} when empty).
    Json* pairs = st->type == Json::Type::kObject && st->keys.size() == 1 &&
                          st->keys[0] == "__dict__" ? &st->items[0] : nullptr;
    if (!(st->type == Json::Type::kObject && st->keys.empty()) &&
        (pairs == nullptr || pairs->type != Json::Type::kArray)) {
      return bad("its state is not keyed by parameter ids");
    }
    for (size_t i = 0; pairs != nullptr && i < pairs->items.size(); ++i) {
      const Json& kv = pairs->items[i];
      int64_t id;
      if (kv.type != Json::Type::kArray || kv.items.size() != 2 || !kv.items[0].AsInt64(&id)) {
        return bad("its state is not keyed by parameter ids");
      }
      ids.push_back(id);
    }
    NONSTOP_ASSIGN_OR_RETURN(std::vector<int64_t> global,
                             dist::ZeroGlobalIds(index, params, ids, key));
    const std::set<std::string> held(names[r].begin(), names[r].end());
    std::set<std::string> done;
    const std::string prefix = key + "#zero/" + std::to_string(r) + "/";
    for (size_t i = 0; i < global.size(); ++i) {
      Json& value = pairs->items[i].items[1];
      NONSTOP_RETURN_IF_ERROR(
          RenameLeaves(value, static_cast<int>(r), prefix, where, held, &done, &out));
      state[global[i]] = std::move(value);
    }
    if (r != 0) continue;
    // Rank 0's groups, each group's parameters numbered in order.
    int64_t end = 0;
    for (size_t g = 0; g < pg->items.size() && g < sizes.size(); ++g) {
      Json group = std::move(pg->items[g]);
      NONSTOP_RETURN_IF_ERROR(RenameLeaves(group, 0, prefix, where, held, &done, &out));
      Json numbered;
      numbered.type = Json::Type::kArray;
      for (int64_t p = end; p < end + sizes[g]; ++p) numbered.items.push_back(Number(p));
      end += sizes[g];
      for (size_t k = 0; k < group.keys.size(); ++k) {
        if (group.keys[k] == "params") {
          group.keys.erase(group.keys.begin() + static_cast<std::ptrdiff_t>(k));
          group.items.erase(group.items.begin() + static_cast<std::ptrdiff_t>(k));
          break;
        }
      }
      group.keys.push_back("params");
      group.items.push_back(std::move(numbered));
      groups.items.push_back(std::move(group));
    }
  }
  out.tree = "{\"state\":";
  if (state.empty()) {
    out.tree += "{}";
  } else {
    out.tree += "{\"__dict__\":[";
    for (auto it = state.begin(); it != state.end(); ++it) {
      if (it != state.begin()) out.tree.push_back(',');
      out.tree += "[" + std::to_string(it->first) + ",";
      jobdir_internal::AppendJson(it->second, &out.tree);
      out.tree.push_back(']');
    }
    out.tree += "]}";
  }
  out.tree += ",\"param_groups\":";
  jobdir_internal::AppendJson(groups, &out.tree);
  out.tree += ",\"nonstop_consolidated_zero\":1}";
  return out;
}

Result<TreeRewrite> RenameModuleKeys(const std::string& key, const std::string& tree, bool add,
                                     const std::vector<std::string>& names) {
  NONSTOP_ASSIGN_OR_RETURN(Json j, Parse(tree, "the state tree of '" + key + "'"));
  TreeRewrite out;
  std::set<std::string> held(names.begin(), names.end());
  const std::string module = "module.";
  for (size_t k = 0; j.type == Json::Type::kObject && k < j.keys.size(); ++k) {
    std::string& nk = j.keys[k];
    if (add) {
      nk = module + nk;
    } else if (nk.rfind(module, 0) == 0) {
      nk = nk.substr(module.size());
    }
    const std::string renamed = key + "/" + nk;
    Json* name = TensorName(j.items[k]);
    if (name != nullptr && held.count(name->text) && !held.count(renamed)) {
      out.renames.emplace_back(0, name->text, renamed);
      held.erase(name->text);
      held.insert(renamed);
      name->text = renamed;
    }
  }
  jobdir_internal::AppendJson(j, &out.tree);
  return out;
}

}  // namespace nonstop
