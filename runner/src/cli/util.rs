use super::*;

/// Write a file via a temporary name and rename, so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp-k3run");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// A flag the first Ctrl-C (SIGINT) sets, for work that stops at its next step; a second
/// Ctrl-C, with the flag already set, exits at once with `second_exit`. For the rest of the
/// process.
pub(crate) fn ctrl_c_flag(second_exit: i32) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let _ = signal_hook::flag::register_conditional_shutdown(
        signal_hook::consts::SIGINT,
        second_exit,
        Arc::clone(&flag),
    );
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&flag));
    flag
}
