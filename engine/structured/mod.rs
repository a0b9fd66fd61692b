//! Structured outputs: a request's constraint (a JSON object, a JSON
//! schema, a regular expression or a Lark grammar) compiled by llguidance
//! over specd's tokenizer, and the per-sequence [`Guide`] the accept stage
//! advances.
//!
//! The constrained target distribution at a position is the request's
//! sampling law applied to logits whose disallowed tokens are set to -inf
//! (the mask first, then penalties, bias, temperature, top-k/p, min-p, as
//! vLLM, SGLang and llama.cpp apply a grammar). Acceptance verifies every
//! draft against that law, so speculation stays lossless under a
//! constraint.
//!
//! Invariants:
//! - A constraint is compiled when the request is validated, so an invalid
//!   schema or grammar is a 400 before anything runs; each sequence starts
//!   from a deep copy of the compiled matcher.
//! - A guide advances only along tokens the accept stage emits (the
//!   accepted path and its correction or bonus token). Rejected drafts and
//!   tree siblings never touch it, so no rollback is needed.
//! - End of sequence is allowed exactly when the constraint accepts the
//!   output. Once nothing else can follow (or end of sequence was
//!   consumed) the guide is `done` and the sequence finishes with `stop`.
//! - A guide error (a token the constraint rejects reaching it, an empty
//!   allowed set) fails that sequence alone.

pub mod env;
pub mod tools;

use std::sync::{Arc, Mutex};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::error::{Result, SpecdError};
use crate::tokenizer::Tokenizer;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema"}`).
    JsonSchema(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect) whose `start` rule the output
    /// matches.
    Lark(String),
}

impl ConstraintSpec {
    /// Short name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonObject => "json_object",
            Self::JsonSchema(_) => "json_schema",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
        }
    }

    /// JSON layout specd asks of a schema unless the schema sets its own
    /// `x-guidance` options: `", "` and `": "` separators and no free
    /// whitespace, the way models print JSON inline; the skeleton is then
    /// forced token for token.
    fn with_layout(mut schema: Value) -> Value {
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert_with(|| {
                json!({
                    "whitespace_flexible": false,
                    "item_separator": ", ",
                    "key_separator": ": ",
                })
            });
        }
        schema
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(Self::with_layout(json!({"type": "object"})))
            }
            Self::JsonSchema(s) => TopLevelGrammar::from_json_schema(Self::with_layout(s.clone())),
            Self::Regex(r) => TopLevelGrammar::from_regex(r),
            Self::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The grammar compiler for one model: llguidance's parser factory over
/// specd's tokenizer. Built once per model (its token trie covers the whole
/// vocabulary) and shared.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish()
    }
}

/// Bounds on what one grammar may cost to compile and to step. Masks run
/// on the engine's acceptance thread, which every request shares, so the
/// per-token bounds are a quarter of llguidance's defaults (lexer fuel
/// 50k, about 3.5 ms by its figures, against 200k; Earley items 20k, about
/// 1 ms, against 50k) and a grammar's lexer holds at most 100k states
/// (against 250k, 1-2 kB each, copied per sequence). A grammar that needs
/// more fails its request with the library's error, never the engine.
fn limits() -> ParserLimits {
    ParserLimits {
        step_lexer_fuel: 50_000,
        step_max_items: 20_000,
        max_lexer_states: 100_000,
        max_grammar_size: 500_000,
        ..ParserLimits::default()
    }
}

impl Grammars {
    /// `vocab`: the model's logits width; `eos`: its end-of-sequence ids.
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self> {
        let env: TokEnv = Arc::new(env::SpecdTokEnv::new(tokenizer.clone(), vocab, eos));
        // The slices (JSON string bodies, whitespace) let a mask inside a
        // string copy precomputed token sets instead of walking the
        // whole vocabulary: several times faster where most tokens fit.
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &slices)
            .map_err(|e| SpecdError::Tokenizer(format!("grammar engine: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self {
            factory,
            vocab,
            eos: eos.into(),
        })
    }

    /// Compile `spec`; `field` names the request field in the error.
    pub fn compile(&self, spec: &ConstraintSpec, field: &str) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(spec.grammar())
            .map_err(|e| SpecdError::InvalidRequest(format!("{field}: {}", short(&e))))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(SpecdError::InvalidRequest(format!(
                "{field}: {}",
                short(&e)
            )));
        }
        let mut first = matcher.deep_clone();
        let initial_forced = first.compute_ff_tokens();
        Ok(Constraint {
            kind: spec.kind(),
            proto: Arc::new(Mutex::new(matcher)),
            vocab: self.vocab,
            eos: self.eos.clone(),
            initial_forced,
        })
    }
}

/// An error's first line, bounded (llguidance's messages can quote a whole
/// grammar).
fn short(e: &dyn std::fmt::Display) -> String {
    let s = e.to_string();
    let line = s.lines().next().unwrap_or("").trim();
    let mut out: String = line.chars().take(300).collect();
    if out.len() < line.len() {
        out.push('…');
    }
    out
}

