//! Tokenizer files of a synthetic checkpoint: `tiktoken.model` and `tokenizer_config.json`
//! in the released K3 layout, for a small test vocabulary.
//!
//! Owns: choosing the BPE ranks and writing both files. Must not: tokenize (k3-text does).
//!
//! Layout (docs/MODEL.md §6): `tiktoken.model` has one `<base64 token> <rank>` line per
//! rank. Ranks 0..255 are the 256 single bytes in byte order (rank b = byte b). Then merges:
//! each merge token is the concatenation of two existing tokens, so BPE can reach it. They come
//! first from prefixes of a fixed list of common English words (with and without a leading
//! space), then from deterministic pseudo-random pairs of existing ASCII tokens; nothing
//! depends on the model seed, so every synthetic model with the same vocabulary shares the same
//! tokenizer. The special ids start right after the ranks (`base` = number of ranks):
//! `[BOS]` base+0, `[EOS]` +1, `<|end_of_msg|>` +2 (the model's stop token), `<|open|>` +3,
//! `<|close|>` +4, `<|sep|>` +5, `<|media_begin|>` +18, `<|media_content|>` +19,
//! `<|media_end|>` +20, `<|media_pad|>` +21, `[UNK]` +254, `[PAD]` +255; the others are
//! unnamed (`<|reserved_token_{id}|>`), as in the release.
//!
//! Split rule: when `vocab_size >= 512`, `base = vocab_size - 256` (so `vocab_size = base + 256`
//! exactly as in K3) with `base - 256` merges. When `vocab_size < 512` there is no room for
//! 256 bytes and 256 specials inside the model's vocabulary; then `base = 256` (bytes only, no
//! merges) and the tokenizer's 256 specials extend past the model vocabulary: ids
//! `>= vocab_size` can be encoded but the model can neither embed nor emit them (for the tiny
//! vocab-256 model no special id is embeddable, so its stop token is never generated and
//! generation runs to `--gen`).

use std::collections::HashSet;

use base64::Engine as _;

use super::rng::Rng;

/// Number of BPE ranks (= first special id) for a model vocabulary.
pub fn n_ranks(vocab_size: usize) -> usize {
    if vocab_size >= 512 {
        vocab_size - 256
    } else {
        256
    }
}

/// Offsets (from the first special id) of the named specials.
pub const NAMED_SPECIALS: [(usize, &str, bool); 12] = [
    (0, "[BOS]", true),
    (1, "[EOS]", true),
    (2, "<|end_of_msg|>", true),
    (3, "<|open|>", false),
    (4, "<|close|>", false),
    (5, "<|sep|>", false),
    (18, "<|media_begin|>", true),
    (19, "<|media_content|>", true),
    (20, "<|media_end|>", true),
    (21, "<|media_pad|>", true),
    (254, "[UNK]", true),
    (255, "[PAD]", true),
];

/// Offset of the model's stop token (`<|end_of_msg|>`), of `[BOS]` and `[PAD]`.
pub const EOS_OFFSET: usize = 2;
pub const BOS_OFFSET: usize = 0;
pub const PAD_OFFSET: usize = 255;
/// Offset of `<|media_pad|>` (config.json `media_placeholder_token_id`).
pub const MEDIA_PAD_OFFSET: usize = 21;

const WORDS: &str = "the of and to in is that it was for on are as with his they at be this \
from have or by one had not but what all were when we there can an your which their said if \
do will each about how up out them then she many some so these would other into has more her \
two like him see time could no make than first been its who now people my made over did down \
only way find use may water long little very after words called just where most know get \
through back much before go good new write our used me man too any day same right look think \
also around another came come work three word must because does part even place well such \
here take why things help put years different away again off went old number great tell men \
say small every found still between name should home big give air line set own under read \
last never us left end along while might next sound below saw something thought both few \
those always looked show large often together asked house world going want school important \
until form food keep children feet land side without boy once animals life enough took \
sometimes four head above kind began almost live page got earth need far hand high year \
mother light parts country father let night following picture being study second eyes soon \
times story boys since white days paper hard near sentence better best across during today \
others however sure means knew try told young miles sun ways thing whole hear example heard \
several change answer room sea against top turned learn point city play toward five using \
himself usually model token layer weight expert shard stream cache tensor vector matrix \
kernel engine memory";

