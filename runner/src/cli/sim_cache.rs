use super::*;

#[derive(Args, Debug)]
pub struct SimCli {
    /// expert_trace.bin written by --dump-cache-trace.
    pub trace: PathBuf,
    /// Capacities to simulate, in experts (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,16,32,64,128,256,512,1024"
    )]
    pub capacities: Vec<usize>,
    /// Bytes of one expert (to print capacities in GB).
    #[arg(long)]
    pub expert_bytes: Option<u64>,
    /// Also replay the trace through this cache-policy plugin (repeatable): its hit rate and
    /// the share of the LRU-to-Belady gap it closes. A bare name is looked for in the current
    /// directory, configs/plugins and next to k3-run.
    #[arg(long = "plugin", value_name = "PLUGIN")]
    pub plugins: Vec<PathBuf>,
    /// KEY=VALUE for the plugins' create (repeatable; `trace=` is set to TRACE).
    #[arg(long = "plugin-opt", value_name = "KEY=VALUE")]
    pub plugin_opts: Vec<String>,
}

pub(crate) fn sim_main(p: &SimCli) -> Result<u8, Failure> {
    let recs =
        crate::stream::trace::read_trace(&p.trace).map_err(|e| Failure::usage(e.to_string()))?;
    if !p.plugins.is_empty() {
        return super::plugins_cmd::sim_with_plugins(p, &recs);
    }
    print!(
        "{}",
        crate::stream::trace::sim_table(&recs, &p.capacities, p.expert_bytes)
    );
    Ok(exit::OK)
}
