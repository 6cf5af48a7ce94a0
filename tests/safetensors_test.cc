// tests: safetensors reading, writing, sharded checkpoints, and rejection of malformed files.
#include "core/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

// A tensor whose bytes are a recognisable pattern (byte i == seed + i mod 251), any dtype.
Tensor pattern_tensor(Shape shape, DType dtype, int seed) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  auto* bytes = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<unsigned char>((seed + i) % 251);
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// The raw bytes of a safetensors file: u64 LE length of `header`, `header`, then `data_size`
// bytes of data.
std::string raw_safetensors(const std::string& header, size_t data_size) {
  std::string bytes;
  for (int i = 0; i < 8; ++i)
    bytes += static_cast<char>((uint64_t{header.size()} >> (8 * i)) & 255);
  bytes += header;
  for (size_t i = 0; i < data_size; ++i) bytes += static_cast<char>(i & 255);
  return bytes;
}

// Runs `body`, which must throw infinigen::Error, and returns the message.
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected infinigen::Error, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected infinigen::Error, nothing was thrown";
  return {};
}

// Every Error is one line that contains all of `parts`.
void expect_message(const std::string& message, std::initializer_list<std::string> parts) {
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = (fs::temp_directory_path() / (std::string("infinigen-safetensors-") +
                                         std::to_string(::getpid()) + "-" + info->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Writes a crafted file into the test directory and returns its path.
  std::string craft(const std::string& header, size_t data_size,
                    const std::string& name = "model.safetensors") {
    const std::string p = path(name);
    write_file(p, raw_safetensors(header, data_size));
    return p;
  }

  std::string open_error(const std::string& p) {
    return error_of([&] { SafetensorsFile::open(p); });
  }

  // The open error of a crafted file holding one F32 tensor 'w' whose shape and data_offsets are
  // the JSON texts `shape` and `offsets`, then `data_size` bytes.
  std::string f32_w_error(const std::string& shape, const std::string& offsets, size_t data_size) {
    return open_error(craft(
        R"({"w": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": )" + offsets + "}}",
        data_size));
  }

  std::string dir_;
};

std::vector<std::pair<std::string, Tensor>> mixed_tensors() {
  return {
      {"w.f32", pattern_tensor({2, 3}, DType::F32, 1)},
      {"w.f16", pattern_tensor({5}, DType::F16, 2)},  // 10 bytes: later tensors are unaligned
      {"w.bf16", pattern_tensor({3, 1}, DType::BF16, 3)},
      {"step", pattern_tensor({}, DType::I64, 4)},  // 0-d scalar
      {"empty", pattern_tensor({0, 4}, DType::F32, 5)},
      {"ids", pattern_tensor({4}, DType::I32, 6)},
      {"big.i64", pattern_tensor({3, 2}, DType::I64, 7)},
  };
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeScalarAndEmptyTensor) {
  const auto tensors = mixed_tensors();
  const std::string p = path("model.safetensors");
  write_safetensors(p, tensors);
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  const auto file = SafetensorsFile::open(p);
  ASSERT_EQ(file->entries().size(), tensors.size());
  for (size_t i = 1; i < file->entries().size(); ++i) {
    EXPECT_LT(file->entries()[i - 1].name, file->entries()[i].name);
  }
  for (const auto& [name, t] : tensors) {
    const SafetensorsEntry* e = file->find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(e->dtype, t.dtype()) << name;
    EXPECT_EQ(e->shape, t.shape()) << name;
    EXPECT_EQ(e->nbytes, t.nbytes()) << name;
    if (t.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(file->bytes(*e), t.raw(), t.nbytes()), 0) << name;
    }
  }
  EXPECT_EQ(file->find("absent"), nullptr);
  EXPECT_TRUE(file->metadata().empty());

  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir_);
  EXPECT_EQ(ckpt.names().size(), tensors.size());
  size_t total = 0;
  for (const auto& [name, t] : tensors) {
    EXPECT_TRUE(ckpt.contains(name));
    EXPECT_TRUE(same_bytes(ckpt.load(name), t)) << name;
    EXPECT_EQ(ckpt.file_of(name).path(), p);
    total += t.nbytes();
  }
  EXPECT_EQ(ckpt.total_bytes(), total);
  EXPECT_EQ(ckpt.load("step").rank(), 0);
  EXPECT_EQ(ckpt.load("empty").numel(), 0);
}

