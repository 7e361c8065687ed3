use super::*;

/// Arguments of `k3-run plan`: everything a run takes (a run config, a preset, budgets, the
/// trunk; merged by the same layering), and what to print.
#[derive(Args, Debug)]
pub struct PlanCli {
    /// Context length to plan the decode state for (default: the run's --max-context, else
    /// 4096).
    #[arg(long)]
    pub positions: Option<usize>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub run: RunArgs,
}

/// `plan`: the layered run arguments are in `p.run` (see [`super::layering::layer_run`]).
pub(crate) fn plan_main(p: &PlanCli) -> Result<u8, Failure> {
    let a = &p.run;
    let model_dir = a.model_dir.as_deref().ok_or_else(|| {
        Failure::usage(
            "plan needs a checkpoint directory: MODEL_DIR, a run config's `model`, or K3RUN_MODEL",
        )
    })?;
    let (spec, _files) = run_spec_files(a, model_dir)?;
    let positions = p.positions.or(a.max_context).unwrap_or(4096);
    let plan = Plan::new(&spec, positions);
    let contexts =
        crate::session::preset_contexts(&plan).map_err(|e| Failure::usage(e.to_string()))?;
    let split_lines = plan_split_lines(a, &spec)?;
    let trunk_plan = match &a.mem.trunk {
        Some(dir) => Some(plan_packed_trunk(a, dir, &spec)?),
        None => None,
    };
    if p.json {
        let mut v = serde_json::to_value(&plan).map_err(|e| Failure::usage(e.to_string()))?;
        v["preset_contexts"] =
            serde_json::to_value(&contexts).map_err(|e| Failure::usage(e.to_string()))?;
        if let Some((t, m)) = &trunk_plan {
            v["trunk_plan"] = serde_json::to_value(t).map_err(|e| Failure::usage(e.to_string()))?;
            if let Some(c) = &m.compression {
                v["trunk_compression"] =
                    serde_json::to_value(c).map_err(|e| Failure::usage(e.to_string()))?;
            }
        }
        if a.pipe.hosts.is_some() || a.pipe.host_gb.is_some() {
            let hosts = a
                .pipe
                .host_gb
                .as_ref()
                .map_or(a.pipe.hosts.unwrap_or(1), Vec::len);
            v["pipeline_split"] = serde_json::to_value(pipeline_split(a, &spec, hosts)?)
                .map_err(|e| Failure::usage(e.to_string()))?;
        }
        let s = serde_json::to_string_pretty(&v).map_err(|e| Failure::usage(e.to_string()))?;
        println!("{s}");
    } else {
        print!("{plan}");
        for l in crate::session::preset_context_lines(&plan, &contexts) {
            println!("{l}");
        }
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
        for l in &split_lines {
            println!("{l}");
        }
    }
    Ok(exit::OK)
}

/// `plan --trunk DIR`: the trunk memory plan at the merged trunk budget (`--trunk-gb`, a run
/// config's, or the preset's), and the packed trunk's manifest.
pub(crate) fn plan_packed_trunk(
    a: &RunArgs,
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
    let gb = a.mem.trunk_gb.ok_or_else(|| {
        Failure::usage("plan --trunk needs a budget: --trunk-gb GB or --preset NAME")
    })?;
    let budget =
        crate::stream::gb_to_bytes(gb, "--trunk-gb").map_err(|e| Failure::usage(e.to_string()))?;
    let m = crate::stream::pack::TrunkManifest::load(dir, spec)
        .map_err(|e| Failure::usage(e.to_string()))?;
    let plan = crate::stream::plan::plan_trunk(&m.layer_sizes(), budget, a.mem.trunk_ring)
        .map_err(|e| Failure::usage(e.to_string()))?;
    Ok((plan, m))
}
