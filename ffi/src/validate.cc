#include "validate.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace gdn {
namespace {

Status fail(int32_t code, int64_t row, int64_t value, int64_t aux = 0) {
  Status s;
  s.code = code;
  s.row = int32_t(row);
  s.value = int32_t(value);
  s.aux = int32_t(aux);
  return s;
}

// Sorting (slot, row) pairs costs O(S log S), independent of the pool size N. Two used columns
// of one row naming one slot clash too (the later token's state would replace the earlier's).
Status check_distinct(std::vector<std::pair<int32_t, int32_t>>& used) {
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i)
    if (used[i].first == used[i - 1].first)
      return fail(used[i].second == used[i - 1].second ? kSlotTwiceInRow : kSlotTwice, used[i].second,
                  used[i].first, used[i - 1].second);
  return Status{};
}

}  // namespace

Status check_query_start_loc(const int32_t* qsl, int64_t S, int64_t T) {
  if (qsl[0] != 0) return fail(kQslStart, 0, qsl[0]);
  for (int64_t s = 0; s < S; ++s)
    if (qsl[s + 1] < qsl[s]) return fail(kQslDecreasing, s, qsl[s + 1], qsl[s]);
  if (qsl[S] > T) return fail(kQslPastEnd, S, qsl[S], T);
  return Status{};
}

Status check_slots(const int32_t* idx, int64_t S, int64_t N) {
  std::vector<std::pair<int32_t, int32_t>> used;
  used.reserve(size_t(S));
  for (int64_t s = 0; s < S; ++s) {
    const int32_t slot = idx[s];
    if (slot == -1) continue;
    if (slot < 0 || slot >= N) return fail(kSlotRange, s, slot, 0);
    used.emplace_back(slot, int32_t(s));
  }
  return check_distinct(used);
}

Status check_spec_rows(const int32_t* qsl, const int32_t* idx, int64_t index_cols,
                       const int32_t* num_accepted, int64_t S, int64_t N, int64_t max_tokens,
                       int64_t max_accepted) {
  std::vector<std::pair<int32_t, int32_t>> used;
  used.reserve(size_t(S * index_cols));
  for (int64_t s = 0; s < S; ++s) {
    const int32_t* row = idx + s * index_cols;
    if (row[0] == -1) continue;  // padding row
    const int64_t q = int64_t(qsl[s + 1]) - qsl[s];
    const int32_t acc = num_accepted[s];
    if (acc < 1 || acc > max_accepted) return fail(kAcceptedRange, s, acc, max_accepted);
    if (q > max_tokens) return fail(kRowTooLong, s, q, max_tokens);
    const int64_t cols = index_cols == 1 ? 1 : std::max<int64_t>(q, acc);
    for (int64_t c = 0; c < cols; ++c) {
      if (row[c] < 0 || row[c] >= N) return fail(kSlotRange, s, row[c], c);
      used.emplace_back(row[c], int32_t(s));
    }
  }
  return check_distinct(used);
}

Status check_step_batch(const int32_t* qsl, const int32_t* idx, int64_t C, const int32_t* row_kind,
                        const int32_t* num_accepted, int64_t S, int64_t T, int64_t N, int32_t allowed_bits) {
  const Status q_st = check_query_start_loc(qsl, S, T);
  if (!q_st.ok()) return q_st;
  std::vector<std::pair<int32_t, int32_t>> used;
  used.reserve(size_t(S * C));
  for (int64_t s = 0; s < S; ++s) {
    const int32_t kind = row_kind[s], acc = num_accepted[s];
    const int32_t* row = idx + s * C;
    const int32_t q = qsl[s + 1] - qsl[s];
    const bool known = kind >= kRowPad && kind <= kRowSpec;
    if (!known || !((allowed_bits >> kind) & 1)) return fail(kRowKind, s, kind, allowed_bits);
    const bool pad = kind == kRowPad, spec = kind == kRowSpec;
    if (pad != (row[0] == -1)) return fail(kPadMismatch, s, kind, row[0]);
    if (spec && (acc < 1 || acc > C)) return fail(kAcceptedRange, s, acc, C);
    if (!pad && !spec && acc != 1) return fail(kAccNotSpec, s, acc, kind);
    if (kind == kRowDecode && q != 1) return fail(kDecodeLen, s, q, 0);
    if (spec && q > C) return fail(kRowTooLong, s, q, C);
    if (pad) continue;
    const int64_t cols = spec ? std::min<int64_t>(C, std::max<int64_t>(std::max<int64_t>(q, acc), 1)) : 1;
    for (int64_t c = 0; c < cols; ++c)
      if (row[c] < 0 || row[c] >= N) return fail(kSlotRange, s, row[c], c);
    for (int64_t c = 0; c < cols; ++c) used.emplace_back(row[c], int32_t(s));
  }
  return check_distinct(used);
}

}  // namespace gdn
