use super::*;

#[derive(Args, Debug)]
pub struct PackCli {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Output directory for trunk.bin + trunk.json (with --check: the packed trunk to check).
    pub trunk_dir: PathBuf,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Store the layers compressed, losslessly (byte planes; the bf16 sign/exponent bytes as
    /// 4-bit codes): ~25% fewer bytes read per pass over the trunk, decoded in place by the
    /// reader threads back to the same bytes, at no extra memory (docs/STREAMING.md,
    /// "Compressed trunk").
    #[arg(long)]
    pub compress: bool,
    /// With --compress: raw KiB per record (a multiple of 4; default 512). Smaller chunks
    /// only cost a little more index; for testing several records per layer on small models.
    #[arg(long, value_name = "KIB", requires = "compress")]
    pub chunk_kib: Option<u64>,
    /// Do not pack: read the packed trunk in TRUNK_DIR as a run reads it (compressed records
    /// decoded) and compare every tensor with the checkpoint's bytes. Exit 0 when all equal,
    /// 1 naming the layers and tensors that differ (pack again), 5 on Ctrl-C.
    #[arg(long, conflicts_with_all = ["compress", "chunk_kib"])]
    pub check: bool,
}

pub(crate) fn pack_main(p: &PackCli) -> Result<u8, Failure> {
    let chunk = match p.chunk_kib {
        None => crate::stream::compress::CHUNK_BYTES,
        Some(k) => k
            .checked_mul(1024)
            .filter(|&b| b > 0 && b.is_multiple_of(4096))
            .ok_or_else(|| {
                Failure::usage(format!(
                    "--chunk-kib {k}: must be a positive multiple of 4 (KiB) that fits in 64 bits"
                ))
            })?,
    };
    let spec = load_spec(&p.model_dir, p.manifest.as_deref(), None)?;
    if p.check {
        return check_main(p, &spec);
    }
    let r = crate::stream::pack::run(
        &p.model_dir,
        &spec,
        &p.trunk_dir,
        p.compress.then_some(chunk),
    )
    .map_err(stream_failure)?;
    println!("{}", r.summary());
    Ok(exit::OK)
}

/// `k3-run pack-trunk --check`: every layer of the packed trunk against the checkpoint.
pub(crate) fn check_main(p: &PackCli, spec: &k3_models::spec::ModelSpec) -> Result<u8, Failure> {
    use std::io::IsTerminal;
    if !p.trunk_dir.is_dir() {
        return Err(Failure::usage(format!(
            "--check: no packed trunk directory {}",
            p.trunk_dir.display()
        )));
    }
    let stop = ctrl_c_flag(130);
    eprintln!(
        "pack-trunk --check: every layer of {} against {}",
        p.trunk_dir.display(),
        p.model_dir.display()
    );
    let r = crate::stream::check::check_trunk(
        &p.model_dir,
        spec,
        &p.trunk_dir,
        &stop,
        std::io::stderr().is_terminal(),
    )
    .map_err(stream_failure)?;
    let rate = r.bytes_checked as f64 / 1e6 / r.seconds.max(1e-9);
    let what = format!(
        "{} of {} layers{}, {} tensors, {:.2} GB read and compared in {:.1} s ({rate:.0} MB/s)",
        r.layers_checked,
        r.layers,
        if r.compressed {
            " (compressed records decoded)"
        } else {
            ""
        },
        r.tensors_checked,
        r.bytes_checked as f64 / 1e9,
        r.seconds
    );
    for line in &r.problems {
        println!("FAIL   : {line}");
    }
    if r.n_problems > r.problems.len() {
        println!(
            "FAIL   : ... and {} more (only the first {} are named)",
            r.n_problems - r.problems.len(),
            r.problems.len()
        );
    }
    if r.interrupted {
        println!("check  : {what}");
        println!("RESULT : INCOMPLETE: stopped by Ctrl-C");
        return Ok(exit::INTERRUPTED);
    }
    if r.n_problems == 0 {
        println!("check  : {what}: every tensor equals the checkpoint's bytes");
        println!("RESULT : the packed trunk matches the checkpoint");
        return Ok(exit::OK);
    }
    let layers: Vec<String> = r.bad_layers.iter().map(ToString::to_string).collect();
    println!("check  : {what}");
    println!(
        "RESULT : FAIL: layer{} {} {} from the checkpoint: pack again with `k3-run \
         pack-trunk {} {}`",
        if layers.len() == 1 { "" } else { "s" },
        layers.join(", "),
        if layers.len() == 1 {
            "differs"
        } else {
            "differ"
        },
        p.model_dir.display(),
        p.trunk_dir.display()
    );
    Ok(crate::verify::MISMATCH)
}
