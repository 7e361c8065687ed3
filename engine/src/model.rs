//! The model a directory holds: its manifest and config.json bound into a [`ModelSpec`].
//!
//! Owns: choosing the manifest (the built-in Kimi K3 one, or a file), reading config.json and
//! the storage-only `A_log` padding rule. Must not: read tensor data.

use std::path::Path;

use k3_models::spec::{ModelSpec, TensorRole};

use crate::checkpoint::Checkpoint;

/// The built-in manifest for Kimi K3 and every synthetic K3-family checkpoint.
pub const KIMI_K3_MANIFEST: &str = include_str!("../../configs/models/kimi-k3.toml");

/// The released Kimi K3's config.json (the published key set; the models crate's tests read
/// the same file): the widths `k3-run doctor` plans the context for when no checkpoint
/// directory with a config.json is named.
pub const KIMI_K3_RELEASE_CONFIG: &str =
    include_str!("../../models/tests/data/kimi-k3-config.json");

/// The released Kimi K3's spec: the built-in manifest bound to [`KIMI_K3_RELEASE_CONFIG`].
pub fn release_spec() -> Result<ModelSpec, SpecError> {
    k3_models::load_spec_from_str(
        KIMI_K3_MANIFEST,
        "<built-in configs/models/kimi-k3.toml>",
        KIMI_K3_RELEASE_CONFIG,
        "<built-in models/tests/data/kimi-k3-config.json>",
    )
    .map_err(|e| SpecError(e.to_string()))
}

/// The model's manifest or config.json cannot be read or does not describe a model the
/// manifest accepts; the message names the file and the key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

/// Load and validate the model spec (manifest + config.json).
pub fn load_spec(
    model_dir: &Path,
    manifest: Option<&Path>,
    config: Option<&Path>,
) -> Result<ModelSpec, SpecError> {
    load_spec_files(model_dir, manifest, config).map(|(spec, _)| spec)
}

/// [`load_spec`], and the checkpoint's files when they opened (headers parsed, shards
/// mapped, no model check yet): a run takes them instead of opening again.
pub fn load_spec_files(
    model_dir: &Path,
    manifest: Option<&Path>,
    config: Option<&Path>,
) -> Result<(ModelSpec, Option<Checkpoint>), SpecError> {
    let config = config
        .map(Path::to_path_buf)
        .unwrap_or_else(|| model_dir.join("config.json"));
    // The files first: the index's text is held while it is parsed (59 MB at the release's
    // 497,056 tensors), and the spec's declarations (81 MB there) are not yet beside it.
    let files = Checkpoint::open_unchecked(model_dir).ok();
    let spec = match manifest {
        Some(m) => k3_models::load_spec(m, &config),
        None => {
            let text = k3_models::load::read_regular_file(&config).map_err(|e| {
                SpecError(format!(
                    "cannot read model config {}: {e}",
                    config.display()
                ))
            })?;
            k3_models::load_spec_from_str(
                KIMI_K3_MANIFEST,
                "<built-in configs/models/kimi-k3.toml>",
                &text,
                &config.display().to_string(),
            )
        }
    };
    let spec = spec.map_err(|e| SpecError(e.to_string()))?;
    Ok((adopt_stored_a_log_len(spec, files.as_ref()), files))
}

/// `A_log` padding is storage-only (one entry per KDA head, then zeros, checked at open), and
/// the manifest's length rule is what the released checkpoint uses. A checkpoint that pads to
/// another length (every layer's `A_log` the same length, same layout, at least one entry per
/// head) is the same model: bind its stored length. Anything else is left to the checkpoint's
/// shape check, which names the tensor. No checkpoint in `model_dir` (e.g. `plan --config`)
/// leaves the spec as it is.
fn adopt_stored_a_log_len(spec: ModelSpec, files: Option<&Checkpoint>) -> ModelSpec {
    let Some((rule_len, heads)) = spec.kda.as_ref().map(|k| (k.a_log_len, k.n_heads)) else {
        return spec;
    };
    let Some(ck) = files else {
        return spec;
    };
    let mut stored = None;
    for d in spec
        .tensors
        .iter()
        .filter(|d| d.role == TensorRole::KdaALog)
    {
        let Some((_, shape)) = ck.info(&d.name) else {
            return spec;
        };
        // the declared layout with one free dimension: `[n]` or `[1, 1, n, 1]`
        let at = if d.shape.len() == 4 { 2 } else { 0 };
        let same_layout = shape.len() == d.shape.len()
            && shape
                .iter()
                .zip(&d.shape)
                .enumerate()
                .all(|(i, (s, want))| i == at || s == want);
        if !same_layout || stored.is_some_and(|n| n != shape[at]) {
            return spec;
        }
        stored = Some(shape[at]);
    }
    match stored {
        Some(n) if n != rule_len && n >= heads => spec.with_stored_a_log_len(n).unwrap_or(spec),
        _ => spec,
    }
}
