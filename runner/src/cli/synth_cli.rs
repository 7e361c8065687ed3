use super::*;

/// Arguments of `k3-run synth`.
#[derive(Clone, Debug, clap::Args)]
pub struct SynthCli {
    /// Synth spec TOML (see configs/synth/*.toml).
    #[arg(long)]
    pub spec: PathBuf,
    /// Seed of every random tensor; same seed + spec = same bytes.
    #[arg(long)]
    pub seed: u64,
    /// Output checkpoint directory (must not exist, or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Model manifest the checkpoint must satisfy (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl From<SynthCli> for crate::synth::SynthArgs {
    fn from(s: SynthCli) -> Self {
        crate::synth::SynthArgs {
            spec: s.spec,
            seed: s.seed,
            out: s.out,
            manifest: s.manifest,
            quiet: s.quiet,
        }
    }
}