/// The byte strings of every rank, rank order.
pub fn ranks(vocab_size: usize) -> Vec<Vec<u8>> {
    let n = n_ranks(vocab_size);
    let mut toks: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen: HashSet<Vec<u8>> = toks.iter().cloned().collect();
    let mut push = |t: Vec<u8>, toks: &mut Vec<Vec<u8>>| {
        if toks.len() < n && seen.insert(t.clone()) {
            toks.push(t);
        }
    };
    for w in WORDS.split_ascii_whitespace() {
        for word in [w.to_string(), format!(" {w}")] {
            let b = word.as_bytes();
            for len in 2..=b.len() {
                push(b[..len].to_vec(), &mut toks);
            }
        }
    }
    // Pseudo-random concatenations of existing ASCII tokens (fixed seed: the tokenizer does
    // not depend on the model seed). Each candidate is two existing tokens, so it is reachable.
    let mut rng = Rng::new(0x6B33_746F_6B65_6E73);
    let ascii: Vec<usize> = (32usize..127).collect();
    let mut guard = 0usize;
    while toks.len() < n {
        let pick = |rng: &mut Rng, toks: &Vec<Vec<u8>>| -> usize {
            let r = rng.next_u64() as usize;
            if r.is_multiple_of(3) {
                ascii[(r >> 8) % ascii.len()]
            } else {
                256 + (r >> 8) % (toks.len() - 256).max(1)
            }
        };
        let a = pick(&mut rng, &toks).min(toks.len() - 1);
        let b = pick(&mut rng, &toks).min(toks.len() - 1);
        let t: Vec<u8> = [toks[a].as_slice(), toks[b].as_slice()].concat();
        if t.len() <= 12 {
            push(t, &mut toks);
        }
        guard += 1;
        if guard > 1000 * n {
            // Unreachable for any vocabulary a u32 id can index; keeps the loop total.
            break;
        }
    }
    toks
}

/// Text of `tiktoken.model`.
pub fn tiktoken_model(vocab_size: usize) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = String::new();
    for (rank, t) in ranks(vocab_size).iter().enumerate() {
        out.push_str(&b64.encode(t));
        out.push(' ');
        out.push_str(&rank.to_string());
        out.push('\n');
    }
    out
}

/// `tokenizer_config.json` in the K3 layout for the given first special id.
pub fn tokenizer_config(base: usize) -> serde_json::Value {
    let mut added = serde_json::Map::new();
    for (off, name, special) in NAMED_SPECIALS {
        added.insert(
            (base + off).to_string(),
            serde_json::json!({
                "content": name,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": special,
            }),
        );
    }
    let additional: Vec<&str> = NAMED_SPECIALS
        .iter()
        .filter(|(_, _, s)| *s)
        .map(|(_, n, _)| *n)
        .collect();
    serde_json::json!({
        "added_tokens_decoder": added,
        "additional_special_tokens": additional,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_count_and_uniqueness() {
        for vocab in [256, 300, 512, 1024, 8192] {
            let r = ranks(vocab);
            assert_eq!(r.len(), n_ranks(vocab), "vocab {vocab}");
            let set: HashSet<&Vec<u8>> = r.iter().collect();
            assert_eq!(set.len(), r.len(), "duplicate token for vocab {vocab}");
            for (b, tok) in r.iter().take(256).enumerate() {
                assert_eq!(*tok, vec![b as u8]);
            }
        }
        assert_eq!(n_ranks(8192) + 256, 8192);
    }

    #[test]
    fn every_merge_splits_into_two_lower_ranks() {
        let r = ranks(8192);
        let index: std::collections::HashMap<&[u8], usize> = r
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_slice(), i))
            .collect();
        for (i, t) in r.iter().enumerate().skip(256) {
            let ok = (1..t.len()).any(|k| {
                matches!((index.get(&t[..k]), index.get(&t[k..])), (Some(&a), Some(&b)) if a < i && b < i)
            });
            assert!(
                ok,
                "rank {i} {:?} is not a merge of lower ranks",
                String::from_utf8_lossy(t)
            );
        }
    }

    #[test]
    fn config_names_specials_at_k3_offsets() {
        let c = tokenizer_config(7936);
        let d = &c["added_tokens_decoder"];
        assert_eq!(d["7936"]["content"], "[BOS]");
        assert_eq!(d["7938"]["content"], "<|end_of_msg|>");
        assert_eq!(d["7939"]["special"], false);
        assert_eq!(d["8191"]["content"], "[PAD]");
        assert_eq!(d["8190"]["content"], "[UNK]");
    }
}
