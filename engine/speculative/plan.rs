//! Planning a step (the scheduler's stages 1 and 2): admission, then what
//! each running sequence wants (a decode with its draft length, or a
//! prefill chunk) within the step's token budget, then the KV manager's
//! grant applied.
//!
//! Invariants: every step's batch costs at most `max_batch_tokens`
//! tokens, decode steps of running sequences come before new prefill
//! work, a step computes at most `max_prefill_tokens` prompt tokens (the
//! whole blocks the prefix cache holds next ride along free), and a
//! sequence drafts no further than its request, its proposer, its
//! `max_tokens` and the context allow (then what its acceptance pays for).

use super::fairness::{self, Scheduling, Slot};
use super::kv_manager::{Grant, Want};
use super::proposer::{Capabilities, QKind};
use super::scheduler::*;
use super::{Event, SeqId};

impl Scheduler {
    pub(super) fn max_draft_for(&self, s: &Sequence, proposer_cap: Option<usize>) -> usize {
        if s.proposer.is_none() {
            return 0;
        }
        let mut k = self.config.max_draft;
        if let Some(m) = s.req.max_draft {
            k = k.min(m);
        }
        if let Some(c) = proposer_cap {
            k = k.min(c);
        }
        // No drafts past max_tokens or the context.
        let left = s.req.max_tokens.saturating_sub(s.generated().len());
        k = k.min(left.saturating_sub(1));
        k.min(self.config.max_seq_len.saturating_sub(s.cached + 1))
    }

    /// Tokens `s` drafts this step, at most `room`: the cap (request,
    /// proposer, max_tokens, context), then what recent acceptance pays
    /// for at `price` a drafted token's verify plus the proposer's own
    /// cost (configured, or measured where `measured` allows: see
    /// `Capabilities::token_cost`), with a probe now and then.
    pub(super) fn draft_len(
        &self,
        s: &Sequence,
        pcaps: Option<&Capabilities>,
        (price, measured, batch): (f64, bool, usize),
        room: usize,
    ) -> usize {
        let mut k = self
            .max_draft_for(s, pcaps.map(|c| c.max_draft))
            .min(room)
            .min(self.config.max_seq_len.saturating_sub(s.tokens.len()));
        if self.config.adaptive_draft && k > 0 {
            // A drafted token costs its share of the verify plus what
            // the proposer spends drafting it.
            let own = match pcaps.and_then(|c| c.token_cost) {
                Some(c) => c,
                None if measured => s
                    .proposer
                    .as_deref()
                    .and_then(|n| self.own_cost(n, batch))
                    .unwrap_or(0.0),
                None => 0.0,
            };
            let cost = price + own;
            let tree = pcaps.is_some_and(|c| c.tree);
            k = s
                .policy
                .draft_len(k, cost, own, self.config.draft_cost, tree);
        }
        // The constraint's forced tokens are drafted whatever the policy
        // says: they cost verification only and are accepted unless the
        // target's masked choice tokenises the same bytes differently.
        let forced = s.forced.len().min(MAX_FORCED_DRAFT);
        if forced > k {
            k = forced
                .min(room)
                .min(self.config.max_seq_len.saturating_sub(s.tokens.len()));
        }
        k
    }

