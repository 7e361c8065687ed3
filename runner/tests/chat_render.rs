//! `k3-run render-chat` through the binary: for every golden transcript in
//! fixtures/text/transcripts (rendered by the independent Python reference into
//! fixtures/text/expected/xtml_golden.json), the JSONL history plus the matching flags must
//! print the reference text byte for byte, and with `--tok --ids` the reference ids; where the
//! reference refuses, the binary exits 2. Plus the `--system` rules.

mod chat_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use chat_support::{bin, repo};
use k3_text::pyjson::PyJson;

fn fixtures() -> PathBuf {
    repo().join("fixtures/text")
}

fn field<'a>(obj: &'a PyJson, key: &str) -> Option<&'a PyJson> {
    match obj {
        PyJson::Object(items) => items.iter().find(|(k, _)| k == key).map(|(_, v)| v),
        _ => None,
    }
}

fn str_of(v: &PyJson) -> &str {
    match v {
        PyJson::Str(s) => s,
        other => panic!("expected a string, got {other:?}"),
    }
}

/// The render-chat flags for a transcript's options; `None` when the options cannot be
/// expressed on the command line (an explicit `effort: null`, i.e. thinking without the
/// effort message, which the CLI does not offer).
fn flags_for(options: Option<&PyJson>, dir: &Path) -> Option<Vec<String>> {
    let mut f = Vec::new();
    let Some(o) = options else {
        return Some(f);
    };
    let PyJson::Object(items) = o else {
        panic!("options must be an object")
    };
    for (key, value) in items {
        match key.as_str() {
            "thinking" => {
                if *value == PyJson::Bool(false) {
                    f.push("--no-think".into());
                }
            }
            "effort" => match value {
                PyJson::Null => return None,
                v => {
                    f.push("--thinking-effort".into());
                    f.push(str_of(v).into());
                }
            },
            "revision" => {
                f.push("--revision".into());
                f.push(str_of(value).into());
            }
            "add_generation_prompt" => {
                if *value == PyJson::Bool(false) {
                    f.push("--no-generation-prompt".into());
                }
            }
            "tools" => {
                let p = dir.join("tools.json");
                std::fs::write(&p, value.dumps()).expect("write tools");
                f.push("--tools".into());
                f.push(p.display().to_string());
            }
            "tool_choice" => {
                f.push("--tool-choice".into());
                f.push(str_of(value).into());
            }
            "response_format" => {
                let p = dir.join("response_format.json");
                std::fs::write(&p, value.dumps()).expect("write response format");
                f.push("--response-format".into());
                f.push(p.display().to_string());
            }
            other => panic!("unknown transcript option {other}"),
        }
    }
    Some(f)
}

fn render_chat(history: &Path, flags: &[String], with_ids: bool) -> Output {
    let mut c = Command::new(bin());
    c.arg("render-chat")
        .arg("--history")
        .arg(history)
        .args(flags);
    if with_ids {
        c.arg("--tok").arg(fixtures().join("vocab")).arg("--ids");
    }
    c.output().expect("run render-chat")
}

