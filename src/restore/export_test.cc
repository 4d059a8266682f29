// The single-rank safetensors export (include/nonstop/export.h): the bytes
// and names of the checkpoint the planner chooses, tied weights under every
// name, include/strip, any window size, what it refuses (an abandoned step, a
// replayed one, no match, colliding names, complex128), a link planted at
// OUT.tmp, damage (no file left), a multi-rank job (nothing written).
#include "nonstop/export.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "jobdir/records.h"
#include "nonstop/jobdir.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using jobdir_internal::Json;
using testing::MakeCheckpoint;
using testing::TestCheckpoint;

struct File {
  Json header;
  std::string data;  // after the header
};

File ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  File f;
  EXPECT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(raw[i])} << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  jobdir_internal::JsonLimits lim;
  lim.max_bytes = n;
  Result<Json> h = jobdir_internal::ParseJson(std::string_view(raw).substr(8, n), path, lim);
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  if (h.ok()) f.header = std::move(h).value();
  f.data = raw.substr(8 + n);
  return f;
}

// The bytes of tensor `name` in `f` (checked against its data_offsets).
std::string Bytes(const File& f, const std::string& name) {
  const Json* e = f.header.Get(name);
  if (e == nullptr) return "<missing>";
  const Json* off = e->Get("data_offsets");
  uint64_t b = 0, end = 0;
  EXPECT_TRUE(off != nullptr && off->items.size() == 2 && off->items[0].AsUint64(&b) &&
              off->items[1].AsUint64(&end));
  EXPECT_LE(end, f.data.size());
  return f.data.substr(b, end - b);
}

std::string Stored(const TestCheckpoint& c, size_t i) {
  const TensorEntry& te = c.layout.tensors[i];
  return std::string(reinterpret_cast<const char*>(c.data.data()) + te.data_offset,
                     te.spec.nbytes);
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("nonstop-export-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    dir_ = (root_ / "ck").string();
    out_ = (root_ / "out.safetensors").string();
  }
  void TearDown() override { fs::remove_all(root_); }

  // A checkpoint of step `step` with at least three tensors, its metadata
  // `meta` ("" keeps the test's own).
  static TestCheckpoint Make(int64_t step, const std::string& meta = "") {
    while (testing::SpecsForStep(step).size() < 3) step += 1000;
    TestCheckpoint c = MakeCheckpoint(step);
    if (!meta.empty()) c.meta_json = meta;
    return c;
  }

  // Commits `cks` (counters 1, 2, ...) into a new job directory of `world` ranks' rank 0.
  std::unique_ptr<SlotFile> Commit(const std::vector<TestCheckpoint>& cks, uint32_t world = 1) {
    auto jd = JobDir::OpenForWrite(dir_, 0, static_cast<int>(world)).value();
    auto m = jd->CreateTempSlot(MediumKind::kBuffered);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    auto sf = SlotFile::Create(std::move(m).value(),
                               StoreGeometry{3, testing::kTestSlotBytes, 0, world});
    EXPECT_TRUE(sf.ok()) << sf.status().ToString();
    EXPECT_TRUE(jd->PublishTempSlot().ok());
    uint64_t counter = 0;
    for (const TestCheckpoint& c : cks) {
      ++counter;
      EXPECT_TRUE(testing::WriteAndCommit(*sf.value(), c, counter % 3, counter).ok());
    }
    return std::move(sf).value();
  }

  Result<ExportResult> Export(ExportRequest req = {}, bool remove_temp_link = false) {
    req.dir = dir_;
    SafetensorsTarget t;
    t.path = out_;
    t.remove_temp_link = remove_temp_link;
    return ExportSafetensors(req, t);
  }

  fs::path root_;
  std::string dir_, out_;
};

TEST_F(ExportTest, TheNewestCheckpointWithEveryNameAndItsBytesInAnyWindow) {
  // The state tree names tensor 0 twice (a tied weight), tensor 1 once.
  const std::string meta =
      "{\"format\": \"nonstop.torch/1\", \"state\": {\"model\": {\"emb\": {\"__tensor__\": "
      "\"layer0.weight\"}, \"head\": {\"__tensor__\": \"layer0.weight\"}, \"b\": "
      "{\"__tensor__\": \"layer1.bias\"}}, \"tagged\": {\"__kind__\": 1, \"x\": {\"__tensor__\": "
      "\"layer1.bias\"}}}}";
  const TestCheckpoint old = Make(3), c = Make(8, meta);
  Commit({old, c});
  for (uint64_t window : {uint64_t{1}, uint64_t{20000}, uint64_t{256} << 20}) {
    SCOPED_TRACE(window);
    ExportRequest req;
    req.window_bytes = window;
    Result<ExportResult> r = Export(req);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->world_size, 1);
    EXPECT_EQ(r->step, c.step);
    EXPECT_EQ(r->counter, 2u);
    const File f = ReadSafetensors(out_);
    // every stored tensor, then the aliases model/emb, model/head, model/b
    EXPECT_EQ(r->tensors, c.layout.tensors.size() + 3);
    EXPECT_EQ(f.header.keys.size(), c.layout.tensors.size() + 4);  // + __metadata__
    uint64_t bytes = 0;
    for (size_t i = 0; i < c.layout.tensors.size(); ++i) {
      const TensorSpec& sp = c.layout.tensors[i].spec;
      EXPECT_EQ(Bytes(f, sp.name), Stored(c, i)) << sp.name;
      EXPECT_EQ(f.header.Get(sp.name)->Get("dtype")->text, DTypeSafetensorsName(sp.dtype));
      EXPECT_EQ(f.header.Get(sp.name)->Get("shape")->items.size(), sp.shape.size());
      bytes += sp.nbytes;
    }
    EXPECT_EQ(Bytes(f, "model/emb"), Stored(c, 0));
    EXPECT_EQ(Bytes(f, "model/head"), Stored(c, 0));
    EXPECT_EQ(Bytes(f, "model/b"), Stored(c, 1));
    EXPECT_EQ(f.header.Get("tagged/x"), nullptr);  // not through a tagged value
    EXPECT_EQ(r->bytes, bytes + 2 * c.layout.tensors[0].spec.nbytes + c.layout.tensors[1].spec.nbytes);
    EXPECT_EQ(f.data.size(), r->bytes);
    const Json* md = f.header.Get("__metadata__");
    ASSERT_NE(md, nullptr);
    EXPECT_EQ(md->Get("nonstop.step")->text, std::to_string(c.step));
    EXPECT_EQ(md->Get("nonstop.counter")->text, "2");
    EXPECT_EQ(md->Get("nonstop.meta")->text, meta);
    EXPECT_FALSE(fs::exists(out_ + ".tmp"));
  }
  // --step: the older one.
  ExportRequest req;
  req.step = old.step;
  ASSERT_TRUE(Export(req).ok());
  EXPECT_EQ(Bytes(ReadSafetensors(out_), "layer0.weight"), Stored(old, 0));
}