TEST_F(SafetensorsTest, WriterPadsHeaderAndPacksDataInRecordOrder) {
  const auto tensors = mixed_tensors();
  const std::string p = path("model.safetensors");
  write_safetensors(p, tensors);
  const std::string bytes = read_file(p);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.find_last_of('}') + 1);
  const nlohmann::json json = nlohmann::json::parse(header);
  // Offsets tile the data buffer with no gaps, in record order (the reference readers' rule).
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const auto& offsets = json.at(name).at("data_offsets");
    EXPECT_EQ(offsets[0].get<uint64_t>(), offset) << name;
    offset += t.nbytes();
    EXPECT_EQ(offsets[1].get<uint64_t>(), offset) << name;
    EXPECT_EQ(json.at(name).at("dtype").get<std::string>(), dtype_name(t.dtype()));
  }
  EXPECT_EQ(bytes.size(), 8 + n + offset);
}

TEST_F(SafetensorsTest, RoundTripsMetadata) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"note", "a \"quoted\" value"}};
  write_safetensors(path("model.safetensors"), {{"x", pattern_tensor({2}, DType::F32, 0)}},
                    metadata);
  EXPECT_EQ(SafetensorsFile::open(path("model.safetensors"))->metadata(), metadata);
  EXPECT_EQ(SafetensorsCheckpoint::open(dir_).metadata(), metadata);
}

TEST_F(SafetensorsTest, WritesAndReadsShards) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (int i = 0; i < 6; ++i) {
    tensors.emplace_back("layer" + std::to_string(i) + ".weight",
                         pattern_tensor({4, 4}, DType::F32, i));  // 64 bytes each
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  write_sharded_safetensors(dir_, tensors, 150, metadata);

  for (const char* name : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors"}) {
    EXPECT_TRUE(fs::exists(path(name))) << name;
  }
  EXPECT_FALSE(fs::exists(path("model.safetensors")));
  const nlohmann::json index =
      nlohmann::json::parse(read_file(path("model.safetensors.index.json")));
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), 6u * 64u);
  EXPECT_EQ(index.at("weight_map").size(), 6u);
  EXPECT_EQ(index.at("weight_map").at("layer0.weight"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(index.at("weight_map").at("layer3.weight"), "model-00002-of-00003.safetensors");
  EXPECT_EQ(index.at("weight_map").at("layer5.weight"), "model-00003-of-00003.safetensors");

  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir_);
  EXPECT_EQ(ckpt.directory(), dir_);
  EXPECT_EQ(ckpt.names().size(), 6u);
  EXPECT_EQ(ckpt.total_bytes(), 6u * 64u);
  EXPECT_EQ(ckpt.metadata(), metadata);
  for (const auto& [name, t] : tensors) EXPECT_TRUE(same_bytes(ckpt.load(name), t)) << name;
  EXPECT_NE(ckpt.file_of("layer5.weight").path().find("model-00003-of-00003"), std::string::npos);
  EXPECT_EQ(ckpt.entry("layer2.weight").shape, (Shape{4, 4}));
}

TEST_F(SafetensorsTest, OneShardIsAPlainFileAndReplacesAStaleIndex) {
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"a", pattern_tensor({8}, DType::F16, 1)}, {"b", pattern_tensor({3}, DType::BF16, 2)}};
  write_sharded_safetensors(dir_, tensors, 150);
  write_sharded_safetensors(dir_, tensors, 1 << 20);
  EXPECT_TRUE(fs::exists(path("model.safetensors")));
  EXPECT_FALSE(fs::exists(path("model.safetensors.index.json")));
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir_);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
  for (const auto& [name, t] : tensors) EXPECT_TRUE(same_bytes(ckpt.load(name), t)) << name;
}

