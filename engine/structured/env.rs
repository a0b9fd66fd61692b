//! llguidance's tokenizer environment written over specd's own tokenizer
//! (not `toktrie_hf_tokenizers`, which pulls a second `tokenizers`).
//!
//! Invariants:
//! - The trie covers the model's whole logits width: ids the tokenizer
//!   lacks (padding rows) are special placeholders no grammar can emit.
//! - Special tokens carry llguidance's marker byte, so text never matches
//!   them; the model's end-of-sequence ids are the trie's EOS set.

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;

pub struct SpecdTokEnv {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl SpecdTokEnv {
    /// `vocab`: the model's logits width; `eos`: its end-of-sequence ids
    /// (the first is the primary one).
    pub fn new(tokenizer: Tokenizer, vocab: usize, eos: &[u32]) -> Self {
        let mut words = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let (bytes, special) = tokenizer
                .grammar_token(id)
                .unwrap_or_else(|| (format!("<[{id}]>").into_bytes(), true));
            words.push(if special {
                let mut b = Vec::with_capacity(bytes.len() + 1);
                b.push(TokTrie::SPECIAL_TOKEN_MARKER);
                b.extend_from_slice(&bytes);
                b
            } else {
                bytes
            });
        }
        let eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&e| (e as usize) < vocab)
            .collect();
        let mut info = TokRxInfo::new(vocab as u32, eos.first().copied().unwrap_or(0));
        if let Some(bos) = tokenizer.bos_id() {
            info.tok_bos = Some(bos);
        }
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        Self { tokenizer, trie }
    }
}

impl TokenizerEnv for SpecdTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // Grammar literals are text, never control tokens.
            self.tokenizer.encode_text(text, false).unwrap_or_default()
        })
    }
}