TEST_F(ExportTest, IncludeAndStripAndWhatTheyRefuse) {
  const std::string meta =
      "{\"state\": {\"model\": {\"w\": {\"__tensor__\": \"layer0.weight\"}}}}";
  const TestCheckpoint c = Make(8, meta);
  Commit({c});
  ExportRequest req;
  req.include = {"model/*", "layer1.*"};
  req.strip = "model/";
  Result<ExportResult> r = Export(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  File f = ReadSafetensors(out_);
  EXPECT_EQ(r->tensors, 2u);
  EXPECT_EQ(Bytes(f, "w"), Stored(c, 0));
  EXPECT_EQ(Bytes(f, "layer1.bias"), Stored(c, 1));
  EXPECT_EQ(f.header.Get("layer0.weight"), nullptr);

  fs::remove(out_);
  req.include = {"nothing/*"};
  req.include_text = "include=['nothing/*']";
  r = Export(req);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("matches include=['nothing/*'] (globs over the stored "
                                      "names, e.g. 'model/*'"),
            std::string::npos)
      << r.status().message();
  // Two names made one by strip: the alias a/layer0.weight and the stored layer0.weight.
  fs::remove_all(dir_);
  Commit({Make(8, "{\"state\": {\"a\": {\"layer0.weight\": {\"__tensor__\": \"layer1.bias\"}}}}")});
  req.include = {};
  req.strip = "a/";
  r = Export(req);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("two tensors would be written as 'layer0.weight'"),
            std::string::npos)
      << r.status().message();
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(ExportTest, AnAbandonedOrReplayedStepIsRefused) {
  const TestCheckpoint a = Make(9), b = Make(29);
  Commit({a, b});
  {
    auto jd = JobDir::OpenForWrite(dir_).value();
    ASSERT_TRUE(jd->RecordRestore(0, 1).ok());  // restored step 9: 29 is abandoned
  }
  Result<ExportResult> r = Export();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->step, a.step);
  ExportRequest req;
  req.step = b.step;
  fs::remove(out_);
  r = Export(req);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("abandoned"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("(steps here: " + std::to_string(a.step) + ")"),
            std::string::npos)
      << r.status().message();
  EXPECT_FALSE(fs::exists(out_));

  fs::remove_all(dir_);
  Commit({Make(4, "{\"multistep_plan\": {\"parts\": []}, \"state\": {}}")});
  r = Export();
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("replay='torch'"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(ExportTest, DamageFailsTheExportAndLeavesNoFile) {
  const TestCheckpoint c = Make(8);
  auto f = Commit({c});
  const CheckpointInfo info = f->Scan().value().checkpoints[0].info;
  const uint64_t at = info.data_offset + info.tensors[0].data_offset + info.tensors[0].spec.nbytes / 2;
  uint8_t byte = 0;
  ASSERT_TRUE(f->medium().Read(at, &byte, 1).ok());
  byte ^= 0x40;
  ASSERT_TRUE(f->medium().Write(at, &byte, 1).ok());
  ASSERT_TRUE(f->medium().Sync().ok());
  Result<ExportResult> r = Export();
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  EXPECT_FALSE(fs::exists(out_));
  EXPECT_FALSE(fs::exists(out_ + ".tmp"));
  // Output errors name the file asked for, never OUT.tmp.
  SafetensorsTarget t;
  t.path = (root_ / "no-such-dir" / "x.safetensors").string();
  Result<uint64_t> w = WriteSafetensors(t, {}, {}, nullptr);
  EXPECT_EQ(w.status().code(), StatusCode::kIOError);
  EXPECT_EQ(w.status().message().rfind("cannot export to " + t.path + ": ", 0), 0u)
      << w.status().message();
  EXPECT_EQ(w.status().message().find(".tmp"), std::string::npos) << w.status().message();
  // complex128 has no safetensors dtype.
  t.path = out_;
  w = WriteSafetensors(t, {SafetensorsEntry{"z", DType::kComplex128, {1}, 16}}, {}, nullptr);
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("'z' has dtype complex128"), std::string::npos);
  // A shape that does not make the bytes is refused before anything is written.
  w = WriteSafetensors(t, {SafetensorsEntry{"f", DType::kFloat32, {2, 3}, 20}}, {}, nullptr);
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("'f': its shape makes 24 bytes, not 20"), std::string::npos)
      << w.status().message();
  w = WriteSafetensors(t, {SafetensorsEntry{"g", DType::kFloat32, {INT64_MAX, 4}, 8}}, {},
                       nullptr);
  EXPECT_NE(w.status().message().find("'g': its shape makes no valid size"), std::string::npos)
      << w.status().message();
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(ExportTest, ALinkAtTheTempNameIsRefusedOrRemovedNeverFollowed) {
  Commit({Make(8)});
  const std::string victim = (root_ / "victim").string();
  { std::ofstream(victim) << "precious"; }
  fs::create_symlink(victim, out_ + ".tmp");
  Result<ExportResult> r = Export({}, /*remove_temp_link=*/false);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("out.safetensors.tmp already exists"), std::string::npos)
      << r.status().message();
  EXPECT_TRUE(fs::is_symlink(out_ + ".tmp"));
  EXPECT_FALSE(fs::exists(out_));
  r = Export({}, /*remove_temp_link=*/true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(fs::is_symlink(out_ + ".tmp"));
  EXPECT_FALSE(fs::is_symlink(out_));
  std::ifstream v(victim);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(v)), std::istreambuf_iterator<char>()),
            "precious");
  // A regular leftover (an interrupted export) is replaced either way.
  { std::ofstream(out_ + ".tmp") << "half"; }
  ASSERT_TRUE(Export().ok());
  EXPECT_FALSE(fs::exists(out_ + ".tmp"));
}

