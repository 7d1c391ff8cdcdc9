// Chunked (WY, chunk 64) gated delta rule prefill over varlen sequences.
// Included inside the ISA namespace.
// PLACEHOLDER: implemented in the native-kernels work (issue 3).

inline void chunk(const ChunkArgs&, const Parallel&) {}
