//! Run configs: one TOML file that names a model manifest, a memory preset and an I/O policy
//! (`k3-run MODEL_DIR --config configs/laptop.toml ...`). A new deployment is a new file.
//!
//! Owns: the run-config schema (strict: `deny_unknown_fields`, `schema_version = 1`) and its
//! layering with figment (the file, then `K3RUN_` environment variables, e.g.
//! `K3RUN_THREADS=4`); explicit command-line flags override both (see `cli.rs`).
//! Must not: decide budgets itself (presets do) or touch weights.
//!
//! Paths inside a run config are relative to the file's directory.

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};

/// The schema version this build reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A run config file.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub schema_version: u32,
    pub name: String,
    /// Model manifest (TOML), relative to this file.
    pub manifest: PathBuf,
    /// Memory preset: a built-in name or a preset TOML path relative to this file; absent =
    /// no budgets (resident experts; with --trunk, the whole trunk pinned).
    #[serde(default)]
    pub preset: Option<String>,
    /// I/O policy: `direct`, `mmap` or a policy TOML path relative to this file.
    pub io: String,
    /// Worker threads (default: physical cores).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Ring slots for streamed trunk layers.
    #[serde(default)]
    pub trunk_ring: Option<usize>,
    /// One line describing what the config is for.
    #[serde(default)]
    pub note: String,
}

/// A run-config problem, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("run config {path}: {msg}")]
pub struct RunConfigError {
    pub path: String,
    pub msg: String,
}

impl RunConfig {
    /// Load and validate a run config; relative paths are resolved against its directory.
    pub fn load(path: &Path) -> Result<RunConfig, RunConfigError> {
        let err = |msg: String| RunConfigError {
            path: path.display().to_string(),
            msg,
        };
        let mut rc: RunConfig = Figment::new()
            .merge(Toml::file_exact(path))
            .merge(Env::prefixed("K3RUN_").only(&["threads", "trunk_ring"]))
            .extract()
            .map_err(|e| err(e.to_string()))?;
        if rc.schema_version != SCHEMA_VERSION {
            return Err(err(format!(
                "schema_version = {} but this build reads {SCHEMA_VERSION}",
                rc.schema_version
            )));
        }
        let base = path.parent().unwrap_or(Path::new("."));
        rc.manifest = base.join(&rc.manifest);
        let resolve = |v: &str| -> String {
            if v.ends_with(".toml") {
                base.join(v).display().to_string()
            } else {
                v.to_string()
            }
        };
        rc.preset = rc.preset.as_deref().map(resolve);
        rc.io = resolve(&rc.io);
        if !rc.manifest.is_file() {
            return Err(err(format!(
                "manifest {} does not exist",
                rc.manifest.display()
            )));
        }
        Ok(rc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write test file");
        p
    }

    #[test]
    fn loads_and_resolves_relative_paths() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(d.path().join("models")).expect("mkdir");
        write(&d.path().join("models"), "m.toml", "schema_version = 1\n");
        let p = write(
            d.path(),
            "laptop.toml",
            "schema_version = 1\nname = \"laptop\"\nmanifest = \"models/m.toml\"\npreset = \"laptop\"\nio = \"io/direct.toml\"\n",
        );
        let rc = RunConfig::load(&p).expect("valid run config");
        assert_eq!(rc.manifest, d.path().join("models/m.toml"));
        assert_eq!(rc.preset.as_deref(), Some("laptop"));
        assert_eq!(rc.io, d.path().join("io/direct.toml").display().to_string());
    }

    #[test]
    fn unknown_field_and_version_are_errors_naming_the_file() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = write(
            d.path(),
            "bad.toml",
            "schema_version = 1\nname = \"x\"\nmanifest = \"m.toml\"\npreset = \"laptop\"\nio = \"direct\"\ntrunk_gbb = 3\n",
        );
        let e = RunConfig::load(&p).expect_err("unknown field");
        assert!(e.to_string().contains("trunk_gbb"), "{e}");
        assert!(e.to_string().contains("bad.toml"), "{e}");
        let p = write(
            d.path(),
            "v2.toml",
            "schema_version = 2\nname = \"x\"\nmanifest = \"m.toml\"\npreset = \"laptop\"\nio = \"direct\"\n",
        );
        let e = RunConfig::load(&p).expect_err("wrong version");
        assert!(e.to_string().contains("schema_version"), "{e}");
    }
}
