//! k3-run library: storage, planning, execution.
