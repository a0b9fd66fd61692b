//! Tokenizer (the `tokenizers` crate), built from GGUF metadata or a
//! tokenizer.json, plus chat templates and streaming detokenization.
//!
//! Invariants:
//! - A GGUF's pre-tokenizer follows its `tokenizer.ggml.pre` the way
//!   llama.cpp does (SmolLM2's `smollm`: individual digits, then byte-level
//!   with the GPT-2 regex and no prefix space), so ids match llama.cpp.
//! - Control and user-defined tokens are added tokens: text such as
//!   `<|im_start|>` encodes to its single id.
//! - `StreamDecoder` never emits a partial UTF-8 character.

use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use crate::error::{Result, SpecdError};

/// One chat message for the template. The optional fields are what
/// Hugging Face chat templates read for tool use: an assistant turn's
/// `tool_calls` (`[{"id", "type": "function", "function": {"name",
/// "arguments": {...}}}]`, arguments as an object) and a `tool` turn's
/// `tool_call_id` and `name`; absent ones are undefined in the template.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens encoded as the text they
    /// spell (for untrusted text: message content, completion prompts).
    text_only: tokenizers::Tokenizer,
    chat_template: Option<String>,
    /// The chat template compiled once, at first use (or
    /// `check_chat_template`):
    /// the environment, or why the template does not compile.
    chat_env: std::sync::OnceLock<std::result::Result<ChatEnv, String>>,
    bos_token: String,
    eos_token: String,
    add_bos: Option<u32>,
}

type ChatEnv = std::sync::Arc<minijinja::Environment<'static>>;

/// The template `apply_chat_template` uses when a model has none.
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// `src` compiled in an environment with what Hugging Face templates use.
fn compile_chat(src: &str) -> std::result::Result<ChatEnv, String> {
    let mut env = minijinja::Environment::new();
    // Python's string and dict methods (`startswith`, `split`, `strip`,
    // `items`...), which Hugging Face templates (Qwen3's among them) call
    // as Jinja2 under Python allows.
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    // Hugging Face renders `tojson` with Python's `json.dumps` (", " and
    // ": " separators, no HTML escaping), which is what models saw in
    // training; minijinja's own is compact and HTML-safe.
    env.add_filter("tojson", py_tojson);
    env.add_template_owned("chat", src.to_string())
        .map_err(|e| e.to_string())?;
    Ok(std::sync::Arc::new(env))
}

fn text_only(t: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    let mut t = t.clone();
    t.set_encode_special_tokens(true);
    t
}

/// Placeholder delimiters for message content while the template renders
/// (private-use code points; content never reaches the rendered text).
const HOLE_OPEN: char = '\u{F8F0}';
const HOLE_CLOSE: char = '\u{F8F1}';

/// GPT-2's byte-level table inverted: the character standing for each byte.
fn byte_level_inverse() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<char, u8>> =
        std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut m = std::collections::HashMap::new();
        let mut n = 0u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let c = if printable {
                char::from(b)
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap_or('?')
            };
            m.insert(c, b);
        }
        m
    })
}