#[test]
fn render_chat_prints_the_reference_bytes_and_ids() {
    let golden = PyJson::parse(
        &std::fs::read_to_string(fixtures().join("expected/xtml_golden.json")).expect("golden"),
    )
    .expect("golden JSON");
    let PyJson::Array(entries) = golden else {
        panic!("golden is an array")
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut checked = 0;
    let mut refused = 0;
    let mut skipped = Vec::new();
    for want in &entries {
        let name = str_of(field(want, "name").expect("name"));
        let t = PyJson::parse(
            &std::fs::read_to_string(fixtures().join("transcripts").join(format!("{name}.json")))
                .expect("transcript"),
        )
        .expect("transcript JSON");
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let Some(flags) = flags_for(field(&t, "options"), &dir) else {
            skipped.push(name.to_string());
            continue;
        };
        // The transcript's messages as a JSONL history, one record per line, keys in order.
        let PyJson::Array(messages) = field(&t, "messages").expect("messages") else {
            panic!("{name}: messages is an array")
        };
        let history = dir.join("history.jsonl");
        let mut jsonl = String::new();
        for m in messages {
            jsonl.push_str(&m.dumps_compact());
            jsonl.push('\n');
        }
        std::fs::write(&history, jsonl).expect("write history");

        if let Some(kind) = field(want, "error") {
            let out = render_chat(&history, &flags, false);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{name}: the reference refuses ({kind:?}); render-chat must exit 2"
            );
            assert!(!out.stderr.is_empty(), "{name}: no error message");
            refused += 1;
            continue;
        }
        let text = str_of(field(want, "text").expect("text"));
        let out = render_chat(&history, &flags, false);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout == text.as_bytes(),
            "{name}: text differs\n got: {}\nwant: {text}",
            String::from_utf8_lossy(&out.stdout)
        );

        let PyJson::Array(ids) = field(want, "ids").expect("ids") else {
            panic!("{name}: ids is an array")
        };
        let ids: Vec<String> = ids
            .iter()
            .map(|v| match v {
                PyJson::Int(s) => s.clone(),
                other => panic!("{name}: id {other:?}"),
            })
            .collect();
        let expected = format!("{text}\n{}\n", ids.join(","));
        let out = render_chat(&history, &flags, true);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout == expected.as_bytes(),
            "{name}: text + ids differ\n got: {}\nwant: {expected}",
            String::from_utf8_lossy(&out.stdout)
        );
        checked += 1;
    }
    assert_eq!(
        skipped,
        ["effort_omitted"],
        "only the explicit effort=None case has no CLI form"
    );
    assert!(checked >= 18, "checked {checked}");
    assert!(refused >= 4, "refused {refused}");
}

#[test]
fn render_chat_system_flag_rules() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let with_sys = tmp.path().join("s.jsonl");
    std::fs::write(
        &with_sys,
        "{\"role\":\"system\",\"content\":\"Be brief.\"}\n{\"role\":\"user\",\"content\":\"Hi\"}\n",
    )
    .expect("write");
    let plain = render_chat(&with_sys, &[], false);
    assert!(plain.status.success());
    // A matching --system changes nothing.
    let same = render_chat(&with_sys, &["--system".into(), "Be brief.".into()], false);
    assert!(same.status.success());
    assert_eq!(same.stdout, plain.stdout);
    // A different one is refused, naming the stored record.
    let other = render_chat(&with_sys, &["--system".into(), "Be verbose.".into()], false);
    assert_eq!(other.status.code(), Some(2));
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(
        err.contains("--system does not match") && err.contains("Be brief."),
        "{err}"
    );
    // An empty history with --system renders the system record, as the REPL starts.
    let empty = tmp.path().join("e.jsonl");
    std::fs::write(&empty, "").expect("write");
    let sys_only = tmp.path().join("sys.jsonl");
    std::fs::write(
        &sys_only,
        "{\"role\":\"system\",\"content\":\"Be brief.\"}\n",
    )
    .expect("write");
    let a = render_chat(&empty, &["--system".into(), "Be brief.".into()], false);
    let b = render_chat(&sys_only, &[], false);
    assert!(a.status.success() && b.status.success());
    assert_eq!(a.stdout, b.stdout);
    assert!(
        String::from_utf8_lossy(&a.stdout)
            .contains("<|open|>message role=\"system\"<|sep|>Be brief.<|close|>message")
    );
    // --ids without --tok, a corrupt line, a missing file: usage errors.
    let no_tok = render_chat(&with_sys, &["--ids".into()], false);
    assert_eq!(no_tok.status.code(), Some(2));
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"role\":\"user\",\"content\":\"a\"}\nnot json\n").expect("write");
    let out = render_chat(&bad, &[], false);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.jsonl:2:"));
    let out = render_chat(&tmp.path().join("missing.jsonl"), &[], false);
    assert_eq!(out.status.code(), Some(2));
}
