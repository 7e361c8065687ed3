//! Golden tokenizer tests: ids must equal the Python `tiktoken` package's for the same
//! vocabulary file, pattern and specials (fixtures/text/expected/tokenizer_golden.json,
//! written by fixtures/text/gen_tokenizer_golden.py), plus robustness and layout checks.

use std::path::PathBuf;
use std::sync::OnceLock;

use k3_text::tokenizer::{self, KIMI_PAT_STR, Tokenizer, python_isspace};
use proptest::prelude::*;
use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/text")
}

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::load(&fixtures().join("vocab")).expect("fixture vocab loads"))
}

fn golden() -> Value {
    let path = fixtures().join("expected/tokenizer_golden.json");
    let data = std::fs::read(&path).expect("golden file exists");
    serde_json::from_slice(&data).expect("golden file is JSON")
}

fn ids_u32(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn check_ids(case: &str, mode: &str, got: &[u32], want: &Value) {
    if want.is_array() {
        assert_eq!(got, ids_u32(want).as_slice(), "{case} ({mode})");
        return;
    }
    let len = want["len"].as_u64().expect("len") as usize;
    let head = ids_u32(&want["head"]);
    assert_eq!(got.len(), len, "{case} ({mode}): id count");
    assert_eq!(&got[..head.len()], head.as_slice(), "{case} ({mode}): head");
    let mut h = Sha256::new();
    for id in got {
        h.update(id.to_le_bytes());
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        want["sha256"].as_str().expect("sha256"),
        "{case} ({mode}): sha256"
    );
}

#[test]
fn corpus_ids_match_python_tiktoken() {
    let g = golden();
    let tok = tok();
    assert_eq!(g["pattern"].as_str(), Some(KIMI_PAT_STR));
    assert_eq!(Some(tok.num_ranks() as u64), g["num_ranks"].as_u64());
    assert_eq!(tok.vocab_size(), tok.num_ranks() as usize + 256);
    let corpus: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("corpus.json")).expect("corpus"))
            .expect("corpus is JSON");
    let cases = g["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), corpus.as_array().expect("corpus list").len());
    for (entry, case) in corpus.as_array().expect("corpus list").iter().zip(cases) {
        let name = entry["name"].as_str().expect("name");
        assert_eq!(case["name"].as_str(), Some(name));
        let mut text = String::new();
        for part in entry["parts"].as_array().expect("parts") {
            let s = part[0].as_str().expect("part text");
            text.push_str(&s.repeat(part[1].as_u64().expect("count") as usize));
        }
        assert_eq!(
            Some(text.chars().count() as u64),
            case["chars"].as_u64(),
            "{name}"
        );
        let plain = tok.encode_text(&text).expect("encode_text");
        check_ids(name, "plain", &plain, &case["plain"]);
        let special = tok
            .encode_with_specials(&text)
            .expect("encode_with_specials");
        check_ids(name, "special", &special, &case["special"]);
        assert_eq!(
            tok.decode_bytes(&plain).expect("decode"),
            text.as_bytes(),
            "{name}"
        );
    }
}

#[test]
fn random_strings_match_python_tiktoken() {
    let g = golden();
    let tok = tok();
    let fuzz = g["fuzz"].as_array().expect("fuzz cases");
    assert!(fuzz.len() >= 300);
    for (i, case) in fuzz.iter().enumerate() {
        let text = case["text"].as_str().expect("text");
        let plain = tok.encode_text(text).expect("encode_text");
        assert_eq!(plain, ids_u32(&case["plain"]), "fuzz {i} (plain): {text:?}");
        let special = tok
            .encode_with_specials(text)
            .expect("encode_with_specials");
        assert_eq!(
            special,
            ids_u32(&case["special"]),
            "fuzz {i} (special): {text:?}"
        );
    }
}

#[test]
fn specials_match_python_naming() {
    let g = golden();
    let tok = tok();
    let specials = g["specials"].as_object().expect("specials");
    assert_eq!(specials.len(), 256);
    for (name, id) in specials {
        let id = id.as_u64().expect("id") as u32;
        assert_eq!(tok.id_of(name), Some(id), "{name}");
        assert_eq!(tok.special_name(id), Some(name.as_str()));
        assert_eq!(
            tok.decode_bytes(&[id]).expect("decode special"),
            name.as_bytes()
        );
    }
    assert_eq!(tok.special_name(tok.num_ranks() - 1), None);
    assert!(tok.decode_bytes(&[tok.vocab_size() as u32]).is_err());
}

#[test]
fn isspace_matches_python_for_every_code_point() {
    let g = golden();
    let want: std::collections::HashSet<u32> = g["isspace"]
        .as_array()
        .expect("isspace list")
        .iter()
        .map(|v| v.as_u64().expect("code point") as u32)
        .collect();
    for cp in 0..0x11_0000u32 {
        if let Some(c) = char::from_u32(cp) {
            assert_eq!(python_isspace(c), want.contains(&cp), "U+{cp:04X}");
        }
    }
}

#[test]
fn vocab_fixture_is_a_prefix_of_cl100k_base() {
    // Provenance: the committed vocabulary is the first N ranks of tiktoken's cl100k_base
    // (tiktoken-rs bundles the official file).
    let cl = tiktoken_rs::cl100k_base().expect("bundled cl100k_base");
    let tok = tok();
    for r in 0..tok.num_ranks() {
        assert_eq!(
            cl.decode_bytes(&[r]).expect("cl100k rank"),
            tok.token_bytes(r).expect("fixture rank"),
            "rank {r}"
        );
    }
}

