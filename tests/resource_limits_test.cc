// tests: runs that meet a limit the plan could not foresee: pinned host memory that cannot be had
// (INFINIGEN_PINNED_LIMIT, as a driver or another process would refuse it), writes that fail
// part way (a file-size limit, which fails writes as a full disk does), and an address-space
// limit. Each ends with one line
// naming what could not be done, and nothing half-written under a final name.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "core/device.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using testing_util::ChildOptions;
using testing_util::expect_one_line_failure;
using testing_util::MeasuredCommand;
using testing_util::run_infinigen_measured;
using testing_util::TempDir;
using testing_util::with_suggestion;

// Every entry of `dir` (names only), to show that nothing was left behind.
std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(ByteSize, ParsesBytesAndBinarySuffixesOnly) {
  EXPECT_EQ(parse_byte_size("268435456"), 268435456u);
  EXPECT_EQ(parse_byte_size("256M"), 256u << 20);
  EXPECT_EQ(parse_byte_size("2G"), size_t{2} << 30);
  EXPECT_EQ(parse_byte_size("64k"), 64u << 10);
  EXPECT_EQ(parse_byte_size("0"), 0u);
  for (const char* bad :
       {"", "M", "1.5G", "-1", "12 M", "1T", "lots", "99999999999999999999", "17179869184G"}) {
    EXPECT_FALSE(parse_byte_size(bad)) << bad;
  }
}

// The KV pool grows block by block while the prompt is stored; past the cap, the run stops with
// what it could not pin and a configuration that fits in what it did pin, which then runs.
TEST(PinnedLimit, AFailedPinNamesItAndSuggestsAPlanThatRuns) {
  const std::vector<std::string> args = {"run", "--batch",  "4",   "--gen-len",
                                         "4",   "--policy", "full"};
  const ChildOptions capped = ChildOptions().with_env("INFINIGEN_PINNED_LIMIT=3M");
  const MeasuredCommand refused = expect_one_line_failure(
      args, capped,
      {"could not pin", "for a KV pool block", "INFINIGEN_PINNED_LIMIT is 3.0 MiB",
       "but only 3.0 MiB could be pinned", "; try --batch "});
  const std::vector<std::string> fixed = with_suggestion(args, refused.err);
  const MeasuredCommand r = run_infinigen_measured(fixed, capped);
  EXPECT_EQ(r.exit_code, 0) << testing_util::command_text(fixed) << "\n" << r.err;
}

TEST(PinnedLimit, WhenNothingCanBePinnedThePolicyThatPinsNothingIsSuggested) {
  const std::vector<std::string> args = {"run", "--batch", "2", "--gen-len", "4"};
  const ChildOptions capped = ChildOptions().with_env("INFINIGEN_PINNED_LIMIT=0");
  const MeasuredCommand refused =
      expect_one_line_failure(args, capped, {"could not pin", "; try --policy gpu"});
  const MeasuredCommand r = run_infinigen_measured(with_suggestion(args, refused.err), capped);
  EXPECT_EQ(r.exit_code, 0) << refused.err << "\n" << r.err;
}

TEST(PinnedLimit, ABadValueIsOneLine) {
  expect_one_line_failure({"run", "--gen-len", "2"},
                          ChildOptions().with_env("INFINIGEN_PINNED_LIMIT=lots"),
                          {"INFINIGEN_PINNED_LIMIT", "'lots'", "256M"});
}

// A checkpoint larger than the file-size limit: the write of the weights fails, and neither the
// output directory nor its staging sibling remains.
// A run whose plan fits runs under an address-space limit (ulimit -v 8G): the planning dry run
// once reserved 1 TiB of address space for its placeholder tensors and aborted with an uncaught
// exception; it now reserves what the limit leaves. (Not under AddressSanitizer, whose shadow
// memory alone needs terabytes of address space.)
TEST(AddressSpace, ARunThatFitsRunsUnderUlimitV) {
#if defined(INFINIGEN_SANITIZED)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than any such limit";
#else
  for (const char* policy : {"infinigen", "full", "gpu"}) {
    const MeasuredCommand r = run_infinigen_measured(
        {"run", "--policy", policy, "--gen-len", "4"},
        ChildOptions().address_space(size_t{8} << 30).timeout(120.0));
    EXPECT_EQ(r.exit_code, 0) << policy << ": " << r.err;
  }
  // One that does not fit in what the limit leaves is refused by the plan, in one line (it ran
  // into std::bad_alloc).
  expect_one_line_failure({"run", "--model", "opt-1.3b", "--gen-len", "2"},
                          ChildOptions().address_space(size_t{1200} << 20).timeout(60.0),
                          {"does not fit", "the host cannot hold the weights"});
#endif
}

TEST(FailedWrites, MakeModelLeavesNoPartialCheckpoint) {
  TempDir dir("write-limit-make-model");
  const fs::path out = dir.path() / "model";
  expect_one_line_failure({"make-model", "--preset", "opt-tiny", "--out", out.string()},
                          ChildOptions().file_limit(64 * 1024), {"model.safetensors", "too large"});
  EXPECT_TRUE(entries(dir.path()).empty()) << entries(dir.path()).front();
}

// bench writes its JSON report, then its CSV: a limit between the two sizes fails the second
// after the first was complete. Each file is whole or absent.
TEST(FailedWrites, BenchLeavesNoPartialReport) {
  TempDir dir("write-limit-bench");
  const fs::path out = dir.path() / "out";
  // Half scale: what is written does not depend on the size, and a prediction replays every
  // decode step of the runtime (about 4x faster than at scale 1, which matters under ASan).
  const std::vector<std::string> args = {"bench",
                                         "--experiment",
                                         "fig14",
                                         "--scale",
                                         "0.5",
                                         "--no-measure",
                                         "--predict",
                                         "rtx-a6000-pcie3",
                                         "--fetched-fraction",
                                         "0.1",
                                         "--no-plot",
                                         "--out",
                                         out.string()};
  const MeasuredCommand full = run_infinigen_measured(args);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  std::vector<std::string> written = entries(out);
  ASSERT_FALSE(written.empty());
  size_t largest = 0;
  for (const std::string& name : written) largest = std::max(largest, fs::file_size(out / name));
  fs::remove_all(out);

  // Progress lines come first; the error is the last line.
  const MeasuredCommand r = run_infinigen_measured(args, ChildOptions().file_limit(largest / 2));
  EXPECT_NE(r.exit_code, 0);
  const size_t last = r.err.rfind('\n', r.err.size() - 2);
  const std::string error = r.err.substr(last == std::string::npos ? 0 : last + 1);
  EXPECT_NE(error.find("infinigen: error: "), std::string::npos) << r.err;
  EXPECT_NE(error.find("cannot write (write: File too large)"), std::string::npos) << r.err;
  if (fs::exists(out)) {
    for (const std::string& name : entries(out)) {
      EXPECT_NE(name.front(), '.') << "staging file left: " << name;
      EXPECT_LE(fs::file_size(out / name), largest / 2) << name;
    }
  }
}

}  // namespace
}  // namespace infinigen