TEST_F(ExportTest, AMultiRankJobIsLeftToTheConsolidatedExport) {
  Commit({Make(8)}, /*world=*/2);
  Result<ExportResult> r = Export();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->world_size, 2);
  EXPECT_FALSE(fs::exists(out_));
}

TEST_F(ExportTest, ProgressReachesTheTotalAndCanCancel) {
  Commit({Make(8)});
  ExportRequest req;
  req.dir = dir_;
  req.window_bytes = 1;
  SafetensorsTarget t;
  t.path = out_;
  uint64_t last = 0, total = 0;
  t.progress = [&](uint64_t done, uint64_t all) {
    last = done;
    total = all;
    return true;
  };
  Result<ExportResult> r = ExportSafetensors(req, t);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(last, r->bytes);
  EXPECT_EQ(total, r->bytes);
  fs::remove(out_);
  t.progress = [](uint64_t, uint64_t) { return false; };
  EXPECT_EQ(ExportSafetensors(req, t).status().code(), StatusCode::kAborted);
  EXPECT_FALSE(fs::exists(out_));
  EXPECT_FALSE(fs::exists(out_ + ".tmp"));
}

TEST(ExportNamesTest, MalformedNamesInTheMetadataAreOneLineCorruption) {
  auto why = [](const std::string& json) { return CheckExportNames(json).message(); };
  EXPECT_TRUE(CheckExportNames("null").ok());
  EXPECT_TRUE(CheckExportNames("{}").ok());
  EXPECT_TRUE(CheckExportNames("{\"modules\": {\"model\": \"module.\"}, \"optimizers\": "
                               "{\"optim\": {\"module\": \"model\", \"params\": [\"w\"]}}}")
                  .ok());
  const std::string pre = "checkpoint metadata 'names' is malformed: ";
  EXPECT_EQ(CheckExportNames("[1, 2]").code(), StatusCode::kCorruption);
  EXPECT_EQ(why("[1, 2]"), pre + "not an object");
  EXPECT_EQ(why("{\"modules\": [\"model\"]}"), pre + "'modules' is not a map of names to prefixes");
  EXPECT_EQ(why("{\"modules\": {\"model\": 3}}"), pre + "'modules' is not a map of names to prefixes");
  EXPECT_EQ(why("{\"optimizers\": []}"), pre + "'optimizers' is not an object");
  for (const char* o : {"{\"module\": \"model\"}", "{\"module\": \"model\", \"params\": [0, 1]}",
                        "{\"module\": 1, \"params\": []}", "[]"}) {
    EXPECT_EQ(why(std::string("{\"optimizers\": {\"optim\": ") + o + "}}"),
              pre + "optimizer \"optim\" has no module name and list of parameter names")
        << o;
  }
  EXPECT_EQ(why("{\"modules\": "), pre + "names: not valid JSON (unexpected end at byte 12)");
}

