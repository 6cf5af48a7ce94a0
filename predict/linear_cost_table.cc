// predict: looking up and checking the linear cost table.
#include "predict/linear_cost_table.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace infinigen {
namespace {

// Where `x` falls on an increasing axis: value = (1 - weight) * at[lo] + weight * at[hi],
// clamped to the axis' ends.
struct Bracket {
  size_t lo = 0, hi = 0;
  double weight = 0;
};

// `scale` maps an axis value to the space interpolated in (identity for rows, log for K).
template <typename Scale>
Bracket bracket(const std::vector<int64_t>& axis, int64_t value, Scale scale) {
  if (value <= axis.front()) return {0, 0, 0};
  if (value >= axis.back()) return {axis.size() - 1, axis.size() - 1, 0};
  const auto above = std::upper_bound(axis.begin(), axis.end(), value);
  const size_t hi = static_cast<size_t>(above - axis.begin());
  const size_t lo = hi - 1;
  const double x0 = scale(axis[lo]), x1 = scale(axis[hi]);
  return {lo, hi, (scale(value) - x0) / (x1 - x0)};
}

double blend(const Bracket& b, double at_lo, double at_hi) {
  return (1 - b.weight) * at_lo + b.weight * at_hi;
}

// Bilinear in `value(k index, rows index)` between the bracketing cells.
template <typename Value>
double bilinear(const Bracket& k, const Bracket& r, Value value) {
  return blend(k, blend(r, value(k.lo, r.lo), value(k.lo, r.hi)),
               blend(r, value(k.hi, r.lo), value(k.hi, r.hi)));
}

void check_axis(const std::vector<int64_t>& axis, const char* key, const std::string& source) {
  INFINIGEN_CHECK(!axis.empty(), source, ": field 'linear_table.", key, "' must not be empty");
  INFINIGEN_CHECK(axis.front() >= 1, source, ": field 'linear_table.", key,
                  "' must hold positive values, got ", axis.front());
  for (size_t i = 1; i < axis.size(); ++i) {
    INFINIGEN_CHECK(axis[i] > axis[i - 1], source, ": field 'linear_table.", key,
                    "' must be increasing, got ", axis[i - 1], " then ", axis[i]);
  }
}

void check_cells(const std::vector<std::vector<double>>& cells, const LinearCostTable& table,
                 const std::string& where, bool zero_allowed, const std::string& source) {
  bool shape_ok = cells.size() == table.k.size();
  for (const std::vector<double>& row : cells)
    shape_ok = shape_ok && row.size() == table.rows.size();
  INFINIGEN_CHECK(shape_ok, source, ": field '", where, "' must be ", table.k.size(),
                  " lists (one per k) of ", table.rows.size(), " numbers (one per rows)");
  for (const std::vector<double>& row : cells) {
    for (double v : row) {
      const bool ok = std::isfinite(v) && (zero_allowed ? v >= 0 : v > 0);
      INFINIGEN_CHECK(ok, source, ": field '", where, "' must hold numbers ",
                      zero_allowed ? ">= 0" : "> 0", ", got ", v);
    }
  }
}

}  // namespace

double LinearCostTable::seconds(int64_t M, int64_t N, int64_t K, double weight_bytes, bool cached,
                                double gemm_flops) const {
  const Bracket kb = bracket(k, K, [](int64_t v) { return std::log(static_cast<double>(v)); });
  const Bracket rb = bracket(rows, M, [](int64_t v) { return static_cast<double>(v); });
  const LinearCostGrid& g = cached ? cache : memory;
  const double fixed = bilinear(kb, rb, [&](size_t i, size_t j) { return g.fixed_s[i][j]; });
  const double per_byte =
      bilinear(kb, rb, [&](size_t i, size_t j) { return 1.0 / g.bytes_per_s[i][j]; });
  const double extra_rows = static_cast<double>(std::max<int64_t>(0, M - rows.back()));
  return fixed + weight_bytes * per_byte +
         extra_rows * 2.0 * static_cast<double>(N) * static_cast<double>(K) / gemm_flops;
}

void check_linear_cost_table(const LinearCostTable& table, const std::string& source) {
  check_axis(table.rows, "rows", source);
  INFINIGEN_CHECK(table.rows.front() == 1, source,
                  ": field 'linear_table.rows' must start at 1, got ", table.rows.front());
  check_axis(table.k, "k", source);
  for (const auto& [name, grid] :
       {std::pair<const char*, const LinearCostGrid*>{"memory", &table.memory},
        {"cache", &table.cache}}) {
    const std::string where = cat("linear_table.", name, ".");
    check_cells(grid->fixed_s, table, where + "fixed_s", true, source);
    check_cells(grid->bytes_per_s, table, where + "bytes_per_s", false, source);
  }
}

}  // namespace infinigen
