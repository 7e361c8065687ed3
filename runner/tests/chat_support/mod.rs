//! Shared helpers of the chat integration tests: a small synthetic chat-capable model, the
//! `k3-run` binary, and a hand-written pseudo-terminal driver (libc `openpty`; the child gets
//! the pty as its controlling terminal, so Ctrl-C typed into it raises SIGINT as in a real
//! terminal).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

/// The binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-run")
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Writes the synthetic `odd9` model (9 layers, vocabulary 384: 256 byte ranks, specials from
/// 256, so `<|end_of_msg|>` = 258 and the XTML control ids 259..261 are embeddable) with its
/// tokenizer files into `dir/odd9`. (`tiny.toml` has vocabulary 256, so no special id is
/// embeddable there and it cannot chat.)
pub fn synth_model(dir: &Path) -> PathBuf {
    let out = dir.join("odd9");
    let st = Command::new(bin())
        .args(["synth", "--spec"])
        .arg(repo().join("configs/synth/odd9.toml"))
        .args(["--seed", "1", "--quiet", "--out"])
        .arg(&out)
        .output()
        .expect("run k3-run synth");
    assert!(
        st.status.success(),
        "synth failed: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    assert!(out.join("tiktoken.model").is_file());
    out
}

/// The ids `render-chat` prints for a history (no generation prompt when `gen_prompt` is
/// false), under the tokenizer in `tok`.
pub fn render_ids(history: &Path, tok: &Path, extra: &[&str]) -> Vec<u32> {
    let out = Command::new(bin())
        .arg("render-chat")
        .arg("--history")
        .arg(history)
        .arg("--tok")
        .arg(tok)
        .arg("--ids")
        .args(extra)
        .output()
        .expect("run render-chat");
    assert!(
        out.status.success(),
        "render-chat failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let last = text
        .trim_end_matches('\n')
        .rsplit('\n')
        .next()
        .expect("ids line");
    last.split(',')
        .map(|s| s.parse::<u32>().expect("id"))
        .collect()
}

/// Run the chat REPL with `stdin` piped; returns (exit status, stdout, stderr).
/// `k3-run MODEL --chat --threads 1 --history HIST EXTRA...` with `stdin` piped in.
pub fn chat_piped(
    model: &Path,
    hist: &Path,
    extra: &[&str],
    stdin: &str,
) -> (ExitStatus, String, String) {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        model.as_os_str(),
        std::ffi::OsStr::new("--chat"),
        std::ffi::OsStr::new("--threads"),
        std::ffi::OsStr::new("1"),
        std::ffi::OsStr::new("--history"),
        hist.as_os_str(),
    ];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    run_piped(&args, stdin)
}

pub fn run_piped(args: &[&std::ffi::OsStr], stdin: &str) -> (ExitStatus, String, String) {
    use std::io::Write;
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn k3-run");
    // A run that refuses its flags exits before reading stdin: a broken pipe is expected then.
    if let Err(e) = child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
    {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
    }
    let out = child.wait_with_output().expect("wait");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The number right after the first occurrence of `prefix` in `s`.
pub fn number_after(s: &str, prefix: &str) -> usize {
    let i = s
        .find(prefix)
        .unwrap_or_else(|| panic!("{prefix:?} not found in:\n{s}"));
    let digits: String = s[i + prefix.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {prefix:?} in:\n{s}"))
}

/// The pseudo-terminal driver (Unix only: the REPL tests that type into a terminal are
/// `#[cfg(unix)]`).
#[cfg(unix)]
mod pty {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    use std::process::Child;
    use std::time::{Duration, Instant};

    /// A child process on a pseudo-terminal.
    pub struct Pty {
        master: OwnedFd,
        pub child: Child,
        /// Everything read so far, `\r` removed.
        out: String,
        /// Bytes not yet valid UTF-8 (a character split across reads).
        pending: Vec<u8>,
        /// Start of the unconsumed part of `out`.
        pos: usize,
        eof: bool,
    }

    fn cvt(r: libc::c_int, what: &str) -> libc::c_int {
        assert!(r >= 0, "{what} failed: {}", std::io::Error::last_os_error());
        r
    }

    impl Pty {
        /// Spawn `cmd` with stdin/stdout/stderr on a new pty (200 columns) that becomes its
        /// controlling terminal.
        pub fn spawn(cmd: &mut Command) -> Pty {
            let mut master: libc::c_int = -1;
            let mut slave: libc::c_int = -1;
            let mut ws = libc::winsize {
                ws_row: 50,
                ws_col: 200,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            // SAFETY: openpty writes two fds into the provided ints; name and termios may be null.
            cvt(
                unsafe {
                    libc::openpty(
                        &mut master,
                        &mut slave,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        &raw mut ws,
                    )
                },
                "openpty",
            );
            // SAFETY: both fds were just returned by openpty and are owned here.
            let master = unsafe { OwnedFd::from_raw_fd(master) };
            let slave = unsafe { OwnedFd::from_raw_fd(slave) };
            // SAFETY: fcntl on an fd we own.
            unsafe {
                let fl = cvt(libc::fcntl(master.as_raw_fd(), libc::F_GETFL), "F_GETFL");
                cvt(
                    libc::fcntl(master.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK),
                    "F_SETFL",
                );
                cvt(
                    libc::fcntl(master.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC),
                    "F_SETFD",
                );
            }
            let dup = || Stdio::from(slave.try_clone().expect("dup slave"));
            cmd.stdin(dup()).stdout(dup()).stderr(dup());
            cmd.env("TERM", "xterm");
            // SAFETY: setsid and ioctl are async-signal-safe; stdio is already the slave here.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd.spawn().expect("spawn on pty");
            // Close every parent copy of the slave, so EOF shows when the child exits.
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            drop(slave);
            Pty {
                master,
                child,
                out: String::new(),
                pending: Vec::new(),
                pos: 0,
                eof: false,
            }
        }

        /// Read what is available, waiting at most `wait`.
        fn pump(&mut self, wait: Duration) {
            if self.eof {
                std::thread::sleep(wait.min(Duration::from_millis(10)));
                return;
            }
            let mut pfd = libc::pollfd {
                fd: self.master.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, wait.as_millis().min(1000) as libc::c_int) };
            if r <= 0 {
                return;
            }
            let mut buf = [0u8; 8192];
            loop {
                // SAFETY: reading into a stack buffer of the given length.
                let n = unsafe {
                    libc::read(self.master.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
                };
                if n > 0 {
                    self.pending.extend_from_slice(&buf[..n as usize]);
                    continue;
                }
                if n == 0 {
                    self.eof = true;
                } else {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::WouldBlock
                        && e.kind() != std::io::ErrorKind::Interrupted
                    {
                        // EIO: the child closed the terminal.
                        self.eof = true;
                    }
                }
                break;
            }
            let valid = match std::str::from_utf8(&self.pending) {
                Ok(_) => self.pending.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => self.pending.len(),
            };
            let chunk: Vec<u8> = self.pending.drain(..valid).collect();
            self.out
                .push_str(&String::from_utf8_lossy(&chunk).replace('\r', ""));
        }

        /// Write all of `bytes` to the terminal, draining its output meanwhile.
        pub fn send(&mut self, bytes: &[u8]) {
            let mut rest = bytes;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !rest.is_empty() {
                // SAFETY: writing from a live slice.
                let n = unsafe {
                    libc::write(self.master.as_raw_fd(), rest.as_ptr().cast(), rest.len())
                };
                if n > 0 {
                    rest = &rest[n as usize..];
                    continue;
                }
                assert!(Instant::now() < deadline, "pty write stalled");
                self.pump(Duration::from_millis(5));
            }
        }

        /// Wait until `needle` appears after the consumed part; consume through it and return the
        /// text from the previous position to the end of the match.
        pub fn expect(&mut self, needle: &str, timeout: Duration) -> String {
            let deadline = Instant::now() + timeout;
            loop {
                if let Some(i) = self.out[self.pos..].find(needle) {
                    let end = self.pos + i + needle.len();
                    let got = self.out[self.pos..end].to_string();
                    self.pos = end;
                    return got;
                }
                assert!(
                    Instant::now() < deadline && !(self.eof && self.pending.is_empty()),
                    "timed out waiting for {needle:?}; output since the last match:\n{}",
                    &self.out[self.pos..]
                );
                self.pump(Duration::from_millis(50));
            }
        }

        /// Wait for a fresh line-editor prompt: rustyline turns bracketed paste on (`ESC[?2004h`)
        /// when it enters raw mode, then draws `> `. Matching only `> ` can match a stale redraw,
        /// or a prompt drawn after the terminal's own cooked-mode echo; input sent then can reach
        /// the editor together with a Ctrl-C, which drops what it read ahead.
        pub fn prompt(&mut self, timeout: Duration) {
            self.expect("\x1b[?2004h", timeout);
            self.expect("> ", timeout);
        }

        /// Ctrl-C at the prompt: wait until the editor gave the line up (bracketed paste off,
        /// `ESC[?2004l`) and drew a fresh prompt.
        pub fn ctrl_c_at_prompt(&mut self, timeout: Duration) {
            self.send(b"\x03");
            self.expect("\x1b[?2004l", timeout);
            self.prompt(timeout);
        }

        /// Keep reading the terminal for `d` (so the child never blocks on a full pty buffer).
        pub fn pump_for(&mut self, d: Duration) {
            let deadline = Instant::now() + d;
            while Instant::now() < deadline {
                self.pump(Duration::from_millis(10));
            }
        }

        /// Drain until the child closes the terminal, then reap it.
        pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
            let deadline = Instant::now() + timeout;
            loop {
                if let Some(st) = self.child.try_wait().expect("try_wait") {
                    self.pump(Duration::from_millis(20));
                    return st;
                }
                assert!(
                    Instant::now() < deadline,
                    "child did not exit; output:\n{}",
                    &self.out[self.pos..]
                );
                self.pump(Duration::from_millis(50));
            }
        }

        /// Everything read so far (`\r` removed).
        pub fn all_output(&self) -> &str {
            &self.out
        }
    }

    impl Drop for Pty {
        fn drop(&mut self) {
            if let Ok(None) = self.child.try_wait() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}
#[cfg(unix)]
#[allow(unused_imports)] // not every test that includes this module drives a pty
pub use pty::Pty;

/// The synthetic chat model in a fresh temporary directory (kept alive by the first value):
/// its path, spec and open checkpoint (in-process session tests).
pub fn synth_chat_model() -> (
    tempfile::TempDir,
    PathBuf,
    k3_models::spec::ModelSpec,
    k3_engine::checkpoint::Checkpoint,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let spec = k3_run::cli::load_spec(&model, None, None).expect("spec");
    let ckpt = k3_engine::checkpoint::Checkpoint::open(&model, &spec).expect("checkpoint");
    (dir, model, spec, ckpt)
}

/// Resident providers of an open checkpoint.
pub fn resident<'c>(
    spec: &'c k3_models::spec::ModelSpec,
    ckpt: &'c k3_engine::checkpoint::Checkpoint,
) -> k3_engine::exec::Providers<'c> {
    use k3_engine::resident::{ResidentExperts, ResidentGlobal, ResidentTrunk};
    k3_engine::exec::Providers {
        trunk: Box::new(ResidentTrunk::with_arena(spec, ckpt, None).expect("trunk")),
        experts: Box::new(ResidentExperts::new(spec, ckpt)),
        global: Box::new(ResidentGlobal::with_arena(spec, ckpt, None).expect("globals")),
    }
}

/// Session settings: thinking on (default), no extra stop ids, no speculation.
pub fn session_config(
    n_gen: usize,
    sampling: k3_run::chat::sample::Sampling,
    incremental: bool,
) -> k3_run::chat::session::SessionConfig {
    k3_run::chat::session::SessionConfig {
        thinking: k3_text::chat::Thinking::default(),
        n_gen,
        incremental,
        sampling,
        extra_stop_ids: Vec::new(),
        speculate: None,
    }
}