// CheckStateTree: what _state.unflatten may trust, checked from a fixed list.
TEST(StateTreeTest, WellFormedTagsPassAnyOtherIsOneLineCorruptionNamingWhere) {
  const std::vector<std::string> names = {"m/w", "m/b"};
  auto why = [&](const std::string& json) { return CheckStateTree(json, names).message(); };
  EXPECT_TRUE(CheckStateTree(
      "{\"model\": {\"w\": {\"__tensor__\": \"m/w\"}, \"b\": [{\"__ndarray__\": \"m/b\"}]},"
      " \"x\": {\"__float__\": \"000000000000f87f\"}, \"t\": {\"__tuple__\": [1, \"a\", null]},"
      " \"d\": {\"__dict__\": [[{\"__tuple__\": [1, {\"__dtype__\": \"float32\"}]}, 2],"
      " [{\"__tensor__\": \"m/w\"}, {\"__device__\": \"cuda:1\"}], [3, {\"__device__\": \"cpu\"}]]},"
      " \"n\": {\"__npscalar__\": [\"<f4\", 1.5]}, \"i\": {\"__npscalar__\": [\"|b1\", true]},"
      " \"f\": {\"__npscalar__\": [\"<f8\", {\"__float__\": \"000000000000f07f\"}]},"
      " \"plain\": {\"__x\": 1}, \"q\": {\"__dtype__\": \"quint4x2\"}}",
      names).ok());
  const std::string pre = "malformed checkpoint metadata: ";
  EXPECT_EQ(CheckStateTree("{\"__tensor__\": \"nope\"}", names).code(), StatusCode::kCorruption);
  EXPECT_EQ(why("{\"a\": [0, {\"__tensor__\": \"nope\"}]}"),
            pre + "state['a'][1] refers to tensor 'nope', which the checkpoint does not hold");
  EXPECT_EQ(why("{\"__ndarray__\": 3}"),
            pre + "state refers to tensor 3, which the checkpoint does not hold");
  EXPECT_EQ(why("{\"__float__\": \"zz\"}"), pre + "state: 'zz' is not a float's 8 bytes in hex");
  EXPECT_EQ(why("{\"__float__\": \"000000000000f87g\"}"),
            pre + "state: '000000000000f87g' is not a float's 8 bytes in hex");
  EXPECT_EQ(why("{\"__tuple__\": 5}"), pre + "state: a tuple must be a list");
  EXPECT_EQ(why("{\"__tuple__\": [[{\"__dtype__\": \"os\"}]]}"),
            pre + "state[0][0]: dtype 'os' is not one of torch's tensor dtypes");
  EXPECT_EQ(why("{\"__dict__\": [[1]]}"), pre + "state: a dict must be a list of [key, value] pairs");
  EXPECT_EQ(why("{\"__dict__\": {}}"), pre + "state: a dict must be a list of [key, value] pairs");
  for (const char* key : {"[1]", "{\"a\": 1}", "{\"__tuple__\": [[1]]}", "{\"__ndarray__\": \"m/w\"}",
                          "{\"__dict__\": []}"}) {
    EXPECT_EQ(why(std::string("{\"__dict__\": [[0, 1], [") + key + ", 2]]}"),
              pre + "state: key 1 is of an unhashable type (a list, dict or array)")
        << key;
  }
  EXPECT_EQ(why("{\"__dict__\": [[5, {\"__float__\": 1}]]}"),
            pre + "state[key 0]: 1 is not a float's 8 bytes in hex");
  EXPECT_EQ(why("{\"__dict__\": [[{\"__dtype__\": \"load\"}, 1]]}"),
            pre + "state.key0: dtype 'load' is not one of torch's tensor dtypes");
  for (const char* bad : {"[\"O\", 1]", "[\"<f4\"]", "[\"<f4\", \"1\"]", "[\"<f4\", [1]]", "\"<f4\""}) {
    EXPECT_NE(why(std::string("{\"__npscalar__\": ") + bad + "}").find("is not of a numeric dtype"),
              std::string::npos)
        << bad;
  }
  EXPECT_EQ(why("{\"__npscalar__\": [\"<f8\", {\"__float__\": \"x\"}]}"),
            pre + "state: 'x' is not a float's 8 bytes in hex");
  for (const char* bad : {"\"__builtins__\"", "3", "\"Tensor\"", "null"}) {
    EXPECT_NE(why(std::string("{\"__dtype__\": ") + bad + "}").find("is not one of torch's tensor"),
              std::string::npos)
        << bad;
  }
  const std::string devices = " is not one of cpu, cuda, meta, mps, xpu, hpu, mtia, privateuseone "
                              "(with an index)";
  for (const char* bad : {"cpu;rm", "cuda:", "cuda:x", "cuda:123456", "gpu", "cuda:1:2"}) {
    EXPECT_EQ(why(std::string("{\"__device__\": \"") + bad + "\"}"),
              pre + "state: device '" + bad + "'" + devices)
        << bad;
  }
  EXPECT_EQ(why("{\"__device__\": [\"cpu\"]}"), pre + "state: device a list" + devices);
  EXPECT_EQ(why("{\"k\": {\"__pickle__\": 1}}"), pre + "state['k']: unknown tag '__pickle__'");
  EXPECT_EQ(why("{\"k\\n\": {\"__\": 1}}"), pre + "state['k\\x0A']: unknown tag '__'");
  EXPECT_EQ(why("[1"), pre + "the state tree: not valid JSON (expected ',' or ']' at byte 2)");
  std::string deep(300, '[');
  EXPECT_NE(why(deep + std::string(300, ']')).find("nested too deep"), std::string::npos);
}

