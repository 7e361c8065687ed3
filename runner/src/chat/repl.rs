//! The `--chat` REPL: line editing, commands, streaming output, the history file and Ctrl-C.
//!
//! Owns: turning the chat flags into a [`Session`], the read-eval-print loop (rustyline; a
//! non-terminal stdin is read line by line, so the REPL can be scripted), `/help`, `/reset`,
//! `/exit`, printing each record's think / response / tools channels as they stream, the
//! history file (validated at start, one whole turn appended per reply, mode 0600, archived
//! on `/reset`) and the Ctrl-C flag.
//! Must not: render XTML, sample or run the model itself ([`Session`] does).
//!
//! Terminal safety: generated text is printed with C0/C1 control characters (other than
//! newline and tab) replaced by visible stand-ins (U+2400 control pictures, U+FFFD), so a
//! model cannot send escape sequences to the terminal; the history keeps the exact text.
//!
//! Ctrl-C (SIGINT, via a signal-hook flag): during prefill or generation it stops the turn;
//! the turn is discarded (neither the user message nor the partial reply is stored) and the
//! REPL continues. A second Ctrl-C before the turn has stopped exits with code 5. At the
//! prompt rustyline reads Ctrl-C as a key: the line is cleared, as in a shell; Ctrl-D or
//! `/exit` quits.

use std::borrow::Cow;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use k3_models::spec::ModelSpec;
use k3_text::chat::{Message, Thinking};
use k3_text::history;
use k3_text::reply::Channel;
use k3_text::tokenizer::{self, Tokenizer};
use rustyline::error::ReadlineError;

use super::sample::Sampling;
use super::session::{Event, Session, SessionConfig, SessionError, Stop, TurnOutcome};
use crate::cli::{Failure, RunArgs, exit};
use crate::exec::{Executor, Providers};

/// `--gen` default in chat (a reasoning reply is long); also the maximum.
pub const CHAT_DEFAULT_GEN: usize = 4096;
/// Upper bound of `--gen` (docs/DESIGN.md §6).
pub const MAX_GEN: usize = 4096;

const HELP: &str = "\
Commands:
  /help     this help
  /reset    start a new conversation: the model state is dropped and, with --history, the
            current file is moved to FILE.reset-N (a new FILE starts with the system prompt)
  /exit     quit (also /quit or Ctrl-D)
  //text    send a message that starts with '/'
Ctrl-C during a reply stops it; that turn is discarded (not stored). At the prompt Ctrl-C
clears the line.";

fn usage(e: impl std::fmt::Display) -> Failure {
    Failure::usage(e.to_string())
}

/// The tokenizer directory: `--tok`, else the model directory when it holds tiktoken.model.
pub fn tokenizer_dir(run: &RunArgs) -> Result<PathBuf, Failure> {
    if let Some(t) = &run.tok {
        return Ok(t.clone());
    }
    match &run.model_dir {
        Some(m) if m.join(tokenizer::MODEL_FILE).is_file() => Ok(m.clone()),
        Some(m) => Err(Failure::usage(format!(
            "--chat needs a tokenizer: {} has no {}; pass --tok DIR",
            m.display(),
            tokenizer::MODEL_FILE
        ))),
        None => Err(Failure::usage("--chat needs --tok DIR")),
    }
}

/// Whether `--gen` was given on this process's command line (chat has its own default).
pub(crate) fn gen_given_on_command_line() -> bool {
    use clap::CommandFactory;
    use clap::parser::ValueSource;
    crate::cli::Cli::command()
        .try_get_matches_from(std::env::args_os())
        .is_ok_and(|m| m.value_source("n_gen") == Some(ValueSource::CommandLine))
}

/// The per-turn token limit: `--gen` if given, else [`CHAT_DEFAULT_GEN`].
pub fn gen_limit(run: &RunArgs, given: bool) -> Result<usize, Failure> {
    let n = if given { run.n_gen } else { CHAT_DEFAULT_GEN };
    if n == 0 || n > MAX_GEN {
        return Err(Failure::usage(format!(
            "--gen {n}: chat needs 1..={MAX_GEN} tokens per reply"
        )));
    }
    Ok(n)
}

