// Causal depthwise conv1d: varlen prefill (conv_fwd) and decode / spec rolling-buffer
// update (conv_update). Included inside the ISA namespace.
// PLACEHOLDER: implemented in the native-kernels work (issue 3).

inline void conv_fwd(const ConvArgs&, const Parallel&) {}
inline void conv_update(const ConvArgs&, const Parallel&) {}
