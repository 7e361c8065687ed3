//! k3-kernels: the pure numerics of Kimi K3 (see kernels/README or module docs).