// The fixed lists the tags are decoded from, as the Python front end takes them.
TEST(StateTreeTest, NamesAreTheFixedListsTheCheckDecodesFrom) {
  const std::vector<std::string> dtypes = StateTreeDtypes(), devices = StateTreeDevices();
  EXPECT_EQ(dtypes.size(), 26u);
  for (const char* d : {"float32", "bfloat16", "float8_e8m0fnu", "quint2x4"}) {
    EXPECT_NE(std::find(dtypes.begin(), dtypes.end(), d), dtypes.end()) << d;
    EXPECT_TRUE(CheckStateTree(std::string("{\"__dtype__\": \"") + d + "\"}", {}).ok()) << d;
  }
  EXPECT_EQ(devices, (std::vector<std::string>{"cpu", "cuda", "meta", "mps", "xpu", "hpu", "mtia",
                                               "privateuseone"}));
}

// CheckSavedState: restore()'s one check of the state tree, then each key's kind.
TEST(StateTreeTest, SavedStateCheckedOnceThenEachKeyOfItsKind) {
  const std::vector<std::string> names = {"m/w", "o/state/0/exp_avg"};
  const std::string where = "checkpoint step 3 in /d";
  using K = StateKind;
  const std::vector<StateKey> keys = {{"model", "'model'", K::kStateDict},
                                      {"optim", "'optim'", K::kOptimizer},
                                      {"t", "'t'", K::kTensor},
                                      {"n", "'n'", K::kAny},
                                      {"absent", "'absent'", K::kOptimizer}};
  const std::string good =
      R"({"model": {"w": {"__tensor__": "m/w"}}, "t": {"__tensor__": "m/w"}, "n": 5,)"
      R"( "optim": {"state": {"__dict__": [[0, {"exp_avg": {"__tensor__": "o/state/0/exp_avg"}}]]},)"
      R"( "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"params": []}]}, "extra": {"__x__": 1}})";
  auto got = CheckSavedState(where, good, keys, names);
  ASSERT_TRUE(got.ok()) << got.status().message();
  ASSERT_EQ(got->size(), 5u);
  EXPECT_FALSE((*got)[0]);
  EXPECT_EQ((*got)[1], (std::vector<int64_t>{2, 0}));
  EXPECT_FALSE((*got)[2] || (*got)[3] || (*got)[4]);
  // A "__dict__" form (a key that is no string) and a consolidated ZeRO state.
  got = CheckSavedState(where,
                        R"({"optim": {"__dict__": [[1, 2], ["state", {}], ["param_groups",)"
                        R"( [{"__dict__": [["params", [7]]]}]]]}, "model": {"__dict__": []}})",
                        keys, names);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ((*got)[1], (std::vector<int64_t>{1}));
  got = CheckSavedState(where, R"({"optim": {"nonstop_consolidated_zero": 1, "state": 3}})", keys,
                        names);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_FALSE((*got)[1]);
  got = CheckSavedState(where, R"({"optim": {"nonstop_consolidated_zero": null, "state": {},)"
                        R"( "param_groups": []}})", keys, names);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ((*got)[1], std::vector<int64_t>{});
  auto why = [&](const std::string& json) {
    Status s = CheckSavedState(where, json, keys, names).status();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << json;
    return s.message();
  };
  const std::string pre = where + ": ";
  EXPECT_EQ(why("null"), pre + "its metadata holds no state tree");
  EXPECT_EQ(why("[{}]"), pre + "its metadata holds no state tree");
  EXPECT_EQ(why("{\"model\": "), pre + "malformed checkpoint metadata: the state tree: not valid "
                                       "JSON (unexpected end at byte 10)");
  // The tree first, every key's (the key named), before any key's kind.
  EXPECT_EQ(why(R"({"model": 3, "n": {"a": [{"__tensor__": "nope"}]}})"),
            pre + "malformed checkpoint metadata: state['n']['a'][0] refers to tensor 'nope', "
                  "which the checkpoint does not hold");
  EXPECT_EQ(why(R"({"t": {"__ndarray__": "m/w"}})"), pre + "state 't' is not a tensor");
  EXPECT_EQ(why(R"({"t": [1]})"), pre + "state 't' is not a tensor");
  for (const auto& [value, type] : std::vector<std::pair<std::string, std::string>>{
           {"[1]", "list"}, {"3", "int"}, {"2.5", "float"}, {"null", "NoneType"},
           {"\"s\"", "str"}, {"true", "bool"}, {R"({"__tensor__": "m/w"})", "Tensor"},
           {R"({"__tuple__": []})", "tuple"}, {R"({"__float__": "000000000000f87f"})", "float"},
           {R"({"__dtype__": "float32"})", "dtype"}}) {
    EXPECT_EQ(why("{\"model\": " + value + "}"), pre + "state 'model' is a " + type +
                                                      ", not a state dict");
  }
  for (const char* optim :
       {R"({"state": {}})", R"({"param_groups": []})", R"({"state": [], "param_groups": []})",
        R"({"state": {}, "param_groups": {"__tuple__": []}})",
        R"({"state": {}, "param_groups": [{"lr": 1}]})",
        R"({"state": {}, "param_groups": [[0]]})",
        R"({"state": {}, "param_groups": [{"params": {"__tuple__": [0]}}]})"}) {
    EXPECT_EQ(why(std::string("{\"optim\": ") + optim + "}"),
              pre + "state 'optim' is not an optimizer state dict")
        << optim;
  }
}