/// The session settings `--chat` and `--serve` share: the flags' `--incremental`, stop ids
/// ([`stop_ids`]) and `--speculate`, with the given thinking, turn length and sampling.
pub(crate) fn session_config(
    spec: &ModelSpec,
    tok: &Tokenizer,
    run: &RunArgs,
    thinking: Thinking,
    n_gen: usize,
    sampling: Sampling,
) -> Result<SessionConfig, Failure> {
    Ok(SessionConfig {
        thinking,
        n_gen,
        incremental: run.incremental,
        sampling,
        extra_stop_ids: stop_ids(spec, tok, run),
        speculate: crate::speculate::from_flag(run.speculate).map_err(usage)?,
    })
}

/// Stops besides `<|end_of_msg|>` for `--chat` and `--serve`: the config's eos ids, the
/// tokenizer-level `[EOS]` (real K3 emits 163585 as well as 163586, docs/DESIGN.md §6) and
/// `--stop-id`.
pub(crate) fn stop_ids(spec: &ModelSpec, tok: &Tokenizer, run: &RunArgs) -> Vec<u32> {
    let mut ids = spec.eos_token_ids.clone();
    ids.extend(tok.id_of("[EOS]"));
    ids.extend(&run.stop_ids);
    ids
}

/// A seed for sampling without `--seed` (printed, so the session can be replayed).
pub(crate) fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // splitmix64 finaliser over time and pid, so two REPLs started together differ.
    let mut z = nanos ^ ((std::process::id() as u64) << 32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The history file of a session.
#[derive(Debug)]
pub struct HistoryFile {
    path: PathBuf,
    system: Option<String>,
}

impl HistoryFile {
    /// Open (or create, mode 0600) `path` and return the transcript it holds, with `--system`
    /// checked against (or written as) its initial record. Nothing is overwritten: a corrupt
    /// file is an error naming the line.
    pub fn open(path: &Path, system: Option<&str>) -> Result<(HistoryFile, Vec<Message>), Failure> {
        let stored = if path.exists() {
            history::load_jsonl(path).map_err(usage)?
        } else {
            Vec::new()
        };
        let was_empty = stored.is_empty();
        let messages = history::with_system(stored, system, path).map_err(usage)?;
        // Creates the file if missing (mode 0600) after checking its tail; a new or empty
        // history gets the system record first.
        let first: &[Message] = if was_empty { &messages } else { &[] };
        history::append_records(path, first).map_err(usage)?;
        // `/reset` restarts with the same system prompt: the flag's, else the stored one.
        let h = HistoryFile {
            path: path.to_path_buf(),
            system: history::initial_system(&messages).map(str::to_string),
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::metadata(path) {
                let mode = meta.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    eprintln!(
                        "k3-run: warning: {} is readable by others (mode {mode:o}); it holds \
                         every message and all reasoning (chmod 600 it)",
                        path.display()
                    );
                }
            }
        }
        Ok((h, messages))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one finished turn (both records in one write, then fsync).
    pub fn append_turn(&self, records: &[Message]) -> Result<(), k3_text::HistoryError> {
        history::append_records(&self.path, records)
    }

    /// `/reset`: move the file to the first free `FILE.reset-N` and start a new one holding
    /// only the system record (if any). Returns the archive path and the new transcript.
    pub fn archive(&self) -> Result<(PathBuf, Vec<Message>), Failure> {
        let mut n = 1u32;
        let archived = loop {
            let mut name = self.path.as_os_str().to_owned();
            name.push(format!(".reset-{n}"));
            let p = PathBuf::from(name);
            if !p.exists() {
                break p;
            }
            n += 1;
        };
        std::fs::rename(&self.path, &archived).map_err(|e| Failure {
            code: exit::OUT_WRITE,
            msg: format!(
                "/reset: cannot move {} to {}: {e}",
                self.path.display(),
                archived.display()
            ),
        })?;
        let messages: Vec<Message> = self
            .system
            .as_deref()
            .map(Message::system)
            .into_iter()
            .collect();
        history::append_records(&self.path, &messages).map_err(usage)?;
        Ok((archived, messages))
    }
}

/// Replace terminal control characters (except newline and tab) by visible stand-ins.
pub fn display_text(s: &str) -> Cow<'_, str> {
    let bad = |c: char| (c.is_control() && c != '\n' && c != '\t') || c == '\u{7f}';
    if !s.chars().any(bad) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(
        s.chars()
            .map(|c| match c {
                '\n' | '\t' => c,
                '\u{7f}' => '\u{2421}',
                c if (c as u32) < 0x20 => char::from_u32(0x2400 + c as u32).unwrap_or('\u{fffd}'),
                c if c.is_control() => '\u{fffd}',
                c => c,
            })
            .collect(),
    )
}

