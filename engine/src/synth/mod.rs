//! `k3-run synth`: write a random checkpoint of any size in exactly the released Kimi K3
//! format, for tests, benchmarks and newcomers.
//!
//! Owns: the synth command end to end: spec file -> config.json (through the models crate's
//! writer) -> [`ModelSpec`] (through the models crate's loader, so the tensor inventory is the
//! one the engine binds) -> shards, index, tokenizer files, written tensor by tensor into a
//! temporary directory that is renamed into place only when complete. Must not: hold a whole
//! model in memory (memory is bounded by ~1 MiB row blocks plus one expert matrix's scale
//! bytes), depend on thread count or platform for its bytes (see [`rng`]), or overwrite an
//! existing non-empty directory.
//!
//! Output directory (same names as the release, `docs/MODEL.md` §0, §3, §6):
//! `config.json`, `generation_config.json`, `model-0000i-of-0000N.safetensors`,
//! `model.safetensors.index.json` (`metadata.total_size` + `weight_map`), `tiktoken.model`,
//! `tokenizer_config.json`, plus `synth_manifest.json` (provenance: seed, spec, layer map,
//! sizes; not part of the release). Shard layout: [`layout`]. Tensor contents and the
//! conditioning: [`fill`]. Tokenizer: [`tokenizer`].

pub mod fill;
pub mod layout;
pub mod mxfp4;
pub mod rng;
pub mod spec;
pub mod tokenizer;

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use k3_models::spec::{AttnKind, ModelSpec, RoleScope};
use k3_models::{ConfigDims, K3Shape};

pub use spec::SynthSpec;

/// What to write: the arguments of `k3-run synth`.
#[derive(Clone, Debug)]
pub struct SynthArgs {
    /// Synth spec TOML (see configs/synth/*.toml).
    pub spec: PathBuf,
    /// Seed of every random tensor; same seed + spec = same bytes.
    pub seed: u64,
    /// Output checkpoint directory (must not exist, or be empty).
    pub out: PathBuf,
    /// Model manifest the checkpoint must satisfy (default: the built-in kimi-k3 manifest).
    pub manifest: Option<PathBuf>,
    /// No progress bar.
    pub quiet: bool,
}

/// What was written.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SynthReport {
    /// Not serialised: `synth_manifest.json` must not depend on where it was written.
    #[serde(skip)]
    pub out: PathBuf,
    pub n_tensors: usize,
    pub n_shards: usize,
    /// Sum of tensor payloads (= index `metadata.total_size`).
    pub total_bytes: u64,
    /// Non-expert tensors of the layers (what the trunk packer packs).
    pub trunk_bytes: u64,
    /// Routed experts (packed + scales).
    pub expert_bytes: u64,
    /// Embedding, lm_head, final norms and output AttnRes.
    pub global_bytes: u64,
}

/// Bytes of a model's tensors by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Sizes {
    /// Non-expert tensors of the layers (what the trunk packer packs).
    pub trunk_bytes: u64,
    /// Routed experts (packed + scales).
    pub expert_bytes: u64,
    /// Embedding, lm_head, final norm, output AttnRes.
    pub global_bytes: u64,
}

/// Sizes of a model's declared tensors (vision stubs excluded).
pub fn sizes(model: &ModelSpec) -> Sizes {
    let mut s = Sizes::default();
    for d in &model.tensors {
        let b = d.n_bytes() as u64;
        match (d.layer, d.role.scope()) {
            (_, RoleScope::Expert) => s.expert_bytes += b,
            (Some(_), _) => s.trunk_bytes += b,
            (None, _) => s.global_bytes += b,
        }
    }
    s
}

