// apps/infinigen: `infinigen eval --task passkey`: passkey retrieval (bench/passkey.h) for every
// setting of the sweep, as a table per setting (lengths by depths), eval.csv, eval.json and a
// heat map per setting (tools/plot_eval.py).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "apps/infinigen/eval_common.h"
#include "bench/passkey.h"

namespace infinigen::cli {

struct EvalPasskeyOptions {
  PasskeyOptions task;
  std::string filler;         // a text file; empty: the bundled filler
  std::string template_path;  // a JSON template; empty: the built-in strings
};

// Registers the passkey flags (--lengths, --depths, --trials, --key-kind, --seed, --filler,
// --passkey-template); returns them, for refusing them with another task. `o` must outlive `app`.
std::vector<const CLI::Option*> add_passkey_flags(CLI::App& app, EvalPasskeyOptions& o);

int eval_passkey(const EvalCommonOptions& common, const EvalPasskeyOptions& o);

}  // namespace infinigen::cli
