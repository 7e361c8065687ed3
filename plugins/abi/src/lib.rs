//! k3-plugin-abi: repr(C) types shared by the runner and plugins.
