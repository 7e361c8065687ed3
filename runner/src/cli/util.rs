use super::*;

/// One line to stderr in a single write(2). `eprintln!` writes each piece of its format
/// separately (stderr is unbuffered), so under `mpirun`, which merges the ranks' stderr, a
/// line could be cut by another rank's output or cut short when the job is ended; one write
/// of less than a pipe buffer (4 KB) arrives whole.
pub(crate) fn stderr_line(line: &str) {
    use std::io::Write;
    let mut b = String::with_capacity(line.len() + 1);
    b.push_str(line);
    b.push('\n');
    let _ = std::io::stderr().lock().write_all(b.as_bytes());
}

/// `eprintln!` as one write (see [`stderr_line`]).
macro_rules! say {
    ($($t:tt)*) => {
        $crate::cli::util::stderr_line(&format!($($t)*))
    };
}
pub(crate) use say;

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