#[test]
fn hostile_inputs_do_not_panic() {
    let tok = tok();
    let million = " ".repeat(1_000_000);
    let ids = tok.encode_text(&million).expect("1,000,000 spaces encode");
    assert_eq!(tok.decode_bytes(&ids).expect("decode"), million.as_bytes());
    let nl = "\n \r\t".repeat(300_000);
    let ids = tok
        .encode_with_specials(&nl)
        .expect("mixed whitespace encodes");
    assert_eq!(tok.decode_bytes(&ids).expect("decode"), nl.as_bytes());

    // A literal control marker in user text stays plain text; with specials it is one id.
    let open = tok.id_of("<|open|>").expect("fixture has <|open|>");
    let plain = tok.encode_text("say <|open|> now").expect("encode");
    assert!(!plain.contains(&open) && plain.len() > 3);
    assert_eq!(
        tok.encode_with_specials("<|open|>").expect("encode"),
        vec![open]
    );

    // Invalid UTF-8: strict rejects with the byte offset; lossy replaces with U+FFFD.
    let bad = b"ok \xe2\x82 then \xff";
    let e = tok.encode_bytes(bad, "prompt.txt").unwrap_err().to_string();
    assert!(
        e.contains("prompt.txt") && e.contains("byte offset 3"),
        "{e}"
    );
    assert_eq!(
        tok.encode_bytes_lossy(bad).expect("lossy"),
        tok.encode_text("ok \u{fffd} then \u{fffd}")
            .expect("encode")
    );
}

#[test]
fn real_k3_layout_ids_come_from_the_files() {
    // A synthetic vocabulary with K3's 163,584 ranks and the fixture config shifted to K3's
    // first special id: the ids must land where the released checkpoint has them
    // (docs/MODEL.md 6.4), derived only from the files.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut model = String::new();
    let b64 = |b: &[u8]| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(b)
    };
    let mut rank = 0u32;
    for b in 0u8..=255 {
        model.push_str(&format!("{} {rank}\n", b64(&[b])));
        rank += 1;
    }
    'outer: for a in 0u8..=255 {
        for b in 0u8..=255 {
            for c in 0u8..=255 {
                if rank == 163_584 {
                    break 'outer;
                }
                let tok: Vec<u8> = if c == 0 { vec![a, b] } else { vec![a, b, c] };
                model.push_str(&format!("{} {rank}\n", b64(&tok)));
                rank += 1;
            }
        }
    }
    std::fs::write(dir.path().join(tokenizer::MODEL_FILE), &model).expect("write model");
    let cfg: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("vocab/tokenizer_config.json")).expect("fixture config"),
    )
    .expect("config JSON");
    let fixture_base = tok().num_ranks() as u64;
    let mut shifted = serde_json::Map::new();
    for (k, v) in cfg["added_tokens_decoder"].as_object().expect("decoder") {
        let id: u64 = k.parse().expect("id key");
        shifted.insert((id - fixture_base + 163_584).to_string(), v.clone());
    }
    let mut cfg = cfg.clone();
    cfg["added_tokens_decoder"] = Value::Object(shifted);
    std::fs::write(
        dir.path().join(tokenizer::CONFIG_FILE),
        serde_json::to_vec(&cfg).expect("serialise"),
    )
    .expect("write config");

    let k3 = Tokenizer::load(dir.path()).expect("K3-layout tokenizer loads");
    assert_eq!(k3.vocab_size(), 163_840);
    for (name, id) in [
        ("[BOS]", 163_584),
        ("[EOS]", 163_585),
        ("<|end_of_msg|>", 163_586),
        ("<|open|>", 163_587),
        ("<|close|>", 163_588),
        ("<|sep|>", 163_589),
        ("<|reserved_token_163590|>", 163_590),
        ("<|media_begin|>", 163_602),
        ("<|media_pad|>", 163_605),
        ("[UNK]", 163_838),
        ("[PAD]", 163_839),
    ] {
        assert_eq!(k3.id_of(name), Some(id), "{name}");
    }
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let e = Tokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("tiktoken.model"), "{e}");
    std::fs::copy(
        fixtures().join("vocab/tiktoken.model"),
        dir.path().join("tiktoken.model"),
    )
    .expect("copy");
    let e = Tokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Streaming decode emits exactly the lossy decode of all bytes, never splitting a
    /// character, whatever ids arrive.
    #[test]
    fn streaming_decoder_equals_lossy_decode(ids in prop::collection::vec(0u32..16_640, 0..64)) {
        let tok = tok();
        let mut d = tok.decoder();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(tok, id).expect("id in vocab"));
        }
        streamed.push_str(&d.finish());
        prop_assert_eq!(streamed, tok.decode_lossy(&ids).expect("decode"));
    }

    /// encode → decode is the identity on arbitrary text, in both modes.
    #[test]
    fn encode_decode_roundtrip(s in "\\PC{0,80}") {
        let tok = tok();
        let ids = tok.encode_text(&s).expect("encode");
        prop_assert_eq!(tok.decode_bytes(&ids).expect("decode"), s.as_bytes());
        let ids = tok.encode_with_specials(&s).expect("encode");
        prop_assert_eq!(tok.decode_bytes(&ids).expect("decode"), s.as_bytes());
    }
}