/// Why synth failed.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Spec(#[from] spec::SpecError),
    #[error("{}: model spec from the synth config is invalid: {msg}", file.display())]
    Model { file: PathBuf, msg: String },
    #[error("{}: {what}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{}: output directory exists and is not empty; remove it or choose another --out", out.display())]
    OutExists { out: PathBuf },
    #[error("{}: wrote {written} bytes but the header declares {declared} (bug)", file.display())]
    SizeMismatch {
        file: PathBuf,
        written: u64,
        declared: u64,
    },
}

fn io_at(path: &Path, what: &'static str) -> impl FnOnce(io::Error) -> SynthError + use<> {
    let path = path.to_path_buf();
    move |source| SynthError::Io { path, what, source }
}

/// The kimi-k3 manifest compiled in (`configs/models/kimi-k3.toml`); one manifest serves the
/// release and every K3-family synthetic model (config.json carries the dimensions).
pub const BUILTIN_MANIFEST: &str = include_str!("../../../configs/models/kimi-k3.toml");

/// The config.json dimensions of a synth spec (release values for everything not in it) and
/// token ids matching [`tokenizer`]'s layout.
pub fn config_dims(s: &SynthSpec) -> ConfigDims {
    let shape = K3Shape {
        hidden: s.model.d_model,
        layers: s.model.n_layers,
        block: s.model.attn_res_block,
        kda_heads: s.kda.n_heads,
        kda_head_dim: s.kda.head_dim,
        conv_k: s.kda.conv_kernel,
        mla_heads: s.mla.n_heads,
        q_lora: s.mla.q_lora_rank,
        kv_lora: s.mla.kv_lora_rank,
        qk_nope: s.mla.d_nope,
        qk_rope: s.mla.d_rope,
        v_head: s.mla.d_v,
        experts: s.moe.n_experts,
        topk: s.moe.n_experts_active,
        shared: s.moe.n_shared_experts,
        moe_inter: s.moe.d_expert_ff,
        latent: s.moe.d_latent,
        dense_inter: s.model.dense_ffn,
        first_dense: s.model.first_k_dense,
        vocab: s.model.vocab_size,
    };
    let mut dims = ConfigDims::k3_family(&shape);
    let base = tokenizer::n_ranks(s.model.vocab_size) as u32;
    dims.bos_token_id = Some(base + tokenizer::BOS_OFFSET as u32);
    dims.eos_token_ids = vec![base + tokenizer::EOS_OFFSET as u32];
    dims.pad_token_id = Some(base + tokenizer::PAD_OFFSET as u32);
    dims.media_placeholder_token_id = Some(base + tokenizer::MEDIA_PAD_OFFSET as u32);
    if let Some(moe) = dims.moe.as_mut() {
        moe.routed_scaling_factor = f64::from(s.moe.routed_scaling_factor);
    }
    dims
}

/// config.json text and the validated model it describes.
pub fn config_and_spec(
    s: &SynthSpec,
    manifest: Option<&Path>,
) -> Result<(String, ModelSpec), SynthError> {
    let config = config_dims(s).to_config_json();
    let (mtext, mfile) = match manifest {
        Some(p) => (
            k3_models::load::read_regular_file(p).map_err(io_at(p, "read manifest"))?,
            p.display().to_string(),
        ),
        None => (
            BUILTIN_MANIFEST.to_string(),
            "<built-in configs/models/kimi-k3.toml>".to_string(),
        ),
    };
    let model = k3_models::load_spec_from_str(&mtext, &mfile, &config, "<synth config.json>")
        .map_err(|e| SynthError::Model {
            file: PathBuf::from(mfile),
            msg: e.to_string(),
        })?;
    Ok((config, model))
}

/// Run `k3-run synth`.
pub fn run(args: &SynthArgs) -> Result<SynthReport, SynthError> {
    let synth = SynthSpec::load(&args.spec)?;
    let (config, model) = config_and_spec(&synth, args.manifest.as_deref())?;
    write_checkpoint(&synth, &config, &model, args)
}

/// Remove a partial output on drop unless disarmed.
struct PartialDir {
    path: PathBuf,
    armed: bool,
}