/// Streams a reply to stdout with a header line per channel.
struct Printer {
    channel: Option<Channel>,
    at_line_start: bool,
}

impl Printer {
    fn new() -> Printer {
        Printer {
            channel: None,
            at_line_start: true,
        }
    }

    fn text(&mut self, channel: Channel, text: &str) {
        let shown = match channel {
            // Off-grammar text between channels is stored in the answer; show it there.
            Channel::Between => Channel::Response,
            c => c,
        };
        let mut out = std::io::stdout().lock();
        if self.channel != Some(shown) {
            if !self.at_line_start {
                let _ = writeln!(out);
            }
            let header = match shown {
                Channel::Think => "[think]",
                Channel::Tools => "[tools]",
                _ => "[response]",
            };
            let _ = writeln!(out, "{header}");
            self.channel = Some(shown);
            self.at_line_start = true;
        }
        if !text.is_empty() {
            let _ = out.write_all(display_text(text).as_bytes());
            self.at_line_start = text.ends_with('\n');
        }
        let _ = out.flush();
    }

    fn finish_line(&mut self) {
        if !self.at_line_start {
            println!();
            self.at_line_start = true;
        }
    }
}

fn print_prefill(p: &super::session::Prefill) {
    println!(
        "[prefill: reused {} positions, fed {} new, {} total, {:.2} s]",
        p.reused, p.fed, p.total, p.seconds
    );
}

fn print_stop(o: &TurnOutcome, positions: usize, max: usize) {
    let n = o.generated.len();
    let rate = if o.decode_seconds > 0.0 {
        n as f64 / o.decode_seconds
    } else {
        0.0
    };
    let why = match o.stop {
        Stop::EndOfMessage => "end of message".to_string(),
        Stop::StopId(id) => format!("stop id {id}"),
        Stop::GenLimit => format!("--gen limit ({n} tokens)"),
        Stop::Interrupted => {
            println!("[interrupted (Ctrl-C): this turn is discarded, nothing stored]");
            return;
        }
        Stop::ContextFull { max } => {
            println!(
                "[context full at {max} positions (--max-context): this turn is discarded, \
                 nothing stored; the history is kept. /reset starts a new conversation, or \
                 restart with a larger --max-context]"
            );
            return;
        }
    };
    let spec = o.speculation.as_ref().map_or(String::new(), |s| {
        format!(
            "; speculation: {} passes, {} of {} guesses held",
            s.passes, s.accepted, s.drafted
        )
    });
    println!(
        "[{why}; {n} tokens in {:.2} s ({rate:.1} tok/s); context {positions}/{max}{spec}]",
        o.decode_seconds
    );
}

/// Everything the REPL needs from the flags alone.
struct Prepared {
    tok_dir: PathBuf,
    tok: Tokenizer,
    thinking: Thinking,
    sampling: Sampling,
    n_gen: usize,
}

/// Check the chat flags, load the tokenizer and validate an existing history file (read
/// only). Cheap; [`super::preflight`] runs it before the model is loaded.
fn prepare(run: &RunArgs) -> Result<Prepared, Failure> {
    let c = &run.chat;
    if run.ids.is_some() || run.prompt.is_some() || run.prompt_file.is_some() {
        return Err(Failure::usage(
            "--chat reads its input from the terminal; --ids, --prompt and --prompt-file are \
             not used with it",
        ));
    }
    if run.stop_ids.len() > 8 {
        return Err(Failure::usage("at most 8 --stop-id values"));
    }
    let tok_dir = tokenizer_dir(run)?;
    let tok = Tokenizer::load(&tok_dir).map_err(usage)?;
    let thinking = Thinking::from_flags(c.no_think, c.thinking_effort.as_deref()).map_err(usage)?;
    let sampling = Sampling::from_flags(c.greedy, c.temperature, c.top_p, c.seed, fresh_seed)
        .map_err(usage)?;
    let n_gen = gen_limit(run, gen_given_on_command_line())?;
    if let Some(p) = &c.history
        && p.exists()
    {
        super::session::load_transcript(p, c.system.as_deref()).map_err(usage)?;
    }
    Ok(Prepared {
        tok_dir,
        tok,
        thinking,
        sampling,
        n_gen,
    })
}

