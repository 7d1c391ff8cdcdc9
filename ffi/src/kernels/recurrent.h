// Gated delta rule token recurrence with fused gating: decode and spec verify.
// Included inside the ISA namespace.
// PLACEHOLDER: implemented in the native-kernels work (issue 3).

inline void recurrent(const RecurrentArgs&, const Parallel&) {}