impl Drop for PartialDir {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Sibling temp directory name: hidden, clearly partial, unique per process.
fn partial_dir(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map_or_else(|| "synth".into(), |n| n.to_string_lossy().into_owned());
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
    let tmp = format!(".{name}.synth-partial-{}", std::process::id());
    parent.map_or_else(|| PathBuf::from(&tmp), |p| p.join(&tmp))
}

fn check_out(out: &Path) -> Result<(), SynthError> {
    match fs::read_dir(out) {
        Ok(mut it) => {
            if it.next().is_some() {
                return Err(SynthError::OutExists {
                    out: out.to_path_buf(),
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_at(out, "inspect output directory")(e)),
    }
}

/// Counts bytes written through it.
struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Split the model's tensors (plus vision stubs) into head / layers / tail items.
fn items_of(
    synth: &SynthSpec,
    model: &ModelSpec,
) -> (Vec<fill::Item>, Vec<Vec<fill::Item>>, Vec<fill::Item>) {
    let cond = &synth.conditioning;
    let mut head = Vec::new();
    let mut tail = Vec::new();
    let mut layers: Vec<Vec<fill::Item>> = vec![Vec::new(); model.n_layers];
    for d in &model.tensors {
        let it = fill::item_for(model, cond, d);
        match d.layer {
            Some(l) if l < layers.len() => layers[l].push(it),
            _ if d.role == k3_models::spec::TensorRole::Embed => head.push(it),
            _ => tail.push(it),
        }
    }
    if synth.layout.vision_stubs {
        tail.extend(vision_stubs(model.d_model));
    }
    (head, layers, tail)
}

/// Tiny stand-ins with the released multimodal names (ignored by the engine).
fn vision_stubs(d_model: usize) -> Vec<fill::Item> {
    let vp = 32;
    let stub = |name: &str, shape: Vec<usize>, std: f32, shift: f32| fill::Item {
        name: name.to_string(),
        dtype: k3_models::spec::DType::BF16,
        shape,
        layer: None,
        recipe: fill::Recipe::Normal { std, shift },
    };
    vec![
        stub("mm_projector.proj.0.weight", vec![vp, vp], 0.18, 0.0),
        stub("mm_projector.proj.2.weight", vec![d_model, vp], 0.18, 0.0),
        stub("mm_projector.post_norm.weight", vec![d_model], 0.1, 1.0),
        stub(
            "vision_tower.patch_embed.proj.weight",
            vec![vp, 3, 2, 2],
            0.1,
            0.0,
        ),
    ]
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), SynthError> {
    let mut text = serde_json::to_string_pretty(v).map_err(|e| SynthError::Io {
        path: path.to_path_buf(),
        what: "serialise JSON",
        source: io::Error::other(e),
    })?;
    text.push('\n');
    fs::write(path, text).map_err(io_at(path, "write"))
}

/// Write the checkpoint for an already built config + spec.
pub fn write_checkpoint(
    synth: &SynthSpec,
    config: &str,
    model: &ModelSpec,
    args: &SynthArgs,
) -> Result<SynthReport, SynthError> {
    check_out(&args.out)?;
    let tmp = partial_dir(&args.out);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io_at(&tmp, "remove stale partial output"))?;
    }
    fs::create_dir_all(&tmp).map_err(io_at(&tmp, "create partial output"))?;
    let mut guard = PartialDir {
        path: tmp.clone(),
        armed: true,
    };

    let (head, layers, tail) = items_of(synth, model);
    let mut report = SynthReport {
        out: args.out.clone(),
        n_tensors: 0,
        n_shards: 0,
        total_bytes: 0,
        trunk_bytes: 0,
        expert_bytes: 0,
        global_bytes: 0,
    };
    let sz = sizes(model);
    report.trunk_bytes = sz.trunk_bytes;
    report.expert_bytes = sz.expert_bytes;
    report.global_bytes = sz.global_bytes;
    let plan = layout::plan_shards(head, layers, tail, synth.layout.shards);
    let total: u64 = plan
        .iter()
        .flat_map(|s| s.items.iter())
        .map(fill::Item::n_bytes)
        .sum();
    let bar = progress_bar(total, args.quiet);
    let mut writer = fill::Writer::new(args.seed);
    let mut weight_map = serde_json::Map::new();
    for shard in &plan {
        let path = tmp.join(&shard.file_name);
        let file = File::create(&path).map_err(io_at(&path, "create shard"))?;
        let mut out = Counting {
            inner: BufWriter::with_capacity(8 << 20, file),
            n: 0,
        };
        let header = layout::header_bytes(&shard.items);
        out.write_all(&header)
            .map_err(io_at(&path, "write shard header"))?;
        for it in &shard.items {
            writer
                .write(it, &mut out)
                .map_err(io_at(&path, "write tensor"))?;
            bar.inc(it.n_bytes());
            weight_map.insert(
                it.name.clone(),
                serde_json::Value::String(shard.file_name.clone()),
            );
        }
        out.flush().map_err(io_at(&path, "flush shard"))?;
        let declared =
            header.len() as u64 + shard.items.iter().map(fill::Item::n_bytes).sum::<u64>();
        if out.n != declared {
            return Err(SynthError::SizeMismatch {
                file: path,
                written: out.n,
                declared,
            });
        }
        report.n_tensors += shard.items.len();
    }
    bar.finish_and_clear();
    report.n_shards = plan.len();
    report.total_bytes = total;

    write_json(
        &tmp.join(crate::checkpoint::INDEX_FILE),
        &serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
    )?;
    let cfg_path = tmp.join("config.json");
    fs::write(&cfg_path, config).map_err(io_at(&cfg_path, "write"))?;
    let base = tokenizer::n_ranks(model.vocab_size);
    write_json(
        &tmp.join("generation_config.json"),
        &serde_json::json!({
            "bos_token_id": base + tokenizer::BOS_OFFSET,
            "eos_token_id": base + tokenizer::EOS_OFFSET,
        }),
    )?;
    let tk = tmp.join("tiktoken.model");
    fs::write(&tk, tokenizer::tiktoken_model(model.vocab_size)).map_err(io_at(&tk, "write"))?;
    write_json(
        &tmp.join("tokenizer_config.json"),
        &tokenizer::tokenizer_config(base),
    )?;
    write_json(
        &tmp.join("synth_manifest.json"),
        &serde_json::json!({
            "generator": "k3-run synth",
            "seed": args.seed,
            // the spec's file name only: the manifest must not depend on where the repository lives
            "spec_file": args.spec.file_name().map_or_else(
                || args.spec.display().to_string(),
                |n| n.to_string_lossy().into_owned()
            ),
            "spec": synth,
            "kda_layers_0based": model.layers.iter().filter(|l| l.attn == AttnKind::Kda).map(|l| l.index).collect::<Vec<_>>(),
            "mla_layers_0based": model.layers.iter().filter(|l| l.attn == AttnKind::Mla).map(|l| l.index).collect::<Vec<_>>(),
            "attn_res_snapshots": (0..synth.model.n_layers)
                .filter(|l| l % synth.model.attn_res_block == 0)
                .collect::<Vec<_>>(),
            "report": &report,
        }),
    )?;

    // Complete: move into place. An interrupted run leaves only the hidden partial directory.
    if args.out.is_dir() {
        fs::remove_dir(&args.out).map_err(io_at(&args.out, "replace empty output directory"))?;
    }
    fs::rename(&tmp, &args.out).map_err(io_at(&args.out, "rename partial output into place"))?;
    guard.armed = false;
    Ok(report)
}

fn progress_bar(total: u64, quiet: bool) -> indicatif::ProgressBar {
    if quiet || total < (64 << 20) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "synth {bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar
}