/// Validate the chat flags, the tokenizer and an existing history without touching the
/// model or writing anything.
pub fn preflight(run: &RunArgs) -> Result<(), Failure> {
    prepare(run).map(|_| ())
}

/// The REPL. See the module docs.
pub fn main(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    providers: &mut Providers<'_>,
    run: &RunArgs,
) -> Result<u8, Failure> {
    let c = &run.chat;
    let Prepared {
        tok_dir,
        tok,
        thinking,
        sampling,
        n_gen,
    } = prepare(run)?;
    let cfg = session_config(spec, &tok, run, thinking, n_gen, sampling)?;

    let (hist, messages) = match &c.history {
        Some(p) => {
            let (h, m) = HistoryFile::open(p, c.system.as_deref())?;
            (Some(h), m)
        }
        None => (
            None,
            c.system
                .as_deref()
                .map(Message::system)
                .into_iter()
                .collect(),
        ),
    };
    let mut session = Session::new(spec, tok, cfg, messages).map_err(usage)?;
    let max = exec.plan().max_positions;

    let thinking_desc = match thinking {
        Thinking::Off => "thinking off".to_string(),
        Thinking::On { effort: Some(e) } => format!("thinking effort {e}"),
        Thinking::On { effort: None } => "thinking on".to_string(),
    };
    println!(
        "k3-run chat: {} ({} layers, vocab {}); tokenizer {}; {thinking_desc}; {sampling}; \
         --gen {n_gen}; context {max} positions; {}",
        spec.name,
        spec.n_layers,
        spec.vocab_size,
        tok_dir.display(),
        if run.incremental {
            "incremental (state reused across turns)"
        } else {
            "full prefill every turn"
        }
    );
    match &hist {
        Some(h) => println!(
            "history: {} ({} record{}; holds every message and all reasoning)",
            h.path().display(),
            session.messages().len(),
            if session.messages().len() == 1 {
                ""
            } else {
                "s"
            }
        ),
        None => println!("history: off (nothing is saved; --history FILE.jsonl keeps it)"),
    }
    println!("/help for commands; Ctrl-D or /exit quits");

    let interrupt = Arc::new(AtomicBool::new(false));
    let sig_ids = [
        signal_hook::flag::register_conditional_shutdown(
            signal_hook::consts::SIGINT,
            exit::INTERRUPTED as i32,
            Arc::clone(&interrupt),
        ),
        signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&interrupt)),
    ];
    let sig_ids: Vec<_> = sig_ids
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|e| Failure::usage(format!("cannot install the Ctrl-C handler: {e}")))?;
    let r = repl_loop(
        &mut session,
        exec,
        providers,
        hist.as_ref(),
        &interrupt,
        max,
    );
    for id in sig_ids {
        signal_hook::low_level::unregister(id);
    }
    r
}

fn fatal(e: SessionError) -> Failure {
    match e {
        SessionError::Exec(e) => Failure {
            code: match &e {
                crate::exec::ExecError::Weight(crate::weights::WeightError::Expert { .. }) => {
                    exit::EXPERT_LOAD
                }
                _ => exit::FORWARD,
            },
            msg: e.to_string(),
        },
        other => Failure::usage(other.to_string()),
    }
}