/// A compiled constraint: cheap to clone; each sequence starts its own
/// [`Guide`] from it.
#[derive(Clone)]
pub struct Constraint {
    kind: &'static str,
    proto: Arc<Mutex<Matcher>>,
    vocab: usize,
    eos: Arc<[u32]>,
    initial_forced: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.kind)
            .finish()
    }
}

impl Constraint {
    /// The tokens forced at the start of the output.
    pub fn initial_forced(&self) -> &[u32] {
        &self.initial_forced
    }

    /// A fresh guide at the start of the output.
    pub fn start(&self) -> Guide {
        let m = match self.proto.lock() {
            Ok(m) => m.deep_clone(),
            Err(p) => p.into_inner().deep_clone(),
        };
        Guide {
            m,
            vocab: self.vocab,
            eos: self.eos.clone(),
            done: false,
            next_mask: None,
            ff: None,
            sampled: false,
        }
    }

    /// A guide that has consumed `tokens` (a resumed or replayed output).
    pub fn start_at(&self, tokens: &[u32]) -> Result<Guide> {
        let mut g = self.start();
        for &t in tokens {
            g.advance(t)?;
        }
        Ok(g)
    }
}

/// One sequence's position in its constraint.
pub struct Guide {
    m: Matcher,
    vocab: usize,
    eos: Arc<[u32]>,
    done: bool,
    /// The allowed set at the current position, computed ahead
    /// (`prefetch`); any advance drops it.
    next_mask: Option<SimpleVob>,
    /// The forced tokens at the current position, once computed.
    ff: Option<Vec<u32>>,
    /// Set by the accept stage: the sequence samples, so its masks are
    /// worth computing ahead.
    pub sampled: bool,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("done", &self.done).finish()
    }
}

fn guide_err(e: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("constraint: {}", short(&e)))
}

impl Guide {
    /// The tokens allowed next (end of sequence only once the output is
    /// complete).
    pub fn allowed(&mut self) -> Result<SimpleVob> {
        if let Some(m) = self.next_mask.take() {
            return Ok(m);
        }
        let mask = self.m.compute_mask_or_eos().map_err(guide_err)?;
        if mask.is_zero() {
            return Err(guide_err("no token can continue the output"));
        }
        Ok(mask)
    }

    /// Whether `token` may come next, exactly as [`Guide::allowed`]
    /// decides, without computing the mask (one lexer step), for a greedy
    /// argmax that is usually allowed. Where the grammar forces bytes the
    /// mask admits only their canonical first token (llguidance's rule,
    /// so every path tokenises forced text alike), and so does this.
    pub fn allows(&mut self, token: u32) -> bool {
        if self.done {
            return self.eos.contains(&token);
        }
        if token as usize >= self.vocab {
            return false;
        }
        if let Some(&f) = self.ff().first() {
            return token == f;
        }
        if self.eos.contains(&token) {
            return self.m.is_accepting().unwrap_or(false);
        }
        matches!(self.m.validate_tokens(&[token]), Ok(1))
    }

    /// Compute the current position's mask ahead of its use (kept until
    /// the next advance; an error is left for `allowed` to report).
    pub fn prefetch(&mut self) {
        if self.next_mask.is_none() {
            self.next_mask = self.allowed().ok();
        }
    }

    /// Set every disallowed logit of `row` to -inf.
    pub fn mask_row(&mut self, row: &mut [f32]) -> Result<()> {
        let mask = self.allowed()?;
        apply_mask(&mask, row);
        Ok(())
    }

    /// Consume an emitted token. Once the output is complete only end of
    /// sequence may follow.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        if self.done {
            if self.eos.contains(&token) {
                return Ok(());
            }
            return Err(guide_err("output continued past the constraint's end"));
        }
        self.next_mask = None;
        self.ff = None;
        self.m.consume_token(token).map_err(guide_err)?;
        if self.m.is_stopped() {
            self.done = true;
        }
        Ok(())
    }

    /// Tokens the constraint forces next (a byte run with one
    /// tokenisation): drafted for free, never consumed here.
    pub fn forced(&mut self) -> Vec<u32> {
        if self.done {
            return Vec::new();
        }
        self.ff().to_vec()
    }

    /// The forced tokens at the current position, computed once per
    /// position (the forced-draft report after a step and the next step's
    /// greedy check both read them; llguidance's next mask reuses them).
    fn ff(&mut self) -> &[u32] {
        let m = &mut self.m;
        self.ff.get_or_insert_with(|| m.compute_ff_tokens())
    }

    /// Whether the output is complete and nothing but end of sequence can
    /// follow (the sequence ends here).
    pub fn done(&self) -> bool {
        self.done
    }
}

/// Set the logits of tokens `mask` disallows to -inf (ids past the mask
/// included).
pub fn apply_mask(mask: &SimpleVob, row: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in row.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}