TEST_F(SafetensorsTest, WriterEnforcesRecordOrderSizesAndCompleteness) {
  const std::string p = path("w.safetensors");
  const std::vector<float> a(4, 1.0f), b(2, 2.0f);
  {
    SafetensorsWriter writer(p, {{"a", DType::F32, {4}}, {"b", DType::F32, {2}}});
    EXPECT_TRUE(fs::exists(p + ".tmp"));
    expect_message(error_of([&] { writer.write("b", b.data(), 8); }), {p, "'b'", "'a'"});
    expect_message(error_of([&] { writer.write("a", a.data(), 12); }), {p, "'a'", "12", "16"});
    writer.write("a", a.data(), 16);
    expect_message(error_of([&] { writer.finish(); }), {p, "'b'", "missing"});
  }
  // Destroyed without finish: nothing is left behind.
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  EXPECT_FALSE(fs::exists(p));

  SafetensorsWriter writer(p, {{"a", DType::F32, {4}}, {"b", DType::F32, {2}}}, {{"k", "v"}});
  writer.write("a", a.data(), 16);
  writer.write("b", b.data(), 8);
  expect_message(error_of([&] { writer.write("c", b.data(), 8); }), {p, "'c'"});
  writer.finish();
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  const auto file = SafetensorsFile::open(p);
  EXPECT_EQ(file->metadata().at("k"), "v");
  float out[2];
  std::memcpy(out, file->bytes(*file->find("b")), sizeof out);
  EXPECT_EQ(out[1], 2.0f);
}

TEST_F(SafetensorsTest, WriterRejectsBadRecordsAndUnwritablePaths) {
  expect_message(
      error_of([&] {
        SafetensorsWriter(path("x.safetensors"), {{"a", DType::F32, {1}}, {"a", DType::F32, {1}}});
      }),
      {"x.safetensors", "'a'", "twice"});
  expect_message(error_of([&] {
                   SafetensorsWriter(path("x.safetensors"), {{"a", DType::F32, {-1}}});
                 }),
                 {"x.safetensors", "'a'", "shape"});
  expect_message(error_of([&] {
                   SafetensorsWriter(path("x.safetensors"), {{"bad\xff", DType::F32, {1}}});
                 }),
                 {"x.safetensors", "UTF-8"});
  const std::string missing = path("no/such/dir/model.safetensors");
  expect_message(error_of([&] { write_safetensors(missing, {}); }),
                 {missing, "No such file or directory"});
  EXPECT_TRUE(fs::is_empty(dir_));
}

// --- Malformed single files ----------------------------------------------------------------------

TEST_F(SafetensorsTest, RejectsMissingEmptyShortAndDirectoryPaths) {
  expect_message(open_error(path("absent.safetensors")),
                 {path("absent.safetensors"), "no such file"});
  write_file(path("empty.safetensors"), "");
  expect_message(open_error(path("empty.safetensors")), {path("empty.safetensors"), "empty"});
  write_file(path("short.safetensors"), "abcde");
  expect_message(open_error(path("short.safetensors")),
                 {path("short.safetensors"), "5 bytes", "shorter than"});
  fs::create_directory(path("dir.safetensors"));
  expect_message(open_error(path("dir.safetensors")), {path("dir.safetensors"), "directory"});
}

TEST_F(SafetensorsTest, RejectsSpecialFiles) {
  ASSERT_EQ(::mkfifo(path("fifo.safetensors").c_str(), 0600), 0);
  expect_message(open_error(path("fifo.safetensors")),
                 {path("fifo.safetensors"), "not a regular file"});
}