/// Jinja's `tojson` as Hugging Face's templates run it (Python's
/// `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`):
/// ", " and ": " between items (with `indent`, a newline and that many
/// spaces per level, and "," between items), non-ASCII kept, nothing
/// HTML-escaped; keys in the order they came.
fn py_tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    write_py_json(&v, indent, sort.unwrap_or(false), 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn write_py_json(
    v: &serde_json::Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_py_json(x, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(m) if !m.is_empty() => {
            let mut items: Vec<(&String, &J)> = m.iter().collect();
            if sort {
                items.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(x, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn tk_err(e: impl std::fmt::Display) -> SpecdError {
    SpecdError::Tokenizer(e.to_string())
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let s = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tk_err)?;
    Ok(s.into())
}

impl Tokenizer {
    /// Build from a GGUF's `tokenizer.*` metadata.
    pub fn from_gguf(path: &Path, ct: &Content) -> Result<Self> {
        let md = &ct.metadata;
        let strs = |key: &str| -> Result<Vec<String>> {
            match md.get(key) {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| v.to_string().cloned().map_err(tk_err))
                    .collect(),
                _ => Err(SpecdError::Tokenizer(format!(
                    "{} has no {key} metadata",
                    path.display()
                ))),
            }
        };
        let get_str = |key: &str| match md.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        let get_u32 = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        let tokens = strs("tokenizer.ggml.tokens")?;
        let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let model = get_str("tokenizer.ggml.model").unwrap_or_else(|| "gpt2".into());
        let pre = get_str("tokenizer.ggml.pre").unwrap_or_else(|| "default".into());
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut inner = match model.as_str() {
            "gpt2" => {
                let merges: Vec<(String, String)> = strs("tokenizer.ggml.merges")?
                    .into_iter()
                    .filter_map(|m| {
                        m.split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                    })
                    .collect();
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .map_err(tk_err)?;
                let mut t = tokenizers::Tokenizer::new(bpe);
                let byte_level = ByteLevel::new(false, true, true);
                let pre_tok: PreTokenizerWrapper = match pre.as_str() {
                    "smollm" | "starcoder" | "refact" | "falcon" => {
                        Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
                    }
                    "llama-bpe" | "llama3" | "smaug-bpe" => Sequence::new(vec![
                        split(LLAMA3_SPLIT)?,
                        ByteLevel::new(false, true, false).into(),
                    ])
                    .into(),
                    "qwen2" | "deepseek-llm" => Sequence::new(vec![
                        split(QWEN2_SPLIT)?,
                        ByteLevel::new(false, true, false).into(),
                    ])
                    .into(),
                    "default" | "gpt2" | "gpt-2" => byte_level.into(),
                    // Another pre-tokenizer splits text differently: ids
                    // would silently differ from the model's.
                    other => {
                        return Err(SpecdError::Tokenizer(format!(
                            "{}: tokenizer.ggml.pre '{other}' is not supported (supported: default, gpt2, smollm, starcoder, refact, falcon, llama-bpe, llama3, smaug-bpe, qwen2, deepseek-llm)",
                            path.display()
                        )))
                    }
                };
                t.with_pre_tokenizer(Some(pre_tok));
                t.with_decoder(Some(ByteLevelDecoder::default()));
                t
            }
            "llama" => {
                // SentencePiece BPE: merges ranked by the merged piece's score,
                // as Hugging Face's Llama converter derives them.
                let scores: Vec<f32> = match md.get("tokenizer.ggml.scores") {
                    Some(Value::Array(a)) => a.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect(),
                    _ => vec![0.0; tokens.len()],
                };
                if scores.len() != tokens.len() {
                    return Err(SpecdError::Tokenizer(format!(
                        "{}: tokenizer.ggml.scores has {} entries for {} tokens",
                        path.display(),
                        scores.len(),
                        tokens.len()
                    )));
                }
                let mut merges: Vec<(f32, u32, String, String)> = Vec::new();
                for (i, piece) in tokens.iter().enumerate() {
                    if types.get(i).copied().unwrap_or(1) != 1 {
                        continue;
                    }
                    for (split_at, _) in piece.char_indices().skip(1) {
                        let (a, b) = piece.split_at(split_at);
                        if let (Some(&ia), Some(&ib)) = (vocab.get(a), vocab.get(b)) {
                            merges.push((scores[i], ia.max(ib), a.to_string(), b.to_string()));
                        }
                    }
                }
                merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                let merges = merges.into_iter().map(|(_, _, a, b)| (a, b)).collect();
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .byte_fallback(true)
                    .fuse_unk(true)
                    .unk_token(
                        tokens
                            .get(get_u32("tokenizer.ggml.unknown_token_id").unwrap_or(0) as usize)
                            .cloned()
                            .unwrap_or_default(),
                    )
                    .build()
                    .map_err(tk_err)?;
                let mut t = tokenizers::Tokenizer::new(bpe);
                // SentencePiece's dummy prefix: on unless the GGUF says
                // otherwise (Gemma's is off).
                let space_prefix = !matches!(
                    md.get("tokenizer.ggml.add_space_prefix"),
                    Some(Value::Bool(false))
                );
                let replace: NormalizerWrapper = Replace::new(" ", "▁").map_err(tk_err)?.into();
                let mut norm = vec![replace];
                if space_prefix {
                    norm.insert(0, Prepend::new("▁".into()).into());
                }
                t.with_normalizer(Some(NormalizerSequence::new(norm)));
                let mut dec: Vec<DecoderWrapper> = vec![
                    Replace::new("▁", " ").map_err(tk_err)?.into(),
                    ByteFallback::new().into(),
                    Fuse::new().into(),
                ];
                if space_prefix {
                    dec.push(Strip::new(' ', 1, 0).into());
                }
                t.with_decoder(Some(DecoderSequence::new(dec)));
                t
            }
            other => {
                return Err(SpecdError::Tokenizer(format!(
                    "unsupported GGUF tokenizer model '{other}' (supported: gpt2, llama)"
                )))
            }
        };
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &ty)| ty == 3 || ty == 4)
            .map(|(t, &ty)| AddedToken::from(t.clone(), ty == 3))
            .collect();
        inner.add_special_tokens(&added);
        let tok_name = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        let bos_id = get_u32("tokenizer.ggml.bos_token_id");
        let add_bos = match md.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            _ => model == "llama",
        };
        Ok(Self {
            text_only: text_only(&inner),
            inner,
            chat_template: get_str("tokenizer.chat_template"),
            chat_env: Default::default(),
            bos_token: tok_name(bos_id),
            eos_token: tok_name(get_u32("tokenizer.ggml.eos_token_id")),
            add_bos: if add_bos { bos_id } else { None },
        })
    }

    /// Load a Hugging Face `tokenizer.json` (chat template and special tokens
    /// from a sibling `tokenizer_config.json` when present).
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| SpecdError::Tokenizer(format!("{}: {e}", path.display())))?;
        let mut t = Self {
            text_only: text_only(&inner),
            inner,
            chat_template: None,
            chat_env: Default::default(),
            bos_token: String::new(),
            eos_token: String::new(),
            add_bos: None,
        };
        if let Some(dir) = path.parent() {
            let cfg = dir.join("tokenizer_config.json");
            if let Ok(text) = std::fs::read_to_string(&cfg) {
                let v: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| SpecdError::Tokenizer(format!("{}: {e}", cfg.display())))?;
                let tok_str = |k: &str| match &v[k] {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Object(o) => o
                        .get("content")
                        .and_then(|c| c.as_str())
                        .unwrap_or_default()
                        .to_string(),
                    _ => String::new(),
                };
                t.chat_template = v["chat_template"].as_str().map(str::to_string);
                t.bos_token = tok_str("bos_token");
                t.eos_token = tok_str("eos_token");
            }
        }
        Ok(t)
    }

    /// The tokenizer for a model path: GGUF metadata, or the directory's
    /// tokenizer.json.
    pub fn for_model(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Self::from_file(&path.join("tokenizer.json"))
        } else {
            let ct = crate::load::read_gguf_header(path)?;
            Self::from_gguf(path, &ct)
        }
    }

    /// Write the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| SpecdError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// The BOS id this model prepends, if it prepends one.
    pub fn bos_id(&self) -> Option<u32> {
        self.add_bos
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encode text; `special` adds BOS where the model wants it.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(tk_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if special {
            ids.extend(self.add_bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Encode untrusted text: special tokens in it (`<|im_start|>`, ...)
    /// become the ordinary tokens that spell them, never control tokens.
    /// `special` adds BOS where the model wants it.
    pub fn encode_text(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self.text_only.encode_fast(text, false).map_err(tk_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if special {
            ids.extend(self.add_bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of a chat: the template's own text (its role markers) is
    /// encoded with special tokens, each message's content as text
    /// (`encode_text`), so content cannot forge a turn. With
    /// `trust_content`, content is parsed for special tokens like the
    /// template (the old behaviour, for trusted deployments).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        trust_content: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None, add_generation_prompt, trust_content)
    }

    /// `encode_chat` with `tools` (OpenAI's list of `{"type": "function",
    /// "function": {...}}`) handed to the template, as Hugging Face's
    /// `apply_chat_template(tools=...)` does. The template writes tool
    /// definitions and earlier calls' arguments itself (as JSON), so
    /// unless `trust_content` any of them that spells one of the
    /// tokenizer's added tokens is refused, naming the field: it would
    /// become a control token.
    pub fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        trust_content: bool,
    ) -> Result<Vec<u32>> {
        if trust_content {
            let text =
                self.apply_chat_template_with_tools(messages, tools, add_generation_prompt)?;
            return self.encode(&text, false);
        }
        if let Some(t) = tools {
            self.refuse_added_tokens("tools", "tools", &t.to_string())?;
        }
        for (i, m) in messages.iter().enumerate() {
            if let Some(c) = &m.tool_calls {
                let at = format!("messages[{i}].tool_calls");
                self.refuse_added_tokens("messages", &at, &c.to_string())?;
            }
            for (f, v) in [("tool_call_id", &m.tool_call_id), ("name", &m.name)] {
                if let Some(v) = v {
                    self.refuse_added_tokens("messages", &format!("messages[{i}].{f}"), v)?;
                }
            }
        }
        // Empty content needs no hole (it encodes to nothing), and a
        // template that tests it (`if message.content`) sees it empty.
        let holes: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: if m.content.is_empty() {
                    String::new()
                } else {
                    format!("{HOLE_OPEN}{i}{HOLE_CLOSE}")
                },
                ..m.clone()
            })
            .collect();
        let rendered = self.apply_chat_template_with_tools(&holes, tools, add_generation_prompt)?;
        let mut ids = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(open) = rest.find(HOLE_OPEN) {
            ids.extend(self.encode(&rest[..open], false)?);
            let after = &rest[open + HOLE_OPEN.len_utf8()..];
            let close = after.find(HOLE_CLOSE).ok_or_else(|| {
                SpecdError::Tokenizer("chat template: a message's content was cut".into())
            })?;
            let i: usize = after[..close].parse().map_err(|_| {
                SpecdError::Tokenizer("chat template: a message's content was altered".into())
            })?;
            let m = messages.get(i).ok_or_else(|| {
                SpecdError::Tokenizer("chat template: a message's content was altered".into())
            })?;
            ids.extend(self.encode_text(&m.content, false)?);
            rest = &after[close + HOLE_CLOSE.len_utf8()..];
        }
        ids.extend(self.encode(rest, false)?);
        Ok(ids)
    }

    /// The bytes a token stands for: byte-level BPE pieces mapped back
    /// through GPT-2's byte-to-character table; other tokens (specials,
    /// SentencePiece pieces) as their text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        let table = byte_level_inverse();
        let bytes: Option<Vec<u8>> = piece.chars().map(|c| table.get(&c).copied()).collect();
        match bytes {
            Some(b) if !self.is_special(id) => b,
            _ => self
                .decode(&[id], false)
                .map(String::into_bytes)
                .unwrap_or_else(|_| piece.into_bytes()),
        }
    }

    /// A token as a grammar engine sees it: its bytes, and whether it is a
    /// special (control) token. Byte-level BPE pieces map back through
    /// GPT-2's table; SentencePiece byte-fallback pieces (`<0x0A>`) are
    /// their byte and `▁` is a space. `None` for an id the vocabulary lacks.
    pub fn grammar_token(&self, id: u32) -> Option<(Vec<u8>, bool)> {
        let piece = self.inner.id_to_token(id)?;
        if self.is_special(id) {
            return Some((piece.into_bytes(), true));
        }
        let table = byte_level_inverse();
        if let Some(b) = piece
            .chars()
            .map(|c| table.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
        {
            return Some((b, false));
        }
        let hex = piece
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .filter(|h| h.len() == 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        Some(match hex {
            Some(b) => (vec![b], false),
            None => (piece.replace('\u{2581}', " ").into_bytes(), false),
        })
    }

    fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tk_err)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The same tokenizer with `template` as its chat template (a base
    /// model's file carries none; a deployment may bring its own).
    pub fn with_chat_template(mut self, template: impl Into<String>) -> Self {
        self.chat_template = Some(template.into());
        self.chat_env = Default::default();
        self
    }

    /// The compiled chat template, or why it does not compile (a fault of
    /// the model file or the deployment, never of a request).
    fn chat_env(&self) -> Result<&ChatEnv> {
        self.chat_env
            .get_or_init(|| compile_chat(self.chat_template.as_deref().unwrap_or(CHATML)))
            .as_ref()
            .map_err(|e| {
                SpecdError::Tokenizer(format!(
                    "the chat template does not compile ({e}); give a working one with `[model] chat_template`"
                ))
            })
    }

    /// Compile the chat template and render one user turn with it, so a
    /// server refuses to start with a template every chat request would
    /// fail on (instead of answering each client with its error).
    pub fn check_chat_template(&self) -> Result<()> {
        self.chat_env()?;
        self.apply_chat_template(&[ChatMessage::user("Hello")], true)
            .map(|_| ())
            .map_err(|e| {
                SpecdError::Tokenizer(format!(
                    "the chat template fails on a single user message ({e}); give a working one with `[model] chat_template`"
                ))
            })
    }

    /// `Err` for request field `field` (at `at`) if `text` spells one of
    /// the added tokens.
    fn refuse_added_tokens(&self, field: &'static str, at: &str, text: &str) -> Result<()> {
        // The characters that mark where message contents go in the
        // rendered template: text the template writes must not spell them.
        if let Some(c) = text.chars().find(|&c| c == HOLE_OPEN || c == HOLE_CLOSE) {
            return Err(SpecdError::invalid_field(
                field,
                format!(
                    "`{at}` contains U+{:04X}, a private-use character this server reserves",
                    c as u32
                ),
            ));
        }
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        match added
            .values()
            .find(|t| !t.content.is_empty() && text.contains(&t.content))
        {
            Some(t) => Err(SpecdError::invalid_field(
                field,
                format!(
                    "`{at}` contains `{}`, one of the model's control tokens",
                    t.content
                ),
            )),
            None => Ok(()),
        }
    }

    /// Whether the chat template documents tools and the calls it expects
    /// in the `<tool_call>` JSON format specd parses (Hermes', which
    /// Qwen 2.5 and 3, Hermes and SmolLM3 templates use): such a template
    /// gets the request's `tools`, `tool_calls` and `tool` turns as they
    /// are. Other templates (none, or another call format) get the tools
    /// documented in a system turn instead (`structured::tools`).
    pub fn native_tool_template(&self) -> bool {
        self.chat_template
            .as_deref()
            .is_some_and(|t| t.contains("tools") && t.contains("<tool_call>"))
    }

    /// Render messages with the model's chat template (ChatML if none).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// `apply_chat_template` with `tools` in the template's context.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.chat_env()?;
        let tmpl = env.get_template("chat").map_err(tk_err)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        // A template that compiles but refuses these messages (its
        // `raise_exception`, e.g. roles that do not alternate) is the
        // request's fault; one that does not compile is the deployment's.
        .map_err(|e| {
            SpecdError::invalid_field(
                "messages",
                format!("the model's chat template refused them: {e}"),
            )
        })
    }
}

/// Incremental detokenizer: feed ids one at a time, get text that is safe
/// to print (whole UTF-8 characters, with byte-level merges resolved).
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one token; returns the newly completed text (possibly empty).
    /// Special (control) tokens add no text, as the API promises (it
    /// always skips them): an end of sequence generated under
    /// `ignore_eos`, or one a grammar ends with, is not `<|im_end|>` in
    /// the output.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        if tok.is_special(id) {
            return Ok(String::new());
        }
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], false)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let text = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(text)
        } else {
            Ok(String::new())
        }
    }

    /// Everything still held back (e.g. an incomplete character at the end).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], false)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// A fingerprint of a vocabulary: SHA-256 over every id's token string
