//! k3-models: model descriptions.
//!
//! Owns: the TOML manifest schema, the strict HF `config.json` importer, and validation of both
//! into a typed [`spec::ModelSpec`]. Must not: touch tensor data, memory budgets or I/O policy.
//!
//! Entry points: [`load::load_spec`] (manifest file + config.json file -> `ModelSpec`, every
//! problem reported at once as [`error::SpecErrors`]); [`hf_config::ConfigDims`] and its
//! `to_config_json` writer for synthetic checkpoints.

pub mod error;
pub mod hf_config;
pub mod inventory;
pub mod load;
pub mod manifest;
pub mod spec;

pub use error::{ErrorKind, SpecError, SpecErrors};
pub use hf_config::{ConfigDims, K3Shape};
pub use load::{load_spec, load_spec_from_str};
pub use spec::ModelSpec;
