//! k3-text: tokenizer and chat format.