fn repl_loop(
    session: &mut Session<'_>,
    exec: &mut Executor<'_>,
    providers: &mut Providers<'_>,
    hist: Option<&HistoryFile>,
    interrupt: &AtomicBool,
    max: usize,
) -> Result<u8, Failure> {
    let pre = crate::cli::with_prompt_progress(exec, None, |exec, _| {
        session.prefill_transcript(exec, providers, interrupt)
    });
    match pre {
        Ok(Some(p)) if p.total > 0 => {
            print!("(transcript) ");
            print_prefill(&p);
        }
        Ok(_) => {}
        Err(SessionError::Exec(e)) => return Err(fatal(SessionError::Exec(e))),
        Err(e) => println!("[{e}]"),
    }
    interrupt.store(false, Ordering::Relaxed);

    let config = rustyline::Config::builder().auto_add_history(true).build();
    let mut rl = rustyline::DefaultEditor::with_config(config)
        .map_err(|e| Failure::usage(format!("cannot start the line editor: {e}")))?;
    let echo = !std::io::stdin().is_terminal();
    loop {
        let line = match rl.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(ReadlineError::Io(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                println!("[input line is not valid UTF-8; ignored]");
                continue;
            }
            Err(e) => {
                return Err(Failure::usage(format!("cannot read input: {e}")));
            }
        };
        if echo {
            println!("> {line}");
        }
        let text = line.trim_end_matches(['\r', '\n']);
        let message = match text.trim() {
            "" => continue,
            "/help" => {
                println!("{HELP}");
                continue;
            }
            "/exit" | "/quit" => break,
            "/reset" => {
                let fresh = match hist {
                    Some(h) => {
                        let (archived, fresh) = h.archive()?;
                        println!(
                            "[new conversation; the previous history is in {}]",
                            archived.display()
                        );
                        fresh
                    }
                    None => {
                        println!("[new conversation]");
                        session
                            .messages()
                            .first()
                            .filter(|m| m.role == k3_text::chat::Role::System)
                            .cloned()
                            .into_iter()
                            .collect()
                    }
                };
                session.reset(fresh).map_err(usage)?;
                continue;
            }
            t if t.starts_with("//") => &text[text.find('/').map_or(0, |i| i + 1)..],
            t if t.starts_with('/') => {
                println!("[unknown command {t:?}; /help lists the commands, //text sends text]");
                continue;
            }
            _ => text,
        };

        interrupt.store(false, Ordering::Relaxed);
        let mut printer = Printer::new();
        let outcome = crate::cli::with_prompt_progress(exec, None, |exec, bar| {
            session.turn(exec, providers, message, interrupt, &mut |ev| match ev {
                Event::Prefilled(p) => {
                    if let Some(b) = bar {
                        b.finish_and_clear();
                    }
                    print_prefill(&p)
                }
                Event::Text { channel, text } => printer.text(channel, text),
            })
        });
        printer.finish_line();
        let outcome = match outcome {
            Ok(o) => o,
            Err(SessionError::Exec(e)) => return Err(fatal(SessionError::Exec(e))),
            Err(e) => {
                println!("[{e}]");
                continue;
            }
        };
        print_stop(&outcome, session.positions(), max);
        interrupt.store(false, Ordering::Relaxed);
        if let Some(records) = outcome.records {
            if let Some(h) = hist
                && let Err(e) = h.append_turn(&records)
            {
                println!("[history NOT saved, this turn is discarded: {e}]");
                continue;
            }
            session.commit(records);
        }
    }
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_made_visible() {
        assert!(matches!(display_text("plain\ttext\n"), Cow::Borrowed(_)));
        assert_eq!(
            display_text("a\u{1b}[2Jb\rc\u{7}\u{7f}\u{9b}d"),
            "a\u{241b}[2Jb\u{240d}c\u{2407}\u{2421}\u{fffd}d"
        );
    }

    #[test]
    fn chat_gen_limit_defaults_to_4096_and_is_bounded() {
        let mut run = RunArgs {
            n_gen: 8,
            ..RunArgs::default()
        };
        assert_eq!(gen_limit(&run, false).ok(), Some(CHAT_DEFAULT_GEN));
        assert_eq!(gen_limit(&run, true).ok(), Some(8));
        run.n_gen = 0;
        assert!(gen_limit(&run, true).is_err());
        run.n_gen = 4097;
        assert!(gen_limit(&run, true).is_err());
    }
}