// DcpGatherLayout: the DCP export's global tensors from the "dist" tables,
// and where each rank's piece goes in its tensor.
TEST(DcpGatherLayoutTest, SharedAndDTensorTablesByNameEachPieceIntoItsTensor) {
  const std::string dist =
      R"({"shared": {"b": [[2], "float32"]}, "dtensor": {"w": [[4, 2], "bfloat16", "S0"],)"
      R"( "b": [[9], "int8", "R"]}, "zero": {}})";
  const std::vector<dist::Piece> pieces = {{0, 0, "w", 0, 8}, {0, 1, "b", 0, 8},
                                           {0, 2, "local", 0, 4}, {1, 0, "w", 4, 8}};
  auto got = DcpGatherLayout(dist, pieces, "/d", 5);
  ASSERT_TRUE(got.ok()) << got.status().message();
  ASSERT_EQ(got->tensors.size(), 2u);
  EXPECT_EQ(got->tensors[0].name, "b");  // "shared"'s, by name
  EXPECT_EQ(got->tensors[0].shape, std::vector<int64_t>{2});
  EXPECT_EQ(got->tensors[0].dtype, DType::kFloat32);
  EXPECT_EQ(got->tensors[1].name, "w");
  EXPECT_EQ(got->tensors[1].shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(got->tensors[1].dtype, DType::kBFloat16);
  ASSERT_EQ(got->copies.size(), 3u);  // "local" is no global tensor's
  const std::vector<std::tuple<int, size_t, uint64_t, uint64_t>> want = {
      {0, 0, 0, 8}, {0, 1, 0, 8}, {1, 0, 8, 8}};
  for (size_t i = 0; i < want.size(); ++i) {
    const dist::PieceCopy& c = got->copies[i];
    EXPECT_EQ(std::make_tuple(c.rank, c.handle, c.offset, c.nbytes), want[i]) << i;
  }
  EXPECT_TRUE(DcpGatherLayout("{}", pieces, "/d", 5)->tensors.empty());
  auto why = [&](const std::string& json, const std::vector<dist::Piece>& p) {
    Status s = DcpGatherLayout(json, p, "/d", 5).status();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << json;
    return s.message();
  };
  EXPECT_EQ(why("[]", pieces), "/d: the metadata's \"dist\" is not an object");
  EXPECT_EQ(why(R"({"shared": [1]})", pieces), "/d: the metadata's \"shared\" table is not an object");
  for (const char* e : {"[[2]]", "[2, \"float32\"]", "[[2.5], \"float32\"]", "{}"}) {
    EXPECT_EQ(why(std::string(R"({"shared": {"b": )") + e + "}}", pieces),
              "/d: the metadata of tensor 'b' in \"shared\" is not [shape, dtype]")
        << e;
  }
  EXPECT_EQ(why(R"({"dtensor": {"w": [[4, 2], "float32"]}})", pieces),
            "/d: the metadata of tensor 'w' in \"dtensor\" is not [shape, dtype, placement]");
  for (const auto& [dtype, shown] : std::vector<std::pair<std::string, std::string>>{
           {"\"Tensor\"", "'Tensor'"}, {"\"__class__\"", "'__class__'"}, {"7", "7"},
           {"null", "null"}, {"\"qint8\"", "'qint8'"}, {"\"" + std::string(50, 'x') + "\"",
                                                      "'" + std::string(40, 'x') + "'"}}) {
    EXPECT_EQ(why(R"({"shared": {"b": [[2], )" + dtype + "]}}", pieces),
              "/d: the metadata of tensor 'b' names dtype " + shown +
                  ", which is not one nonstop writes");
  }
  // A gap LayOutShared finds: rank 1's rows missing.
  EXPECT_NE(why(dist, {{0, 0, "w", 0, 8}, {0, 1, "b", 0, 8}}).find("w"), std::string::npos);
}

// CheckRngRecord: what _rng.prepare may build generator states from.
TEST(RngRecordTest, WellFormedPartsPassAnyOtherIsOneLineCorruptionNamingThePart) {
  auto ints = [](int n, long long last) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(i == n - 1 ? last : 7LL * i);
    return s + "]";
  };
  auto random = [&](const std::string& mt, const std::string& gauss) {
    return "{\"random\": {\"t\": [3, {\"t\": " + mt + "}, " + gauss + "]}}";
  };
  auto numpy = [&](const std::string& keys, const std::string& rest) {
    return "{\"numpy\": [\"MT19937\", " + keys + ", " + rest + "]}";
  };
  EXPECT_TRUE(CheckRngRecord("{}").ok());
  EXPECT_TRUE(CheckRngRecord(random(ints(625, 624), "null")).ok());
  EXPECT_TRUE(CheckRngRecord(random(ints(625, 0), "-0.5")).ok());
  EXPECT_TRUE(CheckRngRecord(numpy(ints(624, 4294967295), "624, 1, 0.25")).ok());
  EXPECT_TRUE(CheckRngRecord("{\"torch\": \"00aF\", \"cuda\": [\"ff\"], \"x\": 1}").ok());
  auto why = [](const std::string& json) {
    const Status s = CheckRngRecord(json);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << json;
    EXPECT_EQ(s.message().find('\n'), std::string::npos);
    return std::string(s.message());
  };
  const std::string r = "RNG record 'random' is malformed: ";
  const std::string n = "RNG record 'numpy' is malformed: ";
  EXPECT_EQ(why("\"not a dict\""), "RNG record is a str, not a dict");
  EXPECT_EQ(why("[1]"), "RNG record is a list, not a dict");
  EXPECT_EQ(why(random("[1, 2]", "null")), r + "not a tuple (3, (625 integers), gauss)");
  EXPECT_EQ(why("{\"random\": {\"t\": [2, {\"t\": " + ints(625, 0) + "}, null]}}"),
            r + "version is not 3");
  const std::string mt = "the Mersenne Twister state is not 625 integers < 2^32 ending at a "
                         "position <= 624";
  EXPECT_EQ(why(random(ints(625, 625), "null")), r + mt);
  EXPECT_EQ(why(random(ints(625, 624).replace(1, 1, "4294967296"), "null")), r + mt);
  EXPECT_EQ(why(random(ints(625, 624).replace(1, 1, "-1"), "null")), r + mt);
  EXPECT_EQ(why(random(ints(625, 624), "\"x\"")), r + "gauss is neither null nor a number");
  EXPECT_EQ(why("{\"numpy\": 7}"), n + "not a list [kind, keys, pos, has_gauss, cached]");
  EXPECT_EQ(why(numpy("[1, 2, 3]", "0, 0, 0.0")), n + "not MT19937's 624 keys (integers < 2^32)");
  EXPECT_EQ(why("{\"numpy\": [\"PCG64\", " + ints(624, 0) + ", 0, 0, 0.0]}"),
            n + "not MT19937's 624 keys (integers < 2^32)");
  EXPECT_EQ(why(numpy(ints(624, 0), "625, 0, 0.0")), n + "pos is not an integer in 0..624");
  EXPECT_EQ(why(numpy(ints(624, 0), "0, 2, 0.0")), n + "has_gauss is not 0 or 1");
  EXPECT_EQ(why(numpy(ints(624, 0), "0, 0, null")), n + "cached is not a number");
  EXPECT_EQ(why("{\"torch\": \"0\"}"), "RNG record 'torch' is malformed: not a hex string");
  EXPECT_EQ(why("{\"torch\": \"zz\"}"), "RNG record 'torch' is malformed: not a hex string");
  EXPECT_EQ(why("{\"torch\": \"\"}"), "RNG record 'torch' is malformed: not a hex string");
  EXPECT_EQ(why("{\"torch\": \"" + std::string((1u << 20) + 2, 'a') + "\"}"),
            "RNG record 'torch' is malformed: not a hex string");
  EXPECT_EQ(why("{\"cuda\": \"00\"}"), "RNG record 'cuda' is malformed: not a list");
  EXPECT_EQ(why("{\"cuda\": [\"00\", 1]}"), "RNG record 'cuda' is malformed: not hex strings");
  EXPECT_EQ(why("{\"cuda\": [\"00\", \"\"]}"), "RNG record 'cuda' is malformed: not hex strings");
  EXPECT_NE(why("{\"torch\": ").find("RNG record"), std::string::npos);  // not JSON
}

