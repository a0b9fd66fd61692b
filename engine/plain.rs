//! Plain (non-speculative) decoding of one request: the reference that every
//! speculative path must reproduce token for token under greedy decoding,
//! and under seeded sampling with one-hot drafts (`speculative::accept`).

use std::time::{Duration, Instant};

use crate::error::{Result, SpecdError};
use crate::model::{Logits, Model};
use crate::sampler::{self, FinishReason, Rng, StopBuffer};
use crate::speculative::Request;
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub time_to_first_token: Duration,
    pub total_time: Duration,
}

impl GenerateOutput {
    /// Decode throughput after the first token.
    pub fn decode_tok_per_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1) as f64;
        let t = (self.total_time - self.time_to_first_token).as_secs_f64();
        if t > 0.0 {
            n / t
        } else {
            0.0
        }
    }
}

/// Decode plainly (the reference every proposer is compared against),
/// calling `on_text` with each piece of safe-to-print text. The request's
/// proposer fields are ignored.
pub fn generate(
    model: &Model,
    tokenizer: Option<&Tokenizer>,
    req: &Request,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput> {
    req.validate(model.config.max_seq_len)?;
    if !req.stop.is_empty() && tokenizer.is_none() {
        return Err(SpecdError::InvalidField {
            field: "stop",
            msg: "stop strings need a tokenizer".into(),
        });
    }
    let start = Instant::now();
    let mut cache = model.new_cache();
    let mut rng = Rng::new(req.params.seed);
    let mut stream = StreamDecoder::new();
    let mut stops = StopBuffer::new(req.stop.clone());
    let mut context = req.prompt.clone();
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut ttft = Duration::ZERO;
    let mut finish = FinishReason::Length;
    let mut guide = req.constraint.as_ref().map(|c| c.start());
    let mut out = model.forward_one(&mut cache, &req.prompt, Logits::Last)?;
    while tokens.len() < req.max_tokens {
        let mut logits = out.logits;
        // The constrained law: disallowed tokens at -inf, then the
        // request's transforms.
        if let Some(g) = guide.as_mut() {
            g.mask_row(&mut logits)?;
        }
        if let Some(ban) = req.end_ban(&model.config.eos_token_ids, tokens.len()) {
            sampler::suppress(&mut logits, &ban.ids);
        }
        sampler::apply_penalties(&mut logits, &context, &tokens, &req.params);
        // Each position draws from its own stream, seeded by one draw of
        // the request's (as acceptance does), so speculative decoding with
        // one-hot drafts emits these very tokens for the same seed.
        let next =
            sampler::distribution(&logits, &req.params).sample(&mut Rng::new(rng.next_u64()));
        if tokens.is_empty() {
            ttft = start.elapsed();
        }
        if let Some(g) = guide.as_mut() {
            g.advance(next)?;
        }
        if req.ends_at(&model.config.eos_token_ids, next) {
            finish = FinishReason::Stop;
            break;
        }
        tokens.push(next);
        context.push(next);
        if let Some(tok) = tokenizer {
            let piece = stream.push(tok, next)?;
            let emit = stops.push_checked(&piece, tokens.len() > req.min_tokens);
            on_text(&emit);
            text.push_str(&emit);
            if stops.stopped() {
                finish = FinishReason::Stop;
                break;
            }
        }
        if guide.as_ref().is_some_and(|g| g.done()) {
            finish = FinishReason::Stop;
            break;
        }
        if tokens.len() == req.max_tokens {
            break;
        }
        out = model.forward_one(&mut cache, &[next], Logits::Last)?;
    }
    if let Some(tok) = tokenizer {
        if !stops.stopped() {
            let rest = stream.flush(tok)?;
            let mut emit = stops.push(&rest);
            if !stops.stopped() {
                emit.push_str(&stops.finish());
            }
            on_text(&emit);
            text.push_str(&emit);
        }
    }
    Ok(GenerateOutput {
        tokens,
        text,
        finish,
        prompt_tokens: req.prompt.len(),
        time_to_first_token: ttft,
        total_time: start.elapsed(),
    })
}