TEST_F(SafetensorsTest, RejectsUnreadableFile) {
  if (::geteuid() == 0) GTEST_SKIP() << "permissions do not apply to root";
  const std::string p = craft("{}", 0);
  ASSERT_EQ(::chmod(p.c_str(), 0), 0);
  expect_message(open_error(p), {p, "cannot open", "Permission denied"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthBeyondFile) {
  std::string bytes = raw_safetensors("{}", 110);  // 120 bytes in all
  const uint64_t n = 999999;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 255);
  write_file(path("model.safetensors"), bytes);
  expect_message(
      open_error(path("model.safetensors")),
      {path("model.safetensors") + ": header length 999999 exceeds the file size (120 bytes)"});
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(0xff);
  write_file(path("model.safetensors"), bytes);
  expect_message(open_error(path("model.safetensors")),
                 {path("model.safetensors"), "header length"});
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotJsonOrNotAnObject) {
  expect_message(open_error(craft("{\"a\": [1, 2", 0)), {"model.safetensors", "not valid JSON"});
  expect_message(open_error(craft("", 0)), {"model.safetensors", "not valid JSON"});
  expect_message(open_error(craft("[1, 2]", 0)), {"model.safetensors", "not a JSON object"});
  expect_message(open_error(craft("\"text\"", 0)), {"model.safetensors", "not a JSON object"});
}

// The JSON library would keep the second entry of a name given twice: the tensor the checkpoint
// meant is lost and the run fails later far from the cause.
TEST_F(SafetensorsTest, RejectsATensorNamedTwice) {
  const std::string p = craft(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                              R"( "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                              8);
  expect_message(open_error(p), {p + ": header names 'w' twice"});
  const std::string index = path("model.safetensors.index.json");
  write_file(index, R"({"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}})");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }), {index, "'a' twice"});
}

TEST_F(SafetensorsTest, RejectsMalformedMetadata) {
  expect_message(open_error(craft(R"({"__metadata__": [1]})", 0)),
                 {"model.safetensors", "__metadata__", "object"});
  expect_message(open_error(craft(R"({"__metadata__": {"k": 3}})", 0)),
                 {"model.safetensors", "__metadata__", "'k'", "not a string"});
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  const std::string p = craft(R"({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", 4);
  expect_message(
      open_error(p),
      {p + ": tensor 'x' has unsupported dtype 'U8' (supported: F32, F16, BF16, I32, I64)"});
  expect_message(
      open_error(craft(R"({"x": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}})", 4)),
      {"'x'", "'F8_E4M3'"});
  expect_message(open_error(craft(R"({"x": {"shape": [4], "data_offsets": [0, 4]}})", 4)),
                 {"'x'", "dtype"});
}

TEST_F(SafetensorsTest, RejectsBadShapes) {
  expect_message(f32_w_error("[-1, 4]", "[0, 16]", 16),
                 {"model.safetensors", "tensor 'w'", "negative", "-1"});
  for (const char* not_a_shape : {"[1.5]", "4"}) {
    expect_message(f32_w_error(not_a_shape, "[0, 4]", 4), {"tensor 'w'", "shape"});
  }
  // numel * 4 overflows 64 bits; a zero extent after huge ones must not slip through either.
  for (const char* huge :
       {"[4611686018427387904, 8]", "[4294967296, 4294967296, 0]", "[18446744073709551615]"}) {
    expect_message(f32_w_error(huge, "[0, 0]", 0), {"tensor 'w'", "large"});
  }
}

TEST_F(SafetensorsTest, RejectsBadDataOffsets) {
  expect_message(
      f32_w_error("[4, 4]", "[0, 64]", 32),
      {"model.safetensors", "tensor 'w'", "data_offsets [0, 64]", "past the end", "32 bytes"});
  expect_message(f32_w_error("[4]", "[16, 0]", 32), {"tensor 'w'", "data_offsets [16, 0]"});
  for (const char* malformed : {"[0]", "[-4, 12]"}) {
    expect_message(f32_w_error("[4]", malformed, 32), {"tensor 'w'", "data_offsets"});
  }
  const std::string p =
      craft(R"({"a.weight": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 64]}})", 64);
  expect_message(open_error(p), {p + ": tensor 'a.weight' data_offsets [0, 64] do not match its "
                                     "shape (4, 4) of F16 (32 bytes)"});
}

TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  const std::string p = craft(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                              24);
  expect_message(open_error(p), {p + ": tensors 'a' and 'b' overlap"});
  // Identical ranges overlap too; an empty tensor inside another's range owns no bytes.
  const std::string same = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "b": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})";
  expect_message(open_error(craft(same, 8)), {"'a'", "'b'", "overlap"});
  EXPECT_NO_THROW(
      SafetensorsFile::open(craft(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
                                  8)));
}

TEST_F(SafetensorsTest, RejectsTruncatedDataSection) {
  const std::string p = path("model.safetensors");
  write_safetensors(p, {{"first", pattern_tensor({4}, DType::F32, 0)},
                        {"last", pattern_tensor({4}, DType::F32, 1)}});
  fs::resize_file(p, fs::file_size(p) - 3);
  expect_message(open_error(p), {p, "tensor 'last'", "past the end", "truncated"});
}

TEST_F(SafetensorsTest, KeepsMessagesOnOneLineWhateverTheNames) {
  expect_message(
      open_error(craft(
          "{\"evil\\nname\": {\"dtype\": \"U8\", \"shape\": [], \"data_offsets\": [0, 1]}}", 1)),
      {"evil\\x0aname", "U8"});
  expect_message(open_error(craft("{\"a\":\n\n\n\n}", 0)), {"not valid JSON"});
}

// --- Checkpoint directories ----------------------------------------------------------------------

TEST_F(SafetensorsTest, CheckpointRejectsMissingEmptyAndNonDirectories) {
  expect_message(error_of([&] { SafetensorsCheckpoint::open(path("nope")); }),
                 {path("nope") + ": no such directory"});
  write_file(path("file"), "x");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(path("file")); }),
                 {path("file") + ": not a directory"});
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }),
                 {dir_ + ": no model.safetensors or model.safetensors.index.json"});
}

TEST_F(SafetensorsTest, CheckpointReportsAbsentTensor) {
  write_safetensors(path("model.safetensors"), {{"a", pattern_tensor({1}, DType::F32, 0)}});
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir_);
  EXPECT_FALSE(ckpt.contains("zzz"));
  expect_message(error_of([&] { ckpt.load("zzz"); }), {dir_ + ": no tensor 'zzz'"});
  expect_message(error_of([&] { ckpt.entry("zzz"); }), {dir_ + ": no tensor 'zzz'"});
}

TEST_F(SafetensorsTest, CheckpointRejectsBadIndex) {
  const std::string index = path("model.safetensors.index.json");
  write_file(index, "{\"weight_map\": ");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }), {index, "not valid JSON"});
  write_file(index, "[]");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }),
                 {index, "not a JSON object"});
  write_file(index, R"({"metadata": {}})");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }), {index, "weight_map"});
  write_file(index, R"({"weight_map": {"a": 3}})");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }), {index, "'a'"});
}

TEST_F(SafetensorsTest, CheckpointRejectsIndexNamingMissingShard) {
  write_file(path("model.safetensors.index.json"),
             R"({"weight_map": {"a": "model-00001-of-00002.safetensors"}})");
  expect_message(
      error_of([&] { SafetensorsCheckpoint::open(dir_); }),
      {path("model-00001-of-00002.safetensors"), "no such file", "model.safetensors.index.json"});
}

TEST_F(SafetensorsTest, CheckpointRejectsTensorAbsentFromItsShard) {
  write_safetensors(path("shard.safetensors"), {{"a", pattern_tensor({1}, DType::F32, 0)}});
  write_file(path("model.safetensors.index.json"),
             R"({"weight_map": {"a": "shard.safetensors", "ghost": "shard.safetensors"}})");
  expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }),
                 {"model.safetensors.index.json", "tensor 'ghost'", "'shard.safetensors'"});
}