// DcpRename: a value under get_state_dict's names.
TEST(DcpRenameTest, ModulePrefixStrippedOptimizerKeyedByNameOtherValuesAsTheyAre) {
  const std::string names =
      "{\"modules\": {\"model\": \"module.\"}, \"optimizers\": {\"optim\": {\"module\": "
      "\"model\", \"params\": [\"fc.weight\", \"fc.bias\", \"__odd\"]}}}";
  auto rename = [&](const std::string& key, const std::string& tree) {
    Result<std::string> r = DcpRename(key, tree, names);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r.value() : "";
  };
  EXPECT_EQ(rename("model", "{\"module.w\": {\"__tensor__\": \"model/module.w\"}, \"b\": 1}"),
            "{\"w\":{\"__tensor__\":\"model/module.w\"},\"b\":1}");
  // A key that becomes "__..." after the prefix goes: written as pairs.
  EXPECT_EQ(rename("model", "{\"module.__x__\": 1, \"module.y\": [2.5]}"),
            "{\"__dict__\":[[\"__x__\",1],[\"y\",[2.5]]]}");
  EXPECT_EQ(rename("model", "{\"__tensor__\": \"model\"}"), "{\"__tensor__\":\"model\"}");
  const std::string opt =
      "{\"state\": {\"__dict__\": [[0, {\"step\": 3}], [2, {\"m\": {\"__tensor__\": \"o/2\"}}]]},"
      " \"param_groups\": [{\"lr\": 0.1, \"params\": [0, 2]}, {\"params\": [1], \"x\": null}]}";
  EXPECT_EQ(rename("optim", opt),
            "{\"state\":{\"__dict__\":[[\"fc.weight\",{\"step\":3}],[\"__odd\",{\"m\":{\"__tensor__"
            "\":\"o/2\"}}]]},\"param_groups\":[{\"lr\":0.1,\"params\":[\"fc.weight\",\"__odd\"]},"
            "{\"params\":[\"fc.bias\"],\"x\":null}]}");
  // Not the optimizer the names were taken from: as it is.
  for (const char* bad : {
           "{\"state\": {}, \"param_groups\": [{\"params\": [0, 1]}]}",
           "{\"state\": {}, \"param_groups\": [{\"params\": [0, 1, 1]}]}",
           "{\"state\": {}, \"param_groups\": [{\"params\": [0, 1, 2.0]}]}",
           "{\"state\": {\"__dict__\": [[3, 1]]}, \"param_groups\": [{\"params\": [0, 1, 2]}]}",
           "{\"state\": {\"a\": 1}, \"param_groups\": [{\"params\": [0, 1, 2]}]}",
           "{\"state\": [], \"param_groups\": [{\"params\": [0, 1, 2]}]}",
           "{\"state\": {}, \"param_groups\": [3]}", "{\"param_groups\": []}"}) {
    EXPECT_EQ(rename("optim", bad), rename("other", bad)) << bad;
    EXPECT_EQ(rename("optim", bad).find("fc."), std::string::npos) << bad;
  }
  EXPECT_EQ(rename("optim", "{\"state\": {}, \"param_groups\": [{\"params\": [2, 0, 1]}]}"),
            "{\"state\":{},\"param_groups\":[{\"params\":[\"__odd\",\"fc.weight\",\"fc.bias\"]}]}");
  EXPECT_EQ(rename("other", "[1, \"\\u00e9\\n\", {\"a\": true}]"), "[1,\"\u00e9\\u000a\",{\"a\":true}]");
  EXPECT_EQ(DcpRename("model", "{}", "[1]").status().code(), StatusCode::kCorruption);
  EXPECT_EQ(DcpRename("model", "{", names).status().code(), StatusCode::kCorruption);
}

