use super::*;

#[derive(Args, Debug)]
pub struct PlanCli {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// The model's config.json (JSON; default MODEL_DIR/config.json). Not a run config
    /// (.toml): plan takes a run config's manifest with --manifest.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Context length to plan the KV cache for.
    #[arg(long, default_value_t = 4096)]
    pub positions: usize,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also plan this packed trunk (pack-trunk's output) at `--trunk-gb` or a preset's trunk
    /// budget: pinned layers, ring slots or shared ring, layers read ahead. Nothing is read
    /// but trunk.json.
    #[arg(long)]
    pub trunk: Option<PathBuf>,
    /// Trunk budget in GB for `--trunk` (fractions allowed; wins over `--preset`).
    #[arg(long, requires = "trunk")]
    pub trunk_gb: Option<f64>,
    /// A preset whose trunk budget to plan `--trunk` at.
    #[arg(long, requires = "trunk")]
    pub preset: Option<String>,
    /// Ring slots asked for (default 2; the budget wins).
    #[arg(long, requires = "trunk", default_value_t = 2)]
    pub trunk_ring: usize,
}

pub(crate) fn plan_main(p: &PlanCli) -> Result<u8, Failure> {
    if let Some(c) = &p.config {
        check_plan_config(c)?;
    }
    let spec = load_spec(&p.model_dir, p.manifest.as_deref(), p.config.as_deref())?;
    let plan = Plan::new(&spec, p.positions);
    let trunk_plan = match &p.trunk {
        Some(dir) => Some(plan_packed_trunk(p, dir, &spec)?),
        None => None,
    };
    if p.json {
        let mut v = serde_json::to_value(&plan).map_err(|e| Failure::usage(e.to_string()))?;
        if let Some((t, m)) = &trunk_plan {
            v["trunk_plan"] = serde_json::to_value(t).map_err(|e| Failure::usage(e.to_string()))?;
            if let Some(c) = &m.compression {
                v["trunk_compression"] =
                    serde_json::to_value(c).map_err(|e| Failure::usage(e.to_string()))?;
            }
        }
        let s = serde_json::to_string_pretty(&v).map_err(|e| Failure::usage(e.to_string()))?;
        println!("{s}");
    } else {
        print!("{plan}");
        if let Some((t, m)) = &trunk_plan {
            for l in t.report_lines() {
                println!("{l}");
            }
            if let Some(c) = &m.compression {
                println!(
                    "compressed trunk ({}): a pass over the streamed layers reads {:.1}% of \
                     their bytes ({} of records for {} of layers), decoded in place",
                    c.codec,
                    100.0 * c.stored_bytes as f64 / m.packed_bytes.max(1) as f64,
                    crate::stream::fmt_bytes(c.stored_bytes),
                    crate::stream::fmt_bytes(m.packed_bytes)
                );
            }
        }
    }
    Ok(exit::OK)
}

/// `plan --trunk DIR`: the trunk memory plan at `--trunk-gb` (or the preset's budget), and
/// the packed trunk's manifest.
pub(crate) fn plan_packed_trunk(
    p: &PlanCli,
    dir: &Path,
    spec: &ModelSpec,
) -> Result<
    (
        crate::stream::plan::TrunkPlan,
        crate::stream::pack::TrunkManifest,
    ),
    Failure,
> {
    check_trunk_dir(dir)?;
    let gb = match (p.trunk_gb, &p.preset) {
        (Some(g), _) => g,
        (None, Some(name)) => {
            crate::stream::presets::load_preset(name)
                .map_err(|e| Failure::usage(e.to_string()))?
                .trunk_gb
        }
        (None, None) => {
            return Err(Failure::usage(
                "plan --trunk needs a budget: --trunk-gb GB or --preset NAME",
            ));
        }
    };
    let budget =
        crate::stream::gb_to_bytes(gb, "--trunk-gb").map_err(|e| Failure::usage(e.to_string()))?;
    let m = crate::stream::pack::TrunkManifest::load(dir, spec)
        .map_err(|e| Failure::usage(e.to_string()))?;
    let plan = crate::stream::plan::plan_trunk(&m.layer_sizes(), budget, p.trunk_ring)
        .map_err(|e| Failure::usage(e.to_string()))?;
    Ok((plan, m))
}
