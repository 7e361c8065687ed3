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
}

pub(crate) fn sim_main(p: &SimCli) -> Result<u8, Failure> {
    let recs =
        crate::stream::trace::read_trace(&p.trace).map_err(|e| Failure::usage(e.to_string()))?;
    print!(
        "{}",
        crate::stream::trace::sim_table(&recs, &p.capacities, p.expert_bytes)
    );
    Ok(exit::OK)
}