// DcpLayout: which values of a multi-rank job are global, which each rank's.
TEST(DcpLayoutTest, GlobalValuesOnceRankLocalOnesPerRankAModuleSplitByEntry) {
  auto show = [](const Result<std::vector<DcpValue>>& got) {
    EXPECT_TRUE(got.ok()) << got.status().ToString();
    std::string s;
    for (const DcpValue& v : got.value()) {
      s += v.key + "@" + std::to_string(v.rank) + (v.zero ? "z" : "");
      if (!v.whole) {
        s += "(";
        for (const std::string& e : v.entries) s += e + ",";
        s += ")";
      }
      s += " ";
    }
    return s;
  };
  const std::string r0 =
      "{\"model\": {\"w\": {\"__tensor__\": \"model/w\"}, \"bn\": {\"__tensor__\": \"model/bn\"}},"
      " \"opt\": {\"state\": {\"__dict__\": [[0, {\"__tensor__\": \"opt/0\"}]]}},"
      " \"local\": [{\"__ndarray__\": \"local/0\"}], \"zero\": {}, \"step\": 3}";
  const std::string r1 =
      "{\"model\": {\"w\": {\"__tensor__\": \"model/w\"}, \"bn\": {\"__tensor__\": \"model/bn\"},"
      " \"extra\": 1}, \"opt\": {}, \"local\": [], \"zero\": {}, \"step\": 3}";
  const std::vector<std::string> shared = {"model/w", "opt/0"};
  const std::string mods = "{\"modules\": {\"model\": \"module.\"}}";
  const std::string zero = "{\"zero\": {\"zero\": {}}}";
  // model: "w" global, "bn" each rank's (rank 1 also its own "extra");
  // opt refers only to shared tensors; local is rank-local whole.
  EXPECT_EQ(show(DcpLayout({r0, r1}, shared, mods, zero)),
            "model@-1(w,) model@0(bn,) model@1(bn,extra,) opt@-1 local@0 local@1 zero@-1z "
            "step@-1 ");
  // Not a module: a value holding a rank-local tensor is each rank's whole.
  EXPECT_EQ(show(DcpLayout({r0, r1}, shared, "null", "{\"zero\": [\"zero\"]}")),
            "model@0 model@1 opt@-1 local@0 local@1 zero@-1 step@-1 ");
  // One rank: everything global, ZeRO too (its one shard is the whole state).
  EXPECT_EQ(show(DcpLayout({r0}, {}, mods, zero)),
            "model@-1 opt@-1 local@-1 zero@-1 step@-1 ");
  EXPECT_EQ(show(DcpLayout({}, {}, "null", "{}")), "");
  EXPECT_EQ(DcpLayout({"[1]"}, {}, "null", "{}").status().message(),
            "the state tree of rank 0 is not an object");
  EXPECT_EQ(DcpLayout({"{}", "{"}, {}, "null", "{}").status().code(), StatusCode::kCorruption);
  // The names checked first; a "dist" of another form holds no ZeRO keys.
  EXPECT_EQ(DcpLayout({r0, r1}, shared, "{\"modules\": [1]}", "{}").status().message(),
            "checkpoint metadata 'names' is malformed: 'modules' is not a map of names to "
            "prefixes");
  EXPECT_EQ(show(DcpLayout({r0, r1}, shared, "{}", "[1]")),
            "model@0 model@1 opt@-1 local@0 local@1 zero@-1 step@-1 ");
  EXPECT_EQ(DcpLayout({r0}, {}, "{}", "{").status().code(), StatusCode::kCorruption);
}

TEST(ExportNamesTest, GlobsOverTheNamesKeepThemStripAndNoneMatchingIsAnError) {
  const std::vector<std::string> names = {"model/fc.weight", "model/fc.bias", "optim/state/0/m",
                                          "rank-1/x"};
  auto r = ExportNames(names, {}, "--include", "", "w");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 4u);
  r = ExportNames(names, {"model/*", "*/0/*"}, "--include", "model/", "w");  // '*' matches '/'
  ASSERT_TRUE(r.ok());
  const std::vector<std::pair<std::string, size_t>> want = {
      {"fc.weight", 0}, {"fc.bias", 1}, {"optim/state/0/m", 2}};
  EXPECT_EQ(r.value(), want);
  r = ExportNames(names, {"model"}, "include=['model']", "", "step 3 of d");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "no tensor of step 3 of d matches include=['model'] (globs over the stored names, "
            "e.g. 'model/*'; `nonstop inspect` lists them)");
}

}  // namespace
}  // namespace nonstop