/// (absent strings hash as empty), so a compact draft, which ships no
/// tokenizer, can check it is paired with the target it was trained for.
pub fn vocab_fingerprint(texts: impl Iterator<Item = Option<String>>) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for t in texts {
        h.update(t.unwrap_or_default().as_bytes());
        h.update([0u8]);
    }
    format!("{:x}", h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_template(template: &str) -> Tokenizer {
        let vocab = [("[UNK]", 0u32), ("a", 1), ("b", 2)]
            .into_iter()
            .map(|(w, i)| (w.to_string(), i))
            .collect();
        let model = tokenizers::models::wordlevel::WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let inner = tokenizers::Tokenizer::new(model);
        Tokenizer {
            text_only: text_only(&inner),
            inner,
            chat_template: Some(template.into()),
            chat_env: Default::default(),
            bos_token: String::new(),
            eos_token: String::new(),
            add_bos: None,
        }
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let t = with_template(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ tools | tojson(sort_keys=true) }}",
        );
        let tools = serde_json::json!([{"z": "<b>&'é", "a": [1, 2.5, null, true], "e": {}}]);
        let out = t
            .apply_chat_template_with_tools(&[ChatMessage::user("a")], Some(&tools), false)
            .unwrap();
        assert_eq!(
            out,
            "[{\"z\": \"<b>&'é\", \"a\": [1, 2.5, null, true], \"e\": {}}]|\
             {\n  \"z\": \"<b>&'é\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"e\": {}\n}|\
             [{\"a\": [1, 2.5, null, true], \"e\": {}, \"z\": \"<b>&'é\"}]"
        );
        // No tools: the template sees none.
        let t = with_template("{% if tools %}tools{% else %}none{% endif %}");
        assert_eq!(
            t.apply_chat_template(&[ChatMessage::user("a")], false)
                .unwrap(),
            "none"
        );
        assert!(!t.native_tool_template());
    }

    #[test]
    fn a_template_that_refuses_the_messages_is_the_requests_fault() {
        let t = with_template(
            "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}\
             {{ messages[0].content }}",
        );
        let m = |c: &str| ChatMessage::user(c);
        assert!(t.encode_chat(&[m("a")], true, false).is_ok());
        for trusted in [false, true] {
            let e = t.encode_chat(&[m("a"), m("b")], true, trusted).unwrap_err();
            assert!(
                matches!(
                    e,
                    SpecdError::InvalidField {
                        field: "messages",
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(e.to_string().contains("one message only"), "{e}");
        }
        // A template that does not compile is the deployment's.
        let broken = with_template("{% if %}");
        let e = broken.encode_chat(&[m("a")], true, false).unwrap_err();
        assert!(matches!(e, SpecdError::Tokenizer(_)), "{e:?}");
    }
}
