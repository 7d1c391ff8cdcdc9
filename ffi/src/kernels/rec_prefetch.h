// What one column block of the recurrent kernel prefetches beside its passes (kernels/recurrent.h,
// recurrent_impl; ffi/README.md, Recurrent decode / spec, "Prefetch" and "Head-ahead"). Offsets
// are in elements from the start of the item's head in its start slot; a row's HV heads follow
// one another in the slot, so the next head starts at K * V. No ISA dependency: tests/cpp walks an
// item's blocks as recurrent_impl does and checks the targets (the head-ahead shares tile the next
// head's row pairs once).
// Included inside a namespace, as the kernels are (recurrent.h: the ISA's; the core tests: their
// own), so that a kernel_ab build's two revisions never share one definition; needs <cstdint>.
#pragma once

struct RecPrefetch {
  int64_t pf = -1;     // the block the passes prefetch (row stride pf_ld); -1: none
  int64_t pf_ld = 0;
  int64_t pf2 = -1;    // a second block, row stride V (a range's first head, head-ahead); -1: none
};

// Block [col, col + w) of a K x V head; bw: the full block width (block: the narrow one), c1: the
// item's last column + 1. next_head: the next item is this row's next head; head_fetched: the
// previous item was this row's previous head. ahead (a bf16 decode row, narrow blocks): a full
// block b prefetches the b-th K x block share of the next head in address order (row stride
// block), so that head is whole in L2 when its item starts; a head no item fetched also prefetches
// its own next block. Otherwise: this head's next block, else the next head's first block.
inline RecPrefetch rec_prefetch_targets(bool ahead, int64_t K, int64_t V, int64_t block, int64_t col, int64_t w,
                                        int64_t bw, int64_t c1, bool next_head, bool head_fetched) {
  RecPrefetch r;
  r.pf_ld = V;
  if (ahead) {
    if (next_head && w == block) {
      r.pf = K * V + (col / block) * K * block;
      r.pf_ld = block;
    }
    if (!head_fetched && col + bw < c1) r.pf2 = col + bw;
  } else if (col + bw < c1) {
    r.pf = col + bw;
  } else if (next_head) {
    r.pf = K * V;
  }
  return r;
}