    /// Step 1: admit waiting requests and list what each running sequence
    /// wants this step, in priority order (fair scheduling: by priority,
    /// then decodes in admission order, then prefills; first come, first
    /// served: without the priorities). `cap(name)` is a proposer's max draft.
    pub fn wants<'c>(
        &mut self,
        caps: impl Fn(&str) -> Option<&'c Capabilities>,
    ) -> (Vec<PlanItem>, Vec<Want>) {
        // Admission: new sequences start prefilling; a forked choice waits
        // for its parent's prefill, then starts from its prompt KV.
        match self.config.scheduling {
            Scheduling::Fcfs => self.admit_fcfs(&caps),
            Scheduling::Fair => self.admit_fair(&caps),
        }
        metrics::gauge!("specd_queue_length").set(self.waiting.len() as f64);
        let mut budget = self.config.max_batch_tokens;
        let mut items = Vec::new();
        let mut wants = Vec::new();
        // Sequences whose prefill is done decode this step.
        // A running id without a sequence would be a bookkeeping bug; such
        // ids are dropped here rather than trusted.
        let seqs = &self.seqs;
        self.running.retain(|id| seqs.contains_key(id));
        for &id in &self.running {
            if let Some(s) = self.seqs.get_mut(&id) {
                if s.status == SeqStatus::Prefill && s.cached >= s.prefill_target() {
                    s.status = SeqStatus::Decoding;
                }
            }
        }
        // Decoding sequences, and how many of them have tokens that do not
        // depend on their draft lengths: greedy ones (the target's argmax
        // path) and sampled ones whose drafts are one-hot (verified by
        // coupling: `accept`). Such a sequence decoding alone drafts at
        // measured prices too.
        let (decoding, free) = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|s| s.status == SeqStatus::Decoding)
            .fold((0, 0), |(n, f), s| {
                // No capabilities: no proposer (or none by that name any
                // more), so its only drafts are a grammar's forced tokens,
                // one-hot.
                let one_hot = s
                    .proposer
                    .as_deref()
                    .and_then(&caps)
                    .is_none_or(|c| c.q_kind == QKind::OneHot);
                (n + 1, f + usize::from(s.req.params.is_greedy() || one_hot))
            });
        let timing_free = decoding == 1 && free == 1;
        let price = self.draft_price(decoding, timing_free);
        // Measured own costs where the verify price is measured too
        // (`draft_price`).
        let pricing = (price, self.measured_price(decoding, timing_free), decoding);
        if self.config.adaptive_draft && decoding > 0 {
            metrics::gauge!("specd_draft_token_price").set(price);
            self.prices.0 += price;
            self.prices.1 += 1;
        }
        // While a prompt is being prefilled, drafts leave it a floor of
        // the budget (an eighth, at most `max_prefill_tokens`): decodes
        // are planned first, and many decoders drafting (or forcing a
        // grammar's tokens) at their caps could otherwise fill every
        // step, holding a prompt, of any priority, at a token a step.
        let prefilling = self.running.iter().any(|id| {
            self.seqs
                .get(id)
                .is_some_and(|s| s.status == SeqStatus::Prefill)
        });
        let reserve = if prefilling {
            (self.config.max_batch_tokens / 8).min(self.config.max_prefill_tokens)
        } else {
            0
        };
        // Decoders not yet planned: each keeps one token of the budget, so
        // the drafts of those before it never starve it of its decode.
        let mut later = decoding;
        for &id in &self.running {
            let Some(s) = self.seqs.get(&id) else {
                continue;
            };
            if s.status != SeqStatus::Decoding {
                continue;
            }
            later = later.saturating_sub(1);
            if budget == 0 {
                continue;
            }
            let Some(&last) = s.tokens.last() else {
                continue;
            };
            let pcaps = s.proposer.as_deref().and_then(&caps);
            let room = budget.saturating_sub(1 + later + reserve);
            let k = self.draft_len(s, pcaps, pricing, room);
            budget -= 1 + k;
            items.push(PlanItem {
                seq: id,
                cache_len: s.cached,
                work: Work::Decode {
                    last,
                    max_draft: k,
                    prefix: Vec::new(),
                },
                hidden_layers: pcaps.map(|c| c.hidden_layers.clone()).unwrap_or_default(),
                moves: s.pending_moves.clone(),
                siblings: pcaps.map(|c| c.siblings).unwrap_or_default(),
                lookup: pcaps.is_some_and(is_lookup),
                fork_from: s.fork_from,
                prompt_logprobs: None,
                keep_window_from: None,
            });
            wants.push(Want {
                seq: id,
                priority: self.priority_of(s),
                len: s.cached + 1 + k,
                charge: pcaps.map_or(0, |c| c.kv_bytes_per_token),
            });
        }
        // Prefill chunks from what the decodes left (at most
        // `max_prefill_tokens`, or more while the step is quiet:
        // `fairness::prefill_cap`): in admission order (FCFS), or shared
        // fairly across requests (`fairness`). A sequence that can also feed its last
        // token this step asks for it: its first token then comes from
        // this step (`Work::Decode` with a prefix).
        let mut batch_left = budget;
        let cap = match self.config.scheduling {
            Scheduling::Fair => {
                let seqs: Vec<(u64, bool)> = self
                    .running
                    .iter()
                    .chain(&self.waiting)
                    .filter_map(|id| self.seqs.get(id))
                    .map(|s| (s.group, s.status == SeqStatus::Decoding))
                    .collect();
                if fairness::quiet(&seqs) {
                    let cap = fairness::prefill_cap(
                        self.config.max_prefill_tokens,
                        self.config.max_batch_tokens,
                        self.quiet_steps,
                    );
                    self.quiet_steps = self.quiet_steps.saturating_add(1);
                    cap
                } else {
                    self.quiet_steps = 0;
                    self.config.max_prefill_tokens.max(1)
                }
            }
            Scheduling::Fcfs => self.config.max_prefill_tokens.max(1),
        };
        budget = budget.min(cap);
        let bs = crate::model::DEFAULT_BLOCK_SIZE;
        // (slot, prompt tokens to compute (+1 for the last token), whether
        // the last token comes along, prompt tokens the prefix cache holds
        // next: free, outside the budget).
        let prefilling: Vec<(Slot, usize, bool, usize)> = self
            .running
            .iter()
            .filter_map(|&id| {
                let s = self.seqs.get(&id)?;
                let need = s.prefill_target().saturating_sub(s.cached);
                // Fresh prompts only (a recompute after a preemption ends
                // with the decode step it would have had anyway), and not
                // for a proposer that drafts from the prompt's hidden
                // states (this forward computes the last of them).
                let hidden = s
                    .proposer
                    .as_deref()
                    .and_then(&caps)
                    .is_some_and(|c| !c.hidden_layers.is_empty());
                // Blocks the prefix cache holds right after what is cached
                // (whole blocks from a block boundary, as the runner takes
                // them; not for chunks it would compute anyway).
                let free = match &self.prefix {
                    Some(p)
                        if s.status == SeqStatus::Prefill
                            && s.cached % bs == 0
                            && s.req.prompt_logprobs.is_none()
                            && s.fork_from.is_none()
                            && !hidden =>
                    {
                        p.cached_blocks(&s.tokens[..s.prefill_target()], s.cached / bs, bs) * bs
                    }
                    _ => 0,
                };
                // Cached blocks ahead ride in this step's chunk; when the
                // budget holds the rest, the first token comes with them.
                let last = s.req.prompt_logprobs.is_none()
                    && s.fork_from.is_none()
                    && s.generated().is_empty()
                    && !hidden;
                (s.status == SeqStatus::Prefill && need > 0).then_some((
                    self.slot(id, false)?,
                    need - free + usize::from(last),
                    last,
                    free,
                ))
            })
            .collect();
        let needs: Vec<(Slot, usize)> = prefilling.iter().map(|(s, n, _, _)| (*s, *n)).collect();
        let shares = match self.config.scheduling {
            Scheduling::Fair => {
                let (shares, first) =
                    fairness::prefill_shares(budget, &needs, !self.first_token_step);
                self.first_token_step = first;
                shares
            }
            Scheduling::Fcfs => needs
                .iter()
                .map(|(_, need)| {
                    let n = (*need).min(budget);
                    budget -= n;
                    n
                })
                .collect(),
        };
        batch_left = batch_left.saturating_sub(shares.iter().sum::<usize>());
        for ((slot, need, last, free), n) in prefilling.into_iter().zip(shares) {
            let Some(s) = self.seqs.get(&slot.id) else {
                continue;
            };
            let id = slot.id;
            if last && n == need {
                // The whole rest of the prompt, its last token and drafts
                // from what is left of the batch budget.
                let Some((&tok, prefix)) = s.tokens[s.cached..].split_last() else {
                    continue;
                };
                let pcaps = s.proposer.as_deref().and_then(&caps);
                let k = self.draft_len(s, pcaps, pricing, batch_left);
                batch_left -= k;
                items.push(PlanItem {
                    seq: id,
                    cache_len: s.cached,
                    work: Work::Decode {
                        last: tok,
                        max_draft: k,
                        prefix: prefix.to_vec(),
                    },
                    hidden_layers: pcaps.map(|c| c.hidden_layers.clone()).unwrap_or_default(),
                    moves: s.pending_moves.clone(),
                    siblings: pcaps.map(|c| c.siblings).unwrap_or_default(),
                    lookup: pcaps.is_some_and(is_lookup),
                    fork_from: None,
                    prompt_logprobs: None,
                    keep_window_from: None,
                });
                wants.push(Want {
                    seq: id,
                    priority: self.priority_of(s),
                    len: s.tokens.len() + k,
                    charge: pcaps.map_or(0, |c| c.kv_bytes_per_token),
                });
                continue;
            }
            // Without the last token (it waits for the next step).
            // The cached blocks ahead, then what it computes.
            let n = free + n.min(need - usize::from(last));
            if n == 0 {
                continue;
            }
            let pcaps = s.proposer.as_deref().and_then(&caps);
            items.push(PlanItem {
                seq: id,
                cache_len: s.cached,
                work: Work::Prefill(s.tokens[s.cached..s.cached + n].to_vec()),
                hidden_layers: pcaps.map(|c| c.hidden_layers.clone()).unwrap_or_default(),
                moves: Vec::new(),
                siblings: Default::default(),
                lookup: false,
                fork_from: None,
                // Positions before the prompt's last predict prompt
                // tokens; a recompute after a preemption also feeds the
                // generated ones, whose log-probabilities are not asked.
                prompt_logprobs: s.req.prompt_logprobs.and_then(|k| {
                    let end = (s.cached + n).min(s.prompt_len.saturating_sub(1));
                    (end > s.cached).then(|| (k, s.tokens[s.cached + 1..end + 1].to_vec()))
                }),
                keep_window_from: None,
            });
            wants.push(Want {
                seq: id,
                priority: self.priority_of(s),
                len: s.cached + n,
                charge: pcaps.map_or(0, |c| c.kv_bytes_per_token),
            });
        }
        // With sliding-window layers, a choice that may still fork copies
        // its parent's cache at the end of the prompt: the parent keeps
        // the window there (without them nothing is released).
        if self.windowed {
            let mut keep: std::collections::HashMap<SeqId, usize> = Default::default();
            for t in self.seqs.values() {
                if let Some(p) = t.req.fork_of {
                    if t.status == SeqStatus::Waiting || t.fork_from.is_some() {
                        let k = keep.entry(p).or_insert(usize::MAX);
                        *k = (*k).min(t.prefill_target());
                    }
                }
            }
            for it in &mut items {
                it.keep_window_from = keep.get(&it.seq).copied();
                if it.keep_window_from.is_none() {
                    if let Some(s) = self.seqs.get_mut(&it.seq) {
                        s.window_past_prompt |= it.cache_len >= s.prefill_target();
                    }
                }
            }
        }
        // Fair scheduling: blocks go to the better priority first, and
        // under pressure the worst priority is evicted first (a stable
        // sort: decodes before prefills, in admission order, within one
        // priority). First come, first served ignores priorities.
        wants.sort_by_key(|w| w.priority);
        (items, wants)
    }

    /// A sequence's priority as the KV grant sees it: its request's under
    /// fair scheduling; first come, first served ignores priorities.
    fn priority_of(&self, s: &super::sequence::Sequence) -> i32 {
        match self.config.scheduling {
            Scheduling::Fair => s.req.priority,
            Scheduling::Fcfs => 0,
        }
    }

    /// Running sequences that hold KV but want nothing this step (the
    /// token budget ran out before them), in admission order, with their
    /// priorities: the grant's last-resort victims. A forked choice before
    /// its first step holds nothing yet.
    pub fn idle_holders(&self, wants: &[super::kv_manager::Want]) -> Vec<(SeqId, i32)> {
        self.running
            .iter()
            .filter(|id| !wants.iter().any(|w| w.seq == **id))
            .filter_map(|id| {
                let s = self.seqs.get(id)?;
                (s.cached > 0
                    && s.fork_from.is_none()
                    && matches!(s.status, SeqStatus::Decoding | SeqStatus::Prefill))
                .then(|| (*id, self.priority_of(s)))
            })
            .collect()
    }

    /// Step 2: apply the KV manager's grant. Preempted sequences go back to
    /// the front of the queue to be recomputed; deferred ones sit out this
    /// step; sequences that can never fit fail. Returns the items that
    /// run, and the forked choices that lost their parent (they sit out
    /// this step: whatever the grant reserved for them is theirs to give
    /// back at commit).
    pub fn apply_grant(
        &mut self,
        items: Vec<PlanItem>,
        grant: &Grant,
    ) -> (Vec<PlanItem>, Vec<SeqId>) {
        // A forked choice whose parent goes away before the copy (preempted
        // or too big now, or ended in an earlier step while the choice sat
        // out for budget or KV: its cache is released before this step
        // runs) prefills its prompt itself (from the next step).
        let gone: Vec<SeqId> = self
            .seqs
            .values()
            .filter_map(|s| s.fork_from)
            .filter(|p| !self.seqs.contains_key(p))
            .collect();
        let mut unforked = Vec::new();
        for s in self.seqs.values_mut() {
            if s.fork_from.is_some_and(|p| {
                grant.preempted.contains(&p) || grant.too_big.contains(&p) || gone.contains(&p)
            }) {
                s.fork_from = None;
                s.cached = 0;
                s.status = SeqStatus::Prefill;
                unforked.push(s.id);
            }
        }
        for &id in grant.preempted.iter().rev() {
            self.requeue(id, "kv");
        }
        for &id in &grant.too_big {
            if let Some(s) = self.seqs.get(&id) {
                s.send(Event::Error(format!(
                    "request needs more KV cache than the whole budget ({} tokens)",
                    s.prompt_len.saturating_add(s.req.max_tokens)
                )));
            }
            self.running.retain(|&r| r != id);
            self.lifecycle.released.push(id);
            self.lifecycle.ended.push(id);
            if self.seqs.remove(&id).is_some() {
                metrics::counter!("specd_requests_total", "finish" => "error").increment(1);
            }
        }
        let items = items
            .into_iter()
            .filter(|it| grant.granted.contains(&it.seq) && !unforked.contains(&it.seq))
            .collect();
        (items, unforked)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Request;
    use super::*;

    /// Drafts never take the budget a later decoder needs for its own
    /// token: with 6 tokens a step, 4 decoders drafting up to 8 each get
    /// every one of their decodes, the first drafting 2, the rest none
    /// (before, the first drafted 5 and the other three got no decode at
    /// all, in the same order every step).
    #[test]
    fn every_decoder_keeps_its_token_of_the_budget() {
        let mut sched = Scheduler::new(
            SchedulerConfig {
                max_batch_tokens: 6,
                max_running: 4,
                max_draft: 8,
                adaptive_draft: false,
                ..SchedulerConfig::default()
            },
            None,
        );
        let ids: Vec<_> = (0..4u32)
            .map(|i| {
                let req = Request {
                    proposer: Some("lookup".into()),
                    ..Request::greedy(vec![1, 2, 3 + i], 64)
                };
                sched.add(req, None, |_| true).unwrap()
            })
            .collect();
        let _ = sched.wants(|_| None);
        // Their prompts are in the cache: they decode from now on.
        for id in &ids {
            let s = sched.seqs.get_mut(id).unwrap();
            assert_eq!(s.status, SeqStatus::Prefill);
            s.cached = s.prefill_target();
        }
        let (items, _) = sched.wants(|_| None);
        let drafts: Vec<usize> = items
            .iter()
            .map(|i| match &i.work {
                Work::Decode { max_draft, .. } => *max_draft,
                Work::Prefill(_) => panic!("a prefill in a decode step"),
            })
            .collect();
        assert_eq!(drafts, vec![2, 0, 0, 0]);
    }
}