TEST_F(SafetensorsTest, CheckpointRejectsShardNamesOutsideTheDirectory) {
  for (const char* shard : {"../evil.safetensors", "sub/x.safetensors", "/etc/passwd", ".."}) {
    write_file(path("model.safetensors.index.json"),
               nlohmann::json{{"weight_map", {{"w", shard}}}}.dump());
    expect_message(error_of([&] { SafetensorsCheckpoint::open(dir_); }),
                   {"model.safetensors.index.json", "tensor 'w'", shard});
  }
}

TEST_F(SafetensorsTest, CheckpointIgnoresShardTensorsMissingFromTheIndex) {
  write_safetensors(path("s1.safetensors"), {{"a", pattern_tensor({2}, DType::F32, 0)},
                                             {"extra", pattern_tensor({2}, DType::F32, 1)}});
  write_safetensors(path("s2.safetensors"), {{"b", pattern_tensor({3}, DType::F16, 2)}});
  write_file(path("model.safetensors.index.json"),
             R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir_);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(ckpt.contains("extra"));
  EXPECT_EQ(ckpt.total_bytes(), 8u + 6u);
  EXPECT_TRUE(same_bytes(ckpt.load("b"), pattern_tensor({3}, DType::F16, 2)));
}

// --- Robustness ----------------------------------------------------------------------------------

// Seeded mutations of a valid file: open must succeed or throw Error, never anything else, and a
// file that opens must have every tensor's bytes readable.
TEST_F(SafetensorsTest, SurvivesRandomMutations) {
  const std::string original_path = path("original.safetensors");
  write_safetensors(original_path,
                    {{"a", pattern_tensor({2, 3}, DType::F32, 1)},
                     {"b", pattern_tensor({5}, DType::F16, 2)},
                     {"c", pattern_tensor({}, DType::I64, 3)},
                     {"d", pattern_tensor({0}, DType::BF16, 4)}},
                    {{"format", "pt"}});
  const std::string original = read_file(original_path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | static_cast<unsigned char>(original[i]);
  ASSERT_LE(8 + header_len, original.size());

  // Bytes that keep the header JSON-like often enough to reach the semantic checks.
  static constexpr char kInteresting[] = "0123456789-[]{},:\". eE\\";
  std::mt19937_64 rng(20240601);
  const std::string p = path("mutant.safetensors");
  int opened = 0, rejected = 0;
  for (int iteration = 0; iteration < 2000; ++iteration) {
    std::string bytes = original;
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0 || kind == 3) {  // flip bytes in the header region
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips; ++f) {
        const size_t at = 8 + rng() % header_len;
        bytes[at] = rng() % 2 ? kInteresting[rng() % (sizeof kInteresting - 1)]
                              : static_cast<char>(rng() & 255);
      }
    }
    if (kind == 1 || kind == 3) bytes.resize(rng() % bytes.size());  // truncate
    if (kind == 2) {  // overwrite the length prefix, near the truth or anywhere
      const uint64_t n = rng() % 2 ? header_len + (rng() % 64) - 32 : rng() >> (rng() % 64);
      for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 255);
    }
    // A fresh file each time: rewriting in place makes ext4 flush the data on every close.
    fs::remove(p);
    write_file(p, bytes);
    try {
      const auto file = SafetensorsFile::open(p);
      ++opened;
      for (const SafetensorsEntry& e : file->entries()) {
        std::vector<unsigned char> copy(e.nbytes);
        if (e.nbytes > 0) std::memcpy(copy.data(), file->bytes(e), e.nbytes);
      }
    } catch (const Error& e) {
      ++rejected;
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(p, 0), 0u) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iteration << ": non-Error exception: " << e.what();
    }
  }
  EXPECT_EQ(opened + rejected, 2000);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace infinigen
