// Data-dependent checks of a batch, run by every handler before its kernel writes
// anything. A failure is reported through the op's status output (code, row, value, aux)
// and nothing is written, so a donated cache survives a bad batch. The codes are decoded
// into messages by gdn_jax/_checks.py (keep the two lists in step).
#pragma once
#include <cstdint>

namespace gdn {

enum StatusCode : int32_t {
  kOk = 0,
  kQslStart = 1,        // query_start_loc[0] != 0                       value = qsl[0]
  kQslDecreasing = 2,   // query_start_loc[row+1] < query_start_loc[row]  value = qsl[row+1]
  kQslPastEnd = 3,      // query_start_loc[S] > T                         value = qsl[S], aux = T
  kSlotRange = 4,       // slot outside [0, N) and not -1                 value = slot, aux = column
  kSlotTwice = 5,       // one slot named by two rows                     value = slot, aux = other row
  kAcceptedRange = 6,   // num_accepted_tokens outside [1, max]           value = acc, aux = max
  kRowTooLong = 7,      // row has more tokens than its path allows       value = tokens, aux = max
  kSlotTwiceInRow = 8,  // one slot in two used columns of one spec row   value = slot, aux = row
  kCopyDstRange = 9,    // copy_slots: dst outside [0, N) and not -1        value = slot, aux = N
  kCopySrcRange = 10,   // copy_slots: src of a live row outside [0, N)     value = slot, aux = N
  // Step-level checks (check_step_batch; gdn_jax/batch.py's batch_status on other backends):
  kRowKind = 16,        // row_kind unknown or not taken by the step       value = kind, aux = allowed bits
  kPadMismatch = 17,    // padding row with a slot, or live row without     value = kind, aux = column-0 slot
  kDecodeLen = 18,      // decode row without exactly 1 token              value = tokens
  kAccNotSpec = 19,     // num_accepted_tokens != 1 on a non-spec row        value = acc, aux = kind
};

// Row kinds of the serving steps' metadata (gdn_jax/batch.py).
enum RowKind : int32_t { kRowPad = 0, kRowPrefill = 1, kRowDecode = 2, kRowSpec = 3 };

struct Status {
  int32_t code = kOk, row = 0, value = 0, aux = 0;
  bool ok() const { return code == kOk; }
};

// qsl[0] == 0, non-decreasing, qsl[S] <= T.
Status check_query_start_loc(const int32_t* qsl, int64_t S, int64_t T);

// One slot per row (prefill, decode): each in [0, N) or -1; no slot named twice.
Status check_slots(const int32_t* idx, int64_t S, int64_t N);

// Rows that read a window starting at num_accepted-1 and take up to max_tokens tokens
// (spec conv buffer: max_tokens = L - W + 2; spec SSM: max_tokens = index_cols).
// Rows whose idx[row, 0] is -1 are padding and not checked further. For the SSM the used
// columns [0, max(q, acc)) must hold slots in [0, N), and no slot may be used twice in the
// whole batch; pass index_cols = 1 for the conv buffer (only column 0 is a slot).
Status check_spec_rows(const int32_t* qsl, const int32_t* idx, int64_t index_cols,
                       const int32_t* num_accepted, int64_t S, int64_t N, int64_t max_tokens,
                       int64_t max_accepted);

// A whole serving step's metadata, as gdn_jax.batch.batch_status checks it and with the same
// answer: query_start_loc first; then the first row failing, in this order, its kind (one of
// allowed_bits), padding iff column-0 slot is -1, num_accepted_tokens (spec: [1, C]; others
// 1), decode length 1, spec length <= C, the used columns' slots in [0, N) (column 0; spec:
// [0, max(q, acc))); then no slot used twice (by two rows or two columns of one). idx is [S, C].
Status check_step_batch(const int32_t* qsl, const int32_t* idx, int64_t C, const int32_t* row_kind,
                        const int32_t* num_accepted, int64_t S, int64_t T, int64_t N, int32_t allowed_bits);

}  // namespace gdn
