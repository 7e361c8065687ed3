//! k3-models: model descriptions.
//!
//! Owns: the TOML manifest schema, the strict HF `config.json` importer, and validation of both
//! into a typed [`spec::ModelSpec`]. Must not: touch tensor data, memory budgets or I/O policy.

pub mod spec;
